"""Import contracts between the three packages (docs/design.md, "Components"):

- the operator never imports Ray, torch, Megatron or the runtime;
- no runtime module imports the operator or its dependencies (kopf, aiohttp,
  prometheus_client; the last two are in the runtime image only because Ray's dashboard
  needs them); the runtime reads Kubernetes through ``tgapi.kube_view``. The one exception is
  the service room (``tgruntime.service``, the Tinker API server) and the gateway room
  (``tgruntime.gateway``, one endpoint for several servers), which serve HTTP with aiohttp;
  they still import neither the operator, kopf nor prometheus_client, and no other runtime
  module imports them at import time;
- ``import tgapi`` needs PyYAML and the standard library only; ``tgapi.kube_view`` adds the
  ``kubernetes`` client and nothing else.
"""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import tg_operator
import tgruntime

RUNTIME_HEAVY = ("ray", "torch", "megatron", "tgruntime", "tensordict")
OPERATOR_ONLY = ("tg_operator", "kopf", "aiohttp", "prometheus_client")


def _modules_after(code: str) -> set[str]:
    probe = code + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))\n"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=300
    ).stdout
    return set(json.loads(out.strip().splitlines()[-1]))


def _tops(mods: set[str]) -> set[str]:
    return {m.split(".")[0] for m in mods}


def _modules_of(pkg: object) -> list[str]:
    pkg_dir = Path(str(getattr(pkg, "__file__", ""))).parent
    name = str(getattr(pkg, "__name__", ""))
    return [
        m.name for m in pkgutil.walk_packages([str(pkg_dir)], prefix=f"{name}.") if not m.ispkg
    ]


def test_every_operator_module_imports_without_ray_torch_megatron_or_runtime() -> None:
    names = _modules_of(tg_operator)
    assert "tg_operator.handlers" in names and "tg_operator.reconcile" in names
    code = "\n".join(f"import {n}" for n in ["tg_operator", *names])
    mods = _modules_after(code)
    assert set(names) <= mods
    assert sorted(_tops(mods) & set(RUNTIME_HEAVY)) == []


SERVICE = "tgruntime.service"
HTTP_ROOMS = (SERVICE + ".", "tgruntime.gateway.")


def test_no_runtime_module_imports_the_operator_or_its_dependencies() -> None:
    names = [n for n in _modules_of(tgruntime) if not n.startswith(HTTP_ROOMS)]
    assert "tgruntime.entrypoints.client_job" in names and "tgruntime.entrypoints.cli" in names
    # the client's Kubernetes path too (imported lazily by --trainergroup and `wait`)
    code = "\n".join(f"import {n}" for n in ["tgruntime", *names, "tgapi.kube_view"])
    mods = _modules_after(code)
    assert set(names) <= mods
    assert sorted(_tops(mods) & set(OPERATOR_ONLY)) == []


def test_the_service_room_imports_aiohttp_but_not_the_operator() -> None:
    names = [n for n in _modules_of(tgruntime) if n.startswith(HTTP_ROOMS)]
    assert f"{SERVICE}.app" in names and "tgruntime.gateway.app" in names
    mods = _modules_after("\n".join(f"import {n}" for n in names))
    assert set(names) <= mods
    assert sorted(_tops(mods) & (set(OPERATOR_ONLY) - {"aiohttp"})) == []


def _third_party_added(code: str) -> set[str]:
    """Top-level non-stdlib modules ``code`` imports beyond a bare interpreter's."""
    added = _tops(_modules_after(code)) - _tops(_modules_after("pass"))
    # PyYAML's C extension is built with Cython, whose runtime registers these two names
    return {
        m
        for m in added - set(sys.stdlib_module_names)
        if m != "cython_runtime" and not m.startswith("_cython_")
    }


def test_tgapi_imports_only_pyyaml_and_the_standard_library() -> None:
    assert sorted(_third_party_added("import tgapi, tgapi.crd")) == ["tgapi", "yaml"]


def test_tgapi_client_adds_only_the_kubernetes_client() -> None:
    added = _third_party_added("import tgapi.kube_view") - _third_party_added("import tgapi")
    assert "kubernetes" in added
    assert sorted(added & {*RUNTIME_HEAVY, *OPERATOR_ONLY}) == []


def test_the_client_jobs_wait_step_imports_neither_ray_nor_torch() -> None:
    """``tg-client wait`` (the client Job's first step, the Tinker pod's too) only watches the
    TrainerGroup: importing its module and the Kubernetes reader it uses loads neither Ray nor
    torch and tensordict (~10 CPU s per process when it did; Ray and the batches' DataProto
    are imported when training starts)."""
    code = "import tgruntime.entrypoints.client_job\nimport tgapi.kube_view"
    mods = _modules_after(code)
    assert sorted(_tops(mods) & {"ray", "torch", "tensordict", "megatron"}) == []
