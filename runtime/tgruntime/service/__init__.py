"""The Tinker API server of a trainer group (docs/tinker.md).

Modules: ``app`` (aiohttp routes), ``auth`` (API keys, re-read on change), ``sessions``
(sessions, models, seq_id ordering), ``futures`` (request ids, long-poll), ``codec`` (the
SDK's own protobuf messages), ``datum`` (Datum -> TrainerClient tensors), ``paths``
(``tinker://`` paths -> the checkpoint directory), ``sampling`` (the batching queue),
``policy`` (who may do what: owners, admins, readers), ``sharing`` (checkpoints reached through
an admin's right or a read grant), ``tls`` (HTTPS), ``limits``, ``audit``.
The group is driven only through :class:`tgruntime.TrainerClient`.
"""

from __future__ import annotations

TINKER_SDK_VERSION = "0.38.0"

__all__ = ["TINKER_SDK_VERSION"]
