"""pytest plugin: a real local Kubernetes control plane (hack/plane.py) for `k8s` tests.

Fixtures:
    k8s_plane       session-scoped KubePlane: etcd, kube-apiserver (RBAC), controller
                    manager, scheduler, kwok (fake nodes kwok-gpu-0 with 8 nvidia.com/gpu and
                    kwok-cpu-0) and the KubeRay operator, started in a temporary directory
                    and stopped at the end of the session.
    k8s_namespace   a fresh namespace per test (deleted afterwards, without waiting).

Environment:
    TG_K8S_PLANE_KUBECONFIG  reuse an already-running plane (e.g. `make k8s-up`): nothing is
                             built, started or stopped.
    TG_K8S_TIMEOUT_SCALE     multiply the plane's start-up timeouts (default 2; slow machines).

The binaries are built from Go modules by hack/build-tools.sh and cached per version; the
first build on a machine is slow (see docs/control-plane.md), so it runs once, right after
collection, outside any test's timeout. Tests are skipped only when there is no Go toolchain.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
PLANE_SCRIPT = REPO / "hack" / "plane.py"
REUSE_ENV = "TG_K8S_PLANE_KUBECONFIG"
T = TypeVar("T")


def _load_plane_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("tg_hack_plane", PLANE_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses need the module registered
    spec.loader.exec_module(module)
    return module


plane_lib = _load_plane_module()


class KubectlError(subprocess.CalledProcessError):
    """A failed kubectl call whose message carries its output."""

    def __str__(self) -> str:
        return f"{super().__str__()}\nstdout:\n{self.stdout}\nstderr:\n{self.stderr}"


@dataclass(frozen=True)
class KubePlane:
    """A running control plane, and helpers to talk to it."""

    kubeconfig: Path  # admin (system:masters) credentials
    server: str  # https URL of the API server
    bin_dir: Path  # kubectl, helm, kube-apiserver, kwok, ray-operator, ...
    state_dir: Path  # the plane's state: logs/, pki/, kubeconfigs/ (or the reused kubeconfig's dir)
    work_dir: Path  # scratch space of this test session (service-account kubeconfigs)

    def kubectl(
        self,
        *args: str,
        check: bool = True,
        input: str | None = None,
        kubeconfig: Path | None = None,
        timeout: float = 120,
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl against the plane (as admin unless another kubeconfig is given)."""
        cmd = [str(self.bin_dir / "kubectl"), "--kubeconfig", str(kubeconfig or self.kubeconfig),
               *args]
        proc = subprocess.run(cmd, input=input, capture_output=True, text=True,
                              timeout=timeout, check=False)
        if check and proc.returncode != 0:
            raise KubectlError(proc.returncode, cmd, proc.stdout, proc.stderr)
        return proc

    def kubectl_json(self, *args: str, **kwargs: Any) -> Any:
        """kubectl ... -o json, parsed."""
        return yaml.safe_load(self.kubectl(*args, "-o", "json", **kwargs).stdout)

    def apply(self, manifest: dict[str, Any] | list[dict[str, Any]] | str,
              namespace: str | None = None) -> None:
        """Server-side apply a manifest (dict, list of dicts, or YAML text)."""
        if isinstance(manifest, dict):
            text = yaml.safe_dump(manifest)
        elif isinstance(manifest, list):
            text = yaml.safe_dump_all(manifest)
        else:
            text = manifest
        ns = ["-n", namespace] if namespace else []
        self.kubectl("apply", "--server-side", "--field-manager=tg-tests", *ns, "-f", "-",
                     input=text)

    def helm(self, *args: str, check: bool = True,
             timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """Run helm against the plane as admin."""
        cmd = [str(self.bin_dir / "helm"), "--kubeconfig", str(self.kubeconfig), *args]
        env = {**os.environ, "HELM_CACHE_HOME": str(self.work_dir / "helm" / "cache"),
               "HELM_CONFIG_HOME": str(self.work_dir / "helm" / "config"),
               "HELM_DATA_HOME": str(self.work_dir / "helm" / "data")}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                              check=False)
        if check and proc.returncode != 0:
            raise KubectlError(proc.returncode, cmd, proc.stdout, proc.stderr)
        return proc

    def kubeconfig_for_service_account(self, namespace: str, name: str, *,
                                       duration: str = "3600s") -> Path:
        """A kubeconfig that authenticates as the ServiceAccount with a TokenRequest token."""
        token = self.kubectl("create", "token", name, "-n", namespace,
                             f"--duration={duration}").stdout.strip()
        if not token:
            raise RuntimeError(f"kubectl create token {namespace}/{name} returned no token")
        cluster = self._admin_cluster()
        user = f"system:serviceaccount:{namespace}:{name}"
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "tg-plane", "cluster": cluster}],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": user, "context": {"cluster": "tg-plane", "user": user,
                                                    "namespace": namespace}}],
            "current-context": user,
        }
        out_dir = self.work_dir / "sa-kubeconfigs"
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"{namespace}.{name}.kubeconfig"
        path.write_text(yaml.safe_dump(config))
        path.chmod(0o600)
        return path

    def _admin_cluster(self) -> dict[str, Any]:
        """The admin kubeconfig's current cluster entry, with file paths made absolute."""
        config = yaml.safe_load(self.kubeconfig.read_text())
        contexts = {c["name"]: c["context"] for c in config.get("contexts", [])}
        clusters = {c["name"]: c["cluster"] for c in config.get("clusters", [])}
        cluster = dict(clusters[contexts[config["current-context"]]["cluster"]])
        ca = cluster.get("certificate-authority")
        if ca and not Path(ca).is_absolute():
            cluster["certificate-authority"] = str((self.kubeconfig.parent / ca).resolve())
        return cluster

    def logs_dir(self) -> Path:
        return self.state_dir / "logs"


def wait_until(predicate: Callable[[], T | None], *, timeout: float, what: str,
               interval: float = 0.5, on_timeout: Callable[[], str] | None = None) -> T:
    """Poll predicate until it returns a truthy value; fail the test after timeout seconds."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            result = predicate()
            if result:
                return result
        except (subprocess.SubprocessError, KeyError, ValueError) as e:
            last_error = e
        if time.monotonic() > deadline:
            detail = on_timeout() if on_timeout else ""
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}"
                        + (f"; last error: {last_error}" if last_error else "")
                        + (f"\n{detail}" if detail else ""))
        time.sleep(interval)


# ---------------------------------------------------------------------------------------------
# Build once, after collection and outside any test's timeout.
# ---------------------------------------------------------------------------------------------

_build_result: dict[str, Any] = {}


def _wants_plane(session: pytest.Session) -> bool:
    return any(item.get_closest_marker("k8s") is not None for item in session.items)


def _build_or_record_error(config: pytest.Config) -> None:
    if "bin_dir" in _build_result or "error" in _build_result:
        return
    if plane_lib.find_go() is None:
        _build_result["error"] = None  # no toolchain: skip
        return
    if plane_lib.cached_bin_dir() is not None:
        # Built already: build-tools.sh only checks its outputs (well under a second).
        try:
            _build_result["bin_dir"] = plane_lib.build_tools(quiet=True)
        except plane_lib.PlaneError as e:
            _build_result["error"] = str(e)
        return
    capman = config.pluginmanager.getplugin("capturemanager")
    reporter = config.pluginmanager.getplugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(
            "k8s: building the control plane's binaries from Go modules (first time on this "
            "machine: slow, see docs/control-plane.md); progress follows", yellow=True)
    try:
        if capman is not None:
            with capman.global_and_fixture_disabled():
                _build_result["bin_dir"] = plane_lib.build_tools()
        else:
            _build_result["bin_dir"] = plane_lib.build_tools()
    except plane_lib.PlaneError as e:
        _build_result["error"] = str(e)


def pytest_collection_finish(session: pytest.Session) -> None:
    config = session.config
    if config.option.collectonly or os.environ.get(REUSE_ENV) or not _wants_plane(session):
        return
    _build_or_record_error(config)


# ---------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------


def _reuse(kubeconfig: Path, work_dir: Path) -> KubePlane:
    if not kubeconfig.is_file():
        pytest.fail(f"{REUSE_ENV}={kubeconfig} does not exist; start a plane with `make k8s-up` "
                    f"or unset {REUSE_ENV}")
    state = plane_lib.PlaneState.load(kubeconfig.parent)
    if state is not None:
        bin_dir, server, state_dir = Path(state.bin_dir), state.server, Path(state.state_dir)
    else:
        bin_dir = plane_lib.cached_bin_dir()
        if bin_dir is None:
            pytest.fail(f"{REUSE_ENV} points at a kubeconfig outside a hack/plane.py state dir "
                        "and no cached binaries exist; run `make k8s-tools`")
        config = yaml.safe_load(kubeconfig.read_text())
        server = config["clusters"][0]["cluster"]["server"]
        state_dir = kubeconfig.parent
    plane = KubePlane(kubeconfig, server, bin_dir, state_dir, work_dir)
    probe = plane.kubectl("get", "--raw", "/readyz", check=False, timeout=30)
    if probe.returncode != 0:
        pytest.fail(f"the plane at {server} ({REUSE_ENV}) does not answer: {probe.stderr.strip()}"
                    "; restart it with `make k8s-down k8s-up`")
    return plane


@pytest.fixture(scope="session")
def k8s_plane(request: pytest.FixtureRequest,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubePlane]:
    work_dir = tmp_path_factory.mktemp("k8s-work")
    reuse = os.environ.get(REUSE_ENV)
    if reuse:
        yield _reuse(Path(reuse).expanduser().resolve(), work_dir)
        return

    _build_or_record_error(request.config)  # no-op when collection already built it
    if "error" in _build_result:
        if _build_result["error"] is None:
            pytest.skip("no Go toolchain (`go` not on PATH, no /usr/local/go/bin/go, GO unset): "
                        "the local Kubernetes plane is built from Go modules; install Go >= 1.26")
        pytest.fail(f"building the control plane failed: {_build_result['error']}")
    bin_dir: Path = _build_result["bin_dir"]

    state_dir = tmp_path_factory.mktemp("k8s-plane")
    scale = float(os.environ.get("TG_K8S_TIMEOUT_SCALE", "2"))
    try:
        state = plane_lib.up(state_dir, bin_dir, owner_pid=os.getpid(), timeout_scale=scale)
    except plane_lib.PlaneError as e:
        pytest.fail(f"the local control plane did not start:\n{e}")
    plane = KubePlane(Path(state.kubeconfig), state.server, bin_dir, state_dir, work_dir)
    try:
        yield plane
    finally:
        plane_lib.down(state_dir)


@pytest.fixture
def k8s_namespace(k8s_plane: KubePlane) -> Iterator[str]:
    """A fresh namespace (with its default ServiceAccount ready, so pods can be created)."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    k8s_plane.kubectl("create", "namespace", name)
    wait_until(
        lambda: k8s_plane.kubectl("get", "serviceaccount", "default", "-n", name,
                                  check=False).returncode == 0,
        timeout=60, what=f"ServiceAccount {name}/default (kube-controller-manager)")
    try:
        yield name
    finally:
        k8s_plane.kubectl("delete", "namespace", name, "--wait=false", check=False)
