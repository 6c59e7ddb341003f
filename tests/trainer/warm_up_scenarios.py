"""Per-rank body of the warm-up test (spawned by ``tgruntime.trainer.launch``): the warm-up
leaves no trace in the model, the optimizer, the step, the RNGs or the next gradient."""

from __future__ import annotations

import io
from typing import Any

import torch

from tests.trainer.rl_scenarios import _batch, rl_inputs
from tests.trainer.scenarios import _quiet, tiny_spec


def _grads(engine: Any) -> dict[str, torch.Tensor]:
    """Every parameter's accumulated gradient (megatron's DDP keeps it in ``main_grad`` on a
    GPU, in ``grad`` on the CPU)."""
    out = {}
    for n, p in engine.state.module.named_parameters():
        g = getattr(p, "main_grad", None)
        g = p.grad if g is None else g
        if g is not None:
            out[n] = g.detach().clone()
    assert out, "no parameter holds a gradient"
    return out


def _gpu_spec() -> Any:
    import tgapi

    return tgapi.parse_spec(
        {
            "workers": {"useGpu": True, "processesPerNode": [1]},
            "model": {"vocabSize": 512, "hiddenSize": 256, "numLayers": 2,
                      "numAttentionHeads": 8, "numQueryGroups": 4, "ffnHiddenSize": 688,
                      "maxSequenceLength": 128, "positionEmbedding": "rope"},
            "training": {"batchSize": 4, "sequenceLength": 64},
        },
        local=True,
    )


def warm_up_suite(gpu: bool = False) -> bytes:
    """TP=2 on the CPU, or one GPU (bf16, the compiled fusions on)."""
    _quiet()
    from tgruntime.trainer import TrainEngine
    from tgruntime.trainer.sampling.generate import Sampler
    from tgruntime.trainer.warm_up import wanted, warm_up

    if gpu:
        from tgruntime.trainer.distributed import init_process_group
        from tgruntime.trainer.settings import resolve_settings

        spec = _gpu_spec()
        init_process_group(resolve_settings(spec))
    else:
        spec = tiny_spec(tp=2)
    engine = TrainEngine.create(spec=spec)
    out: dict[str, Any] = {"wanted": wanted(engine)}
    try:
        engine.train_step(rl_inputs(1)["input_ids"])  # an optimizer state to keep
        raw = rl_inputs(3)
        batch = _batch(engine, {k: raw[k] for k in ("input_ids", "attention_mask")})
        engine.zero_grad()
        engine.forward_backward(batch, loss="cross_entropy")
        before_grads = _grads(engine)
        engine.zero_grad()
        params = {n: p.detach().clone() for n, p in engine.state.module.named_parameters()}
        optim = {k: v.clone() for k, v in _optim_tensors(engine).items()}
        rng, step = _rng(gpu), engine.step
        out["seconds"] = warm_up(engine, Sampler(engine.state.module))
        out["params_equal"] = all(
            torch.equal(p, params[n]) for n, p in engine.state.module.named_parameters()
        )
        now = _optim_tensors(engine)
        out["optim_equal"] = all(torch.equal(v, optim[k]) for k, v in now.items())
        out["optim_tensors"] = len(optim)
        out["rng_equal"] = all(torch.equal(a, b) for a, b in zip(_rng(gpu), rng, strict=True))
        out["step_equal"] = engine.step == step
        engine.forward_backward(batch, loss="cross_entropy")
        after = _grads(engine)
        out["grads_equal"] = after.keys() == before_grads.keys() and all(
            torch.equal(after[k], before_grads[k]) for k in after
        )
        out["grads_max_diff"] = max(
            float((after[k].float() - before_grads[k].float()).abs().max()) for k in after
        )
    finally:
        engine.shutdown()
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


def _rng(gpu: bool) -> list[torch.Tensor]:
    return [torch.get_rng_state(), *([torch.cuda.get_rng_state()] if gpu else [])]


def _optim_tensors(engine: Any) -> dict[str, torch.Tensor]:
    state = engine.state.optimizer.state_dict()
    found: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            found[prefix] = value
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{prefix}/{i}", v)

    walk("", state)
    return found


def warm_up_lora_suite() -> bytes:
    """A LoRA group's warm-up (TP=2, CPU): its generations go down the path
    ``sample(weights=None)`` takes, the active run's one-slot stack (built once here, refilled
    by the first ``sample`` after), and leave the run's adapters and their hooks as they were."""
    _quiet()
    from tgruntime.trainer import TrainEngine
    from tgruntime.trainer.lora.settings import LoraSettings
    from tgruntime.trainer.sampling.mixin import SamplingMixin
    from tgruntime.trainer.warm_up import warm_up

    class _Worker(SamplingMixin):
        def __init__(self, engine: TrainEngine) -> None:
            self._the_engine = engine

        def _engine(self) -> TrainEngine:
            return self._the_engine

    spec = tiny_spec(tp=2, positionEmbedding="rope", numQueryGroups=2)
    engine = TrainEngine.create(spec=spec, lora=LoraSettings(rank=4, alpha=8.0, seed=1))
    out: dict[str, Any] = {}
    try:
        engine.train_step(rl_inputs(1)["input_ids"])  # adapters away from their start
        assert engine.adapters is not None
        before = {k: v.detach().clone() for k, v in engine.adapters.state_dict().items()}
        worker = _Worker(engine)
        sampler = worker._sampler_for(engine)
        out["seconds"] = warm_up(engine, sampler, generate=worker._warm_generate)
        stacks = worker._uniform_stacks()
        out["builds_after_warm_up"] = stacks.builds
        out["hooks_attached"] = engine.adapters.attached
        out["adapters_equal"] = all(
            torch.equal(v, before[k]) for k, v in engine.adapters.state_dict().items()
        )
        worker.sample([[3, 4, 5]], max_tokens=3, temperature=1.0, seed=0)
        out["builds_after_sample"], out["refills_after_sample"] = stacks.builds, stacks.refills
    finally:
        engine.shutdown()
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()
