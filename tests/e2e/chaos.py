"""A bounded, seeded chaos run on the kind cluster: faults, then the issue's post-checks.

    python3 tests/e2e/chaos.py --seed 7 [--faults 3] [--context kind-tg-e2e]

Needs a cluster set up by tests/e2e/run.sh (E2E_KEEP_CLUSTER=1) and its artifacts: the
TrainerGroup manifest (``trainergroup.yaml``) and a client Job manifest (``*-client.yaml``).
It applies the group, waits for Ready, then injects each fault in an order and with delays
drawn from ``--seed`` (the same seed gives the same run):

* ``worker-killed-mid-step``: a client Job trains; after step k its worker pod is deleted;
* ``head-killed``: the head pod is deleted;
* ``operator-killed-creating``: the group is deleted and applied again, and the operator
  pod is deleted while the group is still being created.

After each fault: exactly one RayCluster and one TrainerGroup; the TrainerGroup ends Ready
(or Failed, with its cause shown); through the State API (in the head pod, with the group's
token) the ALIVE actors of the group's Ray namespace are exactly ``status.workerNames`` and at
most one placement group is CREATED (no leaks); the checkpoint check reads
``spec.training.checkpointDir`` ("n/a" when the spec has none). Prints one table row per
fault and exits 1 when any check failed. Standard library and kubectl only; every wait has a
deadline.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

FAULTS = ("worker-killed-mid-step", "head-killed", "operator-killed-creating")
OPERATOR_NS = "trainergroup-system"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cluster:
    context: str
    namespace: str
    name: str
    artifacts: Path

    def kubectl(self, *args: str, check: bool = True) -> str:
        run = subprocess.run(
            ["kubectl", "--context", self.context, "--request-timeout=30s", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if check and run.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)}: {run.stderr.strip()[:400]}")
        return run.stdout

    def json(self, *args: str) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json"))

    def ns(self, *args: str, check: bool = True) -> str:
        return self.kubectl("-n", self.namespace, *args, check=check)

    def tg(self) -> dict[str, Any] | None:
        out = self.ns("get", "tg", self.name, "-o", "json", check=False)
        return json.loads(out) if out.strip() else None

    def pods(self, node_type: str) -> list[dict[str, Any]]:
        sel = f"ray.io/cluster={self.name},ray.io/node-type={node_type}"
        items: list[dict[str, Any]] = self.json(
            "-n", self.namespace, "get", "pods", "-l", sel
        )["items"]
        return [p for p in items if not p["metadata"].get("deletionTimestamp")]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Outcome:
    fault: str
    detail: str
    recovered_s: float
    phase: str
    problems: tuple[str, ...]


def wait(what: str, timeout_s: float, probe: Callable[[], Any]) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            got = probe()
        except (RuntimeError, ValueError, KeyError, subprocess.TimeoutExpired):
            got = None
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:g}s")
        time.sleep(2)


def settled(c: Cluster, *, timeout_s: float, not_names: list[str] | None = None) -> str:
    """Wait until the group is Ready (with other worker names, if given) or Failed."""

    def probe() -> str | None:
        tg = c.tg() or {}
        st = tg.get("status") or {}
        phase = str(st.get("phase") or "")
        if phase == "Failed":
            return "Failed: " + str(st.get("message", ""))[:120]
        if phase != "Ready" or not st.get("workerNames"):
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
        "import json, os, urllib.request as u\n"
        f"r = u.Request('http://127.0.0.1:8265{path}')\n"
        "t = os.environ.get('RAY_AUTH_TOKEN', '')\n"
        "t and r.add_header('Authorization', 'Bearer ' + t)\n"
        "print(u.urlopen(r, timeout=20).read().decode())\n"
    )
    out = c.ns("exec", head, "-c", "ray-head", "--", "python", "-c", code)
    data = json.loads(out)
    rows = data.get("data", {}).get("result", {}).get("result", [])
    return [r for r in rows if isinstance(r, dict)]


def post_checks(c: Cluster, phase: str) -> list[str]:
    problems: list[str] = []
    rcs = c.json("-n", c.namespace, "get", "rayclusters", "-l", f"trainergroup.io/name={c.name}")
    if len(rcs["items"]) != 1:
        problems.append(f"{len(rcs['items'])} RayClusters")
    tgs = [t for t in c.json("-n", c.namespace, "get", "tg")["items"]
           if t["metadata"]["name"] == c.name]
    if len(tgs) != 1:
        problems.append(f"{len(tgs)} TrainerGroups")
    if phase != "Ready":
        problems.append(f"ended {phase}")
        return problems
    st = (c.tg() or {}).get("status") or {}
    ray_ns = st.get("rayNamespace", "")
    q = f"?limit=10000&detail=true&filter_keys=ray_namespace&filter_predicates=%3D&filter_values={ray_ns}"
    alive = sorted(a.get("name", "") for a in state_api(c, "/api/v0/actors" + q)
                   if a.get("state") == "ALIVE")
    if alive != sorted(st.get("workerNames") or []):
        problems.append(f"ALIVE actors {alive} != workerNames {st.get('workerNames')}")
    pgs = [p for p in state_api(c, "/api/v0/placement_groups?limit=10000&detail=true")
           if p.get("state") == "CREATED"]
    if len(pgs) > 1:
        problems.append(f"{len(pgs)} CREATED placement groups (leak)")
    return problems


def checkpoint_note(c: Cluster) -> str:
    spec = (c.tg() or {}).get("spec") or {}
    return "checked" if (spec.get("training") or {}).get("checkpointDir") else "n/a"


def client_job(c: Cluster, *, name: str, steps: int) -> None:
    src = next(iter(sorted(c.artifacts.glob(f"{c.name}-client.yaml"))), None)
    if src is None:
        raise FileNotFoundError(f"no {c.name}-client.yaml in {c.artifacts} (run tests/e2e/run.sh)")
    c.ns("delete", "job", name, "--ignore-not-found", "--wait=true")
    text = src.read_text().replace(f"name: {c.name}-client\n", f"name: {name}\n", 1)
    lines = []
    env_steps = False
    for line in text.splitlines():
        if env_steps and line.strip().startswith("value:"):
            line = line.split("value:")[0] + f"value: '{steps}'"
            env_steps = False
        env_steps = env_steps or line.strip() == "- name: TG_STEPS"
        lines.append(line)
    subprocess.run(["kubectl", "--context", c.context, "apply", "-f", "-"],
                   input="\n".join(lines) + "\n", text=True, check=True, capture_output=True)


def fault_worker(c: Cluster, rng: random.Random, timeout_s: float) -> Outcome:
    k = rng.randint(1, 3)
    job = f"{c.name}-chaos-client"
    client_job(c, name=job, steps=200)
    wait(f"step {k} in the client's log", timeout_s,
         lambda: c.ns("logs", f"job/{job}", check=False).count("TG_STEP ") >= k)
    old = (c.tg() or {})["status"]["workerNames"]
    t0 = time.monotonic()
    c.ns("delete", "pod", c.pods("worker")[0]["metadata"]["name"], "--wait=false")
    phase = settled(c, timeout_s=timeout_s, not_names=old)
    took = time.monotonic() - t0
    jobs = c.json("-n", c.namespace, "get", "job", job).get("status", {})
    c.ns("delete", "job", job, "--wait=false", check=False)
    client = "client Job failed" if jobs.get("failed") else "client Job still running/done"
    return Outcome(fault="worker-killed-mid-step", detail=f"after step {k}; {client}",
                   recovered_s=took, phase=phase, problems=())


def fault_head(c: Cluster, rng: random.Random, timeout_s: float) -> Outcome:
    old = (c.tg() or {})["status"]["workerNames"]
    t0 = time.monotonic()
    c.ns("delete", "pod", c.pods("head")[0]["metadata"]["name"], "--wait=false")
    ft = bool(((c.tg() or {}).get("spec") or {}).get("rayCluster", {}).get("gcsFaultTolerance"))
    phase = settled(c, timeout_s=timeout_s, not_names=None if ft else old)
    return Outcome(fault="head-killed", detail="GCS FT on" if ft else "no GCS FT: re-created",
                   recovered_s=time.monotonic() - t0, phase=phase, problems=())


def fault_operator(c: Cluster, rng: random.Random, timeout_s: float) -> Outcome:
    manifest = c.artifacts / "trainergroup.yaml"
    c.ns("delete", "tg", c.name, "--timeout=600s")
    wait("the old RayCluster gone", timeout_s, lambda: not c.json(
        "-n", c.namespace, "get", "rayclusters", "-l", f"trainergroup.io/name={c.name}")["items"])
    wait("the old token Secret garbage-collected", timeout_s, lambda: not c.ns(
        "get", "secret", f"{c.name}-ray-token", "--ignore-not-found", "-o", "name").strip())
    delay = rng.uniform(0.5, 4.0)
    t0 = time.monotonic()
    c.kubectl("apply", "-f", str(manifest))
    time.sleep(delay)  # the fault's timing (drawn from the seed), not a synchronisation
    phase_at = str(((c.tg() or {}).get("status") or {}).get("phase") or "<none>")
    c.kubectl("-n", OPERATOR_NS, "delete", "pod", "-l", "app.kubernetes.io/component=operator",
              "--wait=false")
    phase = settled(c, timeout_s=timeout_s)
    return Outcome(fault="operator-killed-creating",
                   detail=f"{delay:.1f}s after apply (phase {phase_at})",
                   recovered_s=time.monotonic() - t0, phase=phase, problems=())


RUNNERS: dict[str, Callable[[Cluster, random.Random, float], Outcome]] = {
    "worker-killed-mid-step": fault_worker,
    "head-killed": fault_head,
    "operator-killed-creating": fault_operator,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--faults", type=int, default=len(FAULTS))
    ap.add_argument("--context", default="kind-tg-e2e")
    ap.add_argument("--namespace", default="default")
    ap.add_argument("--name", default="llama-tp2")
    ap.add_argument("--artifacts", type=Path, default=Path("tests/e2e/.artifacts"))
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per wait")
    args = ap.parse_args(argv)
    c = Cluster(context=args.context, namespace=args.namespace, name=args.name,
                artifacts=args.artifacts)
    rng = random.Random(args.seed)
    order = [rng.choice(FAULTS) for _ in range(args.faults)] if args.faults > len(FAULTS) \
        else rng.sample(FAULTS, args.faults)
    if c.tg() is None:
        c.kubectl("apply", "-f", str(args.artifacts / "trainergroup.yaml"))
    print(f"chaos: seed {args.seed}, faults {order}", file=sys.stderr)
    print("baseline: " + settled(c, timeout_s=args.timeout), file=sys.stderr)
    rows: list[Outcome] = []
    for fault in order:
        try:
            out = RUNNERS[fault](c, rng, args.timeout)
            out = dataclasses.replace(out, problems=tuple(post_checks(c, out.phase)))
        except (TimeoutError, RuntimeError, FileNotFoundError) as exc:
            out = Outcome(fault=fault, detail="", recovered_s=float("nan"), phase="?",
                          problems=(str(exc)[:200],))
        rows.append(out)
        print(f"chaos: {fault}: {out.phase} {out.problems or ''}", file=sys.stderr)
    print(f"{'fault':26} {'detail':44} {'recovered':>9} {'ends':8} {'checkpoint':10} checks")
    for r in rows:
        print(f"{r.fault:26} {r.detail[:44]:44} {r.recovered_s:8.0f}s {r.phase[:8]:8} "
              f"{checkpoint_note(c):10} {'; '.join(r.problems) or 'ok'}")
    survived = sum(not r.problems for r in rows)
    print(f"faults tried {len(rows)}, survived {survived}")
    return 0 if survived == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
