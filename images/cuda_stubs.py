"""Stand-in CUDA libraries for the CPU variant of the runtime image (images/runtime.Dockerfile,
target ``cpu``).

PyPI's torch for Linux x86_64 is a CUDA build: its libraries name libcublas, libnccl, libcudnn
and others as NEEDED, and ``import torch`` fails when they are missing. Those libraries are
3 GB of the 6.3 GB runtime image, and a CPU-only pod (the kind suite's workers train on CPU)
never calls them. This script builds, for each library in ``STUBBED``, a small shared library
with the same file name, soname and symbol versions that exports exactly the symbols torch's
own libraries import from it. Each exported function aborts with a message that names itself
when called; the dynamic linker is satisfied, nothing GPU-related can run by accident.

The CUDA runtime (libcudart), CUPTI and cuFile stay real (a few MB): torch calls
``cudaGetDeviceCount`` on CPU too (``torch.cuda.is_available()`` is then False), and its
profiler loads CUPTI.

Run inside the image build, after torch is installed, with binutils' ``readelf`` and a C
compiler on PATH::

    python cuda_stubs.py SITE_PACKAGES

Output: ``SITE_PACKAGES/nvidia/<folder>/lib/<soname>`` for each stubbed library (torch's RPATH
looks there) and ``SITE_PACKAGES/nvidia/TRAINERGROUP_CUDA_STUBS`` listing them. Exit status 1
with a message when torch imports a symbol of a library that is neither stubbed nor present.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

# soname -> folder under site-packages/nvidia (where the PyPI wheels put it; torch's RPATH)
STUBBED: dict[str, str] = {
    "libcublas.so.13": "cu13/lib",
    "libcublasLt.so.13": "cu13/lib",
    "libcufft.so.12": "cu13/lib",
    "libcusparse.so.12": "cu13/lib",
    "libcusolver.so.12": "cu13/lib",
    "libnvrtc.so.13": "cu13/lib",
    "libcudnn.so.9": "cudnn/lib",
    "libcusparseLt.so.0": "cusparselt/lib",
    "libnccl.so.2": "nccl/lib",
    "libnvshmem_host.so.3": "nvshmem/lib",
}
# Unversioned imports are attributed by the library's API prefix (libnccl and libcusparseLt
# export unversioned symbols; the others version theirs, which names the library).
PREFIXES: dict[str, tuple[str, ...]] = {
    "libnccl.so.2": ("nccl", "pnccl"),
    "libcusparseLt.so.0": ("cusparseLt",),
    "libcudnn.so.9": ("cudnn",),
    "libnvshmem_host.so.3": ("nvshmem",),
    "libcufft.so.12": ("cufft",),
    "libcusolver.so.12": ("cusolver",),
    "libnvrtc.so.13": ("nvrtc",),
}
MARKER = "TRAINERGROUP_CUDA_STUBS"
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass
class Stub:
    soname: str
    # version node name ("" = unversioned) -> {symbol: (type, size)}
    nodes: dict[str, dict[str, tuple[str, int]]] = field(default_factory=lambda: defaultdict(dict))


def _readelf(*args: str) -> str:
    proc = subprocess.run(["readelf", "-W", *args], check=True, capture_output=True, text=True)
    return proc.stdout


def needed(lib: Path) -> list[str]:
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", _readelf("-d", str(lib)))


def version_files(lib: Path) -> dict[str, str]:
    """Version name -> the library file it is required from (the .gnu.version_r section)."""
    out: dict[str, str] = {}
    current = ""
    for line in _readelf("-V", str(lib)).splitlines():
        m = re.search(r"File: (\S+)\s+Cnt:", line)
        if m:
            current = m.group(1)
            continue
        m = re.search(r"Name: (\S+)\s+Flags:", line)
        if m and current:
            out[m.group(1)] = current
    return out


def undefined(lib: Path) -> list[tuple[str, str, str, int]]:
    """(name, version or "", type, size) of every undefined, non-weak dynamic symbol."""
    rows = []
    for line in _readelf("--dyn-syms", str(lib)).splitlines():
        parts = line.split()
        # Num: Value Size Type Bind Vis Ndx Name
        if len(parts) < 8 or parts[6] != "UND" or parts[4] == "WEAK":
            continue
        name, _, version = parts[7].partition("@")
        version = version.lstrip("@").split(" ")[0]
        size = int(parts[2], 0) if parts[2].isdigit() or parts[2].startswith("0x") else 0
        rows.append((name, version, parts[3], size))
    return rows


def collect(importers: list[Path]) -> dict[str, Stub]:
    stubs = {soname: Stub(soname) for soname in STUBBED}
    for lib in importers:
        libs_needed = set(needed(lib)) & set(STUBBED)
        if not libs_needed:
            continue
        files = version_files(lib)
        for name, version, typ, size in undefined(lib):
            if not _IDENT.match(name):
                continue
            if version:
                soname = files.get(version, "")
                if soname in libs_needed:
                    stubs[soname].nodes[version][name] = (typ, size)
                continue
            for soname in libs_needed:
                if name.startswith(PREFIXES.get(soname, ("\0",))):
                    stubs[soname].nodes[""][name] = (typ, size)
    return stubs


def c_source(stub: Stub) -> str:
    lines = [
        "#include <stdio.h>",
        "#include <stdlib.h>",
        "static void tg_stub_called(const char *sym) {",
        f'  fprintf(stderr, "{stub.soname} is a stand-in in this CPU-only TrainerGroup runtime '
        'image; %s was called. Use the GPU runtime image (ghcr.io/trainergroup/runtime, '
        'without -cpu) on GPU nodes.\\n", sym);',
        "  abort();",
        "}",
    ]
    for symbols in stub.nodes.values():
        for name, (typ, size) in sorted(symbols.items()):
            if typ == "OBJECT":
                lines.append(f"char {name}[{max(size, 16)}];")
            else:
                lines.append(f'void {name}(void) {{ tg_stub_called("{name}"); }}')
    return "\n".join(lines) + "\n"


def version_script(stub: Stub) -> str:
    blocks = []
    for version, symbols in stub.nodes.items():
        node = version or stub.soname
        body = "".join(f"    {name};\n" for name in sorted(symbols))
        blocks.append(f"{node} {{\n  global:\n{body}  local: *;\n}};\n")
    return "".join(blocks) or f"{stub.soname} {{ local: *; }};\n"


def build(stub: Stub, dest: Path, work: Path) -> None:
    src = work / f"{stub.soname}.c"
    vers = work / f"{stub.soname}.map"
    src.write_text(c_source(stub))
    vers.write_text(version_script(stub))
    dest.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["cc", "-shared", "-fPIC", "-O1", "-fno-builtin", "-w", f"-Wl,-soname,{stub.soname}",
         f"-Wl,--version-script={vers}", "-o", str(dest), str(src)],
        check=True,
    )


# What the CPU variant leaves out of the lock: the CUDA libraries but the three kept real.
KEPT_REAL = ("nvidia-cuda-runtime", "nvidia-cuda-cupti", "nvidia-cufile")


def left_out(package: str) -> bool:
    name = package.lower().replace("_", "-")
    if name.startswith("nvidia-"):
        return name not in KEPT_REAL
    # triton stays (about 1 GB installed): megatron-core 0.19 imports it unconditionally
    # (megatron.core.pipeline_parallel.schedules -> transformer.moe.paged_stash -> triton
    # kernels decorated at import), so `import megatron.core` fails without it. Its libtriton
    # links no CUDA library.
    return name == "cuda-toolkit"


def filter_lock(text: str) -> tuple[str, list[str]]:
    """The hash lock without the CUDA libraries (entries start at column 0; their hash lines
    are indented continuations)."""
    entries = re.split(r"\n(?=\S)", text)
    kept, dropped = [], []
    for entry in entries:
        head = entry.split("==", 1)[0].strip()
        if "==" in entry and not entry.startswith("#") and left_out(head):
            dropped.append(head)
        else:
            kept.append(entry)
    return "\n".join(kept), dropped


def stubs(site: Path) -> int:
    torch_lib = site / "torch" / "lib"
    importers = sorted(p for p in torch_lib.glob("*.so*") if p.is_file())
    importers += sorted(site.joinpath("torch").glob("_C*.so"))
    if not importers:
        print(f"cuda_stubs: no torch libraries under {torch_lib}; install torch first",
              file=sys.stderr)
        return 1
    stubs = collect(importers)
    present = {p.name for p in site.glob("nvidia/*/lib/*.so*")}
    missing = sorted(
        {n for lib in importers for n in needed(lib)}
        - set(STUBBED) - present - {p.name for p in importers}
        - {"libcuda.so.1"}  # the driver: from the node, loaded only by the lazy nvrtc/nvshmem parts
    )
    missing = [n for n in missing if any(k in n for k in ("cu", "nccl", "nvrtc", "nvshmem"))]
    if missing:
        print(f"cuda_stubs: torch needs {missing}, which are neither stubbed nor installed",
              file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        for soname, folder in STUBBED.items():
            build(stubs[soname], site / "nvidia" / folder / soname, Path(tmp))
    report = [
        f"{soname} {STUBBED[soname]} {sum(len(s) for s in stubs[soname].nodes.values())} symbols"
        for soname in STUBBED
    ]
    (site / "nvidia" / MARKER).write_text("\n".join(report) + "\n")
    print("cuda_stubs: " + "; ".join(report))
    return 0


USAGE = """usage:
  cuda_stubs.py lock REQUIREMENTS   drop the CUDA libraries from a hash lock, in place
  cuda_stubs.py stubs SITE_PACKAGES build the stand-ins next to an installed torch"""


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[1] not in ("lock", "stubs"):
        print(USAGE, file=sys.stderr)
        return 2
    if argv[1] == "lock":
        path = Path(argv[2])
        text, dropped = filter_lock(path.read_text())
        if not dropped:
            print(f"cuda_stubs: no CUDA library in {path}; is it the runtime lock?",
                  file=sys.stderr)
            return 1
        path.write_text(text)
        print(f"cuda_stubs: left out of {path.name}: {' '.join(sorted(dropped))}")
        return 0
    return stubs(Path(argv[2]))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
