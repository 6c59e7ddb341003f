"""``spec.model.pretrained``: the model's architecture and shape read from a Hugging Face
checkpoint (``LlamaForCausalLM``, ``Qwen2ForCausalLM`` or ``Qwen3ForCausalLM``).

Where the spec is parsed with the checkpoint's files at hand (``parse_spec(local=True)``:
the runtime's server on the head, ``tgctl``), :func:`apply_pretrained` reads
``<dir>/config.json`` and returns the spec with the architecture (from ``model_type``) and the
shape fields taken from it. A field the user wrote in the spec must agree with the file; one
that disagrees is an error naming the field, the two values and the fix. Another
``model_type`` (mistral, gemma2, ...) is refused, naming the supported ones. The tokenizer
must be there too (the Tinker API's ``get_info`` hands it to the SDK).

The operator parses without the files (it cannot mount the group's volume): it checks the
path's form and the Llama-only fields (``rules.py``: rope, RMSNorm, swiglu) and sizes the
model by the shape fields as written; the rest is checked when the server job parses the spec
on the head, which fails the group with the same messages (``ServerFailed``).

Standard library only, like the rest of tgapi; ``tgruntime.trainer.hf_weights.LlamaShape``
checks the same file again, tensor by tensor, when the weights are loaded.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tgapi.errors import SpecError
from tgapi.hub import HubError, local_dir
from tgapi.model import ROPE_THETA, ModelSpec, TrainerGroupSpec

CONFIG = "config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
"""One of these must be in the directory (a fast tokenizer, or a SentencePiece model)."""
HF_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
"""config.json's ``model_type`` -> its transformers class, for every ``model.architecture``."""
HF_NORM_EPSILON = 1e-6
"""transformers' default ``rms_norm_eps`` (Llama, Qwen2, Qwen3) when config.json has none."""
SUPPORTED = ", ".join(f"{t} ({c})" for t, c in HF_CLASSES.items())

SHAPE_FIELDS: tuple[tuple[str, str, str], ...] = (
    # (dataclass attribute, spec wire name, config.json key)
    ("vocab_size", "vocabSize", "vocab_size"),
    ("hidden_size", "hiddenSize", "hidden_size"),
    ("num_layers", "numLayers", "num_hidden_layers"),
    ("num_attention_heads", "numAttentionHeads", "num_attention_heads"),
    ("num_query_groups", "numQueryGroups", "num_key_value_heads"),
    ("ffn_hidden_size", "ffnHiddenSize", "intermediate_size"),
    ("max_sequence_length", "maxSequenceLength", "max_position_embeddings"),
)
"""The fields of ``spec.model`` a checkpoint's config.json decides."""


def shape_from_config(config: Mapping[str, Any]) -> dict[str, int]:
    """The shape fields (attribute -> value) in a Llama config.json; ValueError if absent."""
    out: dict[str, int] = {}
    missing: list[str] = []
    for attr, _wire, key in SHAPE_FIELDS:
        value = config.get(key)
        if key == "num_key_value_heads" and value is None:
            value = config.get("num_attention_heads")
        if type(value) is not int or value < 1:
            missing.append(key)
            continue
        out[attr] = value
    if missing:
        raise ValueError(f"lacks a positive integer {', '.join(missing)}")
    return out


def architecture_from_config(config: Mapping[str, Any]) -> str:
    """``model.architecture`` of a config.json (its ``model_type``); ValueError naming the
    supported ones for any other, or when ``architectures`` names another class."""
    model_type = config.get("model_type")
    architectures = config.get("architectures") or []
    hf_class = HF_CLASSES.get(model_type) if isinstance(model_type, str) else None
    if hf_class is None or (architectures and hf_class not in architectures):
        raise ValueError(
            f"describes model_type {model_type!r} "
            f"({', '.join(map(str, architectures)) or 'no architectures'}), which the trainer "
            f"does not build; supported: {SUPPORTED}"
        )
    return str(model_type)


def extras_from_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The fields besides the shape that a config.json decides: architecture, headDim (0 when
    it is hidden_size / num_attention_heads), ropeTheta, normEpsilon, tieEmbeddings."""
    out: dict[str, Any] = {"architecture": architecture_from_config(config)}
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    head_dim = config.get("head_dim")
    if type(head_dim) is int and head_dim > 0 and (
        type(hidden) is not int or type(heads) is not int or heads < 1 or hidden != heads * head_dim
    ):
        out["head_dim"] = head_dim
    else:
        out["head_dim"] = 0
    rope = config.get("rope_parameters")
    theta = rope.get("rope_theta") if isinstance(rope, Mapping) else None
    theta = theta if theta is not None else config.get("rope_theta", ROPE_THETA)
    eps = config.get("rms_norm_eps", HF_NORM_EPSILON)
    for key, value in (("rope_theta", theta), ("rms_norm_eps", eps)):
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ValueError(f"has {key} {value!r}, not a positive number")
    out["rope_theta"] = float(theta)
    out["norm_epsilon"] = float(eps)
    out["tie_embeddings"] = bool(config.get("tie_word_embeddings", False))
    return out


EXTRA_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("architecture", "architecture", "model_type"),
    ("head_dim", "headDim", "head_dim"),
    ("rope_theta", "ropeTheta", "rope_theta"),
    ("norm_epsilon", "normEpsilon", "rms_norm_eps"),
    ("tie_embeddings", "tieEmbeddings", "tie_word_embeddings"),
)
"""The fields of ``spec.model`` besides the shape that config.json decides."""


def _error(path: str, problem: str, fix: str) -> SpecError:
    return SpecError(field=path, problem=problem, fix=fix)


def apply_pretrained(
    spec: TrainerGroupSpec, *, written: Mapping[str, Any] | None, path: str = "spec"
) -> tuple[TrainerGroupSpec, list[SpecError]]:
    """``spec`` with the shape of ``spec.model.pretrained`` (and the errors, if any).

    ``written`` is the ``model`` mapping as the user wrote it: only the fields set there are
    compared with the checkpoint (the others are defaults, which the checkpoint replaces).
    """
    if spec.model.pretrained is None:
        return spec, []
    field = f"{path}.model.pretrained"
    try:  # a hub id: its config and tokenizer, downloaded (tgapi.hub)
        directory = local_dir(spec.model.pretrained)
    except HubError as exc:
        return spec, [_error(field, exc.problem, exc.fix)]
    root = Path(directory)
    config_path = root / CONFIG
    if not root.is_dir():
        return spec, [
            _error(
                field,
                f"{directory} is not a directory here",
                "point it at a directory holding a LlamaForCausalLM checkpoint (config.json, "
                "*.safetensors, tokenizer.json) that every worker can read, e.g. on "
                "rayCluster.storage",
            )
        ]
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return spec, [
            _error(
                field,
                f"{directory} holds no {CONFIG}",
                "save the checkpoint there with save_pretrained() (config.json, "
                "*.safetensors) or fix the path",
            )
        ]
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return spec, [
            _error(
                field,
                f"{config_path} cannot be read as JSON ({exc})",
                "write it with save_pretrained() from transformers",
            )
        ]
    errors: list[SpecError] = []
    if not isinstance(config, Mapping):
        return spec, [_error(field, f"{config_path} is not a JSON object", "re-save it")]
    extras: dict[str, Any] = {}
    try:
        extras = extras_from_config(config)
    except ValueError as exc:
        errors.append(
            _error(
                field,
                f"{config_path} {exc}",
                "use a checkpoint of a supported architecture with a complete config.json "
                "(docs/models.md)",
            )
        )
    if not any((root / name).is_file() for name in TOKENIZER_FILES):
        errors.append(
            _error(
                field,
                f"{directory} holds no tokenizer ({' or '.join(TOKENIZER_FILES)})",
                "save the tokenizer beside the weights (tokenizer.save_pretrained(dir)); the "
                "Tinker API's get_info hands it to the SDK",
            )
        )
    try:
        shape = shape_from_config(config)
    except ValueError as exc:
        errors.append(
            _error(field, f"{config_path} {exc}", "write a complete config.json")
        )
        return spec, errors
    model_written = written if isinstance(written, Mapping) else {}
    for attr, wire, key in SHAPE_FIELDS:
        if wire not in model_written or model_written[wire] is None:
            continue
        mine = getattr(spec.model, attr)
        if attr == "num_query_groups" and mine == 0:
            mine = spec.model.num_attention_heads
        if mine != shape[attr]:
            errors.append(
                _error(
                    f"{path}.model.{wire}",
                    f"{getattr(spec.model, attr)} contradicts {key} = {shape[attr]} in "
                    f"{config_path}",
                    f"remove model.{wire} (the checkpoint gives the shape) or set it to "
                    f"{shape[attr]}",
                )
            )
    if extras:
        errors.extend(
            _contradictions(spec.model, extras, shape, model_written, path, config_path)
        )
    if errors:
        return spec, errors
    changes: dict[str, Any] = {**shape, **extras}
    model: ModelSpec = dataclasses.replace(spec.model, **changes)
    return dataclasses.replace(spec, model=model), []


def _contradictions(
    model: ModelSpec,
    extras: Mapping[str, Any],
    shape: Mapping[str, int],
    written: Mapping[str, Any],
    path: str,
    config_path: Path,
) -> list[SpecError]:
    """Errors for the fields besides the shape that the spec sets against config.json."""
    errors: list[SpecError] = []
    for attr, wire, key in EXTRA_FIELDS:
        if wire not in written or written[wire] is None:
            continue
        mine, theirs = getattr(model, attr), extras[attr]
        if attr == "head_dim":  # compare head sizes (0 = hidden_size / num_attention_heads)
            default = shape["hidden_size"] // shape["num_attention_heads"]
            mine, theirs = mine or default, theirs or default
        if mine == theirs:
            continue
        shown = theirs if isinstance(theirs, str) else json.dumps(theirs)
        errors.append(
            _error(
                f"{path}.model.{wire}",
                f"{mine if isinstance(mine, str) else json.dumps(mine)} contradicts "
                f"{key} = {shown} in {config_path}",
                f"remove model.{wire} (the checkpoint gives it) or set it to {shown}",
            )
        )
    return errors
