"""megatron-core without its import-time compiler load: ``torch.compile`` deferred to first call.

megatron-core decorates its fused elementwise functions with ``torch.compile`` (its
``jit_fuser``) as its modules are imported. Decorating alone loads TorchDynamo and Inductor:
about 5 of the ~12.5 CPU seconds that ``import megatron.core`` costs on the 2-core CI machine,
paid by every process that imports it (each rank's Ray worker, the Tinker server's workers, the
launcher's fork server, every pod of a group). A CPU run never calls those functions (the trainer
turns the fusions off there), and on a GPU ``torch.compile`` compiles at the first call anyway.

While a ``megatron.core`` module is being imported, :func:`install`'s import hook swaps
``torch.compile`` for :func:`deferred`, whose wrapper calls the real ``torch.compile`` with the
same options at its first call and the compiled function from then on; the real one is back as
soon as the module is loaded. The behaviour is megatron's own, only the compiler's import moves
to the first fused call. It is on by default only where no NVIDIA device is (it has not run on
a GPU yet); ``TG_DEFER_COMPILE=1`` turns it on anywhere, ``0`` off.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import inspect
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from tgruntime.trainer.gpu_check import nvidia_device_nodes

__all__ = ["deferred", "install"]

PACKAGE = "megatron.core"

Compile = Callable[..., Any]


def deferred(real: Compile) -> Compile:
    """A stand-in for ``torch.compile`` that compiles each plain function at its first call
    (with the options given now); anything else (a module, no function yet) goes to ``real``
    as it would have."""

    def compile_later(model: Any = None, **options: Any) -> Any:
        if model is None:  # used as @torch.compile(mode=...): the function comes next
            return lambda fn: compile_later(fn, **options)
        if not inspect.isfunction(model):
            return real(model, **options)
        compiled: Callable[..., Any] | None = None

        @functools.wraps(model)
        def first_call_compiles(*args: Any, **kwargs: Any) -> Any:
            nonlocal compiled
            if compiled is None:
                compiled = real(model, **options)
            return compiled(*args, **kwargs)

        return first_call_compiles

    return compile_later


class _Loader(importlib.abc.Loader):
    """Runs the real loader with ``torch.compile`` deferred, then puts the real one back."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        import torch

        before = torch.compile
        torch.compile = deferred(before)
        try:
            self._inner.exec_module(module)
        finally:
            torch.compile = before


class _Finder(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core`` and its modules as the path finder does, with :class:`_Loader`."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != PACKAGE and not fullname.startswith(PACKAGE + "."):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _Loader(spec.loader)
        return spec


def wanted(setting: str, dev_names: list[str]) -> bool:
    """``TG_DEFER_COMPILE``: ``1`` on, ``0`` off; unset, on only where no NVIDIA device is (the
    hook has run on CPU machines only so far; a GPU machine keeps megatron's eager decoration
    until it has been measured there)."""
    if setting in ("0", "1"):
        return setting == "1"
    return not nvidia_device_nodes(dev_names)


def install() -> bool:
    """Put the hook first on ``sys.meta_path`` (once; cheap: torch is imported only with
    megatron). False where :func:`wanted` says no or megatron is already imported."""
    try:
        dev_names = os.listdir("/dev")
    except OSError:
        dev_names = []
    if not wanted(os.environ.get("TG_DEFER_COMPILE", ""), dev_names) or PACKAGE in sys.modules:
        return False
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    return True
