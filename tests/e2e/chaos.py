"""A bounded, seeded chaos run on the kind cluster: faults, then the issue's post-checks.

    python3 tests/e2e/chaos.py --seed 7 [--only head-killed,...] [--json out.json]

Needs a cluster set up by tests/e2e/run.sh (E2E_KEEP_CLUSTER=1, or its phase "chaos") and its
artifacts: the TrainerGroup manifest (``trainergroup.yaml``) and a client Job manifest
(``<name>-client.yaml``). docs/chaos.md has the faults, the checks and the figures.

Setup: a ReadWriteMany PersistentVolume on the tree the worker nodes share (a new directory
per run; tests/e2e/lib/shared_claim.py) and its claim become the group's
``spec.rayCluster.storage``, with ``spec.training.checkpointDir`` on it; a
client trains a few steps and saves a checkpoint there. Then each fault, in an order and with
delays drawn from ``--seed`` (the same seed gives the same run). After each fault:

* exactly one RayCluster and one TrainerGroup of the name;
* the TrainerGroup ends Ready (or Failed: the row shows its cause);
* through the State API (in the head pod, with the group's token) the ALIVE actors of the
  group's Ray namespace are exactly ``status.workerNames``, at most one placement group is
  CREATED and none is PENDING or RESCHEDULING (no leaks);
* every checkpoint listed before the fault is still there, complete (``meta.json``);
* a re-created group resumed from the newest checkpoint (the server's TG_GROUP_READY line).

Last, a client trains: its first optimizer step is the newest checkpoint's step + 1. Prints
one table row per fault, writes them as JSON (``--json``) and exits 1 when a check failed.
Standard library, kubectl and docker only; every wait has a deadline.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

FAULTS = (
    "worker-killed-mid-step",
    "worker-and-operator-killed",
    "head-killed",
    "operator-killed-creating",
    "operator-killed-restarting",
    "operator-killed-deleting",
    "control-plane-restarted",
    "gpu-node-drained",
)
OPERATOR_NS = "trainergroup-system"
OPERATOR_SEL = "app.kubernetes.io/component=operator"
MOUNT = "/checkpoints"
SEED_STEPS = 3


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cluster:
    context: str
    namespace: str
    name: str
    artifacts: Path
    cluster: str  # the kind cluster's name: its node containers are <cluster>-...
    gpu_node: str
    host_dir: str  # the checkpoint volume's directory, on the tree the worker nodes share

    def kubectl(self, *args: str, check: bool = True, stdin: str | None = None) -> str:
        run = subprocess.run(
            ["kubectl", "--context", self.context, "--request-timeout=30s", *args],
            capture_output=True, text=True, timeout=180, input=stdin,
        )
        if check and run.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)[:120]}: {run.stderr.strip()[:400]}")
        return run.stdout

    def json(self, *args: str) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json"))

    def ns(self, *args: str, check: bool = True) -> str:
        return self.kubectl("-n", self.namespace, *args, check=check)

    def tg(self) -> dict[str, Any] | None:
        out = self.ns("get", "tg", self.name, "-o", "json", "--ignore-not-found")
        return json.loads(out) if out.strip() else None

    def status(self) -> dict[str, Any]:
        return dict(((self.tg() or {}).get("status")) or {})

    def pods(self, node_type: str) -> list[dict[str, Any]]:
        sel = f"ray.io/cluster={self.name},ray.io/node-type={node_type}"
        items: list[dict[str, Any]] = self.json(
            "-n", self.namespace, "get", "pods", "-l", sel
        )["items"]
        return [p for p in items if not p["metadata"].get("deletionTimestamp")]

    def node_sh(self, script: str) -> str:
        run = subprocess.run(["docker", "exec", self.gpu_node, "sh", "-c", script],
                             capture_output=True, text=True, timeout=60, check=True)
        return run.stdout

    @property
    def ckpt_dir(self) -> str:
        return f"{MOUNT}/{self.name}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Outcome:
    fault: str
    detail: str
    recovered_s: float
    phase: str
    cause: str = ""  # the first Degraded/Failed message seen while it recovered
    checkpoints: tuple[int, ...] = ()
    resumed_step: int | None = None
    problems: tuple[str, ...] = ()


class Watch:
    """The phases and messages seen while waiting (the cause the status gave)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def note(self, st: dict[str, Any]) -> None:
        got = (str(st.get("phase") or ""), str(st.get("message") or ""))
        if not self.seen or self.seen[-1] != got:
            self.seen.append(got)

    def cause(self) -> str:
        return next((m for p, m in self.seen if p in ("Degraded", "Failed") and m), "")


def wait(what: str, timeout_s: float, probe: Callable[[], Any]) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            got = probe()
        except (RuntimeError, ValueError, KeyError, IndexError, subprocess.SubprocessError):
            got = None
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:g}s")
        time.sleep(2)


def settled(c: Cluster, *, timeout_s: float, watch: Watch | None = None,
            not_names: list[str] | None = None) -> str:
    """Wait until the group is Ready (under other worker names, if given) or Failed."""

    def probe() -> str | None:
        tg = c.tg() or {}
        st = tg.get("status") or {}
        if watch is not None:
            watch.note(st)
        phase = str(st.get("phase") or "")
        if phase == "Failed":
            return "Failed"
        if phase != "Ready" or not st.get("workerNames"):
            return None
        if st.get("observedGeneration") != tg["metadata"]["generation"]:
            return None
        if not_names is not None and st["workerNames"] == not_names:
            return None
        if any(w.get("state") != "ALIVE" for w in st.get("workers") or []):
            return None
        return "Ready"

    return str(wait(f"{c.name} Ready or Failed", timeout_s, probe))


def state_api(c: Cluster, path: str) -> list[dict[str, Any]]:
    """A State API list, asked from inside the head pod with the group's token."""
    head = c.pods("head")[0]["metadata"]["name"]
    code = (
        "import os, urllib.request as u\n"
        f"r = u.Request('http://127.0.0.1:8265{path}')\n"
        "t = os.environ.get('RAY_AUTH_TOKEN', '')\n"
        "t and r.add_header('Authorization', 'Bearer ' + t)\n"
        "print(u.urlopen(r, timeout=20).read().decode())\n"
    )
    out = c.ns("exec", head, "-c", "ray-head", "--", "python", "-c", code)
    rows = json.loads(out).get("data", {}).get("result", {}).get("result", [])
    return [r for r in rows if isinstance(r, dict)]


def checkpoints(c: Cluster) -> tuple[int, ...]:
    """The complete checkpoints (a step_N directory with meta.json) on the GPU node's volume."""
    out = c.node_sh(f"cd '{c.host_dir}/{c.name}' 2>/dev/null && ls -d step_*/meta.json || true")
    return tuple(sorted(int(line.split("/")[0][5:]) for line in out.split() if line.strip()))


def ready_line(c: Cluster) -> dict[str, Any]:
    """The newest TG_GROUP_READY line in the head's job-driver logs ({} if none)."""
    head = c.pods("head")[0]["metadata"]["name"]
    script = ("cd /tmp/ray/session_latest/logs && "
              "grep -h TG_GROUP_READY $(ls -t job-driver-*.log) 2>/dev/null | head -n1")
    out = c.ns("exec", head, "-c", "ray-head", "--", "bash", "-c", script, check=False)
    return dict(json.loads(out.split("TG_GROUP_READY ", 1)[1])) if "TG_GROUP_READY " in out \
        else {}


def post_checks(c: Cluster, out: Outcome, *, before: tuple[int, ...], recreated: bool) -> Outcome:
    problems: list[str] = list(out.problems)
    rcs = c.json("-n", c.namespace, "get", "rayclusters", "-l", f"trainergroup.io/name={c.name}")
    if len(rcs["items"]) != 1:
        problems.append(f"{len(rcs['items'])} RayClusters")
    tgs = [t for t in c.json("-n", c.namespace, "get", "tg")["items"]
           if t["metadata"]["name"] == c.name]
    if len(tgs) != 1:
        problems.append(f"{len(tgs)} TrainerGroups")
    after = checkpoints(c)
    lost = sorted(set(before) - set(after))
    if lost:
        problems.append(f"checkpoints lost: {lost}")
    resumed: int | None = None
    if out.phase != "Ready":
        problems.append(f"ended {out.phase}: {c.status().get('message', '')[:160]}")
    else:
        st = c.status()
        ray_ns = st.get("rayNamespace", "")
        q = ("?limit=10000&detail=true&filter_keys=ray_namespace&filter_predicates=%3D"
             f"&filter_values={ray_ns}")
        alive = sorted(a.get("name", "") for a in state_api(c, "/api/v0/actors" + q)
                       if a.get("state") == "ALIVE")
        if alive != sorted(st.get("workerNames") or []):
            problems.append(f"ALIVE actors {alive} != workerNames {st.get('workerNames')}")
        pgs = state_api(c, "/api/v0/placement_groups?limit=10000&detail=true")
        created = [p for p in pgs if p.get("state") == "CREATED"]
        pending = [p for p in pgs if p.get("state") in ("PENDING", "RESCHEDULING")]
        if len(created) > 1 or pending:
            problems.append(f"placement groups: {len(created)} CREATED, {len(pending)} pending")
        line = ready_line(c)
        resumed = line.get("resumedStep")
        if recreated and after and resumed != max(after):
            problems.append(f"resumed from step {resumed}, newest checkpoint is {max(after)}")
    return dataclasses.replace(out, checkpoints=after, resumed_step=resumed,
                               problems=tuple(problems))


# -- setup: the checkpoint volume, a checkpoint -----------------------------------------------
def setup_storage(c: Cluster, *, run_id: str, timeout_s: float) -> None:
    """A ReadWriteMany claim on the tree the worker nodes share (tests/e2e/lib/shared_claim.py),
    its directory root's and 0755: the pods' fsGroup makes it theirs."""
    claim = f"tg-chaos-{run_id}"
    c.node_sh(f"mkdir -p '{c.host_dir}' && chown 0:0 '{c.host_dir}' && chmod 0755 '{c.host_dir}'")
    workers = c.kubectl("get", "nodes", "-l", "!node-role.kubernetes.io/control-plane",
                        "-o", "jsonpath={.items[*].metadata.name}").split()
    nodes = workers or [c.gpu_node]  # a one-node cluster (nvidia mode): its control plane
    script = Path(__file__).resolve().parent / "lib" / "shared_claim.py"
    objects = subprocess.run(
        [sys.executable, str(script), "--claim", claim, "--pv", claim, "--namespace",
         c.namespace, "--path", c.host_dir, "--nodes", ",".join(nodes)],
        capture_output=True, text=True, timeout=60, check=True).stdout
    c.kubectl("apply", "-f", "-", stdin=objects)
    if c.tg() is None:
        c.kubectl("apply", "-f", str(c.artifacts / "trainergroup.yaml"))
    old = settled(c, timeout_s=timeout_s) and c.status().get("workerNames")
    patch = {"spec": {"rayCluster": {"storage": {"claimName": claim, "mountPath": MOUNT}},
                      "training": {"checkpointDir": c.ckpt_dir}}}
    c.ns("patch", "tg", c.name, "--type", "merge", "-p", json.dumps(patch))
    phase = settled(c, timeout_s=timeout_s, not_names=old or None)
    if phase != "Ready":
        raise RuntimeError(f"the group with the checkpoint claim ended {phase}")
    # the worker pod mounted the fresh (root's, 0755) directory: the kubelet gave it to the
    # pods' fsGroup (gid 100, setgid), or no checkpoint could be written
    owner = c.node_sh(f"stat -c '%g %a' '{c.host_dir}'").split()
    if owner[0] != "100" or len(owner[1]) != 4 or owner[1][0] not in "2367":
        raise RuntimeError(
            f"{c.host_dir} is gid/mode {owner}, not the pods' fsGroup 100 with setgid"
        )
    tg = c.tg() or {}
    keep = {"apiVersion": tg["apiVersion"], "kind": tg["kind"],
            "metadata": {"name": c.name, "namespace": c.namespace}, "spec": tg["spec"]}
    (c.artifacts / "chaos-trainergroup.json").write_text(json.dumps(keep, indent=1))


def client_job(c: Cluster, *, name: str, steps: int, extra: str = "") -> None:
    """The run's client Job manifest under another name, with other steps and arguments."""
    src = c.artifacts / f"{c.name}-client.yaml"
    job = c.json("create", "--dry-run=client", "-f", str(src))
    job["metadata"]["name"] = name
    box = job["spec"]["template"]["spec"]["containers"][0]
    for env in box["env"]:
        if env["name"] == "TG_STEPS":
            env["value"] = str(steps)
    box["args"] = [a.replace("--no-progress", f"--no-progress {extra}") for a in box["args"]]
    c.ns("delete", "job", name, "--ignore-not-found", "--wait=true")
    c.kubectl("apply", "-f", "-", stdin=json.dumps(job))


def client_steps(c: Cluster, job: str) -> list[dict[str, Any]]:
    log = c.ns("logs", f"job/{job}", "--tail=-1", check=False)
    return [json.loads(line.split("TG_STEP ", 1)[1]) for line in log.splitlines()
            if "TG_STEP " in line]


def run_client(c: Cluster, *, name: str, steps: int, extra: str, timeout_s: float) -> list[Any]:
    client_job(c, name=name, steps=steps, extra=extra)

    def done() -> str | None:
        conds = c.json("-n", c.namespace, "get", "job", name).get("status", {})
        return "failed" if conds.get("failed") else "ok" if conds.get("succeeded") else None

    if wait(f"client Job {name}", timeout_s, done) != "ok":
        tail = c.ns("logs", f"job/{name}", check=False)[-400:]
        raise RuntimeError(f"client Job {name} failed: {tail}")
    steps_seen = client_steps(c, name)
    c.ns("delete", "job", name, "--wait=false", check=False)
    return steps_seen


# -- the faults ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class Ctx:
    c: Cluster
    rng: random.Random
    timeout_s: float


def kill_operator(c: Cluster) -> None:
    c.kubectl("-n", OPERATOR_NS, "delete", "pod", "-l", OPERATOR_SEL, "--wait=false")


def kill_operator_once_degraded(x: Ctx, w: Watch) -> tuple[float, str]:
    """Once the group is Degraded (restarting), 0-3 s later (seeded), the operator pod
    deleted; (that delay, the status message then)."""
    c = x.c

    def degraded() -> bool:
        st = c.status()
        w.note(st)
        return st.get("phase") == "Degraded"

    wait("the group Degraded (restarting)", x.timeout_s, degraded)
    delay = x.rng.uniform(0.0, 3.0)
    time.sleep(delay)  # the fault's timing (drawn from the seed), not a synchronisation
    at = c.status().get("message", "")[:40]
    kill_operator(c)
    return delay, at


def fault_worker(x: Ctx, *, operator_too: bool = False) -> tuple[Outcome, bool]:
    """The worker pod deleted after step k of a training client. ``operator_too``: also the
    operator pod, 0-3 s (seeded) after the group shows Degraded: worker-killed-mid-step and
    operator-killed-restarting in one re-creation (the CI subset's "worker-and-operator-killed",
    docs/chaos.md)."""
    c, k = x.c, x.rng.randint(1, 3)
    job = f"{c.name}-chaos-mid-step"
    client_job(c, name=job, steps=200)
    wait(f"step {k} in the client's log", x.timeout_s, lambda: len(client_steps(c, job)) >= k)
    old = c.status()["workerNames"]
    t0, w = time.monotonic(), Watch()
    c.ns("delete", "pod", c.pods("worker")[0]["metadata"]["name"], "--wait=false")
    detail = f"after step {k}"
    if operator_too:
        delay, _ = kill_operator_once_degraded(x, w)
        detail += f", the operator {delay:.1f}s into the re-creation"
    phase = settled(c, timeout_s=x.timeout_s, watch=w, not_names=old)
    took = time.monotonic() - t0
    failed = c.json("-n", c.namespace, "get", "job", job).get("status", {}).get("failed")
    c.ns("delete", "job", job, "--wait=false", check=False)
    detail += f"; the client {'failed' if failed else 'did not fail (yet)'}"
    # The status must say so while it recovers (tests/e2e/run.sh's step 7 leaves this to us).
    problems = () if any(p == "Degraded" for p, _ in w.seen) else (
        f"the status never showed Degraded (seen: {[p for p, _ in w.seen]})",)
    name = "worker-and-operator-killed" if operator_too else "worker-killed-mid-step"
    return Outcome(fault=name, detail=detail, recovered_s=took,
                   phase=phase, cause=w.cause(), problems=problems), True


def fault_worker_and_operator(x: Ctx) -> tuple[Outcome, bool]:
    return fault_worker(x, operator_too=True)


def fault_head(x: Ctx) -> tuple[Outcome, bool]:
    c = x.c
    old = c.status()["workerNames"]
    ft = bool((((c.tg() or {}).get("spec") or {}).get("rayCluster") or {})
              .get("gcsFaultTolerance"))
    t0, w = time.monotonic(), Watch()
    c.ns("delete", "pod", c.pods("head")[0]["metadata"]["name"], "--wait=false")
    phase = settled(c, timeout_s=x.timeout_s, watch=w, not_names=None if ft else old)
    said = [m for _, m in w.seen if "head lost the group" in m]
    out = Outcome(fault="head-killed", detail="GCS FT: same workers" if ft else
                  "no GCS FT: re-created from the checkpoint",
                  recovered_s=time.monotonic() - t0, phase=phase,
                  cause=said[0] if said else w.cause())
    if not ft and not said:
        out = dataclasses.replace(out, problems=("the status never said the head lost the group",))
    return out, not ft


def delete_group(c: Cluster, timeout_s: float) -> None:
    """Wait until the group, its RayCluster, its pods and its token Secret are all gone."""
    wait("the TrainerGroup gone", timeout_s, lambda: c.tg() is None)
    wait("the RayCluster and its pods gone", timeout_s, lambda: not c.ns(
        "get", "raycluster,pods", "-l", f"ray.io/cluster={c.name}", "-o", "name").strip()
        and not c.ns("get", "raycluster", c.name, "--ignore-not-found", "-o", "name").strip())
    wait("the token Secret garbage-collected", timeout_s, lambda: not c.ns(
        "get", "secret", f"{c.name}-ray-token", "--ignore-not-found", "-o", "name").strip())


def apply_group(c: Cluster) -> None:
    c.kubectl("apply", "-f", str(c.artifacts / "chaos-trainergroup.json"))


def fault_operator_creating(x: Ctx) -> tuple[Outcome, bool]:
    c = x.c
    c.ns("delete", "tg", c.name, "--wait=false")
    delete_group(c, x.timeout_s)
    delay = x.rng.uniform(0.5, 4.0)
    t0, w = time.monotonic(), Watch()
    apply_group(c)
    time.sleep(delay)  # the fault's timing (drawn from the seed), not a synchronisation
    at = str(c.status().get("phase") or "<none>")
    kill_operator(c)
    phase = settled(c, timeout_s=x.timeout_s, watch=w)
    return Outcome(fault="operator-killed-creating", detail=f"{delay:.1f}s after apply ({at})",
                   recovered_s=time.monotonic() - t0, phase=phase, cause=w.cause()), True


def fault_operator_restarting(x: Ctx) -> tuple[Outcome, bool]:
    c = x.c
    old = c.status()["workerNames"]
    t0, w = time.monotonic(), Watch()
    c.ns("delete", "pod", c.pods("worker")[0]["metadata"]["name"], "--wait=false")
    delay, at = kill_operator_once_degraded(x, w)
    phase = settled(c, timeout_s=x.timeout_s, watch=w, not_names=old)
    return Outcome(fault="operator-killed-restarting", detail=f"{delay:.1f}s into: {at}",
                   recovered_s=time.monotonic() - t0, phase=phase, cause=w.cause()), True


def fault_operator_deleting(x: Ctx) -> tuple[Outcome, bool]:
    c = x.c
    t0 = time.monotonic()
    c.ns("delete", "tg", c.name, "--wait=false")
    wait("deletion started", x.timeout_s,
         lambda: (c.tg() or {"metadata": {"deletionTimestamp": 1}})["metadata"]
         .get("deletionTimestamp"))
    delay = x.rng.uniform(0.0, 3.0)
    time.sleep(delay)  # the fault's timing (drawn from the seed)
    kill_operator(c)
    delete_group(c, x.timeout_s)
    gone_s = time.monotonic() - t0
    w = Watch()
    apply_group(c)
    phase = settled(c, timeout_s=x.timeout_s, watch=w)
    return Outcome(fault="operator-killed-deleting",
                   detail=f"{delay:.1f}s into deletion; all gone in {gone_s:.0f}s, re-applied",
                   recovered_s=time.monotonic() - t0, phase=phase, cause=w.cause()), True


def fault_control_plane(x: Ctx) -> tuple[Outcome, bool]:
    c = x.c
    old = c.status().get("groupGeneration")
    t0, w = time.monotonic(), Watch()
    subprocess.run(["docker", "restart", f"{c.cluster}-control-plane"], check=True,
                   capture_output=True, timeout=180)
    wait("the API server ready", x.timeout_s,
         lambda: c.kubectl("get", "--raw", "/readyz").strip() == "ok")
    api_s = time.monotonic() - t0
    wait("every node Ready", x.timeout_s, lambda: all(
        any(k["type"] == "Ready" and k["status"] == "True" for k in n["status"]["conditions"])
        for n in c.json("get", "nodes")["items"]))
    phase = settled(c, timeout_s=x.timeout_s, watch=w)
    new = c.status().get("groupGeneration")
    same = "same group" if new == old else f"group re-created ({old} -> {new})"
    return Outcome(fault="control-plane-restarted", detail=f"API back in {api_s:.0f}s; {same}",
                   recovered_s=time.monotonic() - t0, phase=phase, cause=w.cause()), new != old


def fault_drain(x: Ctx) -> tuple[Outcome, bool]:
    c = x.c
    old = c.status()["workerNames"]
    t0, w = time.monotonic(), Watch()
    c.kubectl("cordon", c.gpu_node)
    try:
        c.kubectl("drain", c.gpu_node, "--ignore-daemonsets", "--delete-emptydir-data",
                  "--force", "--timeout=300s")

        def unschedulable() -> bool:
            st = c.status()
            w.note(st)
            return st.get("phase") in ("Degraded", "Failed", "ClusterProvisioning") \
                and "nschedulable" in str(st.get("message", ""))

        wait("the status naming the unschedulable worker pod", x.timeout_s, unschedulable)
        held = time.monotonic() - t0
    finally:
        c.kubectl("uncordon", c.gpu_node)
    phase = settled(c, timeout_s=x.timeout_s, watch=w, not_names=old)
    msgs = [m for _, m in w.seen if "nschedulable" in m]
    return Outcome(fault="gpu-node-drained",
                   detail=f"cordoned+drained; uncordoned after {held:.0f}s",
                   recovered_s=time.monotonic() - t0, phase=phase,
                   cause=msgs[0] if msgs else w.cause()), True


RUNNERS: dict[str, Callable[[Ctx], tuple[Outcome, bool]]] = {
    "worker-killed-mid-step": fault_worker,
    "worker-and-operator-killed": fault_worker_and_operator,
    "head-killed": fault_head,
    "operator-killed-creating": fault_operator_creating,
    "operator-killed-restarting": fault_operator_restarting,
    "operator-killed-deleting": fault_operator_deleting,
    "control-plane-restarted": fault_control_plane,
    "gpu-node-drained": fault_drain,
}


def one_fault(x: Ctx, fault: str) -> Outcome:
    c = x.c
    try:
        if settled(c, timeout_s=x.timeout_s) != "Ready":
            return Outcome(fault=fault, detail="not run", recovered_s=math.nan, phase="Failed",
                           problems=("the group was not Ready before the fault",))
        before = checkpoints(c)
        out, recreated = RUNNERS[fault](x)
        return post_checks(c, out, before=before, recreated=recreated)
    except (TimeoutError, RuntimeError, subprocess.SubprocessError, OSError) as exc:
        return Outcome(fault=fault, detail="", recovered_s=math.nan, phase="?",
                       problems=(str(exc)[:300],))


def loss_continues(seed: list[Any], after: list[Any], newest: int) -> dict[str, Any]:
    """Resumed from the seed client's checkpoint, the first loss after the faults sits by the
    seed's last one (the same batch, one more step), not near a fresh model's first: the
    weights came back, not only the step counter (the check of tests/e2e/phases/resume.sh)."""
    if newest != SEED_STEPS or len(seed) != SEED_STEPS or not after:
        return {}
    la, first = [s["loss"] for s in seed], after[0]["loss"]
    drop = la[0] - la[-1]
    near = drop > 0 and math.isfinite(first) and abs(first - la[-1]) < 0.5 * drop
    return {"loss_seed": [round(la[0], 4), round(la[-1], 4)], "loss_after": round(first, 4),
            "loss_continues": near} | ({} if near else {"ok": False})


def print_table(rows: list[Outcome]) -> None:
    print(f"{'fault':27} {'recovered':>9} {'ends':6} {'ckpts':6} {'resumed':7} checks / detail")
    for r in rows:
        ck = ",".join(map(str, r.checkpoints)) or "-"
        res = "-" if r.resumed_step is None else str(r.resumed_step)
        print(f"{r.fault:27} {r.recovered_s:8.0f}s {r.phase[:6]:6} {ck:6} {res:7} "
              f"{'; '.join(r.problems) or 'ok'} / {r.detail}")
        if r.cause:
            print(f"{'':27} cause: {r.cause[:150]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--only", default="", help="comma-separated faults (default: all)")
    ap.add_argument("--cluster", default="tg-e2e", help="the kind cluster's name")
    ap.add_argument("--namespace", default="default")
    ap.add_argument("--name", default="llama-tp2")
    ap.add_argument("--artifacts", type=Path, default=Path("tests/e2e/.artifacts"))
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per wait")
    ap.add_argument("--json", type=Path, default=None, help="write the table here as JSON")
    args = ap.parse_args(argv)
    chosen = [f for f in args.only.split(",") if f] or list(FAULTS)
    unknown = sorted(set(chosen) - set(FAULTS))
    if unknown:
        ap.error(f"--only: unknown faults {unknown}; known: {', '.join(FAULTS)}")
    rng = random.Random(args.seed)
    order = rng.sample(chosen, len(chosen))
    run_id = f"{args.seed}-{int(time.time())}"
    ctx = f"kind-{args.cluster}"
    probe = Cluster(context=ctx, namespace=args.namespace, name=args.name,
                    artifacts=args.artifacts, cluster=args.cluster, gpu_node="", host_dir="")
    gpu = probe.kubectl("get", "nodes", "-l", "nvidia.com/gpu.present=true",
                        "-o", "jsonpath={.items[0].metadata.name}").strip()
    c = dataclasses.replace(probe, gpu_node=gpu, host_dir=f"/var/lib/tg-shared/chaos-{run_id}")
    t_start = time.monotonic()
    print(f"chaos: seed {args.seed}, faults {order}, checkpoints in {gpu}:{c.host_dir}",
          file=sys.stderr)
    setup_storage(c, run_id=run_id, timeout_s=args.timeout)
    path = f"{c.ckpt_dir}/step_{SEED_STEPS:08d}"
    seed = run_client(c, name=f"{c.name}-chaos-seed", steps=SEED_STEPS,
                      extra=f"--save-checkpoint {path}", timeout_s=args.timeout)
    print(f"chaos: setup done in {time.monotonic() - t_start:.0f}s, checkpoints "
          f"{checkpoints(c)}", file=sys.stderr)
    x = Ctx(c=c, rng=rng, timeout_s=args.timeout)
    rows: list[Outcome] = []
    for fault in order:
        out = one_fault(x, fault)
        rows.append(out)
        print(f"chaos: {fault}: {out.phase} in {out.recovered_s:.0f}s "
              f"{list(out.problems) or 'ok'}", file=sys.stderr)
    final: dict[str, Any] = {}
    try:
        settled(c, timeout_s=args.timeout)
        newest = max(checkpoints(c), default=0)
        got = run_client(c, name=f"{c.name}-chaos-after", steps=2, extra="",
                         timeout_s=args.timeout)
        first = got[0]["optimizerStep"] if got else None
        final = {"newest_checkpoint": newest, "first_step_after": first,
                 "ok": first == newest + 1} | loss_continues(seed, got, newest)
    except (TimeoutError, RuntimeError, subprocess.SubprocessError, KeyError) as exc:
        final = {"ok": False, "error": str(exc)[:300]}
    print_table(rows)
    survived = sum(not r.problems for r in rows)
    print(f"training after the faults: {final}")
    print(f"faults tried {len(rows)}, survived {survived}; "
          f"{time.monotonic() - t_start:.0f}s in all")
    if args.json is not None:
        doc = {"seed": args.seed, "order": order, "faults_tried": len(rows),
               "faults_survived": survived, "seconds": round(time.monotonic() - t_start),
               "training_after": final,
               "rows": [dataclasses.asdict(r) | {"recovered_s": None if math.isnan(
                   r.recovered_s) else round(r.recovered_s, 1)} for r in rows]}
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0 if survived == len(rows) and final.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
