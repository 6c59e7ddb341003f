"""megatron-core's import-time ``torch.compile`` waits for a first call
(``tgruntime.trainer.deferred_compile``): the compiler is not loaded by the import, each
decorated function compiles once, at its first call, with the options it was given."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from tgruntime.trainer.deferred_compile import deferred, wanted


class FakeCompile:
    """Records what ``torch.compile`` was asked to compile; the 'compiled' function doubles."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, dict[str, Any]]] = []

    def __call__(self, model: Any, **options: Any) -> Any:
        self.calls.append((model, options))
        if callable(model) and not isinstance(model, type):
            return lambda *a, **k: 2 * model(*a, **k)
        return model


def test_a_function_compiles_at_its_first_call_once_with_its_options() -> None:
    real = FakeCompile()
    compile_later = deferred(real)

    def inc(x: int) -> int:
        return x + 1

    wrapped = compile_later(inc, dynamic=False)
    assert real.calls == [], "decorating must not compile (nor load the compiler)"
    assert wrapped.__wrapped__ is inc and wrapped.__name__ == "inc"
    assert wrapped(1) == 4 and wrapped(2) == 6
    assert real.calls == [(inc, {"dynamic": False})]


def test_the_decorator_with_options_and_non_functions() -> None:
    real = FakeCompile()
    compile_later = deferred(real)

    def negate(x: int) -> int:
        return -x

    neg = compile_later(mode="max-autotune")(negate)  # as @torch.compile(mode=...)
    assert real.calls == [] and neg(3) == -6
    assert real.calls == [(negate, {"mode": "max-autotune"})]

    class Module:
        pass

    module = Module()
    assert compile_later(module) is module  # not a plain function: compiled now, as before
    assert real.calls[-1] == (module, {})


def hook_state() -> dict[str, Any]:
    """In a launched rank (forked from the fork server that preloaded megatron-core), after
    importing the Ray worker's module, samplers included."""
    from megatron.core.fusions import fused_bias_swiglu
    from megatron.core.jit import jit_fuser

    import tgruntime.trainer.worker  # noqa: F401

    return {
        "dynamo_loaded": "torch._dynamo" in sys.modules,
        "inductor_loaded": "torch._inductor.compile_fx" in sys.modules,
        "swiglu_deferred": hasattr(fused_bias_swiglu.swiglu, "__wrapped__"),
        "jit_fuser": getattr(jit_fuser, "__name__", ""),
    }


@pytest.mark.megatron
def test_ranks_import_megatron_without_the_compiler() -> None:
    from tgruntime.trainer.launch import launch

    (state,) = launch(hook_state, world_size=1, timeout_s=300)
    assert state == {
        "dynamo_loaded": False,
        "inductor_loaded": False,
        "swiglu_deferred": True,
        "jit_fuser": "compile_later",
    }


def test_on_by_default_only_without_nvidia_devices() -> None:
    assert wanted("", ["null", "nvme0"]) is True
    assert wanted("", ["null", "nvidia0", "nvidiactl"]) is False
    assert wanted("1", ["nvidia0"]) is True
    assert wanted("0", ["null"]) is False
