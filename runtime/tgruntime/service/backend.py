"""The group behind the server: a ``TrainerClient`` and what the spec says about it.

Calls are submitted on the event loop (so they reach the workers in the order the
routes admit them) and awaited in a thread with a timeout."""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tgapi.model import HF_MODEL_ID
from tgruntime.driver.trainer_client import TrainerClient, TrainerFuture

T = TypeVar("T")


@dataclass(frozen=True)
class GroupInfo:
    """What the server tells clients about the group (from its TrainerGroup spec)."""

    base_model: str
    vocab_size: int
    max_sequence_length: int
    checkpoint_dir: str
    tokenizer_id: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    aliases: tuple[str, ...] = field(default=())
    lora_rank: int | None = None
    """``spec.lora.rank`` of a LoRA group (None: full weights). A LoRA group serves many
    runs: each ``create_model`` is an adapter of its own on the shared base (service.runs)."""
    lora_alpha: float | None = None
    """``spec.lora.alpha``: every run's scaling numerator (the SDK's LoraConfig has none)."""
    max_runs: int = 8
    """``spec.api.maxRuns``: runs a LoRA group holds at once."""
    idle_run_seconds: float = 600.0
    """``spec.api.idleRunSeconds``: a LoRA run idle this long is parked (0: never)."""
    keep_checkpoints: int = 0
    """``spec.training.keepCheckpoints``: named checkpoints kept per run and kind (0: all;
    service.retention)."""

    @property
    def tokenizer_name(self) -> str | None:
        """What ``get_info`` names as ``tokenizer_id`` (the SDK's ``get_tokenizer`` loads it):
        the served ``org/model`` id (``spec.model.name``; over ``HF_ENDPOINT=<base>/hf`` when
        the client has no hub, service.routes.hub), else the tokenizer directory."""
        if re.fullmatch(HF_MODEL_ID, self.base_model):
            return self.base_model
        return self.tokenizer_id

    def accepts(self, name: str | None) -> bool:
        return name is None or name == self.base_model or name in self.aliases


class Backend:
    def __init__(self, client: TrainerClient, info: GroupInfo, *, call_timeout_s: float = 600.0):
        self.client = client
        self.info = info
        self.call_timeout_s = call_timeout_s
        self._dp: int | None = None

    def dp(self) -> int:
        if self._dp is None:
            self._dp = self.client.dp_size()
        return self._dp

    async def wait(self, future: TrainerFuture[T]) -> T:
        return await asyncio.to_thread(future.result, self.call_timeout_s)

    async def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        future = getattr(self.client, name)(*args, **kwargs)
        return await self.wait(future)

    def staleness(self) -> str | None:
        """Why the attached group is not the group's current one (None: it is).

        The operator re-creates a group under a new generation (a worker or the head died, the
        RayCluster was replaced); the server's handles then point at dead actors. ``healthz``
        reports it, so the server's liveness probe restarts the server, which re-attaches by
        name (its pod re-joins the new Ray cluster first).
        """
        from tgruntime.controller import registry

        group = self.client.group
        try:
            record = registry.load_record(
                group_name=group.group_name, ray_namespace=group.ray_namespace
            )
        except Exception as exc:  # the GCS is gone (head restarted) or unreachable
            return f"cannot read the group's record: {type(exc).__name__}: {exc}"
        if record is None:
            return f"group {group.group_name!r} no longer exists in Ray"
        if record.generation != group.generation:
            return (
                f"group {group.group_name!r} was re-created (generation {record.generation}, "
                f"attached to {group.generation}): restart the server to re-attach"
            )
        return None
