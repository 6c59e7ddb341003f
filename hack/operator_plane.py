"""Running the operator as a process against the local control plane: tests and the bench.

Not test code: ``tests/operator/test_k8s_operator.py`` and ``bench/bench_operator.py``
both import it (``from hack import operator_plane``), with the repository root on
``sys.path``. A ``plane`` is anything with ``kubectl``, ``kubectl_json``, ``apply`` and
``kubeconfig_for_service_account`` (tests/fixtures_k8s.KubePlane, the bench's Plane).

The operator runs as ``python -m tg_operator`` with a ServiceAccount token that holds
exactly :data:`tg_operator.rbac.OPERATOR_RULES` (so the tests prove the RBAC list),
the Ray dashboard/GCS overrides pointing at the local Ray, and the venv's Python for
the Ray job entrypoints.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

import tgapi.kube_view
from hack.plane import free_ports
from tests.specs import tiny_spec
from tg_operator import rbac
from tg_operator.dashboard import ActorInfo, DashboardClient
from tg_operator.settings import ray_auth_token

REPO = Path(__file__).resolve().parents[1]
CRD = REPO / "manifests" / "crd" / "trainergroups.yaml"
NOOP_WORKER = "hack.noop_worker:NoopWorker"

# A tiny Llama-style model the Megatron trainer trains on 2 CPU cores (gloo, TP 2).
TINY_SPEC: dict[str, Any] = tiny_spec(
    # GPU pods (so they land on the fake GPU node) while the workers run on CPU in the local
    # Ray: useGpu false.
    workers={"cpusPerProcess": 0.5},
    parallelism={"tensor": 2},
    optimizer={"lr": 1.0e-3, "clipGrad": 1.0},
    timeouts={"clusterReadySeconds": 600, "workersReadySeconds": 600},
)


def trainergroup(name: str, namespace: str, **spec_overrides: Any) -> dict[str, Any]:
    spec = copy.deepcopy(TINY_SPEC)
    for key, value in spec_overrides.items():
        if value is None:
            spec.pop(key, None)
        else:
            spec[key] = value
    return {
        "apiVersion": "trainergroup.io/v1alpha1",
        "kind": "TrainerGroup",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


def noop(name: str, namespace: str, **spec_overrides: Any) -> dict[str, Any]:
    """A TrainerGroup of no-op workers (starts in seconds)."""
    body = trainergroup(name, namespace, **spec_overrides)
    body["spec"]["workers"] = {
        **body["spec"]["workers"],
        "workerClass": NOOP_WORKER,
        "cpusPerProcess": 0.05,
    }
    return body


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def install_crd(plane: Any) -> None:
    plane.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD))
    plane.kubectl(
        "wait",
        "--for=condition=Established",
        "--timeout=60s",
        "crd/trainergroups.trainergroup.io",
    )
    # Established is not yet served: until the API server's storage for the new resource is
    # initialised, a list answers 429 "storage is (re)initializing", which kopf logs at ERROR
    # (and retries). List it the way kopf does until it answers.
    deadline = time.monotonic() + 60
    raw = "/apis/trainergroup.io/v1alpha1/trainergroups"
    while plane.kubectl("get", "--raw", raw, check=False).returncode != 0:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the TrainerGroup CRD was not served within 60 s: GET {raw}")
        time.sleep(0.5)


def grant(
    plane: Any, *, namespace: str, account: str, rules: list[dict[str, Any]], cluster_wide: bool
) -> Path:
    """A ServiceAccount holding exactly ``rules`` (ClusterRole, bound cluster-wide or in ns)."""
    role = f"tg-test-{namespace}-{account}"
    docs: list[dict[str, Any]] = [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": account, "namespace": namespace},
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": role},
            "rules": rules,
        },
    ]
    subject = [{"kind": "ServiceAccount", "name": account, "namespace": namespace}]
    ref = {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role}
    if cluster_wide:
        docs.append(
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRoleBinding",
                "metadata": {"name": role},
                "roleRef": ref,
                "subjects": subject,
            }
        )
    else:
        docs.append(
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding",
                "metadata": {"name": role, "namespace": namespace},
                "roleRef": ref,
                "subjects": subject,
            }
        )
    plane.apply(docs)
    return Path(plane.kubeconfig_for_service_account(namespace, account))


@dataclass
class OperatorProcess:
    """``python -m tg_operator`` as a subprocess; restartable, killable."""

    env: dict[str, str]
    log_path: Path
    liveness_port: int
    metrics_port: int
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    _log: Any = field(default=None, repr=False)

    def start(self, *, timeout: float = 120) -> None:
        self._log = self.log_path.open("ab")
        self._log.write(f"\n===== start #{self.starts + 1} =====\n".encode())
        self._log.flush()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tg_operator"],
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.starts += 1
        deadline = time.monotonic() + timeout
        # both servers: one that failed to bind takes the whole operator down a moment later
        urls = [
            f"http://127.0.0.1:{self.liveness_port}/healthz",
            f"http://127.0.0.1:{self.metrics_port}/metrics",
        ]
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the operator exited ({self.proc.returncode}):\n{self.tail()}")
            while urls:
                with contextlib.suppress(OSError), urllib.request.urlopen(urls[0], timeout=2) as r:
                    if r.status == 200:
                        urls.pop(0)
                        continue
                break
            if not urls:
                return
            time.sleep(0.5)
        raise RuntimeError(
            f"the operator's {urls[0]} never answered in {timeout:.0f} s:\n{self.tail()}"
        )

    def stop(self, *, kill: bool = False) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def tail(self, lines: int = 60) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            return str(resp.read().decode())


def operator_env(
    *,
    kubeconfig: Path,
    dashboard_url: str,
    gcs_address: str,
    namespaces: str,
    health_interval: float = 2.0,
) -> tuple[dict[str, str], int, int]:
    # distinct and free on every address: the operator binds both on 0.0.0.0, and two
    # ports picked one at a time were once the same one (CI, 2026-12-08: kopf's liveness
    # server then failed to bind, and the operator died under every test of the plane)
    liveness, metrics = free_ports(2, host="")
    env = {
        **os.environ,
        "KUBECONFIG": str(kubeconfig),
        "TG_NAMESPACES": namespaces,
        "TG_DASHBOARD_URL_TEMPLATE": dashboard_url,
        "TG_GCS_ADDRESS_TEMPLATE": gcs_address,
        "TG_PYTHON": sys.executable,
        "TG_HEALTH_INTERVAL_SECONDS": str(health_interval),
        # kwok's pods run no raylet: the one local Ray head does the work, so Ray's node
        # table never lists a node per worker pod here
        "TG_RAY_NODE_CHECK": "0",
        "TG_LIVENESS_PORT": str(liveness),
        "TG_METRICS_PORT": str(metrics),
        "TG_DASHBOARD_TIMEOUT_SECONDS": "30",
        # the per-group Ray tokens' key (the chart's Secret in a real install)
        "TG_RAY_TOKEN_KEY": "k8s-tests-token-key",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("KUBERNETES_SERVICE_HOST", None)
    return env, liveness, metrics


@contextlib.contextmanager
def running_operator(
    plane: Any,
    *,
    namespace: str,
    ray_dashboard: str,
    ray_gcs: str,
    log_path: Path,
    cluster_wide: bool = False,
    health_interval: float = 2.0,
    extra_env: dict[str, str] | None = None,
    cleanup_timeout: float = 300,
) -> Iterator[OperatorProcess]:
    """An operator with the least-privilege service account, watching ``namespace``."""
    install_crd(plane)
    kubeconfig = grant(
        plane,
        namespace=namespace,
        account="tg-operator",
        rules=rbac.OPERATOR_RULES,
        cluster_wide=cluster_wide,
    )
    env, liveness, metrics = operator_env(
        kubeconfig=kubeconfig,
        dashboard_url=ray_dashboard,
        gcs_address=ray_gcs,
        namespaces="" if cluster_wide else namespace,
        health_interval=health_interval,
    )
    env.update(extra_env or {})
    op = OperatorProcess(env=env, log_path=log_path, liveness_port=liveness, metrics_port=metrics)
    op.start()
    try:
        yield op
    finally:
        # Whatever a test left behind goes while the operator still runs, so the local
        # Ray (shared with other tests) is cleaned too.
        try:
            if op.proc is None:
                op.start()
            delete_all(plane, namespace, timeout=cleanup_timeout)
        finally:
            op.stop()
        role = f"tg-test-{namespace}-tg-operator"
        plane.kubectl("delete", "clusterrole", role, "--ignore-not-found", check=False)
        plane.kubectl("delete", "clusterrolebinding", role, "--ignore-not-found", check=False)


# -- reading the world -------------------------------------------------------------------
def get_tg(plane: Any, namespace: str, name: str) -> dict[str, Any] | None:
    proc = plane.kubectl("get", "trainergroup", name, "-n", namespace, "-o", "json", check=False)
    if proc.returncode != 0:
        if "NotFound" in proc.stderr:
            return None
        raise RuntimeError(proc.stderr)
    return dict(json.loads(proc.stdout))


def status_of(plane: Any, namespace: str, name: str) -> dict[str, Any]:
    obj = get_tg(plane, namespace, name)
    return dict((obj or {}).get("status") or {})


def wait_for(
    predicate: Callable[[], Any],
    *,
    timeout: float,
    what: str,
    interval: float = 0.5,
    detail: Callable[[], str] | None = None,
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            extra = f"\n{detail()}" if detail else ""
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}{extra}")
        time.sleep(interval)


def wait_object(
    plane: Any,
    namespace: str,
    name: str,
    done: Callable[[dict[str, Any]], Any],
    *,
    timeout: float,
    what: str,
    op: OperatorProcess | None = None,
    on_change: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Watch the TrainerGroup (tgapi.kube_view's waiter, as the client does: one request in
    this process, not a kubectl process per poll) until ``done(obj)``; that object.
    ``on_change`` sees every version (the current one first). AssertionError with the last
    status and the operator's log on timeout or deletion."""
    try:
        obj = tgapi.kube_view.wait_until(
            name=name,
            k8s_namespace=namespace,
            kubeconfig=str(plane.kubeconfig),
            timeout_s=timeout,
            done=lambda o: bool(done(dict(o))),
            on_change=None if on_change is None else (lambda o: on_change(dict(o))),
            what=what,
        )
    except (tgapi.kube_view.TrainerGroupNotReady, tgapi.kube_view.TrainerGroupNotFound) as exc:
        st = status_of(plane, namespace, name)
        text = f"{exc}\nlast status: {json.dumps(st, indent=1)[:3000]}"
        raise AssertionError(text + (f"\noperator log:\n{op.tail()}" if op else "")) from exc
    return dict(obj)


def wait_status(
    plane: Any,
    namespace: str,
    name: str,
    done: Callable[[dict[str, Any]], Any],
    *,
    timeout: float,
    what: str,
    op: OperatorProcess | None = None,
    on_change: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """:func:`wait_object` on the status: until ``done(status)``; that status. ``on_change``
    sees the status of every version."""

    def status(obj: dict[str, Any]) -> dict[str, Any]:
        return dict(obj.get("status") or {})

    obj = wait_object(
        plane,
        namespace,
        name,
        lambda o: done(status(o)),
        timeout=timeout,
        what=what,
        op=op,
        on_change=None if on_change is None else (lambda o: on_change(status(o))),
    )
    return status(obj)


def wait_phase(
    plane: Any,
    namespace: str,
    name: str,
    phases: set[str],
    *,
    timeout: float,
    op: OperatorProcess | None = None,
) -> dict[str, Any]:
    """Watch the TrainerGroup until its phase is one of ``phases``; its status then."""
    return wait_status(
        plane,
        namespace,
        name,
        lambda st: st.get("phase") in phases,
        timeout=timeout,
        what=f"phase in {sorted(phases)}",
        op=op,
    )


def wait_gone(
    plane: Any, namespace: str, name: str, *, timeout: float, op: OperatorProcess | None = None
) -> None:
    """Watch the TrainerGroup until it is deleted (its finalizer released); at once when it
    does not exist. AssertionError with its last state and the operator's log on timeout."""
    try:
        tgapi.kube_view.wait_until(
            name=name,
            k8s_namespace=namespace,
            kubeconfig=str(plane.kubeconfig),
            timeout_s=timeout,
            done=lambda o: False,
            what="its deletion",
        )
    except tgapi.kube_view.TrainerGroupNotFound:
        return
    except tgapi.kube_view.TrainerGroupNotReady as exc:
        text = f"{exc}\nlast state: {dump(get_tg(plane, namespace, name))}"
        raise AssertionError(text + (f"\noperator log:\n{op.tail()}" if op else "")) from exc


def events_of(plane: Any, namespace: str, name: str) -> list[dict[str, Any]]:
    data = plane.kubectl_json(
        "get", "events", "-n", namespace, "--field-selector", f"involvedObject.name={name}"
    )
    return list(data.get("items") or [])


def dashboard_call(url: str, fn: Callable[[DashboardClient], Any]) -> Any:
    async def main() -> Any:
        async with aiohttp.ClientSession() as session:
            client = DashboardClient(
                base_url=url, session=session, timeout_s=30, token=ray_auth_token(os.environ)
            )
            return await fn(client)

    return asyncio.run(main())


def actors(url: str, ray_namespace: str) -> list[ActorInfo]:
    return list(dashboard_call(url, lambda d: d.list_actors(ray_namespace=ray_namespace)))


def ray_get(url: str) -> Any:
    """GET a Ray dashboard URL (with the Ray token when there is one), parsed JSON."""
    token = ray_auth_token(os.environ)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    req = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def live_placement_groups(url: str, ray_namespace: str) -> list[str]:
    """Placement groups not REMOVED whose name mentions the Ray namespace."""
    data = ray_get(f"{url}/api/v0/placement_groups?limit=10000&detail=true")
    rows = data["data"]["result"]["result"]
    return [
        r.get("name", "")
        for r in rows
        if ray_namespace in (r.get("name") or "") and r.get("state") != "REMOVED"
    ]


def ray_jobs(url: str, prefix: str) -> list[dict[str, Any]]:
    jobs = ray_get(f"{url}/api/jobs/")
    return [j for j in jobs if str(j.get("submission_id") or "").startswith(prefix)]


def delete_all(plane: Any, namespace: str, *, timeout: float) -> None:
    """Delete every TrainerGroup in ``namespace``; force the stragglers after ``timeout``."""
    plane.kubectl("delete", "trainergroups", "--all", "-n", namespace, "--wait=false", check=False)

    def none_left() -> bool:
        items = plane.kubectl_json("get", "trainergroups", "-n", namespace)["items"]
        return not items

    try:
        wait_for(none_left, timeout=timeout, what="TrainerGroups to go")
    except AssertionError:
        plane.kubectl(
            "annotate",
            "trainergroups",
            "--all",
            "-n",
            namespace,
            "trainergroup.io/force-delete=true",
            "--overwrite",
            check=False,
        )
        wait_for(none_left, timeout=120, what="forced TrainerGroups to go")


def dump(obj: Any) -> str:
    return yaml.safe_dump(obj, sort_keys=False)[:4000]
