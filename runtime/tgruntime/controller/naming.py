"""Deterministic names: workers, placement groups and group-record keys.

Everything a group leaves in Ray is named from (Ray namespace, group name, generation), so
teardown and attach can find it again without any state kept by the creating process:

- workers: verl's rule ``{prefix}{ClassName}_{pg_index}:{local_rank}``;
- placement groups: ``tg:{ray_namespace}:{group}:g{generation}:{pg_index}``;
- group record and helper keys: Ray's internal KV, KV namespace ``trainergroup``.
"""

from __future__ import annotations

import re

KV_NAMESPACE = "trainergroup"

_GROUP_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,126}[A-Za-z0-9])?$")
_WORKER_RE = re.compile(r"^(?P<stem>.+)_(?P<pg>\d+):(?P<local>\d+)$")


def validate_group_name(group_name: str) -> str:
    """Return ``group_name`` or raise ``ValueError`` saying what a valid name looks like."""
    if not isinstance(group_name, str) or not _GROUP_RE.match(group_name):
        raise ValueError(
            f"invalid group name {group_name!r}: use 1-128 letters, digits, '.', '_' or '-', "
            "starting and ending with a letter or digit"
        )
    return group_name


def validate_namespace(ray_namespace: str) -> str:
    """A Ray namespace must be explicit (never the anonymous one) and have no '/'."""
    if not isinstance(ray_namespace, str) or not ray_namespace or "/" in ray_namespace:
        raise ValueError(f"invalid Ray namespace {ray_namespace!r}: a non-empty name without '/'")
    return ray_namespace


def worker_name(*, prefix: str, class_name: str, pg_index: int, local_rank: int) -> str:
    """verl's worker name, e.g. ``trainerTrainer_0:1``."""
    return f"{prefix}{class_name}_{pg_index}:{local_rank}"


def parse_worker_name(name: str) -> tuple[str, int, int]:
    """Split a worker name into (prefix+class, pg_index, local_rank)."""
    match = _WORKER_RE.match(name)
    if match is None:
        raise ValueError(f"{name!r} is not a worker name of the form '<prefix><Class>_<pg>:<rank>'")
    return match["stem"], int(match["pg"]), int(match["local"])


def placement_group_prefix(*, ray_namespace: str, group_name: str) -> str:
    """Prefix shared by every placement group of a group, all generations."""
    return f"tg:{ray_namespace}:{group_name}:"


def placement_group_name(
    *, ray_namespace: str, group_name: str, generation: int, index: int
) -> str:
    prefix = placement_group_prefix(ray_namespace=ray_namespace, group_name=group_name)
    return f"{prefix}g{generation}:{index}"


def record_key(*, ray_namespace: str, group_name: str) -> str:
    """KV key of the published group record."""
    return f"record/{ray_namespace}/{group_name}"


def record_prefix(*, ray_namespace: str | None = None) -> str:
    return "record/" if ray_namespace is None else f"record/{ray_namespace}/"


def members_key(*, ray_namespace: str, group_name: str) -> str:
    """KV key written before any worker starts: the names teardown must remove."""
    return f"members/{ray_namespace}/{group_name}"


def master_key(*, ray_namespace: str, group_name: str, generation: int) -> str:
    """KV key where rank 0 publishes MASTER_ADDR:MASTER_PORT for its generation."""
    return f"master/{ray_namespace}/{group_name}/g{generation}"


def master_prefix(*, ray_namespace: str, group_name: str) -> str:
    return f"master/{ray_namespace}/{group_name}/"


def ray_class_name(cls: type) -> str:
    """The user's class name, also for a ``ray.remote`` wrapper (``ActorClass(Foo)`` -> ``Foo``)."""
    inner = getattr(cls, "__ray_actor_class__", None)
    if isinstance(inner, type):
        return inner.__name__
    name = cls.__name__
    match = re.fullmatch(r"ActorClass\((.+)\)", name)
    return match.group(1) if match else name

