"""The Go tools cache is checked, not trusted: hack/build-tools.sh --verify on a made-up set.

A set of stand-in binaries in a temporary cache root (TG_K8S_TOOLS_CACHE): complete and
unchanged passes; a truncated binary, a changed one or a missing one fails, and the real
build path then rebuilds (``complete`` is the same function the build consults).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "hack" / "build-tools.sh"
TOOLS = [
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubectl",
    "kubelet",
    "kubeadm",
    "kube-proxy",
    "kwok",
    "ray-operator",
    "helm",
    "kind",
    "kube-router",
]

pytestmark = pytest.mark.skipif(
    shutil.which("go") is None and not Path("/usr/local/go/bin/go").exists(),
    reason="needs a Go toolchain (the cache key includes `go version`)",
)


def _run(cache: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TG_K8S_TOOLS_CACHE": str(cache)}
    return subprocess.run(
        ["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.fixture
def tool_set(tmp_path: Path) -> Path:
    """A complete stand-in set at the path the current versions map to; returns its bin dir."""
    out = _run(tmp_path, "--print")
    assert out.returncode == 0, out.stderr
    bin_dir = Path(out.stdout.strip().splitlines()[-1])
    bin_dir.mkdir(parents=True)
    for name in TOOLS:
        f = bin_dir / name
        f.write_bytes(b"\x7fELF" + name.encode() * 1000)
        f.chmod(0o755)
    (bin_dir.parent / "BUILD_INFO").write_text("# stand-in set for the test\n")
    return bin_dir


def test_an_intact_set_verifies_and_records_its_checksums(tool_set: Path, tmp_path: Path) -> None:
    first = _run(tmp_path, "--verify")
    assert first.returncode == 0, first.stderr
    assert (tool_set.parent / "SHA256SUMS").is_file()
    assert _run(tmp_path, "--verify").returncode == 0


@pytest.mark.parametrize("damage", ["truncate", "change", "remove"])
def test_a_damaged_set_fails_verification(tool_set: Path, tmp_path: Path, damage: str) -> None:
    assert _run(tmp_path, "--verify").returncode == 0  # records the checksums
    victim = tool_set / "kube-apiserver"
    if damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:100])
    elif damage == "change":
        victim.write_bytes(victim.read_bytes().replace(b"kube", b"kubf", 1))
    else:
        victim.unlink()
    out = _run(tmp_path, "--verify")
    assert out.returncode != 0
    if damage != "remove":
        assert "fails its checksums" in out.stderr and "kube-apiserver" in out.stderr
