"""The embedded default: a local Ray head that tgctl starts on demand and remembers.

The head's addresses are kept in ``~/.cache/trainergroup/local-ray.json`` so that later
``tgctl`` commands reach the same head and ``tgctl down --stop-ray`` stops only a head
that tgctl itself started.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

from tgruntime import ray_connect

log = logging.getLogger("tgruntime.local_ray")


def state_file() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "trainergroup" / "local-ray.json"


@dataclasses.dataclass(frozen=True, kw_only=True)
class LocalRay:
    gcs_address: str
    dashboard_url: str
    started_by_tgctl: bool


def load() -> LocalRay | None:
    try:
        data = json.loads(state_file().read_text())
        return LocalRay(**data)
    except (OSError, ValueError, TypeError):
        return None


def save(head: LocalRay) -> None:
    path = state_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dataclasses.asdict(head)))


def forget() -> None:
    state_file().unlink(missing_ok=True)


def ensure(*, address: str | None, num_cpus: float | None, num_gpus: int | None) -> LocalRay:
    """Return a reachable Ray: the given address, the remembered head, or a new local head."""
    if address:
        return LocalRay(gcs_address=address, dashboard_url="", started_by_tgctl=False)
    known = load()
    if known is not None and ray_connect.is_reachable(known.gcs_address):
        return known
    if known is not None:
        log.warning(
            "the remembered local Ray head at %s is gone; starting a new one", known.gcs_address
        )
        forget()
    # Generous: on a busy 2-core laptop the head (dashboard included) can take minutes.
    head = ray_connect.start_local_head(num_cpus=num_cpus, num_gpus=num_gpus, timeout_s=300)
    local = LocalRay(
        gcs_address=head.gcs_address, dashboard_url=head.dashboard_url, started_by_tgctl=True
    )
    save(local)
    log.info(
        "started a local Ray head at %s (dashboard %s)", local.gcs_address, local.dashboard_url
    )
    return local


def stop() -> bool:
    """Stop the head tgctl started; False when there was none."""
    known = load()
    if known is None or not known.started_by_tgctl:
        return False
    ray_connect.stop_local_head(gcs_address=known.gcs_address)
    forget()
    return True
