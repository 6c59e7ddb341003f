"""Per-rank body of the sampler's KV-cache unit check (spawned by ``tgruntime.trainer.launch``)."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from tests.trainer.scenarios import tiny_spec


def _row_adapters(module: Any, spec: Any, position_embedding: str, uniform: bool) -> Any:
    """Two adapter sets (ranks 4 and 2, the second without MLP adapters, B drawn non-zero)
    as one attached ``MultiLora`` whose rows 0, 1, 2 use set 1, set 2 and the base (every
    row set 1 with ``uniform``: the one-row map of ``MultiLora.set_uniform``)."""
    from tgruntime.trainer.hf_weights import LlamaShape
    from tgruntime.trainer.lora.inject import inject_lora
    from tgruntime.trainer.lora.multi import MultiLora
    from tgruntime.trainer.lora.settings import LoraSettings

    shape = LlamaShape.from_model_spec(spec.model, position_embedding=position_embedding)
    sets = []
    for seed, settings in enumerate(
        (LoraSettings(rank=4, alpha=8.0, seed=1), LoraSettings(rank=2, alpha=2.0, train_mlp=False))
    ):
        adapters = inject_lora(module, settings=settings, shape=shape)
        adapters.detach()
        noise = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in adapters.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=noise) * 0.3)
        sets.append(adapters)
    multi = MultiLora(module, sets)
    if uniform:
        multi.set_uniform(1)
    else:
        multi.set_rows([1, 2, 0])
    multi.attach()
    return multi


def kv_cache_matches_full_forward(
    position_embedding: str, extra: dict[str, Any] | None = None, lora: str = ""
) -> dict[str, Any]:
    """Max |logit difference| of prefill and cached decode against ``GPTModel.forward``,
    and which decode path ran (``lean``: the plain-function layers; ``compiled``;
    ``path``: the decoder's last step). ``lora``: ``rows`` (rows 0 and 1 with their own
    adapters) or ``uniform`` (every row with one), :func:`_row_adapters`; the full forward
    through the same adapters' hooks."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from tgruntime.trainer.engine import TrainEngine
    from tgruntime.trainer.sampling.decode_attention import kernel_applies
    from tgruntime.trainer.sampling.decoder import CachedDecoder

    model: dict[str, Any] = {"numQueryGroups": 2, **(extra or {})}
    if position_embedding == "rope":
        model["positionEmbedding"] = "rope"
    spec = tiny_spec(world=1, **model)
    engine = TrainEngine.create(spec=spec)
    try:
        module = engine.state.module
        decoder = CachedDecoder(module)
        if lora:
            _row_adapters(module, spec, position_embedding, uniform=lora == "uniform")
        b, s, p = 3, 20, 7
        ids = torch.randint(0, 128, (b, s), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            full = module(ids, torch.arange(s).unsqueeze(0).expand(b, s), None).float()
        cache = decoder.allocate(b, s)
        prefill = decoder.logits(decoder.prefill(ids[:, :p], cache)).transpose(0, 1)
        worst_decode = 0.0
        for t in range(p, s):
            logits = decoder.decode(ids[:, t], torch.full((b,), t), cache)
            worst_decode = max(worst_decode, float((logits - full[:, t]).abs().max()))
        # rows at different positions in one decode step
        cache2 = decoder.allocate(b, s)
        decoder.prefill(ids[:, :p], cache2)
        staggered = torch.tensor([p, p - 2, p - 4])
        mixed = decoder.decode(ids[torch.arange(b), staggered], staggered, cache2)
        want = full[torch.arange(b), staggered]
        return {
            "prefill": float((prefill - full[:, :p]).abs().max()),
            "decode": worst_decode,
            "staggered": float((mixed - want).abs().max()),
            "scale": float(full.abs().max()),
            "lean": decoder.lean is not None,
            "path": decoder.last_path,
            "compiled": decoder.lean is not None and decoder.lean.compiled,
            "kernel": kernel_applies(torch.empty(1, 1, 1, decoder.head_dim)),
        }
    finally:
        engine.shutdown()


def pipeline_sampling(root: str, pipeline: int, tensor: int = 1) -> dict[str, Any]:
    """Sample on a group of ``pipeline`` stages (the layers split over ranks), export the
    weights as Hugging Face's, and (rank 0) score the sampled sequences with
    ``LlamaForCausalLM``: what every rank sampled, and the reference log-probs."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    import torch.distributed as dist

    from tgruntime.trainer.engine import TrainEngine
    from tgruntime.trainer.hf_worker import export_hf_checkpoint
    from tgruntime.trainer.sampling import Sampler, SamplingParams
    from tgruntime.trainer.sampling.generate import _whole_batch

    model: dict[str, Any] = {
        "numQueryGroups": 2,
        "positionEmbedding": "rope",
        "normalization": "RMSNorm",
        "activation": "swiglu",
    }
    world = pipeline * tensor
    engine = TrainEngine.create(spec=tiny_spec(world=world, tp=tensor, pp=pipeline, **model))
    try:
        sampler = Sampler(engine.state.module)
        prompts = [[3, 17, 9], [40, 2, 8, 11, 5, 30], [7]]
        params = SamplingParams.build(
            max_tokens=10, seed=11, num_samples=2, vocab_size=128, prompt_logprobs=True
        )
        prefill_rows: list[int] = []  # the rows of each prefill forward
        prefill = sampler.decoder.prefill

        def counted(tokens: torch.Tensor, cache: Any) -> torch.Tensor:
            prefill_rows.append(int(tokens.shape[0]))
            return prefill(tokens, cache)

        sampler.decoder.prefill = counted  # type: ignore[method-assign]
        results = sampler.generate(prompts, params)
        alone = sampler.generate([prompts[1]], params)
        # a row scope makes every row prefill its own prompt (no prefill shared by samples)
        every_row = sampler.generate(prompts, params, scope=_whole_batch)
        path = f"{root}/hf"
        export_hf_checkpoint(engine, path=path)
        dist.barrier()
        reference: list[list[float]] | None = None
        if engine.mesh_info.rank == 0:
            import transformers

            hf: Any = transformers.LlamaForCausalLM.from_pretrained(path)
            hf.eval()
            reference = []
            for prompt, res in zip(prompts, results, strict=True):
                for seq in res["sequences"]:
                    ids = torch.tensor([prompt + seq["tokens"]])
                    with torch.no_grad():
                        logits = hf(input_ids=ids).logits.float()
                    lp = torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None])
                    reference.append(lp[:, 0].tolist())
        return {
            "rank": engine.mesh_info.rank,
            "results": results,
            "alone": alone,
            "every_row": every_row,
            "prefill_rows": prefill_rows,
            "reference": reference,
            "pp": sampler.decoder.pp_size,
            "graphs": sampler.cuda_graphs,
        }
    finally:
        engine.shutdown()


def compiled_variants() -> dict[str, Any]:
    """The compiled decode functions' variants over a LoRA group's kinds of step (base rows,
    per-row adapters, one adapter for every row), each at several batch sizes: Dynamo's
    variant count per kind (its code object's cache entries)."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from tgruntime.trainer.engine import TrainEngine
    from tgruntime.trainer.sampling import lean_layer
    from tgruntime.trainer.sampling.decoder import CachedDecoder

    spec = tiny_spec(world=1, numQueryGroups=2, positionEmbedding="rope")
    engine = TrainEngine.create(spec=spec)
    try:
        module = engine.state.module
        decoder = CachedDecoder(module)
        multi = _row_adapters(module, spec, "rope", uniform=False)  # base frozen from here on
        paths = []

        def step(rows: int) -> None:
            cache = decoder.allocate(rows, 12)
            decoder.decode(torch.ones(rows, dtype=torch.int64), torch.full((rows,), 2), cache)
            paths.append(decoder.last_path)

        for rows in (2, 3, 5):
            multi.set_rows([1, 2, 0, 1, 2][:rows])
            step(rows)
        multi.set_uniform(2)
        for rows in (2, 3, 5):
            step(rows)
        multi.detach()
        for rows in (2, 3, 5):
            step(rows)
        return {
            "paths": paths,
            "variants": {
                kind: len(_debug_get_cache_entry_list(lean_layer._KINDS[kind][0].__code__))
                for kind in lean_layer._COMPILED
            },
            "limit": int(torch._dynamo.config.recompile_limit),
        }
    finally:
        engine.shutdown()
