"""verl's ``verl.protocol`` names: DataProto (imported on first use: it needs torch),
DataProtoConfig and the padding helpers."""

from __future__ import annotations

import logging
import os
from typing import Any

from tgruntime.controller.futures import DataProtoFuture

__all__ = [
    "DataProto",  # noqa: F822 - provided lazily by __getattr__
    "DataProtoConfig",
    "DataProtoFuture",
    "DataProtoItem",  # noqa: F822
    "pad_dataproto_to_divisor",
    "unpad_dataproto",
]

log = logging.getLogger("tgruntime.compat.verl")


def __getattr__(name: str) -> Any:
    # DataProto needs torch: imported on first use, so drivers that never send one stay light.
    if name in ("DataProto", "DataProtoItem"):
        from tgruntime.controller import dataproto

        return getattr(dataproto, name)
    raise AttributeError(f"module 'tgruntime.compat.verl.protocol' has no attribute {name!r}")


class _DataProtoConfigMeta(type):
    _auto_padding = False

    @property
    def auto_padding(cls) -> bool:
        by_env = os.environ.get("VERL_AUTO_PADDING", "FALSE").upper() in ("TRUE", "1")
        return by_env or cls._auto_padding

    @auto_padding.setter
    def auto_padding(cls, enabled: bool) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"auto_padding must be a bool, got {enabled!r}")
        cls._auto_padding = enabled


class DataProtoConfig(metaclass=_DataProtoConfigMeta):
    """verl's switch for DP_COMPUTE_PROTO padding (``DataProtoConfig.auto_padding = True``).

    ``DataProto.is_padding_enabled()`` reads it (or the batch's own flag,
    ``meta_info[auto_padding_key]``, set by ``from_dict(auto_padding=True)``), and
    ``DataProto.chunk()`` then allows uneven parts, as in verl. DP_COMPUTE_PROTO pads uneven
    batches (and removes the padding from the result) whatever the setting.
    """

    auto_padding_key = "_verl_auto_padding"  # == tgruntime.controller.dataproto.AUTO_PADDING_KEY


def pad_dataproto_to_divisor(data: Any, size_divisor: int) -> tuple[Any, int]:
    """verl's ``pad_dataproto_to_divisor``: (padded copy, pad size); padding repeats
    leading rows."""
    from tgruntime.controller.dataproto import DataProto

    if not isinstance(data, DataProto):
        raise TypeError(f"data must be a DataProto, got {type(data).__name__}")
    if len(data) == 0:
        log.warning("padding a DataProto with no rows: unchanged")
    return data.pad_to_divisor(size_divisor)


def unpad_dataproto(data: Any, pad_size: int) -> Any:
    """verl's ``unpad_dataproto``: drop the last ``pad_size`` rows."""
    return data.unpad(pad_size)
