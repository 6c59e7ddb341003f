"""The group record: what a client needs to attach to a group by name alone.

A detached group publishes one small JSON record in Ray's internal key-value store (held
by the GCS, so it lives as long as the cluster and costs no process): worker names in
rank order, world size, mesh, worker class, generation, creation time, and the table of
registered methods (so attaching needs no import of the worker's module), and the last
training step (``training``, written by the trainer's rank 0). A lookup is one GCS round
trip.

Two more keys live beside it: ``members`` (claimed atomically before any worker starts;
lists what teardown must remove even if creation never finished) and ``master`` (rank
0's MASTER_ADDR:MASTER_PORT per generation).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from ray.experimental import internal_kv

from tgapi.progress import TrainingProgress
from tgruntime.controller import naming

_NS = naming.KV_NAMESPACE


@dataclass(frozen=True, kw_only=True)
class GroupRecord:
    """A published group: everything needed to attach to it and to describe it.

    The one record of a group (the operator reads what it needs from the server's
    ``TG_GROUP_READY`` line, ``tgapi.markers.GroupReady``, built from this).
    """

    group_name: str
    ray_namespace: str
    worker_names: tuple[str, ...]
    world_size: int
    mesh: Mapping[str, Any]
    worker_class: str
    generation: int
    created_at: float
    methods: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    placement_groups: tuple[str, ...] = ()
    # Whether the bundles hold a GPU per worker (``workers.useGpu`` after "auto" is resolved).
    use_gpu: bool | None = None
    # What the workers actually run on, reported by ``init_model`` (empty until then):
    # {"device": "cuda"|"cpu"|"mixed", "backend": "nccl"|"gloo", "dtype": "bfloat16", ...}.
    device: Mapping[str, Any] = field(default_factory=dict)
    # The last optimizer step, written by the trainer's rank 0 after each one (None before
    # the first); on the wire the camelCase object of ``tgapi.progress.TrainingProgress``.
    training: TrainingProgress | None = None

    def to_json(self) -> str:
        data = asdict(self)
        data["training"] = None if self.training is None else self.training.to_wire()
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> GroupRecord:
        data = json.loads(text)
        known = {f.name for f in fields(cls)}
        if "namespace" in data and "ray_namespace" not in data:  # written before the rename
            data["ray_namespace"] = data.pop("namespace")
        data = {k: v for k, v in data.items() if k in known}  # a newer writer's extra keys
        data["worker_names"] = tuple(data["worker_names"])
        data["placement_groups"] = tuple(data.get("placement_groups", ()))
        training = data.get("training")  # absent in records written before it existed
        data["training"] = TrainingProgress.from_wire(training) if training else None
        return cls(**data)


@dataclass(frozen=True)
class Members:
    """Names claimed by a group before its workers start (for teardown of partial groups)."""

    worker_names: tuple[str, ...]
    generation: int

    def to_json(self) -> str:
        return json.dumps({"worker_names": list(self.worker_names), "generation": self.generation})

    @classmethod
    def from_json(cls, text: str | bytes) -> Members:
        data = json.loads(text)
        return cls(worker_names=tuple(data["worker_names"]), generation=int(data["generation"]))


def publish_record(record: GroupRecord) -> None:
    internal_kv._internal_kv_put(
        naming.record_key(ray_namespace=record.ray_namespace, group_name=record.group_name),
        record.to_json(),
        overwrite=True,
        namespace=_NS,
    )


def update_record(*, group_name: str, ray_namespace: str, **changes: Any) -> GroupRecord | None:
    """Re-publish the record with ``changes`` (e.g. ``device=...``); None when there is none."""
    record = load_record(group_name=group_name, ray_namespace=ray_namespace)
    if record is None:
        return None
    updated = replace(record, **changes)
    publish_record(updated)
    return updated


def load_record(*, group_name: str, ray_namespace: str) -> GroupRecord | None:
    """The published record of a group."""
    raw = internal_kv._internal_kv_get(
        naming.record_key(ray_namespace=ray_namespace, group_name=group_name), namespace=_NS
    )
    return None if raw is None else GroupRecord.from_json(raw)


def list_groups(*, ray_namespace: str | None = None) -> list[tuple[str, str]]:
    """(Ray namespace, group name) of every published record (optionally in one Ray
    namespace)."""
    keys = internal_kv._internal_kv_list(
        naming.record_prefix(ray_namespace=ray_namespace), namespace=_NS
    )
    out = []
    for key in keys:
        text = key.decode() if isinstance(key, bytes) else str(key)
        _, ns, name = text.split("/", 2)
        out.append((ns, name))
    return sorted(out)


def claim_members(*, group_name: str, ray_namespace: str, members: Members) -> bool:
    """Write the members key unless it exists; True when this caller claimed it."""
    existed = internal_kv._internal_kv_put(
        naming.members_key(ray_namespace=ray_namespace, group_name=group_name),
        members.to_json(),
        overwrite=False,
        namespace=_NS,
    )
    return not existed


def load_members(*, group_name: str, ray_namespace: str) -> Members | None:
    raw = internal_kv._internal_kv_get(
        naming.members_key(ray_namespace=ray_namespace, group_name=group_name), namespace=_NS
    )
    return None if raw is None else Members.from_json(raw)


def delete_group_keys(*, group_name: str, ray_namespace: str) -> list[str]:
    """Delete record, members and every generation's master key; the keys that existed."""
    keys = [
        naming.record_key(ray_namespace=ray_namespace, group_name=group_name),
        naming.members_key(ray_namespace=ray_namespace, group_name=group_name),
    ]
    for raw in internal_kv._internal_kv_list(
        naming.master_prefix(ray_namespace=ray_namespace, group_name=group_name), namespace=_NS
    ):
        keys.append(raw.decode() if isinstance(raw, bytes) else str(raw))
    removed: list[str] = []
    for key in keys:
        if internal_kv._internal_kv_del(key, namespace=_NS):
            removed.append(key)
    return removed


def publish_master(
    *, group_name: str, ray_namespace: str, generation: int, addr: str, port: int
) -> None:
    internal_kv._internal_kv_put(
        naming.master_key(
            ray_namespace=ray_namespace, group_name=group_name, generation=generation
        ),
        json.dumps({"addr": addr, "port": port}),
        overwrite=True,
        namespace=_NS,
    )


def load_master(*, group_name: str, ray_namespace: str, generation: int) -> tuple[str, int] | None:
    raw = internal_kv._internal_kv_get(
        naming.master_key(
            ray_namespace=ray_namespace, group_name=group_name, generation=generation
        ),
        namespace=_NS,
    )
    if raw is None:
        return None
    data = json.loads(raw)
    return str(data["addr"]), int(data["port"])


def namespaces_with_group(group_name: str) -> list[str]:
    """Namespaces where a record of ``group_name`` exists (for NamespaceMismatchError)."""
    return sorted({ns for ns, name in list_groups() if name == group_name})


def groups_in(ray_namespace: str) -> list[str]:
    return [name for ns, name in list_groups(ray_namespace=ray_namespace) if ns == ray_namespace]


def with_names(names: Sequence[str], ray_namespace: str) -> GroupRecord | None:
    """The record in ``ray_namespace`` whose workers are exactly ``names`` (any order), if any."""
    wanted = set(names)
    for _, name in list_groups(ray_namespace=ray_namespace):
        record = load_record(group_name=name, ray_namespace=ray_namespace)
        if record is not None and set(record.worker_names) == wanted:
            return record
    return None
