"""The runtime entrypoints the operator launches as Ray jobs, and their output lines.

Commands and output lines are the contract in ``docs/contracts.md``: the server
prints ``TG_GROUP_READY {json}`` (or ``TG_GROUP_FAILED {json}``), the teardown
prints ``TG_TEARDOWN {json}`` (payloads and parsers: ``tgapi.markers``, shared with the
runtime). The operator only builds command lines and parses those lines; it never imports
the runtime.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import shlex
from typing import Any

from tg_operator import names
from tgapi import TrainerGroup, markers, to_wire

READY_MARKER = markers.GROUP_READY


def spec_b64(tg: TrainerGroup) -> str:
    """base64(JSON of the whole object) as ``--spec-b64`` wants it (defaults filled in)."""
    doc = {
        "apiVersion": names.TG_API_VERSION,
        "kind": names.TG_KIND,
        "metadata": {"name": tg.name, "namespace": tg.namespace, "uid": tg.uid},
        "spec": to_wire(tg.spec),
    }
    raw = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return base64.b64encode(raw).decode()


def server_entrypoint(tg: TrainerGroup, *, python: str, generation: int) -> str:
    return " ".join(
        [
            shlex.quote(python),
            "-m",
            names.SERVER_MODULE,
            "--spec-b64",
            spec_b64(tg),
            "--generation",
            str(generation),
        ]
    )


def teardown_entrypoint(tg: TrainerGroup, *, python: str, ray_namespace: str) -> str:
    return " ".join(
        [
            shlex.quote(python),
            "-m",
            names.TEARDOWN_MODULE,
            "--group",
            shlex.quote(tg.group_name),
            "--ray-namespace",
            shlex.quote(ray_namespace),
        ]
    )


def job_metadata(tg: TrainerGroup, *, generation: int) -> dict[str, str]:
    return {
        names.JOB_META_UID: tg.uid,
        names.JOB_META_NAME: tg.name,
        names.JOB_META_NAMESPACE: tg.namespace,
        names.JOB_META_GENERATION: str(generation),
    }


def parse_group_ready(logs: str) -> markers.GroupReady | None:
    """The last ``TG_GROUP_READY`` payload in a job's logs (None if absent or broken).

    Anyone's code in the job can print the marker: only well-formed values are kept.
    """
    rec = markers.parse_last(markers.GroupReady, logs)
    if rec is None or not all(isinstance(n, str) for n in rec.worker_names):
        return None
    mesh_raw: Any = rec.mesh
    mesh = (
        {str(k): v for k, v in mesh_raw.items() if type(v) is int and v > 0}
        if isinstance(mesh_raw, dict)
        else {}
    )
    gen: Any = rec.generation
    world: Any = rec.world_size
    return dataclasses.replace(
        rec,
        group_name=str(rec.group_name or ""),
        ray_namespace=str(rec.ray_namespace or ""),
        generation=gen if type(gen) is int and gen >= 0 else 0,
        world_size=world if type(world) is int and world > 0 else len(rec.worker_names),
        mesh=mesh,
        worker_class=str(rec.worker_class or ""),
        device=str(rec.device or ""),
        backend=str(rec.backend or ""),
    )


def parse_group_failed(logs: str) -> str | None:
    """The server's one-line error, or None when it printed none."""
    failed = markers.parse_last(markers.GroupFailed, logs)
    if failed is None:
        return None
    return failed.error or "the server reported a failure without a message"


def parse_teardown(logs: str) -> markers.Teardown | None:
    """The last ``TG_TEARDOWN`` report in a job's logs (None if absent or broken)."""
    return markers.parse_last(markers.Teardown, logs)


def tail(logs: str, *, lines: int = 3) -> str:
    """The last non-empty log lines, for a status message."""
    kept = [ln.strip() for ln in logs.splitlines() if ln.strip()]
    return " | ".join(kept[-lines:])[:600]
