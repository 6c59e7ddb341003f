"""Benchmark the TrainerGroup operator: apply -> Ready latency, and its cost at scale.

    .venv/bin/python bench/bench_operator.py [--groups 100] [--latency-runs 3]
        [--kubeconfig PATH]            # reuse a running plane (`make k8s-up`), else start one
        [--ray-address H:P --ray-dashboard URL]   # reuse a Ray head, else start one

What it measures (the operator runs as ``python -m tg_operator`` with its least-privilege
ServiceAccount against the local control plane; the groups run in a local Ray):

1. apply -> Ready with a RayCluster the operator creates: split into apply ->
   RayClusterReady (KubeRay + kwok pod start) and RayClusterReady -> Ready (the part
   without pod start: server job submission, the job itself, the State API check), and
   the server job's own run time from Ray, so the operator's overhead is visible.
2. apply -> Ready with ``rayClusterRef`` to a RayCluster that is already up (no pods).
3. N TrainerGroups at once, one no-op worker each: ``--owned`` of them with a RayCluster
   of their own (head + 1 worker pod, kwok; the CPU node holds 110 pods), the rest with
   ``rayClusterRef`` to one shared RayCluster. Reported: time until all are Ready, create
   -> RayCluster-created p50/p95 (from watch events), the operator's RSS and CPU while it
   creates them, in the steady state (each group's loop checks health every
   TG_HEALTH_INTERVAL_SECONDS) and while deleting them, and the API requests per group
   per minute in the steady state (``apiserver_request_total`` from the API server's
   /metrics, all clients, and the operator's resources alone). ``--queued Q``: Q of them
   get ``spec.queue`` (``--queue-name``, default team-a) and their own RayCluster, which the
   operator creates suspended; no Kueue controller runs, so they stay Queued (Kueue's
   Workload CRD is installed, from hack/kueue/source.sh, so the operator's Workload lookup
   is the real one). The others must be Ready, the queued ones Queued.
4. ``--status-writes``: one TrainerGroup of the tiny Megatron model (hack/operator_plane's
   TINY_SPEC, 2 CPU workers, TP 2) trained by bench/throttled_client.py at ``--train-rate``
   optimizer steps per second for ``--train-s`` seconds. Reported: the steps/s achieved,
   ``tg_operator_status_writes_total`` per minute and the MODIFIED events of a watch on the
   TrainerGroup per minute (with what each event changed), over the training window and the
   ``--idle-s`` after it, against the health ticks (``--health-interval``) in the window.

The groups use ``hack.noop_worker:NoopWorker`` (no torch, no Megatron), so
the figures are the operator's and Ray's job machinery, not model start-up. Prints a
table and writes JSON (default docs/results/bench_operator.json).

The issue-23 figures (docs/kueue.md, "Figures"):

    .venv/bin/python bench/bench_operator.py --latency-runs 0 --groups 0 --status-writes \
        --out docs/results/bench_operator_status_writes.json
    .venv/bin/python bench/bench_operator.py --latency-runs 0 --groups 20 --queued 10 \
        --owned 5 --out docs/results/bench_operator_queued.json
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hack import operator_plane as ks  # noqa: E402
from tg_operator import raycluster as rc_builder  # noqa: E402
from tg_operator import rbac  # noqa: E402
from tgapi import parse_resource  # noqa: E402

ACTOR_MB = 110  # RSS of one idle no-op worker process (measured ~95 MiB)
DRIVER_MB = 300  # a Ray job driver (server/teardown entrypoint) while it runs
CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- the control plane and Ray ---------------------------------------------------------------
@dataclass
class Plane:
    """Just what hack/operator_plane.py needs from tests/fixtures_k8s.KubePlane."""

    kubeconfig: Path
    bin_dir: Path
    work_dir: Path

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 120
    ) -> Any:
        cmd = [str(self.bin_dir / "kubectl"), "--kubeconfig", str(self.kubeconfig), *args]
        proc = subprocess.run(
            cmd, input=input, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr}")
        return proc

    def kubectl_json(self, *args: str) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json").stdout)

    def apply(self, manifest: Any, namespace: str | None = None) -> None:
        import yaml

        docs = manifest if isinstance(manifest, list) else [manifest]
        ns = ["-n", namespace] if namespace else []
        self.kubectl(
            "apply",
            "--server-side",
            "--field-manager=tg-bench",
            *ns,
            "-f",
            "-",
            input=yaml.safe_dump_all(docs),
            timeout=300,
        )

    def kubeconfig_for_service_account(self, namespace: str, name: str) -> Path:
        import yaml

        token = self.kubectl(
            "create", "token", name, "-n", namespace, "--duration=7200s"
        ).stdout.strip()
        admin = yaml.safe_load(self.kubeconfig.read_text())
        ctx = {c["name"]: c["context"] for c in admin["contexts"]}[admin["current-context"]]
        cluster = dict({c["name"]: c["cluster"] for c in admin["clusters"]}[ctx["cluster"]])
        ca = cluster.get("certificate-authority")
        if ca and not Path(ca).is_absolute():
            cluster["certificate-authority"] = str((self.kubeconfig.parent / ca).resolve())
        user = f"system:serviceaccount:{namespace}:{name}"
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "p", "cluster": cluster}],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [
                {"name": user, "context": {"cluster": "p", "user": user, "namespace": namespace}}
            ],
            "current-context": user,
        }
        path = self.work_dir / f"{namespace}.{name}.kubeconfig"
        path.write_text(yaml.safe_dump(config))
        path.chmod(0o600)
        return path


def _plane_module() -> Any:
    spec = importlib.util.spec_from_file_location("tg_hack_plane", REPO / "hack" / "plane.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def control_plane(kubeconfig: str | None, work: Path) -> Iterator[Plane]:
    plane_lib = _plane_module()
    if kubeconfig:
        state = plane_lib.PlaneState.load(Path(kubeconfig).parent)
        bin_dir = Path(state.bin_dir) if state else plane_lib.cached_bin_dir()
        yield Plane(Path(kubeconfig), bin_dir, work)
        return
    bin_dir = plane_lib.build_tools(quiet=True)
    state_dir = work / "plane"
    state = plane_lib.up(state_dir, bin_dir, owner_pid=os.getpid(), timeout_scale=2)
    try:
        yield Plane(Path(state.kubeconfig), bin_dir, work)
    finally:
        plane_lib.down(state_dir)


@contextlib.contextmanager
def ray_head(address: str | None, dashboard: str | None) -> Iterator[tuple[str, str]]:
    if address and dashboard:
        yield address, dashboard.rstrip("/")
        return
    from tgruntime.local import head as local_head

    head = local_head.start_local_head(
        num_cpus=4, object_store_memory=1 << 30, timeout_s=300, env={"PYTHONPATH": str(REPO)}
    )
    try:
        yield head.gcs_address, head.dashboard_url.rstrip("/")
    finally:
        local_head.stop_local_head(head)


# -- sampling the operator process ------------------------------------------------------------
@dataclass
class Sampler:
    """RSS and CPU of one process, sampled every ``period`` seconds in a thread."""

    pid: int
    period: float = 1.0
    samples: list[tuple[float, float, float]] = field(default_factory=list)  # (t, rss MiB, cpu s)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def read(self) -> tuple[float, float]:
        with open(f"/proc/{self.pid}/status") as f:
            rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        with open(f"/proc/{self.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime
        return rss_kb / 1024, cpu

    def start(self) -> None:
        def loop() -> None:
            while not self._stop.is_set():
                with contextlib.suppress(OSError, StopIteration):
                    rss, cpu = self.read()
                    self.samples.append((time.monotonic(), rss, cpu))
                self._stop.wait(self.period)

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()

    def window(self, t0: float, t1: float) -> dict[str, float]:
        pts = [s for s in self.samples if t0 <= s[0] <= t1]
        if len(pts) < 2:
            return {
                "rss_mib_avg": float("nan"),
                "rss_mib_peak": float("nan"),
                "cpu_pct_avg": float("nan"),
            }
        cpu_pct = 100 * (pts[-1][2] - pts[0][2]) / (pts[-1][0] - pts[0][0])
        return {
            "rss_mib_avg": round(sum(p[1] for p in pts) / len(pts), 1),
            "rss_mib_peak": round(max(p[1] for p in pts), 1),
            "cpu_pct_avg": round(cpu_pct, 1),
        }


# -- helpers ------------------------------------------------------------------------------------
def mem_available_mib() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("MemAvailable:"))


def noop_group(name: str, ns: str, *, ref: str | None, small: bool = False) -> dict[str, Any]:
    body = ks.noop(name, ns)
    if small:  # CPU pods small enough that 50 clusters fit on the kwok CPU node
        body["spec"]["rayCluster"] = {
            "head": {"cpu": "200m", "memory": "256Mi"},
            "workers": {"replicas": 1, "gpusPerWorker": 0, "cpu": "200m", "memory": "256Mi"},
        }
    body["spec"]["workers"]["processesPerNode"] = [1]
    body["spec"]["workers"]["cpusPerProcess"] = 0.01
    body["spec"]["parallelism"] = {"tensor": 1}
    body["spec"]["training"]["batchSize"] = 4
    if ref is not None:
        body["spec"].pop("rayCluster")
        body["spec"]["rayClusterRef"] = {"name": ref}
    return body


def shared_raycluster(ns: str) -> dict[str, Any]:
    """A RayCluster not owned by any TrainerGroup (for rayClusterRef), on the CPU node."""
    tg = parse_resource(noop_group("shared", ns, ref=None))
    rc = rc_builder.build_raycluster(tg, cluster_hash="bench")
    rc["metadata"].pop("ownerReferences")
    rc["metadata"]["labels"] = {"app": "tg-bench"}
    group = rc["spec"]["workerGroupSpecs"][0]
    res = group["template"]["spec"]["containers"][0]["resources"]
    for part in ("limits", "requests"):
        res[part].pop("nvidia.com/gpu", None)
    group["template"]["spec"]["tolerations"] = []
    return dict(rc)


def watch_phases(
    plane: Plane, ns: str, name: str, *, timeout: float
) -> tuple[dict[str, float], dict[str, Any]]:
    """Poll one object until Ready: when (monotonic) each milestone was first seen, and
    the final status."""
    seen: dict[str, float] = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = ks.status_of(plane, ns, name)
        now = time.monotonic()
        conds = {c["type"]: c["status"] for c in st.get("conditions", [])}
        if conds.get("RayClusterReady") == "True":
            seen.setdefault("cluster_ready", now)
        if st.get("phase"):
            seen.setdefault(st["phase"], now)
        if st.get("phase") == "Ready":
            return seen, st
        if st.get("phase") == "Failed":
            raise RuntimeError(f"{name} failed: {st.get('message')}")
        time.sleep(0.1)
    raise TimeoutError(f"{name} not Ready after {timeout:.0f}s")


def job_wall_s(dashboard: str, submission_id: str) -> float | None:
    job = ks.ray_get(f"{dashboard}/api/jobs/{submission_id}")
    if job.get("start_time") and job.get("end_time"):
        return float(job["end_time"] - job["start_time"]) / 1000
    return None


def delete_and_time(plane: Plane, ns: str, name: str, *, timeout: float = 600) -> float:
    t0 = time.monotonic()
    plane.kubectl("delete", "trainergroup", name, "-n", ns, "--wait=false")
    ks.wait_for(
        lambda: ks.get_tg(plane, ns, name) is None,
        timeout=timeout,
        what=f"{name} to be deleted",
        interval=0.2,
    )
    return time.monotonic() - t0


def metric_sums(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"^(tg_operator_[a-z_]+)(\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m:
            key = m.group(1) + (m.group(2) or "")
            out[key] = float(m.group(3))
    return out


def reconcile_stats(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    stats: dict[str, Any] = {}
    triggers = {
        re.search(r'trigger="([^"]+)"', k).group(1)  # type: ignore[union-attr]
        for k in after
        if k.startswith("tg_operator_reconcile_duration_seconds_count")
    }
    for trig in sorted(triggers):
        n = delta(f'tg_operator_reconcile_duration_seconds_count{{trigger="{trig}"}}')
        s = delta(f'tg_operator_reconcile_duration_seconds_sum{{trigger="{trig}"}}')
        if n:
            stats[trig] = {"passes": int(n), "mean_ms": round(1000 * s / n, 1)}
    return stats


class AddedTimes:
    """When each TrainerGroup and RayCluster of a namespace was first seen (watch events)."""

    def __init__(self, kubeconfig: Path, ns: str) -> None:
        from kubernetes import client, config

        self.api = client.CustomObjectsApi(
            config.new_client_from_config(config_file=str(kubeconfig))  # type: ignore[no-untyped-call]
        )
        self.ns = ns
        self.seen: dict[str, dict[str, float]] = {"trainergroups": {}, "rayclusters": {}}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for group, plural in (("trainergroup.io", "trainergroups"), ("ray.io", "rayclusters")):
            t = threading.Thread(target=self._watch, args=(group, plural), daemon=True)
            t.start()
            self._threads.append(t)

    def _watch(self, group: str, plural: str) -> None:
        from kubernetes import watch

        version = "v1alpha1" if group == "trainergroup.io" else "v1"
        while not self._stop.is_set():
            w = watch.Watch()  # type: ignore[no-untyped-call]
            with contextlib.suppress(Exception):
                for ev in w.stream(  # type: ignore[no-untyped-call]
                    self.api.list_namespaced_custom_object,
                    group,
                    version,
                    self.ns,
                    plural,
                    timeout_seconds=5,
                ):
                    name = ev["object"]["metadata"]["name"]
                    self.seen[plural].setdefault(name, time.monotonic())
                    if self._stop.is_set():
                        break

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=15)

    def latencies(self, names: list[str]) -> list[float]:
        tgs, rcs = self.seen["trainergroups"], self.seen["rayclusters"]
        return sorted(rcs[n] - tgs[n] for n in names if n in tgs and n in rcs)


class ObjectEvents:
    """Every watch event of one TrainerGroup (wall time, type, object), resumed by
    resourceVersion across the watch's timeouts so that none is missed."""

    def __init__(self, kubeconfig: Path, ns: str, name: str) -> None:
        from kubernetes import client, config

        self.api = client.CustomObjectsApi(
            config.new_client_from_config(config_file=str(kubeconfig))  # type: ignore[no-untyped-call]
        )
        self.ns, self.name = ns, name
        self.events: list[tuple[float, str, dict[str, Any]]] = []
        self._rv: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _watch(self) -> None:
        from kubernetes import watch

        while not self._stop.is_set():
            w = watch.Watch()  # type: ignore[no-untyped-call]
            extra = {"resource_version": self._rv} if self._rv else {}
            try:
                for ev in w.stream(  # type: ignore[no-untyped-call]
                    self.api.list_namespaced_custom_object,
                    "trainergroup.io",
                    "v1alpha1",
                    self.ns,
                    "trainergroups",
                    field_selector=f"metadata.name={self.name}",
                    timeout_seconds=30,
                    **extra,
                ):
                    obj = ev["object"]
                    self._rv = obj["metadata"]["resourceVersion"]
                    self.events.append((time.time(), str(ev["type"]), obj))
                    if self._stop.is_set():
                        break
            except Exception:  # a 410 Gone: start over from a fresh list
                self._rv = None
                time.sleep(0.5)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=40)

    def modified(self, t0: float, t1: float) -> dict[str, Any]:
        """The MODIFIED events in [t0, t1] and, for each, what it changed (the status's and
        the spec's top-level fields, the metadata's annotations/labels/finalizers)."""
        changes: dict[str, int] = {}
        steps: list[int | None] = []
        count = 0
        prev: dict[str, Any] | None = None
        for t, kind, obj in self.events:
            if kind == "MODIFIED" and t0 <= t <= t1:
                count += 1
                steps.append(((obj.get("status") or {}).get("training") or {}).get("step"))
                for path in changed_paths(prev, obj) if prev is not None else ["(first)"]:
                    changes[path] = changes.get(path, 0) + 1
            prev = obj
        return {
            "count": count,
            "per_min": round(count * 60 / (t1 - t0), 2),
            "changed": dict(sorted(changes.items())),
            "training_step_at_each": steps,
        }


def changed_paths(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for part in ("spec", "status"):
        o, n = old.get(part) or {}, new.get(part) or {}
        out += [f"{part}.{k}" for k in sorted(set(o) | set(n)) if o.get(k) != n.get(k)]
    om, nm = old.get("metadata") or {}, new.get("metadata") or {}
    out += [
        f"metadata.{k}" for k in ("annotations", "labels", "finalizers") if om.get(k) != nm.get(k)
    ]
    return out or ["(resourceVersion only)"]


def install_kueue_workload_crd(plane: Plane) -> None:
    """Kueue's Workload CRD from Kueue's Go module, as tests/operator/test_k8s_queue.py does."""
    proc = subprocess.run(
        ["bash", str(REPO / "hack" / "kueue" / "source.sh")],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    src = Path(proc.stdout.strip().splitlines()[-1])
    crd = src / "config" / "components" / "crd" / "bases" / "kueue.x-k8s.io_workloads.yaml"
    plane.kubectl("apply", "--server-side", "-f", str(crd))  # too big for client-side apply

    def established() -> bool:  # not `kubectl wait`: it fails while the CRD has no conditions
        conds = plane.kubectl_json("get", "crd", "workloads.kueue.x-k8s.io").get("status", {})
        return any(
            c["type"] == "Established" and c["status"] == "True"
            for c in conds.get("conditions") or []
        )

    ks.wait_for(established, timeout=60, what="Kueue's Workload CRD to be established")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def apiserver_requests(plane: Plane) -> dict[str, float]:
    """``apiserver_request_total`` summed by resource (all verbs, codes, clients)."""
    text = plane.kubectl("get", "--raw", "/metrics", timeout=60).stdout
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("apiserver_request_total{"):
            continue
        labels, value = line.rsplit(" ", 1)
        m = re.search(r'resource="([^"]*)"', labels)
        sub = re.search(r'subresource="([^"]*)"', labels)
        key = (m.group(1) if m else "") + (f"/{sub.group(1)}" if sub and sub.group(1) else "")
        out[key] = out.get(key, 0.0) + float(value)
    return out


OPERATOR_RESOURCES = ("trainergroups", "trainergroups/status", "events")
"""Resources only the operator touches in the steady state (the bench does not poll then)."""


def requests_per_group_minute(
    before: dict[str, float], after: dict[str, float], *, groups: int, seconds: float
) -> dict[str, Any]:
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    scale_ = 60.0 / seconds / max(1, groups)
    ours = sum(delta.get(k, 0.0) for k in OPERATOR_RESOURCES)
    top = sorted(((v, k) for k, v in delta.items() if v > 0), reverse=True)[:8]
    return {
        "all_clients": round(sum(delta.values()) * scale_, 2),
        "operator_resources": round(ours * scale_, 2),
        "by_resource": {k: round(v * scale_, 2) for v, k in top},
    }


# -- the benchmark -------------------------------------------------------------------------------
def save(args: argparse.Namespace, result: dict[str, Any]) -> Path:
    """Write what is measured so far (a later crash keeps the finished sections)."""
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    merged = dict(result)
    if args.update and out.exists():
        merged = {**json.loads(out.read_text()), **result}
    out.write_text(json.dumps(merged, indent=2) + "\n")
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="tg-bench-"))
    result: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "mem_available_mib_at_start": mem_available_mib(),
        },
        "settings": {
            "health_interval_s": args.health_interval,
            "max_concurrent_jobs": args.max_jobs,
            "worker_class": ks.NOOP_WORKER,
            "queued": args.queued,
        },
    }
    with (
        control_plane(args.kubeconfig, work) as plane,
        ray_head(args.ray_address, args.ray_dashboard) as (gcs, dashboard),
    ):
        ns = f"tgbench-{uuid.uuid4().hex[:6]}"
        plane.kubectl("create", "namespace", ns)
        ks.wait_for(
            lambda: (
                plane.kubectl("get", "serviceaccount", "default", "-n", ns, check=False).returncode
                == 0
            ),
            timeout=60,
            what="the namespace's ServiceAccount",
        )
        if args.queued > 0:
            install_kueue_workload_crd(plane)
        log = work / "operator.log"
        with ks.running_operator(
            plane,
            namespace=ns,
            ray_dashboard=dashboard,
            ray_gcs=gcs,
            log_path=log,
            health_interval=args.health_interval,
            extra_env={"TG_MAX_CONCURRENT_JOBS": str(args.max_jobs)},
            cleanup_timeout=1800,
        ) as op:
            assert op.proc is not None
            sampler = Sampler(op.proc.pid)
            sampler.start()
            t_idle = time.monotonic()
            time.sleep(5)
            result["idle"] = sampler.window(t_idle, time.monotonic())
            try:
                if args.latency_runs > 0:
                    result["latency_own_cluster"] = latency_own(plane, ns, dashboard, args)
                    save(args, result)
                if args.status_writes:
                    result["status_writes"] = status_writes(plane, ns, args, op, work)
                    save(args, result)
                if args.latency_runs > 0 or args.groups > 0:
                    shared_cluster_up(plane, ns)
                if args.latency_runs > 0:
                    result["latency_cluster_ref"] = latency_ref(plane, ns, dashboard, args)
                    save(args, result)
                if args.groups > 0:
                    result["scale"] = scale(plane, ns, dashboard, args, op, sampler, result)
            finally:
                sampler.stop()
                result["operator_log"] = str(log)
        plane.kubectl("delete", "namespace", ns, "--wait=false", check=False)
    return result


def status_writes(
    plane: Plane, ns: str, args: argparse.Namespace, op: ks.OperatorProcess, work: Path
) -> dict[str, Any]:
    """One tiny Megatron group trained at ``--train-rate`` steps/s: the operator's status
    writes and the object's MODIFIED events per minute, in training and after it."""
    name = "sw"
    t0 = time.monotonic()
    plane.apply(ks.trainergroup(name, ns))
    st = ks.wait_phase(plane, ns, name, {"Ready", "Failed"}, timeout=900, op=op)
    if st["phase"] != "Ready":
        raise RuntimeError(f"{name} {st['phase']}: {st.get('message')}")
    ready_s = time.monotonic() - t0
    print(f"  {name} Ready after {ready_s:.0f}s; training", flush=True)
    kubeconfig = ks.grant(
        plane, namespace=ns, account="tg-client", rules=rbac.CLIENT_RULES, cluster_wide=False
    )
    events = ObjectEvents(plane.kubeconfig, ns, name)
    events.start()
    time.sleep(3)  # the watch is open
    env = {**os.environ}
    env.pop("RAY_ADDRESS", None)
    cmd = [
        sys.executable,
        str(REPO / "bench" / "throttled_client.py"),
        "--trainergroup", name, "--k8s-namespace", ns, "--kubeconfig", str(kubeconfig),
        "--rate", str(args.train_rate), "--duration", str(args.train_s), "--no-progress",
    ]  # fmt: skip
    client_log = work / "client.log"
    m0: dict[str, float] = {}
    t_start = t_end = 0.0
    done: dict[str, Any] = {}
    with client_log.open("w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("TG_BENCH_START "):
                m0, t_start = metric_sums(op.metrics()), time.time()
            elif line.startswith("TG_BENCH_DONE "):
                m1, t_end = metric_sums(op.metrics()), time.time()
                done = json.loads(line.split(" ", 1)[1])
        if proc.wait(timeout=120) != 0 or not done:
            raise RuntimeError(f"the client failed; see {client_log}:\n{client_log.read_text()}")
    time.sleep(args.idle_s)
    m2, t_idle = metric_sums(op.metrics()), time.time()
    events.stop()
    final = ks.status_of(plane, ns, name)

    def writes(a: dict[str, float], b: dict[str, float], seconds: float) -> dict[str, float]:
        n = b.get("tg_operator_status_writes_total", 0.0) - a.get(
            "tg_operator_status_writes_total", 0.0
        )
        return {"count": n, "per_min": round(n * 60 / seconds, 2)}

    train_window, idle_window = t_end - t_start, t_idle - t_end
    out = {
        "group": name,
        "apply_to_ready_s": round(ready_s, 1),
        "client": done,
        "health_interval_s": args.health_interval,
        "training_window_s": round(train_window, 1),
        "health_ticks_in_training_window": round(train_window / args.health_interval, 1),
        "status_writes_training": writes(m0, m1, train_window),
        "modified_events_training": events.modified(t_start, t_end),
        "idle_window_s": round(idle_window, 1),
        "status_writes_idle": writes(m1, m2, idle_window),
        "modified_events_idle": events.modified(t_end + 1e-3, t_idle),
        "reconcile_passes_training": reconcile_stats(m0, m1),
        "final_status_training": final.get("training"),
    }
    print(f"  status writes: {json.dumps(out)}", flush=True)
    delete_and_time(plane, ns, name)
    return out


def latency_own(plane: Plane, ns: str, dashboard: str, args: argparse.Namespace) -> dict[str, Any]:
    runs = []
    for i in range(args.latency_runs):
        name = f"lat-own-{i}"
        t0 = time.monotonic()
        plane.apply(noop_group(name, ns, ref=None))
        seen, st = watch_phases(plane, ns, name, timeout=900)
        job = job_wall_s(dashboard, st["submissionId"])
        cluster_to_ready = seen["Ready"] - seen["cluster_ready"]
        runs.append(
            {
                "apply_to_cluster_ready_s": round(seen["cluster_ready"] - t0, 2),
                "cluster_ready_to_ready_s": round(cluster_to_ready, 2),
                "apply_to_ready_s": round(seen["Ready"] - t0, 2),
                "server_job_wall_s": round(job, 2) if job else None,
                "operator_overhead_s": round(cluster_to_ready - job, 2) if job else None,
                "delete_s": round(delete_and_time(plane, ns, name), 2),
            }
        )
        print(f"  own cluster run {i}: {runs[-1]}", flush=True)
    return {"runs": runs, **_means(runs)}


def shared_cluster_up(plane: Plane, ns: str) -> None:
    plane.apply(shared_raycluster(ns))
    ks.wait_for(
        lambda: (
            plane.kubectl_json("get", "raycluster", "shared", "-n", ns)
            .get("status", {})
            .get("state")
            == "ready"
        ),
        timeout=300,
        what="the shared RayCluster",
    )


def latency_ref(plane: Plane, ns: str, dashboard: str, args: argparse.Namespace) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    for i in range(args.latency_runs):
        name = f"lat-ref-{i}"
        t0 = time.monotonic()
        plane.apply(noop_group(name, ns, ref="shared"))
        seen, st = watch_phases(plane, ns, name, timeout=900)
        job = job_wall_s(dashboard, st["submissionId"])
        total = seen["Ready"] - t0
        runs.append(
            {
                "apply_to_ready_s": round(total, 2),
                "server_job_wall_s": round(job, 2) if job else None,
                "operator_overhead_s": round(total - job, 2) if job else None,
                "delete_s": round(delete_and_time(plane, ns, name), 2),
            }
        )
        print(f"  rayClusterRef run {i}: {runs[-1]}", flush=True)
    return {"runs": runs, **_means(runs)}


def _means(runs: list[dict[str, Any]]) -> dict[str, Any]:
    if not runs:
        return {}
    keys = [k for k in runs[0] if all(isinstance(r.get(k), int | float) for r in runs)]
    return {f"mean_{k}": round(sum(r[k] for r in runs) / len(runs), 2) for k in keys}


def scale(
    plane: Plane,
    ns: str,
    dashboard: str,
    args: argparse.Namespace,
    op: ks.OperatorProcess,
    sampler: Sampler,
    result: dict[str, Any],
) -> dict[str, Any]:
    requested = args.groups
    budget = mem_available_mib() - 3072 - args.max_jobs * DRIVER_MB
    n = max(1, min(requested, budget // ACTOR_MB))
    if n < requested:
        print(
            f"  only {n} of {requested} groups fit in memory ({mem_available_mib()} MiB "
            f"available, ~{ACTOR_MB} MiB per worker process): running {n}",
            flush=True,
        )
    names = [f"g{i:03d}" for i in range(n)]
    queued = set(names[n - min(args.queued, n) :])  # the last ones: own (suspended) RayCluster
    owned = set(names[: min(args.owned, n - len(queued))])

    def body(nm: str) -> dict[str, Any]:
        tg = noop_group(nm, ns, ref=None if nm in owned | queued else "shared", small=True)
        if nm in queued:
            tg["spec"]["queue"] = {"name": args.queue_name}
        return tg

    want = {nm: "Queued" if nm in queued else "Ready" for nm in names}
    m0 = metric_sums(op.metrics())
    added = AddedTimes(plane.kubeconfig, ns)
    added.start()
    time.sleep(2)  # the watches are open before the first object arrives
    t0 = time.monotonic()
    plane.apply([body(nm) for nm in names])
    t_applied = time.monotonic()

    def all_ready() -> bool:
        phases = phases_now()
        failed = list(phases.values()).count("Failed")
        if failed:
            raise RuntimeError(f"{failed} groups Failed; see {op.log_path}")
        return phases == want

    def phases_now() -> dict[str, str | None]:
        items = plane.kubectl_json("get", "trainergroups", "-n", ns)["items"]
        return {
            i["metadata"]["name"]: i.get("status", {}).get("phase")
            for i in items
            if i["metadata"]["name"] in want
        }

    what = f"{n - len(queued)} groups Ready" + (f", {len(queued)} Queued" if queued else "")
    ks.wait_for(all_ready, timeout=args.ready_timeout, interval=2, what=what, detail=op.tail)
    t_ready = time.monotonic()
    added.stop()
    to_cluster = added.latencies(sorted(owned | queued))
    m1 = metric_sums(op.metrics())
    print(
        f"  {what} after {t_ready - t0:.0f}s; steady state for {args.steady_s}s",
        flush=True,
    )
    time.sleep(5)  # the last status writes of the creation settle
    a1, t_a1 = apiserver_requests(plane), time.monotonic()
    time.sleep(args.steady_s)
    a2, t_a2 = apiserver_requests(plane), time.monotonic()
    t_steady = time.monotonic()
    m2 = metric_sums(op.metrics())
    phases_after = list(phases_now().values())
    suspended = sum(
        1
        for rc in plane.kubectl_json("get", "rayclusters", "-n", ns)["items"]
        if rc["spec"].get("suspend") is True
    )
    partial = {
        "groups_requested": requested,
        "groups": n,
        "groups_with_own_cluster": len(owned),
        "groups_queued": len(queued),
        "phases_after_steady": {
            p or "": phases_after.count(p) for p in sorted(set(phases_after), key=str)
        },
        "suspended_rayclusters_after_steady": suspended,
        "apply_s": round(t_applied - t0, 2),
        "all_ready_s": round(t_ready - t0, 2),
        "create_to_raycluster_s": {
            "n": len(to_cluster),
            "p50": round(percentile(to_cluster, 0.5), 2),
            "p95": round(percentile(to_cluster, 0.95), 2),
            "max": round(max(to_cluster), 2) if to_cluster else None,
        },
        "steady_api_requests_per_group_per_min": requests_per_group_minute(
            a1, a2, groups=n, seconds=t_a2 - t_a1
        ),
        "creating": sampler.window(t0, t_ready),
        "steady": sampler.window(t_ready, t_steady),
        "reconcile_passes_creating": reconcile_stats(m0, m1),
        "reconcile_passes_steady": reconcile_stats(m1, m2),
    }
    save(args, {**result, "scale": partial})
    plane.kubectl("delete", "trainergroups", "--all", "-n", ns, "--wait=false")
    ks.wait_for(
        lambda: not plane.kubectl_json("get", "trainergroups", "-n", ns)["items"],
        timeout=args.ready_timeout,
        interval=2,
        what="all groups deleted",
        detail=op.tail,
    )
    t_gone = time.monotonic()
    m3 = metric_sums(op.metrics())
    return {
        **partial,
        "all_deleted_s": round(t_gone - t_steady, 2),
        "deleting": sampler.window(t_steady, t_gone),
        "reconcile_passes_deleting": reconcile_stats(m2, m3),
        "errors": {k: v for k, v in m3.items() if k.startswith("tg_operator_reconcile_errors")},
    }


def table_rows(r: dict[str, Any]) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    own, ref, sc = r.get("latency_own_cluster"), r.get("latency_cluster_ref"), r.get("scale")
    if own:
        rows += [
            (
                "apply -> RayClusterReady (own cluster, kwok pods)",
                f"{own['mean_apply_to_cluster_ready_s']:.2f} s",
            ),
            (
                "RayClusterReady -> Ready (excl. pod start)",
                f"{own['mean_cluster_ready_to_ready_s']:.2f} s",
            ),
            (
                "  of which the server job itself (Ray)",
                f"{own.get('mean_server_job_wall_s', 0):.2f} s",
            ),
            ("  operator overhead", f"{own.get('mean_operator_overhead_s', 0):.2f} s"),
        ]
    if ref:
        rows += [
            ("apply -> Ready (rayClusterRef, cluster up)", f"{ref['mean_apply_to_ready_s']:.2f} s"),
            (
                "  of which the server job itself (Ray)",
                f"{ref.get('mean_server_job_wall_s', 0):.2f} s",
            ),
            ("  operator overhead", f"{ref.get('mean_operator_overhead_s', 0):.2f} s"),
            ("delete -> gone (Ray teardown + finalizer)", f"{ref['mean_delete_s']:.2f} s"),
        ]
    rows.append(
        (
            "operator RSS / CPU idle (0 groups)",
            f"{r['idle']['rss_mib_avg']:.0f} MiB / {r['idle']['cpu_pct_avg']:.1f} %",
        )
    )
    sw = r.get("status_writes")
    if sw:
        c, wt, et = sw["client"], sw["status_writes_training"], sw["modified_events_training"]
        wi, ei = sw["status_writes_idle"], sw["modified_events_idle"]
        rows += [
            (
                "status writes: training rate achieved",
                f"{c['steps_per_s']:.2f} steps/s ({c['steps']} steps in {c['seconds']:.0f} s)",
            ),
            (
                "  health interval / ticks in the training window",
                f"{sw['health_interval_s']:g} s / {sw['health_ticks_in_training_window']:g}",
            ),
            (
                "  tg_operator_status_writes_total per minute, training",
                f"{wt['per_min']:.2f} ({wt['count']:g} in {sw['training_window_s']:.0f} s)",
            ),
            (
                "  MODIFIED watch events per minute, training",
                f"{et['per_min']:.2f} ({et['count']} in {sw['training_window_s']:.0f} s)",
            ),
            (
                f"  writes / MODIFIED events in the {sw['idle_window_s']:.0f} s after training",
                f"{wi['count']:g} / {ei['count']}",
            ),
        ]
    if sc:
        n, q = sc["groups"], sc.get("groups_queued", 0)
        phases = ", ".join(f"{v} {k}" for k, v in sc.get("phases_after_steady", {}).items())
        rows += [
            (
                f"{n} groups: apply -> all Ready" + (f" / Queued ({q} queued)" if q else ""),
                f"{sc['all_ready_s']:.0f} s",
            ),
            ("  phases after the steady state", phases),
            (
                f"create -> RayCluster created, p50 / p95 ({sc['create_to_raycluster_s']['n']} "
                "groups)",
                f"{sc['create_to_raycluster_s']['p50']:.2f} s / "
                f"{sc['create_to_raycluster_s']['p95']:.2f} s",
            ),
            (
                "steady: API requests per group per minute (all clients / operator's)",
                f"{sc['steady_api_requests_per_group_per_min']['all_clients']:.1f} / "
                f"{sc['steady_api_requests_per_group_per_min']['operator_resources']:.1f}",
            ),
            (f"{n} groups: delete -> all gone", f"{sc['all_deleted_s']:.0f} s"),
            (
                "operator RSS creating (avg / peak) / CPU avg",
                f"{sc['creating']['rss_mib_avg']:.0f} / {sc['creating']['rss_mib_peak']:.0f} MiB"
                f" / {sc['creating']['cpu_pct_avg']:.1f} %",
            ),
            (
                f"operator RSS steady (avg / peak) / CPU avg, {n} groups",
                f"{sc['steady']['rss_mib_avg']:.0f} / {sc['steady']['rss_mib_peak']:.0f} MiB"
                f" / {sc['steady']['cpu_pct_avg']:.1f} %",
            ),
            (
                "operator RSS / CPU deleting (peak RSS, avg CPU)",
                f"{sc['deleting']['rss_mib_peak']:.0f} MiB / {sc['deleting']['cpu_pct_avg']:.1f} %",
            ),
        ]
        for trig, st in sc["reconcile_passes_steady"].items():
            rows.append(
                (f"steady state: reconcile passes ({trig})", f"{st['passes']} x {st['mean_ms']} ms")
            )
    return rows


def print_table(r: dict[str, Any]) -> None:
    rows = table_rows(r)
    width = max(len(a) for a, _ in rows)
    print("\n" + "-" * (width + 22))
    for a, b in rows:
        print(f"{a:<{width}}  {b}")
    print("-" * (width + 22))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=100)
    p.add_argument(
        "--owned", type=int, default=50, help="of --groups, how many get their own RayCluster"
    )
    p.add_argument(
        "--queued",
        type=int,
        default=0,
        help="of --groups, how many get spec.queue (own RayCluster, suspended: they stay Queued)",
    )
    p.add_argument("--queue-name", default="team-a", help="spec.queue.name of the --queued groups")
    p.add_argument(
        "--status-writes",
        action="store_true",
        help="train one tiny group at --train-rate steps/s; count status writes and watch events",
    )
    p.add_argument("--train-rate", type=float, default=3.0, help="optimizer steps per second")
    p.add_argument("--train-s", type=float, default=120.0, help="seconds of training")
    p.add_argument("--idle-s", type=float, default=30.0, help="seconds watched after training")
    p.add_argument("--latency-runs", type=int, default=3)
    p.add_argument("--max-jobs", type=int, default=4, help="TG_MAX_CONCURRENT_JOBS")
    p.add_argument("--health-interval", type=float, default=10.0)
    p.add_argument("--steady-s", type=float, default=60.0)
    p.add_argument("--ready-timeout", type=float, default=3600.0)
    p.add_argument("--kubeconfig", default=os.environ.get("TG_K8S_PLANE_KUBECONFIG"))
    p.add_argument("--ray-address", default=None)
    p.add_argument("--ray-dashboard", default=None)
    p.add_argument("--out", default=str(REPO / "docs" / "results" / "bench_operator.json"))
    p.add_argument(
        "--update",
        action="store_true",
        help="keep the sections of an existing --out file that this run skips",
    )
    args = p.parse_args(argv)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")])
    )
    started = time.time()
    result = run(args)
    result["wall_s"] = round(time.time() - started, 1)
    result["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    out = save(args, result)
    print_table(json.loads(out.read_text()))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
