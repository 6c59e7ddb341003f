"""Per-rank body of the LoRA tests (two processes, CPU, gloo; spawned by ``launch``).

For each layout (TP=2; PP=2; TP=1 with DP=2, each replica on half of the batch) one engine
imports the Hugging Face base the test built, gets LoRA adapters (their initial weights
read from the peft directory the test wrote, B non-zero), and returns: log-probs,
the adapters' gradients under ``tinker_cross_entropy`` and ``tinker_ppo`` (summed), what
an optimizer step changed, the PEFT and merged exports after it, and a per-rank
save/load round trip. Returned as ``torch.save`` bytes.
"""

from __future__ import annotations

import io
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.trainer.scenarios import VOCAB, _quiet, tiny_spec

MODEL: dict[str, Any] = {"positionEmbedding": "rope", "numQueryGroups": 2}
RANK, ALPHA = 4, 8.0
PPO = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
LAYOUTS: dict[str, dict[str, int]] = {"tp2": {"tp": 2}, "pp2": {"pp": 2}, "dp2": {}}


def settings() -> Any:
    from tgruntime.trainer.lora import LoraSettings

    return LoraSettings(rank=RANK, alpha=ALPHA, seed=7)


def _rows(t: dict[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    if layout != "dp2":
        return t
    half = t["input_ids"].shape[0] // 2
    lo = dist.get_rank() * half
    return {k: v[lo : lo + half] for k, v in t.items()}


def _layout(
    name: str, *, base_dir: str, init_dir: str, out_dir: Path, tensors: dict[str, torch.Tensor]
) -> dict[str, Any]:
    from tgruntime.trainer import TrainEngine, hf_worker, lora
    from tgruntime.trainer.hf_weights import LlamaShape
    from tgruntime.trainer.hf_worker import import_hf_checkpoint
    from tgruntime.trainer.token_batch import token_batch

    start = time.perf_counter()
    layout = LAYOUTS[name]
    spec = tiny_spec(tp=layout.get("tp", 1), pp=layout.get("pp", 1), **MODEL)
    engine = TrainEngine.create(spec=spec)
    try:
        import_hf_checkpoint(engine, path=base_dir)
        module = engine.state.module
        shape = LlamaShape.from_model_spec(spec.model, position_embedding="rope")
        errors = {}
        if name == "tp2":  # refused before any hook is placed
            import dataclasses

            for case, bad_settings, bad_shape in (
                ("rank", lora.LoraSettings(rank=65), shape),
                ("groups", settings(), dataclasses.replace(shape, num_key_value_heads=1)),
            ):
                try:
                    lora.inject_lora(module, settings=bad_settings, shape=bad_shape)
                except ValueError as exc:
                    errors[case] = str(exc)
        adapters = lora.inject_lora(module, settings=settings(), shape=shape)
        seeded = lora.gather_full(adapters)
        lora.import_peft(adapters, init_dir)
        engine.state = lora.build_adapter_training_state(
            module, adapters=adapters, config=module.config, spec=spec.optimizer
        )
        batch = token_batch(_rows(tensors, name), device=engine.device, vocab_size=VOCAB)
        out: dict[str, Any] = {"log_probs": engine.compute_log_prob(batch).log_probs}
        for loss, config in (("cross_entropy", {}), ("ppo", PPO)):
            engine.zero_grad()
            fb = engine.forward_backward(
                batch, loss=f"tinker_{loss}", loss_config=config, reduction="sum"
            )
            out[loss] = {"loss": fb.loss, "grads": lora.gather_full(adapters, grads=True)}
        base = [p.detach().clone() for p in module.parameters()]
        before = lora.gather_full(adapters)
        in_optimizer = [p for g in engine.state.optimizer.param_groups for p in g["params"]]
        step = engine.optim_step()
        after = lora.gather_full(adapters)
        trainable = lora.adapter_parameters(adapters)
        out["step"] = {
            "grad_norm": step.grad_norm,
            "base_max_diff": max(
                float((a - p).abs().max()) for a, p in zip(base, module.parameters(), strict=True)
            ),
            "base_requires_grad": any(p.requires_grad for p in module.parameters()),
            "base_grads": sum(p.grad is not None for p in module.parameters()),
            "optimizer_params": len(in_optimizer),
            "optimizer_is_adapters": {id(p) for p in in_optimizer} == {id(p) for p in trainable},
            "adapter_moved": (
                None
                if before is None or after is None
                else max(float((after[n] - before[n]).abs().max()) for n in before)
            ),
            "optimizer_state_bytes": lora.optimizer_state_bytes(engine.state.optimizer),
            "adam_bytes_adapters": lora.adam_state_bytes(trainable),
            "adam_bytes_full": lora.adam_state_bytes(module.parameters()),
            "adapter_params": sum(p.numel() for p in trainable),
            "base_params": sum(p.numel() for p in module.parameters()),
        }
        out["log_probs_after"] = engine.compute_log_prob(batch).log_probs
        root = out_dir / name
        t0 = time.perf_counter()
        out["peft"] = lora.export_peft(adapters, root / "peft", base_model=base_dir)
        out["peft_seconds"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        out["merged"] = hf_worker.export_merged_lora(engine, adapters, root / "merged")
        out["merged_seconds"] = time.perf_counter() - t0
        out["restored_max_diff"] = max(
            float((a - p).abs().max()) for a, p in zip(base, module.parameters(), strict=True)
        )
        out["log_probs_after_export"] = engine.compute_log_prob(batch).log_probs
        saved = lora.save_adapter_state(adapters, root / "state")
        with torch.no_grad():
            for p in trainable:
                p.zero_()
        lora.load_adapter_state(adapters, saved)
        reloaded = lora.gather_full(adapters)
        out["reload_equal"] = (
            None
            if after is None or reloaded is None
            else all(torch.equal(after[n], reloaded[n]) for n in after)
        )
        out["seeded"] = seeded
        out["errors"] = errors
        out["mesh"] = engine.mesh()
        adapters.detach()
        out["seconds"] = time.perf_counter() - start
        return out
    finally:
        engine.shutdown()


def lora_suite(
    *, base_dir: str, init_dir: str, out_dir: str, tensors: dict[str, torch.Tensor]
) -> bytes:
    _quiet()
    from tgruntime.trainer.distributed import init_process_group
    from tgruntime.trainer.settings import resolve_settings

    init_process_group(resolve_settings(tiny_spec(**MODEL)))
    try:
        result = {
            name: _layout(
                name, base_dir=base_dir, init_dir=init_dir, out_dir=Path(out_dir), tensors=tensors
            )
            for name in LAYOUTS
        }
        buffer = io.BytesIO()
        torch.save(result, buffer)
        return buffer.getvalue()
    finally:
        dist.destroy_process_group()
