"""Deterministic names: workers, placement groups and group-record keys.

Everything a group leaves in Ray is named from (namespace, group name, generation), so
teardown and attach can find it again without any state kept by the creating process:

- workers: verl's rule ``{prefix}{ClassName}_{pg_index}:{local_rank}``;
- placement groups: ``tg:{namespace}:{group}:g{generation}:{pg_index}``;
- group record and helper keys: Ray's internal KV, KV namespace ``trainergroup``.
"""

from __future__ import annotations

import re
import warnings

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


def validate_namespace(namespace: str) -> str:
    """A Ray namespace must be explicit (never the anonymous one) and have no '/'."""
    if not isinstance(namespace, str) or not namespace or "/" in namespace:
        raise ValueError(f"invalid Ray namespace {namespace!r}: a non-empty name without '/'")
    return namespace


def worker_name(*, prefix: str, class_name: str, pg_index: int, local_rank: int) -> str:
    """verl's worker name, e.g. ``trainerTrainer_0:1``."""
    return f"{prefix}{class_name}_{pg_index}:{local_rank}"


def parse_worker_name(name: str) -> tuple[str, int, int]:
    """Split a worker name into (prefix+class, pg_index, local_rank)."""
    match = _WORKER_RE.match(name)
    if match is None:
        raise ValueError(f"{name!r} is not a worker name of the form '<prefix><Class>_<pg>:<rank>'")
    return match["stem"], int(match["pg"]), int(match["local"])


def placement_group_prefix(*, namespace: str, group_name: str) -> str:
    """Prefix shared by every placement group of a group, all generations."""
    return f"tg:{namespace}:{group_name}:"


def placement_group_name(*, namespace: str, group_name: str, generation: int, index: int) -> str:
    return (
        f"{placement_group_prefix(namespace=namespace, group_name=group_name)}g{generation}:{index}"
    )


def record_key(*, namespace: str, group_name: str) -> str:
    """KV key of the published group record."""
    return f"record/{namespace}/{group_name}"


def record_prefix(*, namespace: str | None = None) -> str:
    return "record/" if namespace is None else f"record/{namespace}/"


def members_key(*, namespace: str, group_name: str) -> str:
    """KV key written before any worker starts: the names teardown must remove."""
    return f"members/{namespace}/{group_name}"


def master_key(*, namespace: str, group_name: str, generation: int) -> str:
    """KV key where rank 0 publishes MASTER_ADDR:MASTER_PORT for its generation."""
    return f"master/{namespace}/{group_name}/g{generation}"


def master_prefix(*, namespace: str, group_name: str) -> str:
    return f"master/{namespace}/{group_name}/"


def ray_class_name(cls: type) -> str:
    """The user's class name, also for a ``ray.remote`` wrapper (``ActorClass(Foo)`` -> ``Foo``)."""
    inner = getattr(cls, "__ray_actor_class__", None)
    if isinstance(inner, type):
        return inner.__name__
    name = cls.__name__
    match = re.fullmatch(r"ActorClass\((.+)\)", name)
    return match.group(1) if match else name


def ray_namespace_arg(
    *, ray_namespace: str | None, namespace: str | None, where: str, stacklevel: int = 3
) -> str | None:
    """``ray_namespace``, or the deprecated ``namespace=`` keyword it replaced (one release).

    "namespace" alone is Kubernetes' namespace elsewhere in TrainerGroup; Ray's is
    ``ray_namespace`` in every public signature.
    """
    if namespace is None:
        return ray_namespace
    if ray_namespace is not None and ray_namespace != namespace:
        raise TypeError(
            f"{where}: ray_namespace={ray_namespace!r} and the deprecated namespace="
            f"{namespace!r} disagree; pass ray_namespace only"
        )
    warnings.warn(
        f"{where}(namespace=...) is deprecated and will be removed in the next release: pass "
        "ray_namespace=... (Ray's namespace; 'namespace' is Kubernetes' in TrainerGroup)",
        DeprecationWarning,
        stacklevel=stacklevel,  # the public function's caller
    )
    return namespace


def required_ray_namespace(
    *, ray_namespace: str | None, namespace: str | None, where: str
) -> str:
    """Like ``ray_namespace_arg``, for a signature where the Ray namespace is required."""
    ns = ray_namespace_arg(
        ray_namespace=ray_namespace, namespace=namespace, where=where, stacklevel=4
    )
    if ns is None:
        raise TypeError(f"{where}() missing required keyword argument: 'ray_namespace'")
    return ns
