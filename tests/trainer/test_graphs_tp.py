"""CUDA graphs at tensor size > 1 (``TG_SAMPLER_CUDA_GRAPHS=tp``, docs/sampling.md).

* ``graphs_allowed``: the rule, as a table (pure decision logic, a stand-in decoder).
* Two ranks, TP=2, full weights, pieces driven directly (``tgruntime.trainer.launch``): the
  same arrivals served by the continuous engine with CUDA graphs and without, and the one-shot
  sampler with graphs and without; both ranks must return the same tokens, and the graphed
  engine the eager engine's. On two GPUs the graphs capture the tensor-parallel all-reduces
  and the tokens' broadcast (NCCL); here, on the CPU (gloo, no graphs), the same script runs
  as a check of itself.
"""

from __future__ import annotations

import types
from typing import Any, cast

import pytest
import torch

from tgruntime.trainer.sampling.decoder import CachedDecoder
from tgruntime.trainer.sampling.generate import graphs_allowed

CASES = [  # (device, tp, pp, setting) -> graphs
    (("cuda", 1, 1, "1"), True),
    (("cuda", 2, 1, "1"), False),
    (("cuda", 2, 1, "tp"), True),
    (("cuda", 1, 1, "tp"), True),
    (("cuda", 2, 2, "tp"), False),
    (("cuda", 1, 1, "0"), False),
    (("cpu", 1, 1, "1"), False),
    (("cpu", 2, 1, "tp"), False),
]


@pytest.mark.parametrize(("case", "want"), CASES)
def test_when_samplers_replay_cuda_graphs(case: tuple[str, int, int, str], want: bool) -> None:
    device, tp, pp, setting = case
    decoder = types.SimpleNamespace(device=torch.device(device), tp_size=tp, pp_size=pp)
    assert graphs_allowed(cast(CachedDecoder, decoder), setting) is want


def test_an_unknown_setting_is_refused_with_the_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TG_SAMPLER_CUDA_GRAPHS", "yes")
    decoder = types.SimpleNamespace(device=torch.device("cuda"), tp_size=1, pp_size=1)
    with pytest.raises(ValueError, match="TG_SAMPLER_CUDA_GRAPHS must be 0, 1 or tp, not 'yes'"):
        graphs_allowed(cast(CachedDecoder, decoder))


def tp_graphs(gpu: bool = True) -> dict[str, Any]:
    """On each of two ranks: one training step, then the same requests through the engine
    and the one-shot sampler, with graphs (``gpu``) and without."""
    import os

    from tests.trainer.scenarios import _quiet

    _quiet()
    import tgapi
    from tgruntime.trainer import TrainEngine
    from tgruntime.trainer.distributed import init_process_group
    from tgruntime.trainer.sampling.continuous import SlotEngine
    from tgruntime.trainer.sampling.generate import Sampler
    from tgruntime.trainer.sampling.params import SamplingParams
    from tgruntime.trainer.sampling.pool import PoolSize
    from tgruntime.trainer.settings import resolve_settings

    spec = tgapi.parse_spec(
        {
            "workers": {"useGpu": gpu, "processesPerNode": [2]},
            "parallelism": {"tensor": 2},
            "model": {
                "vocabSize": 256,
                "hiddenSize": 128,
                "numLayers": 2,
                "numAttentionHeads": 4,
                "numQueryGroups": 2,
                "ffnHiddenSize": 256,
                "maxSequenceLength": 64,
                "positionEmbedding": "rope",
            },
            "training": {"batchSize": 4, "sequenceLength": 64},
        },
        local=True,
    )
    init_process_group(resolve_settings(spec))
    vocab = spec.model.vocab_size
    gen = torch.Generator().manual_seed(0)
    engine = TrainEngine.create(spec=spec)
    out: dict[str, Any] = {"rank": torch.distributed.get_rank()}
    try:
        length = spec.model.max_sequence_length
        engine.train_step(torch.randint(0, vocab, (4, length), generator=gen))
        module = engine.state.module
        prompts = [torch.randint(0, vocab, (int(n),), generator=gen).tolist() for n in (5, 9, 3)]
        arrivals = [
            ("r0", prompts[0], SamplingParams(max_tokens=20, seed=1, num_samples=3)),
            ("r1", prompts[1], SamplingParams(max_tokens=12, seed=2, temperature=0.7)),
            ("r2", prompts[2], SamplingParams(max_tokens=16, seed=3, temperature=0.0)),
        ]
        eager_sampler = Sampler(module, cuda_graphs=False)

        def serve(graphs: bool) -> tuple[dict[str, Any], int]:
            size = PoolSize(slots=8, length=length, row_bytes=0, budget=None)
            slot_engine = SlotEngine(eager_sampler.decoder, size, cuda_graphs=graphs)
            got: dict[str, Any] = {}
            for rid, prompt, params in arrivals:
                slot_engine.submit(rid, prompt, params)
                got.update(slot_engine.run(4))
            while slot_engine.busy:
                got.update(slot_engine.run(8))
            return got, int(slot_engine.info()["graphs"])

        def tokens(results: dict[str, Any]) -> list[list[int]]:
            return [s["tokens"] for rid, *_ in arrivals for s in results[rid]["sequences"]]

        graphed, out["engine_graphs"] = serve(gpu)
        out["engine_graphed"] = tokens(graphed)
        out["engine_eager"] = tokens(serve(False)[0])
        os.environ["TG_SAMPLER_CUDA_GRAPHS"] = "tp"
        graphed_sampler = Sampler(module)
        out["one_shot_graphs_on"] = graphed_sampler.cuda_graphs
        out["one_shot_graphed"] = [
            s["tokens"] for _, p, params in arrivals
            for s in graphed_sampler.generate([p], params)[0]["sequences"]
        ]
        out["one_shot_eager"] = [
            s["tokens"] for _, p, params in arrivals
            for s in eager_sampler.generate([p], params)[0]["sequences"]
        ]
        return out
    finally:
        engine.shutdown()
        torch.distributed.destroy_process_group()


def _check(ranks: list[dict[str, Any]], *, gpu: bool) -> None:
    first, second = sorted(ranks, key=lambda r: r["rank"])
    for key in ("engine_graphed", "engine_eager", "one_shot_graphed", "one_shot_eager"):
        assert first[key] == second[key], key  # the ranks agree, token for token
    rows = len(first["engine_eager"])
    assert rows == 5
    # bf16 on a GPU: the graphed step attends over the whole slot length, the eager one over
    # the live prefix; a wrong capture (a collective missing, stale buffers) changes every row
    same = sum(a == b for a, b in zip(first["engine_graphed"], first["engine_eager"], strict=True))
    assert same >= rows - 1, first
    same = sum(
        a == b for a, b in zip(first["one_shot_graphed"], first["one_shot_eager"], strict=True)
    )
    assert same >= rows - 1, first
    assert first["one_shot_graphs_on"] is gpu
    assert (first["engine_graphs"] > 0) is gpu


@pytest.mark.megatron
def test_the_tp_graphs_script_runs_on_the_cpu() -> None:
    from tgruntime.trainer.launch import launch

    _check(launch(tp_graphs, world_size=2, kwargs={"gpu": False}, timeout_s=600), gpu=False)


@pytest.mark.gpu
@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two NVIDIA GPUs (tensor parallel 2)"
)
def test_gpu_graphs_at_tensor_parallel_two_give_the_eager_tokens() -> None:
    from tgruntime.trainer.launch import launch

    _check(launch(tp_graphs, world_size=2, timeout_s=900), gpu=True)
