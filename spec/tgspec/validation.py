"""Cross-field rules of a TrainerGroup spec (what a per-field schema cannot say).

The same rules are expressed as CEL ``x-kubernetes-validations`` in the CRD where
CEL can say them (see ``crd.py``); the messages match so a user reads the same
sentence from ``kubectl apply`` and from ``tgctl``.
"""

from __future__ import annotations

from tgspec.errors import SpecError
from tgspec.model import USE_GPU_AUTO, TrainerGroupSpec

MSG_CLUSTER_CHOICE = "set exactly one of rayCluster and rayClusterRef"


def cross_field_errors(
    spec: TrainerGroupSpec, *, path: str = "spec", local: bool = False
) -> list[SpecError]:
    errors: list[SpecError] = []

    def fail(field: str, problem: str, fix: str) -> None:
        errors.append(SpecError(field=f"{path}.{field}", problem=problem, fix=fix))

    p, m, w = spec.parallelism, spec.model, spec.workers
    world = spec.world_size
    if not w.processes_per_node:
        fail("workers.processesPerNode", "is empty", "list the worker processes per node, e.g. [2]")
        return errors
    model_parallel = p.tensor * p.pipeline * p.context
    if world % model_parallel != 0:
        fail(
            "parallelism",
            f"tensor x pipeline x context = {p.tensor} x {p.pipeline} x {p.context} = "
            f"{model_parallel} does not divide the world size {world} (sum of workers.processesPerNode)",
            f"make the world size a multiple of {model_parallel} or lower the parallel sizes",
        )
    if m.num_attention_heads % p.tensor != 0:
        fail(
            "model.numAttentionHeads",
            f"{m.num_attention_heads} heads are not divisible by tensor parallel size {p.tensor}",
            "use a head count that is a multiple of parallelism.tensor",
        )
    if m.vocab_size % p.tensor != 0:
        fail(
            "model.vocabSize",
            f"{m.vocab_size} is not divisible by tensor parallel size {p.tensor}",
            "use a vocabulary size that is a multiple of parallelism.tensor",
        )
    if m.hidden_size % m.num_attention_heads != 0:
        fail(
            "model.hiddenSize",
            f"{m.hidden_size} is not divisible by numAttentionHeads {m.num_attention_heads}",
            "use a hidden size that is a multiple of the head count",
        )
    if m.ffn_hidden_size % p.tensor != 0:
        fail(
            "model.ffnHiddenSize",
            f"{m.ffn_hidden_size} is not divisible by tensor parallel size {p.tensor}",
            "use an FFN size that is a multiple of parallelism.tensor",
        )
    groups = m.num_query_groups or m.num_attention_heads
    if m.num_attention_heads % groups != 0 or groups % p.tensor != 0:
        fail(
            "model.numQueryGroups",
            f"{groups} query groups must divide {m.num_attention_heads} heads and be "
            f"divisible by tensor parallel size {p.tensor}",
            "pick a compatible numQueryGroups (0 = heads)",
        )
    if m.num_layers % p.pipeline != 0:
        fail(
            "model.numLayers",
            f"{m.num_layers} layers are not divisible by pipeline parallel size {p.pipeline}",
            "use a layer count that is a multiple of parallelism.pipeline",
        )
    if p.expert > 1:
        fail(
            "parallelism.expert",
            "expert parallelism needs a mixture-of-experts model, which the built-in "
            "trainer does not build",
            "set parallelism.expert to 1",
        )
    if p.context > 1 and spec.training.sequence_length % (2 * p.context) != 0:
        fail(
            "training.sequenceLength",
            f"{spec.training.sequence_length} is not divisible by 2 x context "
            f"parallel size {p.context}",
            "use a sequence length that is a multiple of 2 x parallelism.context",
        )
    if spec.training.sequence_length > m.max_sequence_length:
        fail(
            "training.sequenceLength",
            f"{spec.training.sequence_length} exceeds model.maxSequenceLength "
            f"{m.max_sequence_length}",
            "lower training.sequenceLength or raise model.maxSequenceLength",
        )
    dp = world // model_parallel if world % model_parallel == 0 else 0
    if dp and spec.training.batch_size % dp != 0:
        fail(
            "training.batchSize",
            f"{spec.training.batch_size} is not divisible by the data-parallel size {dp}",
            f"use a batch size that is a multiple of {dp}",
        )
    if not local:
        if (spec.ray_cluster is None) == (spec.ray_cluster_ref is None):
            fail(
                "rayCluster",
                "exactly one of rayCluster and rayClusterRef must be set",
                MSG_CLUSTER_CHOICE,
            )
        rc = spec.ray_cluster
        # useGpu "auto" resolves against the cluster: GPU workers when its pods have GPUs.
        gpu = rc is not None and (
            w.use_gpu is True or (w.use_gpu == USE_GPU_AUTO and rc.workers.gpus_per_worker > 0)
        )
        if rc is not None and gpu:
            if rc.workers.gpus_per_worker < 1:
                fail(
                    "rayCluster.workers.gpusPerWorker",
                    "is 0 but workers.useGpu is true",
                    "give worker pods GPUs or set workers.useGpu: false",
                )
            if len(w.processes_per_node) > rc.workers.replicas:
                fail(
                    "workers.processesPerNode",
                    f"lists {len(w.processes_per_node)} nodes but the RayCluster has "
                    f"{rc.workers.replicas} worker replicas",
                    "raise rayCluster.workers.replicas or list fewer nodes",
                )
            over = [n for n in w.processes_per_node if n > rc.workers.gpus_per_worker]
            if over:
                fail(
                    "workers.processesPerNode",
                    f"{over[0]} GPU processes on one node exceed gpusPerWorker "
                    f"{rc.workers.gpus_per_worker}",
                    "lower processesPerNode or raise rayCluster.workers.gpusPerWorker",
                )
    return errors
