"""A Tinker server over a fresh group on a private local Ray: the set-up the SDK benchmarks
share (bench/tinker_overhead.py, bench/rl_memory.py).

    with served_group("bench", spec(tp, ckpt, "tiny")) as g:
        with tinker.ServiceClient(base_url=g.running.url, api_key=g.key) as sc: ...

Ray, torch and the runtime are imported on entry, so ``--help`` stays fast.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import uuid
from collections.abc import Iterator
from typing import Any

os.environ.setdefault("TINKER_TELEMETRY", "0")

import tgapi

__all__ = ["Served", "served_group", "spec"]


def spec(tp: int, ckpt: str, preset: str, *, layers: int = 0) -> tgapi.TrainerGroupSpec:
    """The benchmarks' group: ``tiny`` (CPU-sized), ``seed`` (a 1.3B-shaped Llama) or
    ``llama8b-block`` (Llama-3-8B's block: hidden 4096, 32 heads in 8 key/value groups, FFN
    14336, vocabulary 128,256, RoPE theta 500,000; 8 of its 32 layers unless ``layers``, so that
    full-weight training with Adam fits one 80 GB GPU), TP=tp. ``layers``: override the
    preset's layer count (0: the preset's)."""
    shapes: dict[str, dict[str, Any]] = {
        "tiny": dict(
            vocabSize=128,
            hiddenSize=64,
            numLayers=2,
            numAttentionHeads=4,
            ffnHiddenSize=128,
            maxSequenceLength=64,
        ),
        "seed": dict(
            vocabSize=256,
            hiddenSize=2048,
            numLayers=24,
            numAttentionHeads=16,
            ffnHiddenSize=5504,
            maxSequenceLength=1024,
        ),
        "llama8b-block": dict(
            vocabSize=128256,
            hiddenSize=4096,
            numLayers=8,
            numAttentionHeads=32,
            numQueryGroups=8,
            ffnHiddenSize=14336,
            maxSequenceLength=1024,
            ropeTheta=500000.0,
        ),
    }
    shape = dict(shapes[preset])
    if layers:
        shape = {**shape, "numLayers": layers}
    return tgapi.parse_spec(
        {
            "workers": {"processesPerNode": [tp]},
            "parallelism": {"tensor": tp},
            "model": {**shape, "positionEmbedding": "rope"},
            "optimizer": {"lr": 1e-3},
            "training": {
                "batchSize": 4,
                "sequenceLength": shape["maxSequenceLength"],
                "checkpointDir": ckpt,
            },
        },
        local=True,
    )


@dataclasses.dataclass
class Served:
    client: Any  # tgruntime.TrainerClient over the group
    running: Any  # the server (``.url``, ``.stop()``)
    key: str  # an API key it accepts
    use_gpu: bool


@contextlib.contextmanager
def served_group(name: str, sp: tgapi.TrainerGroupSpec) -> Iterator[Served]:
    """A private local Ray, a non-detached group ``name`` of ``sp`` (GPUs when torch sees
    one), initialised, and a Tinker server over it on a free port (base model ``name``);
    stopped, torn down and shut down on exit."""
    import ray
    import torch

    from tgruntime import TrainerClient
    from tgruntime.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
    from tgruntime.service.__main__ import group_info, serve
    from tgruntime.service.auth import KeyStore
    from tgruntime.trainer.worker import MegatronTrainer

    use_gpu = torch.cuda.is_available()
    ray.init(address="local", include_dashboard=False, namespace=f"bench-{uuid.uuid4().hex[:6]}")
    wg = None
    running = None
    try:
        wg = WorkerGroup.create(
            group_name=name,
            ray_namespace=ray.get_runtime_context().namespace,
            resource_pool=ResourcePool(
                process_on_nodes=list(sp.workers.processes_per_node),
                use_gpu=use_gpu,
                strategy="PACK",
            ),
            cls=ClassWithInitArgs(MegatronTrainer, json.dumps(tgapi.to_wire(sp))),
            detached=False,
            pg_timeout_s=120,
            actor_timeout_s=300,
        )
        wg.init_model()
        client = TrainerClient(wg)
        key = "tml-bench-" + uuid.uuid4().hex
        running = serve(client, group_info(name, sp), KeyStore(keys=[key]), port=0)
        yield Served(client=client, running=running, key=key, use_gpu=use_gpu)
    finally:
        if running is not None:
            running.stop()
        if wg is not None:
            wg.teardown()
        ray.shutdown()
