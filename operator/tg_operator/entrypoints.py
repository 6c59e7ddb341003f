"""The runtime entrypoints the operator launches as Ray jobs, and their output lines.

Commands and output lines are the contract in ``docs/contracts.md``: the server
prints ``TG_GROUP_READY {json}`` (or ``TG_GROUP_FAILED {json}``), the teardown
prints ``TG_TEARDOWN {json}``. The operator only builds command lines and parses
those lines; it never imports the runtime.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import shlex
from collections.abc import Mapping
from typing import Any

from tg_operator import names
from tgapi import TrainerGroup, to_wire

READY_MARKER = "TG_GROUP_READY"
FAILED_MARKER = "TG_GROUP_FAILED"
TEARDOWN_MARKER = "TG_TEARDOWN"


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupRecord:
    """What the server entrypoint reports about the group it created."""

    group_name: str
    ray_namespace: str
    generation: int
    worker_names: tuple[str, ...]
    world_size: int
    mesh: Mapping[str, int]
    worker_class: str = ""
    device: str = ""
    """What the workers run on ("cuda"/"cpu"; "" when the worker class reports nothing)."""
    backend: str = ""


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


def _last_marked(logs: str, marker: str) -> dict[str, Any] | None:
    """The JSON after the last line that starts with ``marker`` (None if absent/broken)."""
    prefix = marker + " "
    for line in reversed(logs.splitlines()):
        line = line.strip()
        if not line.startswith(prefix):
            continue
        try:
            data = json.loads(line[len(prefix) :])
        except ValueError:
            return None
        return data if isinstance(data, dict) else None
    return None


def parse_group_ready(logs: str) -> GroupRecord | None:
    data = _last_marked(logs, READY_MARKER)
    if data is None:
        return None
    names_ = data.get("workerNames")
    if not isinstance(names_, list) or not all(isinstance(n, str) for n in names_):
        return None
    mesh_raw = data.get("mesh")
    # Anyone's code in the job can print the marker: keep well-formed values only.
    mesh = (
        {str(k): v for k, v in mesh_raw.items() if type(v) is int and v > 0}
        if isinstance(mesh_raw, dict)
        else {}
    )
    generation, world = data.get("generation"), data.get("worldSize")
    return GroupRecord(
        group_name=str(data.get("groupName") or ""),
        ray_namespace=str(data.get("rayNamespace") or ""),
        generation=generation if type(generation) is int and generation >= 0 else 0,
        worker_names=tuple(names_),
        world_size=world if type(world) is int and world > 0 else len(names_),
        mesh=mesh,
        worker_class=str(data.get("workerClass") or ""),
        device=str(data.get("device") or ""),
        backend=str(data.get("backend") or ""),
    )


def parse_group_failed(logs: str) -> str | None:
    """The server's one-line error, or None when it printed none."""
    data = _last_marked(logs, FAILED_MARKER)
    if data is None:
        return None
    return str(data.get("error") or "the server reported a failure without a message")


def parse_teardown(logs: str) -> dict[str, Any] | None:
    return _last_marked(logs, TEARDOWN_MARKER)


def tail(logs: str, *, lines: int = 3) -> str:
    """The last non-empty log lines, for a status message."""
    kept = [ln.strip() for ln in logs.splitlines() if ln.strip()]
    return " | ".join(kept[-lines:])[:600]
