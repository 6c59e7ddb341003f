"""A Tinker service over a fake backend, for unit tests of the service's own logic (routes,
policy, limits, stores) with no group: the client stands in for the workers' replies, and
every backend call answers 0."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def fake_service(
    *,
    client: Any,
    wire: dict[str, Any],
    root: Path,
    keys_file: Path,
    limits: Any = None,
    tokenizer: str | None = None,
) -> Any:
    """A ``TinkerService`` for the spec ``wire`` (local), checkpoints under ``root``, keys from
    ``keys_file``; ``service.backend.calls`` lists the backend calls it made."""
    import tgapi
    from tgruntime.service.__main__ import group_info
    from tgruntime.service.app import TinkerService
    from tgruntime.service.auth import KeyStore
    from tgruntime.service.backend import Backend
    from tgruntime.service.limits import Limits

    info = group_info("tiny", tgapi.parse_spec(wire, local=True), checkpoint_dir=str(root),
                      tokenizer=tokenizer)

    class FakeBackend(Backend):
        calls: list[str] = []

        def dp(self) -> int:
            return 1

        async def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            return 0

    return TinkerService(
        FakeBackend(client=client, info=info),
        KeyStore(keys_file=str(keys_file), recheck_s=0.0),
        Limits() if limits is None else limits,
    )
