"""The workers' ``init_model`` answers made into the ``TG_GROUP_READY`` payload (pure)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tgapi import markers
from tgruntime.controller import WorkerGroup


def device_summary(init_results: Any) -> dict[str, Any]:
    """What the workers run on, from their ``init_model`` results (one dict per rank).

    The built-in trainer's ranks report ``device`` ("cuda:0", "cpu"), ``backend`` and
    ``dtype``; the summary is {"device": "cuda"|"cpu", "backend": "nccl"|"gloo", "dtype":
    ...}, with "mixed" where ranks disagree. Empty for a worker class that reports none.
    """
    if not isinstance(init_results, list | tuple):
        return {}
    ranks = [r for r in init_results if isinstance(r, dict) and "device" in r]
    if not ranks:
        return {}
    out: dict[str, Any] = {}
    for key in ("device", "backend", "dtype"):
        values = sorted({str(r.get(key, "")).split(":", 1)[0] for r in ranks} - {""})
        if values:
            out[key] = values[0] if len(values) == 1 else "mixed"
    return out


def resume_summary(init_results: Any) -> dict[str, Any]:
    """Where the workers resumed from, from their ``init_model`` results: ``resumedFrom``
    (the checkpoint every rank loaded; "" when none did, "mixed" when ranks disagree) and
    ``resumedStep`` (the optimizer step the workers start from)."""
    if not isinstance(init_results, list | tuple):
        return {}
    ranks = [r for r in init_results if isinstance(r, dict) and "resumed_from" in r]
    if not ranks:
        return {}
    paths = {str(r.get("resumed_from") or "") for r in ranks}
    steps = {int(r.get("step") or 0) for r in ranks}
    return {
        "resumedFrom": paths.pop() if len(paths) == 1 else "mixed",
        "resumedStep": steps.pop() if len(steps) == 1 else -1,
    }


def ready_payload(
    wg: WorkerGroup,
    *,
    mesh: Mapping[str, int] | None,
    worker_class: str,
    use_gpu: bool | None = None,
    device: dict[str, Any] | None = None,
    resumed: dict[str, Any] | None = None,
) -> markers.GroupReady:
    """The body of the ``TG_GROUP_READY`` line (tgapi.markers, docs/contracts.md).

    ``use_gpu``: workers.useGpu as resolved ("auto" decided against the cluster); ``device``
    / ``backend`` / ``dtype``: what the workers actually run on (``device_summary``), e.g.
    a GPU request that found no CUDA in the workers falls back to "cpu" / "gloo".
    """
    dev = device or {}
    rs = resumed or {}
    return markers.GroupReady(
        group_name=wg.group_name,
        ray_namespace=wg.ray_namespace,
        generation=wg.generation,
        worker_names=tuple(wg.worker_names),
        world_size=wg.world_size,
        mesh=dict(mesh or {}),
        worker_class=worker_class,
        use_gpu=use_gpu,
        device=str(dev.get("device", "")),
        backend=str(dev.get("backend", "")),
        dtype=str(dev.get("dtype", "")),
        resumed_from=str(rs["resumedFrom"]) if rs.get("resumedFrom") else None,
        resumed_step=int(rs["resumedStep"]) if rs.get("resumedStep") is not None else None,
    )
