#!/usr/bin/env python3
"""A real, local Kubernetes control plane run as plain processes on loopback.

    hack/plane.py up     [--state-dir DIR] [--bin-dir DIR] [--owner-pid PID]
    hack/plane.py down   [--state-dir DIR]
    hack/plane.py env    [--state-dir DIR]
    hack/plane.py status [--state-dir DIR]

`up` starts etcd, kube-apiserver (RBAC on), kube-controller-manager, kube-scheduler, kwok
(fake nodes and pod lifecycles) and the KubeRay operator, installs KubeRay's CRDs and creates
two fake nodes (kwok-gpu-0 with 8 nvidia.com/gpu, kwok-cpu-0), then waits until every part
answers. Binaries come from hack/build-tools.sh (built from Go modules, cached by version).
State (PKI, kubeconfigs, etcd data, one log per component under logs/) lives in the state
dir, by default ${XDG_CACHE_HOME:-~/.cache}/trainergroup/plane. `down` stops everything and
is safe to run at any time. `env` prints the shell lines that point kubectl at the plane.

Standard library only, so that it runs before any virtual environment exists.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

HACK_DIR = Path(__file__).resolve().parent
BUILD_SCRIPT = HACK_DIR / "build-tools.sh"
STATE_FILE = "plane.json"
LOOPBACK = "127.0.0.1"
SERVICE_CIDR = "10.0.0.0/24"
POD_CIDR = "10.244.0.1/24"
KWOK_NODE_IP = "10.96.0.2"
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
KWOK_SELECTOR = "kwok.x-k8s.io/node=fake"
# (name, allocatable/capacity, extra labels, taints)
FAKE_NODES: list[tuple[str, dict[str, str], dict[str, str], list[dict[str, str]]]] = [
    (
        "kwok-gpu-0",
        {"cpu": "64", "memory": "512Gi", "pods": "110", "nvidia.com/gpu": "8"},
        {"nvidia.com/gpu.present": "true"},
        [GPU_TAINT],
    ),
    ("kwok-cpu-0", {"cpu": "32", "memory": "128Gi", "pods": "110"}, {}, []),
]
COMPONENTS = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kwok",
    "ray-operator",
)


class PlaneError(RuntimeError):
    """Raised when the plane cannot be built, started or reached; the message says what to do."""


def log(msg: str) -> None:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    print(f"{stamp} plane: {msg}", file=sys.stderr, flush=True)


def default_state_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "trainergroup" / "plane"


# ---------------------------------------------------------------------------------------------
# Binaries
# ---------------------------------------------------------------------------------------------


def find_go() -> str | None:
    """The Go toolchain build-tools.sh would use, or None when there is none."""
    env_go = os.environ.get("GO")
    if env_go and os.access(env_go, os.X_OK):
        return env_go
    found = shutil.which("go")
    if found:
        return found
    if os.access("/usr/local/go/bin/go", os.X_OK):
        return "/usr/local/go/bin/go"
    return None


def build_tools(*, quiet: bool = False) -> Path:
    """Run hack/build-tools.sh (a no-op when the binaries for these versions are cached)."""
    if find_go() is None:
        raise PlaneError(
            "no Go toolchain: install Go >= 1.26 (https://go.dev/dl/) or set GO=/path/to/go, "
            "then run `make k8s-tools`"
        )
    proc = subprocess.run(
        ["bash", str(BUILD_SCRIPT)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL if quiet else None,
        text=True,
        check=False,
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise PlaneError(
            f"{BUILD_SCRIPT} failed (exit {proc.returncode}); run it by hand to see why"
        )
    return Path(lines[-1])


def cached_bin_dir() -> Path | None:
    """The bin dir for the pinned versions if it is already built, else None; builds nothing."""
    if find_go() is None:
        return None
    proc = subprocess.run(
        ["bash", str(BUILD_SCRIPT), "--print"], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0 or not proc.stdout.strip():
        return None
    bin_dir = Path(proc.stdout.strip().splitlines()[-1])
    return bin_dir if (bin_dir.parent / "BUILD_INFO").is_file() else None


# ---------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------


def free_ports(count: int, *, host: str = LOOPBACK) -> list[int]:
    """Distinct free ports on ``host`` (all held open until all are chosen: two ports picked
    one after the other can be the same one; ``""``: free on every address, for a server
    that binds 0.0.0.0)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def run(cmd: Sequence[str | Path], *, cwd: Path | None = None, input: str | None = None,
        timeout: float = 60) -> str:
    proc = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, input=input, capture_output=True, text=True,
        timeout=timeout, check=False,
    )
    if proc.returncode != 0:
        raise PlaneError(
            f"command failed (exit {proc.returncode}): {' '.join(str(c) for c in cmd)}\n"
            f"{proc.stdout}{proc.stderr}"
        )
    return proc.stdout


def tail(path: Path, lines: int = 40) -> str:
    try:
        data = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"(no log at {path})"
    return "\n".join(data[-lines:]) or "(log is empty)"


def proc_start_time(pid: int) -> int | None:
    """The kernel's start time of a process (clock ticks), to tell a reused PID apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces; the fields after its ')' are fixed.
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[19])


def alive(pid: int, start_time: int | None) -> bool:
    now = proc_start_time(pid)
    if now is None:
        return False
    if start_time is not None and now != start_time:
        return False
    with contextlib.suppress(OSError):
        state = Path(f"/proc/{pid}/stat").read_text()
        if state[state.rindex(")") + 2] == "Z":
            return False
    return True


def rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


# ---------------------------------------------------------------------------------------------
# PKI (openssl CLI): one CA; a serving cert for the API server, controller manager and
# scheduler; client certs for admin (system:masters), controller manager and scheduler;
# an EC key pair that signs service-account tokens.
# ---------------------------------------------------------------------------------------------

OPENSSL_CNF = """\
[req]
distinguished_name = dn
prompt = no
[dn]
[ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign, digitalSignature
subjectKeyIdentifier = hash
[serving]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth, clientAuth
subjectAltName = @serving_names
[serving_names]
IP.1 = 127.0.0.1
IP.2 = 10.0.0.1
DNS.1 = localhost
DNS.2 = kubernetes
DNS.3 = kubernetes.default
DNS.4 = kubernetes.default.svc
DNS.5 = kubernetes.default.svc.cluster.local
[client]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = clientAuth
"""

CLIENTS = {
    # file stem: subject (CN is the user, O the groups)
    "admin": "/O=system:masters/CN=tg-plane-admin",
    "kube-controller-manager": "/CN=system:kube-controller-manager",
    "kube-scheduler": "/CN=system:kube-scheduler",
}


def make_pki(pki: Path) -> None:
    if (pki / "DONE").is_file():
        return
    openssl = shutil.which("openssl")
    if openssl is None:
        raise PlaneError("openssl not found: install it (Debian/Ubuntu: apt-get install openssl)")
    if pki.exists():
        shutil.rmtree(pki)
    pki.mkdir(parents=True)
    cnf = pki / "openssl.cnf"
    cnf.write_text(OPENSSL_CNF)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    common: list[str | Path] = [openssl, "req", "-config", cnf, "-x509", "-days", "3650", *ec]
    run([*common, "-extensions", "ca", "-subj", "/CN=tg-plane-ca",
         "-keyout", pki / "ca.key", "-out", pki / "ca.crt"])
    issued: list[str | Path] = ["-CA", pki / "ca.crt", "-CAkey", pki / "ca.key"]
    run([*common, *issued, "-extensions", "serving", "-subj", "/CN=tg-plane-serving",
         "-keyout", pki / "serving.key", "-out", pki / "serving.crt"])
    for stem, subject in CLIENTS.items():
        run([*common, *issued, "-extensions", "client", "-subj", subject,
             "-keyout", pki / f"{stem}.key", "-out", pki / f"{stem}.crt"])
    run([openssl, "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256",
         "-out", pki / "sa.key"])
    run([openssl, "pkey", "-in", pki / "sa.key", "-pubout", "-out", pki / "sa.pub"])
    for key in pki.glob("*.key"):
        key.chmod(0o600)
    (pki / "DONE").write_text("")


def write_kubeconfig(path: Path, server: str, ca: Path, user: dict[str, str],
                     name: str = "tg-plane") -> None:
    """A kubeconfig (JSON is valid YAML; kubectl and client libraries read it)."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": name, "cluster": {"server": server,
                                                "certificate-authority": str(ca)}}],
        "users": [{"name": name, "user": user}],
        "contexts": [{"name": name, "context": {"cluster": name, "user": name}}],
        "current-context": name,
    }
    path.write_text(json.dumps(config, indent=2) + "\n")
    path.chmod(0o600)


# ---------------------------------------------------------------------------------------------
# State
# ---------------------------------------------------------------------------------------------


@dataclass
class ComponentState:
    name: str
    pid: int
    start_time: int | None
    log: str
    health: str


@dataclass
class PlaneState:
    state_dir: str
    bin_dir: str
    server: str
    kubeconfig: str
    pgid: int
    components: list[ComponentState] = field(default_factory=list)
    started_s: float = 0.0

    def save(self) -> None:
        path = Path(self.state_dir) / STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        tmp.replace(path)

    @classmethod
    def load(cls, state_dir: Path) -> PlaneState | None:
        path = state_dir / STATE_FILE
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        raw["components"] = [ComponentState(**c) for c in raw.get("components", [])]
        return cls(**raw)

    def live_components(self) -> list[ComponentState]:
        return [c for c in self.components if alive(c.pid, c.start_time)]


# ---------------------------------------------------------------------------------------------
# Health checks
# ---------------------------------------------------------------------------------------------


def https_ok(url: str, ctx: ssl.SSLContext) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=3, context=ctx) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def http_ok(url: str, expect: str | None = None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=3) as resp:
            body = resp.read().decode(errors="replace")
            return resp.status == 200 and (expect is None or expect in body)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def tls_context(pki: Path, client: str | None = "admin") -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    if client:
        ctx.load_cert_chain(str(pki / f"{client}.crt"), str(pki / f"{client}.key"))
    return ctx


# ---------------------------------------------------------------------------------------------
# The plane
# ---------------------------------------------------------------------------------------------


class Plane:
    """Starts the components of one plane in one process group and waits for each."""

    def __init__(self, state_dir: Path, bin_dir: Path, *, timeout_scale: float = 1.0) -> None:
        self.state_dir = state_dir
        self.bin_dir = bin_dir
        self.assets = bin_dir.parent / "assets"
        self.pki = state_dir / "pki"
        self.logs = state_dir / "logs"
        self.kc_dir = state_dir / "kubeconfigs"
        self.kubeconfig = state_dir / "kubeconfig"
        self.scale = timeout_scale
        self.pgid = 0
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.state: PlaneState | None = None

    # -- process handling ------------------------------------------------------------------

    def _env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {
            k: v for k, v in os.environ.items()
            if not k.startswith(("ETCD_", "KUBECONFIG", "KUBERNETES_", "POD_NAMESPACE"))
        }
        env.update(extra or {})
        return env

    def spawn(self, name: str, args: Sequence[str | Path], health: str,
              env: dict[str, str] | None = None) -> None:
        log_path = self.logs / f"{name}.log"
        cmd = [str(self.bin_dir / str(args[0])), *(str(a) for a in args[1:])]
        with log_path.open("ab") as out:
            out.write(f"# {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} "
                      f"plane: starting {' '.join(cmd)}\n".encode())
            out.flush()
            # The first process leads a new process group and the rest join it, so `down`
            # stops the whole plane with one killpg, and a Ctrl-C in the terminal (sent to
            # the foreground group only) does not reach it. (A new session would be tidier,
            # but a process may only join a group of its own session.)
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env=self._env(env), cwd=self.state_dir, process_group=self.pgid,
            )
        if self.pgid == 0:
            self.pgid = proc.pid
        self.procs[name] = proc
        assert self.state is not None
        self.state.components.append(
            ComponentState(name, proc.pid, proc_start_time(proc.pid), str(log_path), health)
        )
        self.state.pgid = self.pgid
        self.state.save()
        log(f"started {name} (pid {proc.pid}), log {log_path}")

    def wait_for(self, checks: dict[str, Callable[[], bool]], timeout: float) -> None:
        """Poll each check until all pass; fail fast on an exited process or the timeout.

        Keys are "<component>" or "<component>: <what>"; the component's process must stay
        alive and its log is shown when the check fails.
        """
        timeout *= self.scale
        t0 = time.monotonic()
        pending = dict(checks)
        while pending:
            for name, proc in self.procs.items():  # any component dying fails the start-up
                if proc.poll() is not None:
                    self.fail(name, f"{name} exited with code {proc.returncode} while starting")
            for key, check in list(pending.items()):
                if check():
                    log(f"{key} ready after {time.monotonic() - t0:.1f}s")
                    del pending[key]
            if not pending:
                break
            if time.monotonic() - t0 > timeout:
                key = next(iter(pending))
                self.fail(key.split(":", 1)[0], f"{key} not ready after {timeout:.0f}s")
            time.sleep(0.2)

    def fail(self, name: str, why: str) -> None:
        log_path = self.logs / f"{name}.log"
        msg = (
            f"{why}.\n--- last lines of {log_path} ---\n{tail(log_path)}\n--- end ---\n"
            f"All logs: {self.logs}. The plane was stopped; fix the cause and run `up` again "
            f"(a slow machine may need a larger --timeout-scale)."
        )
        log(f"FAILED: {why}")
        stop_group(self.state)
        raise PlaneError(msg)

    # -- kubectl -------------------------------------------------------------------------------

    def kubectl(self, *args: str, input: str | None = None, timeout: float = 60) -> str:
        return run([self.bin_dir / "kubectl", "--kubeconfig", self.kubeconfig, *args],
                   input=input, timeout=timeout * self.scale)

    # -- start-up --------------------------------------------------------------------------------

    def prepare(self) -> None:
        missing = [t for t in (*COMPONENTS, "kubectl") if not (self.bin_dir / t).is_file()]
        if missing:
            raise PlaneError(
                f"missing binaries in {self.bin_dir}: {', '.join(missing)}; run `make k8s-tools`"
            )
        for needed in (self.assets / "kwok" / "stages.yaml", self.assets / "crds" / "kuberay"):
            if not needed.exists():
                raise PlaneError(f"missing {needed}; run hack/build-tools.sh (make k8s-tools)")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        # Fresh cluster state on every start; the PKI is kept (it is cheap but not free).
        for name in ("etcd", "logs", "kubeconfigs", "kwok-home"):
            shutil.rmtree(self.state_dir / name, ignore_errors=True)
        for sub in (self.logs, self.kc_dir, self.state_dir / "kwok-home"):
            sub.mkdir(parents=True)
        make_pki(self.pki)

    def up(self, owner_pid: int | None = None) -> PlaneState:
        t_start = time.monotonic()
        self.prepare()
        (etcd_port, etcd_peer, api_port, kcm_port, sched_port, kwok_port,
         ray_probe) = free_ports(7)
        server = f"https://{LOOPBACK}:{api_port}"
        self.state = PlaneState(str(self.state_dir), str(self.bin_dir), server,
                                str(self.kubeconfig), 0)
        pki = self.pki
        ca = pki / "ca.crt"
        write_kubeconfig(self.kubeconfig, server, ca,
                         {"client-certificate": str(pki / "admin.crt"),
                          "client-key": str(pki / "admin.key")})
        for stem in ("kube-controller-manager", "kube-scheduler"):
            write_kubeconfig(self.kc_dir / f"{stem}.kubeconfig", server, ca,
                             {"client-certificate": str(pki / f"{stem}.crt"),
                              "client-key": str(pki / f"{stem}.key")})
        kcm_kc = self.kc_dir / "kube-controller-manager.kubeconfig"
        sched_kc = self.kc_dir / "kube-scheduler.kubeconfig"
        serving: list[str | Path] = ["--tls-cert-file", pki / "serving.crt",
                   "--tls-private-key-file", pki / "serving.key"]

        # 1. etcd
        etcd_url = f"http://{LOOPBACK}:{etcd_port}"
        peer_url = f"http://{LOOPBACK}:{etcd_peer}"
        self.spawn("etcd", [
            "etcd", "--name", "tg-plane", "--data-dir", self.state_dir / "etcd",
            "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
            "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"tg-plane={peer_url}", "--initial-cluster-state", "new",
            "--unsafe-no-fsync", "--log-level", "warn",
        ], f"{etcd_url}/health")
        self.wait_for({"etcd": lambda: http_ok(f"{etcd_url}/health", '"health":"true"')}, 30)

        # 2. kube-apiserver
        self.spawn("kube-apiserver", [
            "kube-apiserver",
            "--etcd-servers", etcd_url,
            "--bind-address", LOOPBACK, "--advertise-address", LOOPBACK,
            "--secure-port", str(api_port), *serving,
            "--client-ca-file", ca,
            # Published in kube-system/extension-apiserver-authentication, which the
            # controller manager and scheduler read; without it they log errors forever.
            "--requestheader-client-ca-file", ca,
            "--requestheader-allowed-names", "tg-plane-front-proxy",
            "--requestheader-username-headers", "X-Remote-User",
            "--requestheader-group-headers", "X-Remote-Group",
            "--requestheader-extra-headers-prefix", "X-Remote-Extra-",
            "--authorization-mode", "Node,RBAC",
            "--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
            "--service-account-key-file", pki / "sa.pub",
            "--service-account-signing-key-file", pki / "sa.key",
            "--service-cluster-ip-range", SERVICE_CIDR,
            # One API server on loopback: no "kubernetes" Service endpoints to reconcile
            # (loopback addresses are not valid endpoints anyway).
            "--endpoint-reconciler-type", "none",
            "--profiling=false",
        ], f"{server}/readyz")
        admin_ctx = tls_context(pki)
        self.wait_for({"kube-apiserver": lambda: https_ok(f"{server}/readyz", admin_ctx)}, 120)

        # 3. controller manager, scheduler, kwok: in parallel; CRDs meanwhile.
        self.spawn("kube-controller-manager", [
            "kube-controller-manager",
            "--kubeconfig", kcm_kc,
            "--authentication-kubeconfig", kcm_kc, "--authorization-kubeconfig", kcm_kc,
            "--bind-address", LOOPBACK, "--secure-port", str(kcm_port), *serving,
            "--leader-elect=false",
            "--use-service-account-credentials=true",
            "--service-account-private-key-file", pki / "sa.key",
            "--root-ca-file", ca,
            "--cluster-signing-cert-file", ca, "--cluster-signing-key-file", pki / "ca.key",
            "--service-cluster-ip-range", SERVICE_CIDR,
            "--profiling=false",
        ], f"https://{LOOPBACK}:{kcm_port}/healthz")
        sched_cfg = self.kc_dir / "kube-scheduler.config.json"
        sched_cfg.write_text(json.dumps({
            "apiVersion": "kubescheduler.config.k8s.io/v1",
            "kind": "KubeSchedulerConfiguration",
            "clientConnection": {"kubeconfig": str(sched_kc)},
            "leaderElection": {"leaderElect": False},
            "enableProfiling": False,
        }, indent=2))
        self.spawn("kube-scheduler", [
            "kube-scheduler",
            "--config", sched_cfg,
            "--authentication-kubeconfig", sched_kc, "--authorization-kubeconfig", sched_kc,
            "--bind-address", LOOPBACK, "--secure-port", str(sched_port), *serving,
        ], f"https://{LOOPBACK}:{sched_port}/healthz")
        self.spawn("kwok", [
            "kwok",
            "--kubeconfig", self.kubeconfig,
            "--config", self.assets / "kwok" / "stages.yaml",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={KWOK_SELECTOR}",
            "--node-ip", KWOK_NODE_IP, "--cidr", POD_CIDR,
            "--node-lease-duration-seconds", "40",
            "--server-address", f"{LOOPBACK}:{kwok_port}",
        ], f"http://{LOOPBACK}:{kwok_port}/healthz",
            # kwok also reads ~/.kwok/kwok.yaml when it exists: keep the user's out of it.
            env={"HOME": str(self.state_dir / "kwok-home")})
        crd_dir = self.assets / "crds" / "kuberay"
        self.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd_dir))
        crds = [f"crd/{p.name.split('_', 1)[1].removesuffix('.yaml')}.{p.name.split('_')[0]}"
                for p in sorted(crd_dir.glob("*.yaml"))]
        # kubectl wait fails at once ("status.conditions accessor error") on a CRD whose status
        # has no conditions yet: retry until they are Established or the deadline passes.
        deadline = time.monotonic() + 60 * self.scale
        while True:
            try:
                self.kubectl("wait", "--for=condition=Established",
                             f"--timeout={60 * self.scale:.0f}s", *crds, timeout=70)
                break
            except PlaneError as exc:
                if "accessor error" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        log(f"KubeRay CRDs established: {', '.join(c[4:] for c in crds)}")

        # 4. KubeRay operator (needs its CRDs in place before it starts).
        self.spawn("ray-operator", [
            "ray-operator",
            "--metrics-addr", "0",
            "--health-probe-bind-address", f"{LOOPBACK}:{ray_probe}",
            "--enable-leader-election=false",
            "--log-stdout-encoder", "console",
        ], f"http://{LOOPBACK}:{ray_probe}/readyz", env={"KUBECONFIG": str(self.kubeconfig)})

        serving_ctx = tls_context(pki, client=None)
        self.wait_for({
            "kube-controller-manager":
                lambda: https_ok(f"https://{LOOPBACK}:{kcm_port}/healthz", serving_ctx),
            "kube-scheduler":
                lambda: https_ok(f"https://{LOOPBACK}:{sched_port}/healthz", serving_ctx),
            "kwok": lambda: http_ok(f"http://{LOOPBACK}:{kwok_port}/healthz"),
            "ray-operator": lambda: http_ok(f"http://{LOOPBACK}:{ray_probe}/readyz"),
        }, 90)

        # 5. Fake nodes; ready once kwok marked them Ready and the node lifecycle controller
        #    lifted the not-ready taint, and pods can be admitted (default ServiceAccount).
        self.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
                     input=json.dumps(fake_nodes_manifest()))
        self.wait_for({
            "kwok: fake nodes Ready and untainted": self.nodes_ready,
            "kube-controller-manager: ServiceAccount default/default":
                self.default_service_account_exists,
        }, 90)
        if owner_pid is not None:
            self.start_watchdog(owner_pid)
        elapsed = time.monotonic() - t_start
        self.state.started_s = round(elapsed, 2)
        self.state.save()
        log(f"plane up in {elapsed:.1f}s: KUBECONFIG={self.kubeconfig}")
        return self.state

    def nodes_ready(self) -> bool:
        try:
            out = self.kubectl("get", "nodes", "-o", "json", timeout=15)
        except (PlaneError, subprocess.TimeoutExpired):
            return False
        items = {n["metadata"]["name"]: n for n in json.loads(out)["items"]}
        for name, resources, _, _ in FAKE_NODES:
            node = items.get(name)
            if node is None:
                return False
            status = node.get("status", {})
            ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                        for c in status.get("conditions", []))
            lifecycle_taints = [t for t in node.get("spec", {}).get("taints", [])
                                if t["key"].startswith("node.kubernetes.io/")]
            if not ready or lifecycle_taints:
                return False
            allocatable = status.get("allocatable", {})
            if any(allocatable.get(k) != v for k, v in resources.items()):
                # kwok initialises an empty status with its own defaults; put ours back.
                patch = {"status": {"capacity": resources, "allocatable": resources}}
                self.kubectl("patch", "node", name, "--subresource=status", "--type=merge",
                             "-p", json.dumps(patch))
                return False
        return True

    def default_service_account_exists(self) -> bool:
        try:
            self.kubectl("get", "serviceaccount", "default", "-n", "default", timeout=15)
        except (PlaneError, subprocess.TimeoutExpired):
            return False
        return True

    def start_watchdog(self, owner_pid: int) -> None:
        """A tiny process in the plane's group that stops the group when the owner dies."""
        assert self.state is not None
        log_path = self.logs / "watchdog.log"
        with log_path.open("ab") as out:
            proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "_watchdog",
                 "--owner-pid", str(owner_pid),
                 "--owner-start", str(proc_start_time(owner_pid) or 0),
                 "--pgid", str(self.pgid)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                process_group=self.pgid,
            )
        self.state.components.append(
            ComponentState("watchdog", proc.pid, proc_start_time(proc.pid), str(log_path),
                           f"stops the plane when pid {owner_pid} exits")
        )
        self.state.save()


def fake_nodes_manifest() -> dict[str, object]:
    items = []
    for name, resources, labels, taints in FAKE_NODES:
        items.append({
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
                "labels": {
                    "kubernetes.io/hostname": name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    "type": "kwok",
                    **labels,
                },
            },
            "spec": {"taints": taints} if taints else {},
            "status": {"capacity": resources, "allocatable": resources},
        })
    return {"apiVersion": "v1", "kind": "List", "items": items}


# ---------------------------------------------------------------------------------------------
# Stopping
# ---------------------------------------------------------------------------------------------


def _group_members(pgid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                pids.append(int(entry.name))
    return pids


def stop_group(state: PlaneState | None, grace: float = 10.0) -> bool:
    """SIGTERM the plane's process group, SIGKILL what is left after `grace` seconds.

    Only signals the group when it still holds one of the processes recorded at start-up
    (same PID and start time), so a stale state file never hits an unrelated group.
    """
    if state is None or state.pgid <= 0 or not state.live_components():
        return False
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(state.pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and _group_members(state.pgid):
        time.sleep(0.1)
    if _group_members(state.pgid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(state.pgid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and _group_members(state.pgid):
            time.sleep(0.1)
    return True


def down(state_dir: Path) -> bool:
    """Stop the plane whose state is in state_dir. True if something was running."""
    state = PlaneState.load(state_dir)
    stopped = stop_group(state)
    with contextlib.suppress(FileNotFoundError):
        (state_dir / STATE_FILE).unlink()
    return stopped


def running_state(state_dir: Path) -> PlaneState | None:
    """The state of a plane whose components are all alive and whose API server answers."""
    state = PlaneState.load(state_dir)
    if state is None or len(state.live_components()) != len(state.components):
        return None
    try:
        ctx = tls_context(state_dir / "pki")
    except (OSError, ssl.SSLError):
        return None
    return state if https_ok(f"{state.server}/readyz", ctx) else None


def up(state_dir: Path, bin_dir: Path | None = None, *, owner_pid: int | None = None,
       timeout_scale: float = 1.0) -> PlaneState:
    """Start a plane in state_dir (stopping a stale one there first) and wait until ready."""
    state_dir = state_dir.resolve()
    existing = running_state(state_dir)
    if existing is not None and owner_pid is None:
        log(f"already running: KUBECONFIG={existing.kubeconfig}")
        return existing
    down(state_dir)
    if bin_dir is None:
        bin_dir = build_tools()
    plane = Plane(state_dir, bin_dir.resolve(), timeout_scale=timeout_scale)
    try:
        return plane.up(owner_pid=owner_pid)
    except BaseException:
        stop_group(plane.state)
        raise


def memory_report(state: PlaneState) -> list[tuple[str, int]]:
    return [(c.name, rss_kib(c.pid) // 1024) for c in state.components]


# ---------------------------------------------------------------------------------------------
# Watchdog (internal): stop the group when the process that owns the plane is gone.
# ---------------------------------------------------------------------------------------------


def watchdog(owner_pid: int, owner_start: int, pgid: int) -> None:
    """Wait for the owner to exit, then stop every other member of the plane's group.

    SIGTERM keeps its default action, so `down` (which signals the whole group) ends us too.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while alive(owner_pid, owner_start or None):
        time.sleep(1.0)
    log(f"owner {owner_pid} is gone: stopping process group {pgid}")
    me = os.getpid()
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        for pid in _group_members(pgid):
            if pid != me:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and set(_group_members(pgid)) - {me}:
            time.sleep(0.2)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def env_lines(state: PlaneState) -> Iterator[str]:
    yield f"export KUBECONFIG={state.kubeconfig}"
    yield f"export PATH={state.bin_dir}:$PATH"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hack/plane.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("up", "down", "env", "status"):
        p = sub.add_parser(name)
        p.add_argument("--state-dir", type=Path,
                       default=Path(os.environ.get("TG_K8S_PLANE_DIR") or default_state_dir()))
        if name == "up":
            p.add_argument("--bin-dir", type=Path, default=None,
                           help="use these binaries instead of running hack/build-tools.sh")
            p.add_argument("--owner-pid", type=int, default=None,
                           help="stop the plane when this process exits")
            p.add_argument("--timeout-scale", type=float, default=1.0,
                           help="multiply every start-up timeout (slow machines)")
    wd = sub.add_parser("_watchdog")
    wd.add_argument("--owner-pid", type=int, required=True)
    wd.add_argument("--owner-start", type=int, default=0)
    wd.add_argument("--pgid", type=int, required=True)
    args = parser.parse_args(argv)

    try:
        if args.cmd == "_watchdog":
            watchdog(args.owner_pid, args.owner_start, args.pgid)
        elif args.cmd == "up":
            started = up(args.state_dir, args.bin_dir, owner_pid=args.owner_pid,
                         timeout_scale=args.timeout_scale)
            report = memory_report(started)
            log("memory (RSS MiB): " + ", ".join(f"{n}={m}" for n, m in report)
                + f", total={sum(m for _, m in report)}")
            log("to use it:")
            for line in env_lines(started):
                print(line)
        elif args.cmd == "down":
            if down(args.state_dir.resolve()):
                log(f"stopped the plane in {args.state_dir}")
            else:
                log(f"no plane running in {args.state_dir}; nothing to do")
        elif args.cmd == "env":
            state = PlaneState.load(args.state_dir.resolve())
            if state is None:
                log(f"no plane in {args.state_dir}; start one with `make k8s-up`")
                return 1
            for line in env_lines(state):
                print(line)
        elif args.cmd == "status":
            state = PlaneState.load(args.state_dir.resolve())
            if state is None:
                log(f"no plane in {args.state_dir}")
                return 1
            for c in state.components:
                up_ = alive(c.pid, c.start_time)
                mem = f"{rss_kib(c.pid) // 1024} MiB" if up_ else "-"
                print(f"{c.name:24} {'running' if up_ else 'STOPPED':8} pid {c.pid:<8} "
                      f"rss {mem:>8}  log {c.log}")
            return 0 if len(state.live_components()) == len(state.components) else 1
    except PlaneError as e:
        log(f"ERROR: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
