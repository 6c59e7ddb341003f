"""Put LoRA adapters on a built megatron ``GPTModel`` stage; freeze its base weights.

:func:`inject_lora` wraps this pipeline stage's linears (its own layers, and the output
layer on the last stage) with forward hooks that add each adapter's delta; the adapters
live in a separate :class:`LoraAdapters` module, so the model's own parameter names (its
checkpoints, ``export_hf``/``import_hf``) are unchanged and an adapter set can be detached.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from megatron.core import parallel_state

from tgruntime.trainer.hf_weights import LlamaShape
from tgruntime.trainer.lora.adapters import (
    COLUMN,
    FUSE_GATED,
    FUSE_NONE,
    FUSE_QKV,
    ROW,
    LinearLora,
    Part,
)
from tgruntime.trainer.lora.settings import LoraSettings

__all__ = [
    "LoraAdapters",
    "adapter_parameters",
    "base_parameters",
    "freeze_base",
    "inject_lora",
]


def _key(megatron_name: str) -> str:
    return megatron_name.replace(".", "-")  # ModuleDict keys cannot hold dots


class LoraAdapters(torch.nn.Module):
    """This rank's adapters, keyed by the (stage-local) megatron name of the linear."""

    def __init__(self, *, settings: LoraSettings, shape: LlamaShape) -> None:
        super().__init__()
        self.settings = settings
        self.shape = shape
        self.adapters = torch.nn.ModuleDict()
        self.megatron_names: dict[str, str] = {}  # key -> stage-local megatron module name
        self._handles: list[Any] = []
        self._bases: dict[str, torch.nn.Module] = {}  # key -> the base linear (not a child)
        self._attached = True

    def add(self, megatron_name: str, adapter: LinearLora, base: torch.nn.Module) -> None:
        key = _key(megatron_name)
        self.adapters[key] = adapter
        self.megatron_names[key] = megatron_name
        self._bases[key] = base
        if self._attached:
            self._hook(key)

    def _hook(self, key: str) -> None:
        adapter, megatron_name = self.adapters[key], self.megatron_names[key]

        def hook(
            module: torch.nn.Module,
            args: tuple[Any, ...],
            kwargs: dict[str, Any],
            output: Any,
        ) -> Any:
            x = args[0] if args else kwargs["input_"]
            out, bias = output
            delta = adapter(x)
            if delta.shape != out.shape:
                raise RuntimeError(
                    f"LoRA on {megatron_name}: the delta has shape {tuple(delta.shape)}, the "
                    f"output {tuple(out.shape)} (a gathered output is not supported)"
                )
            return out + delta.to(out.dtype), bias

        self._handles.append(self._bases[key].register_forward_hook(hook, with_kwargs=True))

    def items(self) -> Iterator[tuple[str, LinearLora]]:
        """(stage-local megatron name, adapter) pairs."""
        for key, adapter in self.adapters.items():
            assert isinstance(adapter, LinearLora)
            yield self.megatron_names[key], adapter

    @property
    def attached(self) -> bool:
        """Whether the hooks are on the model (its forward adds these adapters' deltas)."""
        return self._attached

    def attach(self) -> None:
        """Put the hooks (back) on the model; a no-op when attached. Another adapter set on
        the same linears must be detached first (many runs: ``lora.runs``)."""
        if not self._attached:
            self._attached = True
            for key in self.adapters:
                self._hook(key)

    def detach(self) -> None:
        """Remove the hooks: the model computes its base function again."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._attached = False

    def forward(self, *_: Any) -> None:
        raise RuntimeError("LoraAdapters are applied through the model's forward hooks")


def _stage_first_layer(module: torch.nn.Module) -> int:
    layers = list(module.decoder.layers)  # type: ignore[union-attr, arg-type]
    return int(layers[0].layer_number) - 1 if layers else 0


def inject_lora(
    module: torch.nn.Module,
    *,
    settings: LoraSettings,
    shape: LlamaShape,
    initialize: bool = True,
) -> LoraAdapters:
    """Add ``settings``' adapters to this rank's stage of ``module`` (a built ``GPTModel``).

    Model-parallel state must be initialised. The base weights are frozen
    (:func:`freeze_base`). Raises ``ValueError`` naming the field when the settings do not
    fit the model (rank too large, key/value groups not divisible by the TP size).
    ``initialize=False``: the adapters' tensors are left unset, for a state loaded next.
    """
    if not settings.enabled:
        raise ValueError("lora.rank is 0: no adapters to inject (a full-weight run)")
    settings.check_shape(shape)
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    if settings.train_attn and shape.num_key_value_heads % tp_size:
        raise ValueError(
            f"lora.train_attn: the model's {shape.num_key_value_heads} key/value groups do not "
            f"split over tensor-parallel size {tp_size}; LoRA on q/k/v needs whole groups per "
            "rank (set lora.train_attn false or use a TP size dividing the groups)"
        )
    h, f, d = shape.hidden_size, shape.intermediate_size, shape.head_dim
    q, kv = shape.num_attention_heads * d, shape.num_key_value_heads * d
    adapters = LoraAdapters(settings=settings, shape=shape)

    def make(kind: str, fuse: str, parts: list[Part], base: torch.nn.Module) -> LinearLora:
        weight = getattr(base, "weight", None)
        if weight is None:
            raise ValueError(f"{type(base).__name__} has no weight to adapt")
        return LinearLora(
            kind=kind,
            fuse=fuse,
            parts=parts,
            rank=settings.rank,
            scaling=settings.scaling,
            seed=settings.seed,
            tp_size=tp_size,
            tp_rank=tp_rank,
            device=weight.device,
            heads_per_group=shape.heads_per_group,
            head_dim=d,
            initialize=initialize,
        )

    first = _stage_first_layer(module)
    for local, layer in enumerate(module.decoder.layers):  # type: ignore[union-attr, arg-type]
        m = f"model.layers.{first + local}."
        src = f"decoder.layers.{local}."
        attn, mlp = layer.self_attention, layer.mlp
        if settings.train_attn:
            qkv = [
                Part(hf_module=m + "self_attn.q_proj", in_features=h, out_features=q),
                Part(hf_module=m + "self_attn.k_proj", in_features=h, out_features=kv),
                Part(hf_module=m + "self_attn.v_proj", in_features=h, out_features=kv),
            ]
            adapters.add(
                src + "self_attention.linear_qkv",
                make(COLUMN, FUSE_QKV, qkv, attn.linear_qkv),
                attn.linear_qkv,
            )
            o = [Part(hf_module=m + "self_attn.o_proj", in_features=q, out_features=h)]
            adapters.add(
                src + "self_attention.linear_proj",
                make(ROW, FUSE_NONE, o, attn.linear_proj),
                attn.linear_proj,
            )
        if settings.train_mlp:
            gate_up = [
                Part(hf_module=m + "mlp.gate_proj", in_features=h, out_features=f),
                Part(hf_module=m + "mlp.up_proj", in_features=h, out_features=f),
            ]
            adapters.add(
                src + "mlp.linear_fc1",
                make(COLUMN, FUSE_GATED, gate_up, mlp.linear_fc1),
                mlp.linear_fc1,
            )
            down = [Part(hf_module=m + "mlp.down_proj", in_features=f, out_features=h)]
            adapters.add(
                src + "mlp.linear_fc2",
                make(ROW, FUSE_NONE, down, mlp.linear_fc2),
                mlp.linear_fc2,
            )
    output = getattr(module, "output_layer", None)
    if settings.train_unembed and output is not None and getattr(module, "post_process", False):
        head = [Part(hf_module="lm_head", in_features=h, out_features=shape.vocab_size)]
        adapters.add("output_layer", make(COLUMN, FUSE_NONE, head, output), output)
    freeze_base(module)
    return adapters


def freeze_base(module: torch.nn.Module) -> int:
    """``requires_grad = False`` (and no ``.grad``) on every parameter of ``module``;
    returns how many elements were frozen."""
    frozen = 0
    for param in module.parameters():
        param.requires_grad_(False)
        param.grad = None
        frozen += param.numel()
    return frozen


def adapter_parameters(adapters: LoraAdapters) -> list[torch.nn.Parameter]:
    """The trainable parameters: every ``A`` and ``B`` of this rank (what the optimizer gets)."""
    return [p for p in adapters.parameters() if p.requires_grad]


def base_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return list(module.parameters())
