"""Where the kind cluster's CPU goes: CPU seconds per pod (and per node, the rest being the
kubelet, containerd and the node's other processes), read from the host's cgroup-v1
``cpuacct`` tree of each kind node container, which holds the node's pod cgroups.

``sample OUT``: every few seconds until killed (or its parent is gone), read each node's total
and each pod cgroup's ``cpuacct.usage``, and the pods' names from the node's
``/var/log/pods/<ns>_<name>_<uid>`` (through ``/proc/<node pid>/root``); a pod's figure is the
largest seen, so a pod deleted during the run keeps what it used until its last sample (up to
one interval is lost). The state is rewritten as JSON at each sample.

``report OUT``: a table, costliest first, of pods grouped by their workload (the name without
the ReplicaSet/Job/KubeRay suffixes), and the nodes.

Issue 34 (CI's CPU budget): the kind phase's containers took 2,077 of the warm run's 4,846 CPU
seconds, without saying which pods."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CGROUP = Path("/sys/fs/cgroup/cpuacct/docker")
# a UUID, or a static pod's 32 hex digits (etcd, the API server: the hash of its manifest)
_UID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}|[0-9a-f]{32}"
POD_DIR = re.compile(rf"pod({_UID})(\.slice)?$")
# a pod's random suffix and a ReplicaSet's template hash: Kubernetes' "safe" alphabet (no vowels)
SAFE = "[bcdfghjklmnpqrstvwxz2456789]"
SUFFIX = re.compile(rf"(-{SAFE}{{8,10}})?-{SAFE}{{5}}$")


def pod_usages(node_cgroup: Path) -> Iterator[tuple[str, int]]:
    """(pod uid, CPU ns) for every pod cgroup under a node's cgroup (cgroupfs or systemd)."""
    for root, dirs, _files in os.walk(node_cgroup):
        for d in list(dirs):
            m = POD_DIR.search(d)
            if m is None:
                continue
            dirs.remove(d)  # its containers are inside: the pod's figure holds them
            try:
                usage = int((Path(root) / d / "cpuacct.usage").read_text())
            except (OSError, ValueError):
                continue
            yield m.group(1).replace("_", "-"), usage


def pod_names(node_root: Path) -> dict[str, str]:
    """uid -> ``namespace/name`` from the kubelet's log directories."""
    out = {}
    try:
        for entry in (node_root / "var/log/pods").iterdir():
            parts = entry.name.split("_")
            if len(parts) == 3:
                out[parts[2]] = f"{parts[0]}/{parts[1]}"
    except OSError:
        pass
    return out


def workload(name: str) -> str:
    """``default/llama-tp2-tinker-58d8c66954-7prcs`` -> ``default/llama-tp2-tinker``."""
    return SUFFIX.sub("", name)


def _nodes(cluster: str) -> dict[str, tuple[str, int]]:
    """kind node name -> (container id, pid)."""
    names = subprocess.run(
        ["docker", "ps", "--filter", f"label=io.x-k8s.kind.cluster={cluster}",
         "--format", "{{.Names}}"], capture_output=True, text=True, check=False,
    ).stdout.split()
    out = {}
    for n in names:
        got = subprocess.run(["docker", "inspect", "-f", "{{.Id}} {{.State.Pid}}", n],
                             capture_output=True, text=True, check=False).stdout.split()
        if len(got) == 2:
            out[n] = (got[0], int(got[1]))
    return out


def sample(out: Path, cluster: str, interval: float) -> None:
    """Until killed, or until the process that started it is gone (a run.sh killed outright
    runs no trap: the sampler must not outlive it)."""
    state: dict[str, Any] = {"pods": {}, "nodes": {}}
    nodes: dict[str, tuple[str, int]] = {}
    parent = os.getppid()
    while os.getppid() == parent:
        if not nodes:  # started once the cluster exists: its nodes are all there
            nodes = _nodes(cluster)
        for node, (cid, pid) in nodes.items():
            cg = CGROUP / cid
            try:
                total = int((cg / "cpuacct.usage").read_text())
            except (OSError, ValueError):
                continue
            names = pod_names(Path(f"/proc/{pid}/root"))
            rec = state["nodes"].setdefault(node, {"ns": 0, "pods_ns": 0})
            rec["ns"] = max(rec["ns"], total)
            for uid, ns in pod_usages(cg):
                pod = state["pods"].setdefault(uid, {"node": node, "name": "", "ns": 0})
                pod["ns"] = max(pod["ns"], ns)
                pod["name"] = names.get(uid, pod["name"])
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(out)
        time.sleep(interval)


def report(path: Path) -> str:
    state = json.loads(path.read_text())
    by_workload: dict[str, list[float]] = {}
    pods_per_node: dict[str, float] = {}
    for uid, p in state["pods"].items():
        key = workload(p["name"]) if p["name"] else f"(pod {uid[:8]})"
        row = by_workload.setdefault(key, [0.0, 0])
        row[0] += p["ns"] / 1e9
        row[1] += 1
        pods_per_node[p["node"]] = pods_per_node.get(p["node"], 0.0) + p["ns"] / 1e9
    lines = [f"{'workload (pods)':<58} {'cpu s':>8}"]
    for key, (cpu, n) in sorted(by_workload.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"{key + f' ({n})':<58} {cpu:>8.0f}")
    lines.append(f"{'node':<30} {'cpu s':>8} {'pods':>8} {'rest':>8}")
    for node, rec in sorted(state["nodes"].items()):
        total, pods = rec["ns"] / 1e9, pods_per_node.get(node, 0.0)
        lines.append(f"{node:<30} {total:>8.0f} {pods:>8.0f} {total - pods:>8.0f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("sample", "report"))
    p.add_argument("out", type=Path)
    p.add_argument("--cluster", default="tg-e2e")
    p.add_argument("--interval", type=float, default=5.0)
    a = p.parse_args(argv)
    if a.mode == "sample":
        sample(a.out, a.cluster, a.interval)
        return 0
    if not a.out.is_file():
        print(f"no samples in {a.out}", file=sys.stderr)
        return 1
    print(report(a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
