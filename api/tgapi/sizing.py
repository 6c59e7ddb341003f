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

The estimate and its sentences are written once, in ``tgapi.expr``'s expression language
(:data:`SIZING_RULES`): Python evaluates them for tgapi's parse (:func:`sizing_errors`), and
``crd.py`` writes the same expressions as CEL into the ValidatingAdmissionPolicy, so
``kubectl apply`` refuses a model that cannot fit with the same sentence. Counts are
doubles there (``double(x) * double(y)``: no int64 overflow; the model's bounds keep every
value finite and every per-layer integer inside int64) and quantities are read with
Kubernetes' quantity library (``quantity(s).asApproximateFloat()``).
"""

from __future__ import annotations

import dataclasses
import decimal
import math
import os
import re
from typing import Any

from tgapi import rules
from tgapi.errors import SpecError
from tgapi.expr import (
    CelError,
    Cond,
    ContainsFolded,
    Expr,
    Field,
    Fixed,
    Lit,
    MapGet,
    Str,
    Text,
    Var,
    Wire,
    fmt,
)
from tgapi.model import MEMORY_BASE_GI, MEMORY_PER_GPU_GI, TrainerGroupSpec
from tgapi.rules import Rule
from tgapi.wire import to_wire

__all__ = [
    "GPU_PRODUCT_LABEL",
    "KNOWN_GPU_MEMORY",
    "SIZING_RULES",
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
    value = _bytes_per_parameter(Lit(on_gpu)).eval({"model": {"dtype": dtype}})
    assert isinstance(value, int)
    return value


# -- the estimate as expressions over the wire form ------------------------------------
def _ceil_div(a: Expr, b: Expr) -> Expr:
    """Integer ceil(a / b) for a >= 0, b >= 1."""
    return (a + b - 1) // b


def _bytes_per_parameter(on_gpu: Expr) -> Expr:
    return Cond(~on_gpu | Field("model.dtype").eq("float32"), Lit(16), Lit(18))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Formula:
    """The estimate's values as expressions (doubles but ``bytes_per_parameter``)."""

    parameters: Expr
    worker_parameters: Expr
    bytes_per_parameter: Expr
    worker_bytes: Expr


def formula(on_gpu: Expr, *, prefix: str = "") -> Formula:
    """Parameters of the trainer's GPT model (no biases but Qwen2's QKV bias, Qwen3's q/k
    norms, embeddings tied or not) and per worker.

    Per-layer sizes are integers (each inside int64 under the model's bounds, so the
    ceiling divisions are exact); products with the layer count are doubles. With a
    ``prefix`` the shared values are policy variables named ``<prefix>...``.
    """

    def var(name: str, expr: Expr) -> Expr:
        return Var(prefix + name, expr) if prefix else expr

    h, heads, t, p = rules.HIDDEN, rules.HEADS, rules.TENSOR, rules.PIPELINE
    head_dim = Cond(rules.HEAD_DIM > 0, rules.HEAD_DIM, Cond(h // heads >= 1, h // heads, Lit(1)))
    qkv_rows = heads * head_dim + 2 * rules.QUERY_GROUPS * head_dim
    qkv_bias = Cond(rules.ARCHITECTURE.eq("qwen2"), qkv_rows, Lit(0))
    qkv = h * qkv_rows + qkv_bias
    qk_norm = Cond(rules.ARCHITECTURE.eq("qwen3"), 2 * head_dim, Lit(0))  # replicated
    proj = heads * head_dim * h
    swiglu = Field("model.activation").eq("swiglu")
    mlp = h * rules.FFN * Cond(swiglu, Lit(2), Lit(1)) + rules.FFN * h
    layer_norm = Field("model.normalization").eq("LayerNorm")
    norm = var("Norm", h * Cond(layer_norm, Lit(2), Lit(1)))
    position = Field("model.positionEmbedding")
    learned = position.eq("learned_absolute") | (position.eq("auto") & ~on_gpu)
    positions = var("Positions", Cond(learned, rules.MAX_SEQ * h, Lit(0)))
    vocab = rules.VOCAB * h
    matrices = var("LayerMatrices", qkv + proj + mlp)
    layer_total = matrices + 2 * norm + qk_norm
    layer_shard = _ceil_div(matrices, t) + 2 * norm + qk_norm
    # tied embeddings: one vocabulary matrix (a copy on the last of several stages)
    vocabs = Cond(Field("model.tieEmbeddings").eq(True), Lit(1), Lit(2))
    total = (
        rules.LAYERS.to_double() * layer_total.to_double()
        + (vocabs * vocab + positions + norm).to_double()
    )
    stage = var("Stage", _ceil_div(rules.LAYERS, p).to_double() * layer_shard.to_double())
    vocab_shard = _ceil_div(vocab, t)
    # the largest stage: with one stage it holds both ends; else the first (embedding and
    # positions) or the last (output layer and final norm)
    ends = Cond(
        p.eq(1),
        vocabs * vocab_shard + positions + norm,
        vocab_shard + Cond(positions >= norm, positions, norm),
    )
    worker = var("WorkerParameters", stage + ends.to_double())
    bpp = var("BytesPerParameter", _bytes_per_parameter(on_gpu))
    return Formula(
        parameters=var("Parameters", total),
        worker_parameters=worker,
        bytes_per_parameter=bpp,
        worker_bytes=var("WorkerBytes", worker * bpp.to_double()),
    )


# -- how numbers read: fixed precision, so CEL's format() writes the same ----------------
_BYTE_UNITS = ("PiB", "TiB", "GiB", "MiB", "KiB")
_COUNT_UNITS = (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3))


def _three_digits(v: Expr) -> Expr:
    """A double in [1, 1000) with three significant digits: 1.07, 70.6, 175."""
    return Cond(
        v < 10.0,
        fmt("{}", Fixed(v, 2)),
        Cond(v < 100.0, fmt("{}", Fixed(v, 1)), fmt("{}", Fixed(v, 0))),
    )


def count_text(n: Expr) -> Expr:
    """A count (a double) as ``1.07B``, ``70.6M``, ``512``."""
    out: Expr = fmt("{}", n.to_int())
    for unit, size in reversed(_COUNT_UNITS):
        out = Cond(n >= float(size), fmt("{}" + unit, _three_digits(n / float(size))), out)
    return out


def bytes_text(n: Expr) -> Expr:
    """Bytes (a double) as ``85.8 GiB`` (one decimal, the largest binary unit that fits)."""
    out: Expr = fmt("{} B", Fixed(n, 0))
    for unit in reversed(_BYTE_UNITS):
        size = float(_BINARY[unit[:2]])
        out = Cond(n >= size, fmt("{} " + unit, Fixed(n / size, 1)), out)
    return out


def _ceil(x: Expr) -> Expr:
    """ceil(x) of a double >= 0 as an integer."""
    return Cond(x.to_int().to_double() < x, x.to_int() + 1, x.to_int())


def quantity_up_text(n: Expr) -> Expr:
    """``n`` bytes (a double) as the smallest whole Gi (or Mi) quantity that holds it."""
    mib = _ceil(n / float(2**20))
    return Cond(
        n >= float(2**30),
        fmt("{}Gi", _ceil(n / float(2**30))),
        fmt("{}Mi", Cond(mib >= 1, mib, Lit(1))),
    )


def _describe(f: Formula) -> tuple[str, tuple[Expr, ...]]:
    return (
        "{} parameters, {} on the largest worker under tensor {} x pipeline {}; weights + "
        "gradients + AdamW state at {} bytes per parameter = {} per worker",
        (
            count_text(f.parameters),
            count_text(f.worker_parameters),
            rules.TENSOR,
            rules.PIPELINE,
            f.bytes_per_parameter,
            bytes_text(f.worker_bytes),
        ),
    )


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
        f = Formula(
            parameters=Lit(float(self.parameters)),
            worker_parameters=Lit(float(self.worker_parameters)),
            bytes_per_parameter=Lit(self.bytes_per_parameter),
            worker_bytes=Lit(float(self.worker_bytes)),
        )
        template, args = _describe(f)
        wire = {"parallelism": {"tensor": self.tensor, "pipeline": self.pipeline}}
        return Text(template, *args).render(wire)


def estimate(spec: TrainerGroupSpec, *, on_gpu: bool) -> Estimate:
    """The spec's estimate on a GPU or a CPU (exact below 2**53 parameters)."""
    wire = to_wire(spec)
    f = formula(Lit(on_gpu))
    return Estimate(
        parameters=int(f.parameters.eval(wire)),
        worker_parameters=int(f.worker_parameters.eval(wire)),
        bytes_per_parameter=int(f.bytes_per_parameter.eval(wire)),
        tensor=spec.parallelism.tensor,
        pipeline=spec.parallelism.pipeline,
    )


def human_bytes(n: int | float | decimal.Decimal) -> str:
    value = float(n) if n < 2**1000 else float("inf")
    text = bytes_text(Lit(value)).eval({})
    assert isinstance(text, str)
    return text


# -- the rules ---------------------------------------------------------------------------
def _text(value: object) -> str:
    if not isinstance(value, str):
        raise CelError(f"expected a string, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True, eq=False)
class Quantity(Expr):
    """``quantity(s).asApproximateFloat()`` (Kubernetes' quantity library); Python reads it
    with :func:`parse_quantity`."""

    arg: Expr

    def cel(self, root: str = "self") -> str:
        return f"quantity({self.arg.cel(root)}).asApproximateFloat()"

    def eval(self, spec: Wire) -> Any:
        q = parse_quantity(_text(self.arg.eval(spec)))
        if q is None:
            raise CelError("quantities must match the regular expression")
        return float(q) if q.is_finite() and q < 2**1000 else math.inf


@dataclasses.dataclass(frozen=True, eq=False)
class IsQuantity(Expr):
    """``isQuantity(s)``."""

    arg: Expr

    def cel(self, root: str = "self") -> str:
        return f"isQuantity({self.arg.cel(root)})"

    def eval(self, spec: Wire) -> Any:
        return parse_quantity(_text(self.arg.eval(spec))) is not None


_SHRINK = (
    "raise parallelism.tensor or parallelism.pipeline (with enough worker processes), or "
    "shrink the model (model.numLayers, model.hiddenSize, model.ffnHiddenSize, "
    "model.vocabSize)"
)

_NODES = "rayCluster.workers"
MEMORY = Field(f"{_NODES}.memory")
GPU_MEMORY = Field(f"{_NODES}.gpuMemory")
_GPU = formula(Lit(True), prefix="sizeGpu")
_CPU = formula(Lit(False), prefix="sizeCpu")
_GPU_PRODUCT = Var(
    "sizeGpuProduct",
    MapGet(Field(f"{_NODES}.nodeSelector"), GPU_PRODUCT_LABEL, Lit("")),
)


def _product_memory() -> Expr:
    """The nominal memory of the GPU the product label names (0: not known)."""
    out: Expr = Lit(0)
    for name, size in reversed(KNOWN_GPU_MEMORY):
        out = Cond(ContainsFolded(_GPU_PRODUCT, name.lower()), Lit(size), out)
    return out


_PRODUCT_MEMORY = Var("sizeGpuProductMemory", _product_memory())
_MEMORY_SET = MEMORY.ne("")
_AUTO_MEMORY_GI = rules.GPUS_PER_WORKER * MEMORY_PER_GPU_GI + MEMORY_BASE_GI
_MEMORY_BYTES = Cond(_MEMORY_SET, Quantity(MEMORY), (_AUTO_MEMORY_GI * 2**30).to_double())
"""The worker pod's memory in bytes: ``memory``, else the default for its GPUs."""
_MEMORY_TEXT = Cond(
    _MEMORY_SET,
    Str(MEMORY),
    fmt(
        f"the default {{}}Gi ({MEMORY_BASE_GI}Gi + {MEMORY_PER_GPU_GI}Gi per GPU)",
        _AUTO_MEMORY_GI,
    ),
)
_PER_POD = Var("sizeProcessesPerPod", Cond(rules.PPN.size().eq(0), Lit(1), rules.PPN.max()))
_POD_BYTES = Var("sizeCpuPodBytes", _CPU.worker_bytes * _PER_POD.to_double())


def _gpu_text(what: str, *what_args: Expr) -> tuple[Text, Text]:
    template, args = _describe(_GPU)
    problem = Text(f"the model does not fit one GPU: {template}, but {what}", *args, *what_args)
    fix = Text("use GPUs with at least {}, or " + _SHRINK, bytes_text(_GPU.worker_bytes))
    return problem, fix


_GPU_BY_MEMORY = _gpu_text("gpuMemory is {}", Str(GPU_MEMORY))
_GPU_BY_PRODUCT = _gpu_text(
    "{} has {} GB ({})",
    Str(_GPU_PRODUCT),
    _PRODUCT_MEMORY // _GB,
    bytes_text(_PRODUCT_MEMORY.to_double()),
)
_CPU_TEMPLATE, _CPU_ARGS = _describe(_CPU)

SIZING_RULES: tuple[Rule, ...] = (
    Rule(
        name="model-fits-gpu-memory",
        field=f"{_NODES}.gpuMemory",
        holds=~rules.GPU
        | GPU_MEMORY.eq("")
        | ~IsQuantity(GPU_MEMORY)
        | (_GPU.worker_bytes <= Quantity(GPU_MEMORY)),
        problem=_GPU_BY_MEMORY[0],
        fix=_GPU_BY_MEMORY[1],
        cluster=True,
    ),
    Rule(
        name="model-fits-gpu-product",
        field=f"{_NODES}.nodeSelector.{GPU_PRODUCT_LABEL}",
        holds=~rules.GPU
        | GPU_MEMORY.ne("")
        | _PRODUCT_MEMORY.eq(0)
        | (_GPU.worker_bytes <= _PRODUCT_MEMORY.to_double()),
        problem=_GPU_BY_PRODUCT[0],
        fix=_GPU_BY_PRODUCT[1],
        cluster=True,
    ),
    Rule(
        name="model-fits-pod-memory",
        field=f"{_NODES}.memory",
        holds=~rules.HAS_CLUSTER
        | rules.GPU
        | (_MEMORY_SET & ~IsQuantity(MEMORY))
        | (_MEMORY_BYTES >= _POD_BYTES),
        problem=Text(
            "{} is too small for the model: " + _CPU_TEMPLATE + ", and a pod holds {} CPU "
            "worker process(es): at least {}",
            _MEMORY_TEXT,
            *_CPU_ARGS,
            _PER_POD,
            bytes_text(_POD_BYTES),
        ),
        fix=Text(
            "set rayCluster.workers.memory to at least {}, put fewer processes on each node "
            "(workers.processesPerNode), or " + _SHRINK,
            quantity_up_text(_POD_BYTES),
        ),
        cluster=True,
    ),
)
"""The size estimate against the worker pods' limits; in the admission policy (they read
``workers.useGpu`` and policy variables), evaluated in Python by :func:`sizing_errors`."""


def sizing_errors(
    spec: TrainerGroupSpec, *, path: str = "spec", local: bool = False
) -> list[SpecError]:
    """The model cannot fit the worker pods (or their GPUs) the spec's RayCluster has.

    Only a spec that creates its RayCluster says what the pods have; ``local`` (tgctl,
    where rayCluster is ignored) and ``rayClusterRef`` give no limit here.
    """
    if local or spec.ray_cluster is None:
        return []
    wire = to_wire(spec)
    errors = []
    for rule in SIZING_RULES:
        if rule.broken_by(wire):
            problem, fix = rule.sentences(wire)
            errors.append(SpecError(field=f"{path}.{rule.field}", problem=problem, fix=fix))
    return errors


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
