"""tests/e2e/pod_cpu.py: pod cgroups found in a node's cgroup tree (systemd and cgroupfs
layouts), names from the kubelet's log directories, workloads and the report (pure, on a
directory tree made here; the kind suite runs it on the real nodes)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.e2e.pod_cpu import pod_names, pod_usages, report, workload

UID1 = "0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0"
UID2 = "11111111-2222-3333-4444-555555555555"


def _cg(path: Path, ns: int) -> None:
    path.mkdir(parents=True)
    (path / "cpuacct.usage").write_text(f"{ns}\n")


def test_pod_cgroups_in_both_layouts_and_names_from_the_log_directories(tmp_path: Path) -> None:
    node = tmp_path / "cg"
    _cg(node / "kubelet.slice/kubepods.slice/kubepods-burstable.slice"
        / f"kubepods-burstable-pod{UID1.replace('-', '_')}.slice", 3_000_000_000)
    _cg(node / "kubelet.slice/kubepods.slice/kubepods-burstable.slice"
        / f"kubepods-burstable-pod{UID1.replace('-', '_')}.slice/cri-containerd-abc.scope", 1)
    _cg(node / f"kubepods/besteffort/pod{UID2}", 5_000_000_000)
    static = "9c446778e12b388cc5d1a585cc8d6842"  # a static pod (the API server)
    _cg(node / f"kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-pod{static}.slice", 7)
    assert sorted(pod_usages(node)) == [
        (UID1, 3_000_000_000), (UID2, 5_000_000_000), (static, 7)]
    logs = tmp_path / "root/var/log/pods"
    (logs / f"default_llama-tp2-tinker-58d8c66954-7prcs_{UID1}").mkdir(parents=True)
    assert pod_names(tmp_path / "root") == {UID1: "default/llama-tp2-tinker-58d8c66954-7prcs"}
    assert pod_names(tmp_path / "nowhere") == {}


def test_workloads_and_the_report(tmp_path: Path) -> None:
    assert workload("default/llama-tp2-tinker-58d8c66954-7prcs") == "default/llama-tp2-tinker"
    assert workload("default/llama-tp2-head-r9p76") == "default/llama-tp2-head"
    assert workload("kube-system/etcd-tg-e2e-control-plane") == (
        "kube-system/etcd-tg-e2e-control-plane")
    state = {
        "pods": {
            UID1: {"node": "w", "name": "default/llama-tp2-head-r9p76", "ns": 40e9},
            UID2: {"node": "w", "name": "default/llama-tp2-head-x2g9m", "ns": 20e9},
            "u3": {"node": "w2", "name": "", "ns": 5e9},
        },
        "nodes": {"w": {"ns": 100e9, "pods_ns": 0}, "w2": {"ns": 10e9, "pods_ns": 0}},
    }
    path = tmp_path / "pod-cpu.json"
    path.write_text(json.dumps(state))
    lines = report(path).splitlines()
    assert lines[1].split() == ["default/llama-tp2-head", "(2)", "60"]
    assert lines[2].split() == ["(pod", "u3)", "(1)", "5"]
    assert lines[-2].split() == ["w", "100", "60", "40"]
