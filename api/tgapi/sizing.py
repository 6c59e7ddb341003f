"""Will the model fit? The memory a worker needs for its weights, gradients and optimizer
state, compared with what its pod (or GPU) has, before anything is started.

The figures follow the built-in trainer (``tgruntime.trainer.optim`` / ``settings``):

* on a GPU, megatron's mixed-precision AdamW: weights in the spec's dtype (2 bytes for
  bfloat16/float16, 4 for float32), fp32 gradient buffers (``grad_reduce_in_fp32``, 4),
  fp32 main weights for a 16-bit model (4) and Adam's two fp32 moments (8), with no
  distributed optimizer: 18 bytes per parameter (16 for float32);
* on a CPU, float32 whatever the dtype, fp32 gradients and ``torch.optim.AdamW``'s two
  moments: 16 bytes per parameter.

A worker holds one tensor-parallel shard of one pipeline stage; the largest stage (the
first or the last, which also hold the embedding and the output layer) is the one that
counts. Activations, buffers and the CUDA context come on top, so the estimate is a lower
bound and a refusal is certain: the model cannot fit, whatever the batch.

Limits come from the spec: ``rayCluster.workers.memory`` for CPU workers (all the
processes of one node share a pod), the GPU's memory for GPU workers when it is known
(``rayCluster.workers.gpuMemory``, else the nominal capacity of the GPU named by the
``nvidia.com/gpu.product`` node selector); ``tgctl`` passes the machine's memory for local
CPU workers (:func:`host_errors`). Nothing here imports more than the standard library.
"""

from __future__ import annotations

import dataclasses
import decimal
import os
import re

from tgapi.errors import SpecError
from tgapi.model import USE_GPU_AUTO, ModelSpec, TrainerGroupSpec

__all__ = [
    "GPU_PRODUCT_LABEL",
    "KNOWN_GPU_MEMORY",
    "Estimate",
    "bytes_per_parameter",
    "estimate",
    "host_errors",
    "host_memory_bytes",
    "parse_quantity",
    "sizing_errors",
]

GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
"""The GPU feature discovery label naming a node's GPU (e.g. ``NVIDIA-H200``)."""

_GB = 10**9
KNOWN_GPU_MEMORY: tuple[tuple[str, int], ...] = (
    # (a substring of the product label, nominal memory): the most specific first. Nominal
    # capacities are upper bounds of what a process can use, so a refusal stays certain.
    ("H200", 141 * _GB),
    ("H100", 80 * _GB),
    ("A100-SXM4-80GB", 80 * _GB),
    ("A100-PCIE-80GB", 80 * _GB),
    ("A100", 40 * _GB),
    ("L40S", 48 * _GB),
    ("L40", 48 * _GB),
    ("A10G", 24 * _GB),
    ("L4", 24 * _GB),
    ("T4", 16 * _GB),
)

_QUANTITY = re.compile(
    r"^(?P<num>[0-9]+(\.[0-9]*)?|\.[0-9]+)"
    r"(?P<suffix>[KMGTPE]i|[numkMGTPE]|[eE][+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+))?$"
)
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {
    "n": decimal.Decimal("1e-9"),
    "u": decimal.Decimal("1e-6"),
    "m": decimal.Decimal("1e-3"),
    "": decimal.Decimal(1),
    "k": decimal.Decimal("1e3"),
    "M": decimal.Decimal("1e6"),
    "G": decimal.Decimal("1e9"),
    "T": decimal.Decimal("1e12"),
    "P": decimal.Decimal("1e15"),
    "E": decimal.Decimal("1e18"),
}


def parse_quantity(text: str) -> decimal.Decimal | None:
    """A Kubernetes quantity (``32Gi``, ``500M``, ``1.5``, ``1e9``) as a number; None if it
    is not one (the CRD's pattern for quantities is the same grammar, unsigned)."""
    m = _QUANTITY.fullmatch(text)
    if m is None:
        return None
    num, suffix = decimal.Decimal(m["num"]), m["suffix"] or ""
    if suffix in _BINARY:
        return num * _BINARY[suffix]
    if suffix in _DECIMAL:
        return num * _DECIMAL[suffix]
    exponent = decimal.Decimal(suffix[1:])
    if abs(exponent) > 100:  # beyond any memory size; keeps Decimal's exponent in range
        return decimal.Decimal("Infinity") if exponent > 0 else decimal.Decimal(0)
    return num * decimal.Decimal(10) ** exponent


def bytes_per_parameter(*, on_gpu: bool, dtype: str) -> int:
    """Weights + gradients + optimizer state per parameter (see the module docstring)."""
    if not on_gpu or dtype == "float32":
        return 4 + 4 + 8
    return 2 + 4 + 4 + 8


@dataclasses.dataclass(frozen=True, kw_only=True)
class Estimate:
    """The model's size and what its largest worker holds."""

    parameters: int
    """The whole model."""
    worker_parameters: int
    """The largest worker's share: one tensor shard of the largest pipeline stage."""
    bytes_per_parameter: int
    tensor: int
    pipeline: int

    @property
    def worker_bytes(self) -> int:
        return self.worker_parameters * self.bytes_per_parameter

    def describe(self) -> str:
        return (
            f"{_count(self.parameters)} parameters, {_count(self.worker_parameters)} on the "
            f"largest worker under tensor {self.tensor} x pipeline {self.pipeline}; weights + "
            f"gradients + AdamW state at {self.bytes_per_parameter} bytes per parameter = "
            f"{human_bytes(self.worker_bytes)} per worker"
        )


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def estimate(spec: TrainerGroupSpec, *, on_gpu: bool) -> Estimate:
    """Parameters of the trainer's GPT model (untied embeddings, no biases) and per worker."""
    m: ModelSpec = spec.model
    t, p = spec.parallelism.tensor, spec.parallelism.pipeline
    h, heads = m.hidden_size, m.num_attention_heads
    groups = m.num_query_groups or heads
    head_dim = max(h // heads, 1)
    qkv = h * (heads * head_dim + 2 * groups * head_dim)
    proj = heads * head_dim * h
    mlp = h * m.ffn_hidden_size * (2 if m.activation == "swiglu" else 1) + m.ffn_hidden_size * h
    norm = h * (2 if m.normalization == "LayerNorm" else 1)
    position = m.position_embedding
    if position == "auto":
        position = "rope" if on_gpu else "learned_absolute"
    positions = m.max_sequence_length * h if position == "learned_absolute" else 0
    vocab = m.vocab_size * h

    layer_total = qkv + proj + mlp + 2 * norm
    total = m.num_layers * layer_total + 2 * vocab + positions + norm
    layer_shard = _ceil_div(qkv + proj + mlp, t) + 2 * norm
    stage = _ceil_div(m.num_layers, p) * layer_shard
    first = stage + _ceil_div(vocab, t) + positions
    last = stage + _ceil_div(vocab, t) + norm
    worker = first + last - stage if p == 1 else max(first, last)
    return Estimate(
        parameters=total,
        worker_parameters=worker,
        bytes_per_parameter=bytes_per_parameter(on_gpu=on_gpu, dtype=m.dtype),
        tensor=t,
        pipeline=p,
    )


def _count(n: int) -> str:
    for unit, size in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def human_bytes(n: int | decimal.Decimal) -> str:
    value = float(n) if n < 2**1000 else float("inf")
    for unit in ("PiB", "TiB", "GiB", "MiB", "KiB"):
        size = float(_BINARY[unit[:2]])
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value:.0f} B"


def _quantity_up(n: int) -> str:
    """``n`` bytes as the smallest whole Gi (or Mi) quantity that holds it."""
    if n >= 2**30:
        return f"{_ceil_div(n, 2**30)}Gi"
    return f"{max(_ceil_div(n, 2**20), 1)}Mi"


_SHRINK = (
    "raise parallelism.tensor or parallelism.pipeline (with enough worker processes), or "
    "shrink the model (model.numLayers, model.hiddenSize, model.ffnHiddenSize, "
    "model.vocabSize)"
)


def _gpu_memory(spec: TrainerGroupSpec, path: str) -> tuple[int, str, str] | None:
    """(bytes, field, what it is) of one GPU of a worker pod, when the spec tells it."""
    assert spec.ray_cluster is not None
    nodes = spec.ray_cluster.workers
    if nodes.gpu_memory:
        q = parse_quantity(nodes.gpu_memory)
        if q is None or not q.is_finite():
            return None  # the field check reports the format
        return int(q), f"{path}.rayCluster.workers.gpuMemory", f"gpuMemory is {nodes.gpu_memory}"
    product = nodes.node_selector.get(GPU_PRODUCT_LABEL, "")
    for name, size in KNOWN_GPU_MEMORY:
        if name.lower() in product.lower():
            field = f"{path}.rayCluster.workers.nodeSelector.{GPU_PRODUCT_LABEL}"
            return size, field, f"{product} has {size // _GB} GB ({human_bytes(size)})"
    return None


def _uses_gpu(spec: TrainerGroupSpec) -> bool:
    assert spec.ray_cluster is not None
    if spec.workers.use_gpu == USE_GPU_AUTO:
        return spec.ray_cluster.workers.gpus_per_worker > 0
    return bool(spec.workers.use_gpu)


def sizing_errors(
    spec: TrainerGroupSpec, *, path: str = "spec", local: bool = False
) -> list[SpecError]:
    """The model cannot fit the worker pods (or their GPUs) the spec's RayCluster has.

    Only a spec that creates its RayCluster says what the pods have; ``local`` (tgctl,
    where rayCluster is ignored) and ``rayClusterRef`` give no limit here.
    """
    if local or spec.ray_cluster is None:
        return []
    nodes = spec.ray_cluster.workers
    if _uses_gpu(spec):
        gpu = _gpu_memory(spec, path)
        est = estimate(spec, on_gpu=True)
        if gpu is None or est.worker_bytes <= gpu[0]:
            return []
        _, field, what = gpu
        return [
            SpecError(
                field=field,
                problem=(f"the model does not fit one GPU: {est.describe()}, but {what}"),
                fix=f"use GPUs with at least {human_bytes(est.worker_bytes)}, or {_SHRINK}",
            )
        ]
    est = estimate(spec, on_gpu=False)
    per_pod = max(spec.workers.processes_per_node, default=1)
    need = est.worker_bytes * per_pod
    limit = parse_quantity(nodes.memory)
    if limit is None or need <= limit:
        return []
    return [
        SpecError(
            field=f"{path}.rayCluster.workers.memory",
            problem=(
                f"{nodes.memory} is too small for the model: {est.describe()}, and a pod "
                f"holds {per_pod} CPU worker process(es): at least {human_bytes(need)}"
            ),
            fix=(
                f"set rayCluster.workers.memory to at least {_quantity_up(need)}, put fewer "
                f"processes on each node (workers.processesPerNode), or {_SHRINK}"
            ),
        )
    ]


def host_memory_bytes() -> int | None:
    """This machine's physical memory (None where the platform does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError, AttributeError):
        return None


def host_errors(
    spec: TrainerGroupSpec, *, memory_bytes: int, path: str = "spec"
) -> list[SpecError]:
    """The model cannot fit this machine: every CPU worker process of the group runs here
    (tgctl's local Ray head), each holding its estimate in host memory."""
    est = estimate(spec, on_gpu=False)
    need = est.worker_bytes * spec.world_size
    if need <= memory_bytes:
        return []
    return [
        SpecError(
            field=f"{path}.model",
            problem=(
                f"the model does not fit this machine: {est.describe()}, times "
                f"{spec.world_size} CPU worker process(es) = {human_bytes(need)}, but the "
                f"machine has {human_bytes(memory_bytes)} of memory"
            ),
            fix=(
                f"use fewer worker processes (workers.processesPerNode), {_SHRINK}, "
                "or run it on a RayCluster with larger pods"
            ),
        )
    ]
