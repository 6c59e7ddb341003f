"""images/cuda_stubs.py: the CPU variant of the runtime image leaves the CUDA libraries out of
its lock and builds stand-ins with the symbols torch imports from them.

The lock filter is checked on the real lock. The stand-ins are built from this machine's torch
(the same torch release as the image's lock) with its own readelf and C compiler, and checked
with readelf; the image itself (import with every symbol bound, a stand-in aborting with its
message) is checked by test_images.py's built-image test.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.deploy.chart import REPO

LOCK = REPO / "images" / "requirements-runtime.txt"


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("cuda_stubs", REPO / "images" / "cuda_stubs.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["cuda_stubs"] = module
    spec.loader.exec_module(module)
    return module


cuda_stubs = _module()


def _pins(text: str) -> set[str]:
    return {m.lower() for m in re.findall(r"^([A-Za-z0-9_.\-]+)==", text, re.M)}


def test_the_cpu_lock_keeps_everything_but_the_cuda_libraries() -> None:
    full = LOCK.read_text()
    text, dropped = cuda_stubs.filter_lock(full)
    kept = _pins(text)
    assert set(dropped) == _pins(full) - kept
    assert {"torch", "ray", "megatron-core", "tensordict"} <= kept
    assert set(cuda_stubs.KEPT_REAL) <= kept
    assert "nvidia-cublas" in dropped and "nvidia-nccl-cu13" in dropped
    # megatron-core 0.19 imports triton at `import megatron.core` (moe paged_stash kernels)
    assert "triton" in kept and "triton" not in dropped
    assert not [p for p in kept if p.startswith("nvidia-") and p not in cuda_stubs.KEPT_REAL]
    # every kept entry still carries its hashes (pip --require-hashes)
    for entry in re.split(r"\n(?=\S)", text):
        if "==" in entry and not entry.startswith("#"):
            assert "--hash=sha256:" in entry, entry.splitlines()[0]


def test_a_lock_without_cuda_libraries_is_refused(tmp_path: Path) -> None:
    lock = tmp_path / "requirements.txt"
    lock.write_text("six==1.16.0 \\\n    --hash=sha256:00\n")
    assert cuda_stubs.main(["cuda_stubs.py", "lock", str(lock)]) == 1
    assert cuda_stubs.main(["cuda_stubs.py"]) == 2


def _torch_libs() -> list[Path]:
    import torch

    lib = Path(torch.__file__).parent / "lib"
    return sorted(p for p in lib.glob("*.so*") if p.is_file())


@pytest.mark.skipif(
    shutil.which("readelf") is None or shutil.which("cc") is None,
    reason="needs binutils' readelf and a C compiler (the image build installs both)",
)
def test_stand_ins_export_what_torch_imports_with_the_right_versions(tmp_path: Path) -> None:
    libs = _torch_libs()
    stubs = cuda_stubs.collect(libs)
    nccl = stubs["libnccl.so.2"]
    assert "ncclCommInitRank" in nccl.nodes[""]  # unversioned, attributed by its prefix
    cublas = stubs["libcublas.so.13"]
    assert "cublasCreate_v2" in cublas.nodes["libcublas.so.13"]
    # every versioned import of torch_cuda from a stubbed library is covered
    torch_cuda = next(p for p in libs if p.name == "libtorch_cuda.so")
    files = cuda_stubs.version_files(torch_cuda)
    for name, version, _typ, _size in cuda_stubs.undefined(torch_cuda):
        if version and files.get(version) in cuda_stubs.STUBBED:
            assert name in stubs[files[version]].nodes[version], (name, version)
    # built: the soname, the version node and the symbol, as the dynamic linker will see them
    out = tmp_path / "libcublas.so.13"
    cuda_stubs.build(cublas, out, tmp_path)
    dyn = subprocess.run(["readelf", "-W", "-d", "--dyn-syms", str(out)], capture_output=True,
                         text=True, check=True).stdout
    assert "Library soname: [libcublas.so.13]" in dyn
    assert re.search(r"FUNC\s+GLOBAL\s+DEFAULT\s+\d+\s+cublasCreate_v2@@libcublas\.so\.13", dyn)
    assert out.stat().st_size < 200_000
