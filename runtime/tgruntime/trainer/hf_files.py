"""The files of a Hugging Face checkpoint directory: safetensors shards, their index, config.json.

Layout (what ``transformers``' ``from_pretrained`` reads)::

    config.json                          written last: the directory is complete once it exists
    model.safetensors                    all weights, when they fit in one file, or
    model-00001-of-0000N.safetensors     shards of at most ``max_shard_bytes`` each, plus
    model.safetensors.index.json         {"metadata": {"total_size"}, "weight_map": name -> file}
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

__all__ = [
    "CONFIG",
    "DEFAULT_MAX_SHARD_BYTES",
    "INDEX",
    "SINGLE",
    "clear_weights",
    "plan_shards",
    "read_config",
    "read_tensors",
    "shard_names",
    "weight_map",
    "write_config",
    "write_index",
    "write_shard",
]

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3  # transformers' own default shard size (5 GB)


def plan_shards(sizes: Sequence[tuple[str, int]], *, max_shard_bytes: int) -> list[list[str]]:
    """Group tensors (in order) into files of at most ``max_shard_bytes`` each.

    A tensor larger than the limit gets a file of its own.
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, not {max_shard_bytes}")
    shards: list[list[str]] = []
    used = 0
    for name, size in sizes:
        if not shards or (shards[-1] and used + size > max_shard_bytes):
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def shard_names(count: int) -> list[str]:
    """File names for ``count`` shards (one file: ``model.safetensors``)."""
    if count == 1:
        return [SINGLE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def clear_weights(path: str | Path) -> None:
    """Remove an earlier export's weights, index and config from ``path`` (so none is mixed in)."""
    root = Path(path)
    if not root.is_dir():
        return
    for entry in root.iterdir():
        stale = entry.name in (CONFIG, INDEX) or (
            entry.name.startswith("model") and entry.name.endswith(".safetensors")
        )
        if stale and entry.is_file():
            entry.unlink()


def write_shard(path: str | Path, tensors: Mapping[str, torch.Tensor]) -> int:
    """Write one safetensors file (CPU, contiguous copies); returns its tensors' bytes."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    plain = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    tmp = target.with_name(target.name + ".tmp")
    save_file(plain, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, target)
    return sum(t.numel() * t.element_size() for t in plain.values())


def write_index(path: str | Path, *, weights: Mapping[str, str], total_size: int) -> None:
    payload = {"metadata": {"total_size": total_size}, "weight_map": dict(weights)}
    (Path(path) / INDEX).write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")


def write_config(path: str | Path, config: Mapping[str, Any]) -> None:
    target = Path(path) / CONFIG
    tmp = target.with_name(CONFIG + ".tmp")
    tmp.write_text(json.dumps(dict(config), indent=2, sort_keys=True) + "\n")
    os.replace(tmp, target)


def read_config(path: str | Path) -> dict[str, Any]:
    target = Path(path) / CONFIG
    if not target.is_file():
        raise FileNotFoundError(
            f"{target} not found: import_hf needs a Hugging Face checkpoint directory "
            "(config.json plus model.safetensors or an index of shards)"
        )
    loaded: dict[str, Any] = json.loads(target.read_text())
    return loaded


def weight_map(path: str | Path) -> dict[str, str]:
    """Parameter name -> file name of the checkpoint in ``path``."""
    root = Path(path)
    if (root / INDEX).is_file():
        mapping: dict[str, str] = json.loads((root / INDEX).read_text())["weight_map"]
        return mapping
    if (root / SINGLE).is_file():
        with safe_open(str(root / SINGLE), framework="pt") as f:
            return dict.fromkeys(f.keys(), SINGLE)
    raise FileNotFoundError(
        f"{root} holds neither {SINGLE} nor {INDEX} (pytorch_model.bin is not read: "
        "save the model with safe_serialization)"
    )


def read_tensors(path: str | Path, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """Read just ``names`` from the checkpoint in ``path`` (each file opened once)."""
    root = Path(path)
    mapping = weight_map(root)
    wanted = list(names)
    missing = [n for n in wanted if n not in mapping]
    if missing:
        raise KeyError(f"{root} lacks {len(missing)} weights the model needs, e.g. {missing[:3]}")
    by_file: dict[str, list[str]] = {}
    for name in wanted:
        by_file.setdefault(mapping[name], []).append(name)
    out: dict[str, torch.Tensor] = {}
    for file, file_names in by_file.items():
        with safe_open(str(root / file), framework="pt") as f:
            for name in file_names:
                out[name] = f.get_tensor(name)
    return out
