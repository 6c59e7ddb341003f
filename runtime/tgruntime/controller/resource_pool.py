"""ResourcePool: what a group asks of the cluster, and the placement groups that hold it.

One placement group per entry of ``process_on_nodes`` (verl's name: processes per node),
one bundle per worker process. CPU amounts may be fractional, so several workers fit on
a 2-core machine. Placement groups are named from (Ray namespace, group, generation, index)
and may be detached, so they outlive their creator and can be found and removed later.
Waiting for placement is bounded; a timeout removes what was created and says what was
asked and what the cluster has.

Placement groups stay in spec order: placement group ``i`` holds ``process_on_nodes[i]``
bundles and carries the ranks of entry ``i`` (and the ``_i:`` worker names). They used to
be re-sorted by node IP after placement while the per-node counts stayed in spec order, so
on a cluster whose nodes' IPs did not follow the spec, ``[2, 1]`` paired a one-bundle group
with two ranks (and names and ranks pointed at the wrong node). ``node_resources`` pins an
entry to a node: extra resources (e.g. a custom resource each node declares) added to
every bundle of that entry's placement group.
"""

from __future__ import annotations

import contextlib
import enum
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)

from tgruntime.controller import naming
from tgruntime.controller.errors import PlacementInfeasibleError, PlacementTimeoutError


class PlacementStrategy(enum.StrEnum):
    """Ray's placement strategies for the bundles of one placement group."""

    PACK = "PACK"
    SPREAD = "SPREAD"
    STRICT_PACK = "STRICT_PACK"
    STRICT_SPREAD = "STRICT_SPREAD"


@dataclass(frozen=True, kw_only=True)
class ResourcePool:
    """Processes per node and the resources of each process."""

    process_on_nodes: Sequence[int]
    use_gpu: bool = False
    gpus_per_process: float = 1.0
    cpus_per_process: float = 1.0
    strategy: PlacementStrategy | str = PlacementStrategy.STRICT_PACK
    # Placement-group lifetime: True = detached (outlives its creator), None = as the group.
    detached: bool | None = None
    resources_per_process: Mapping[str, float] = field(default_factory=dict)
    # What each actor requests inside its bundle (default: the whole bundle). Smaller
    # values let several groups share the same placement groups (verl's colocation).
    actor_num_cpus: float | None = None
    actor_num_gpus: float | None = None
    # Per entry of process_on_nodes: extra resources in each bundle of that placement group
    # (e.g. {"node_a": 0.01} where only node a declares "node_a"), to pin it to a node.
    node_resources: Sequence[Mapping[str, float]] = ()

    def __post_init__(self) -> None:
        counts = tuple(int(c) for c in self.process_on_nodes)
        if not counts or any(c < 1 for c in counts):
            raise ValueError(
                "process_on_nodes must be a non-empty list of positive counts, got "
                f"{list(self.process_on_nodes)}"
            )
        object.__setattr__(self, "process_on_nodes", counts)
        object.__setattr__(self, "strategy", PlacementStrategy(self.strategy))
        extra = tuple({str(k): float(v) for k, v in r.items()} for r in self.node_resources)
        if extra and len(extra) != len(counts):
            raise ValueError(
                f"node_resources has {len(extra)} entries for {len(counts)} entries of "
                "process_on_nodes"
            )
        object.__setattr__(self, "node_resources", extra)
        if self.cpus_per_process < 0 or self.gpus_per_process < 0:
            raise ValueError("resource amounts must not be negative")
        if not self.bundle():
            raise ValueError("each process must ask for some resource (CPU, GPU or a custom one)")

    @property
    def world_size(self) -> int:
        return sum(self.process_on_nodes)

    def bundle(self) -> dict[str, float]:
        """The resources of one process's bundle."""
        out: dict[str, float] = {}
        if self.cpus_per_process > 0:
            out["CPU"] = float(self.cpus_per_process)
        if self.use_gpu and self.gpus_per_process > 0:
            out["GPU"] = float(self.gpus_per_process)
        out.update({k: float(v) for k, v in self.resources_per_process.items()})
        return out

    def bundles(self) -> list[list[dict[str, float]]]:
        """Per entry of process_on_nodes (in spec order), its placement group's bundles."""
        out = []
        for i, count in enumerate(self.process_on_nodes):
            bundle = self.bundle()
            if self.node_resources:
                for k, v in self.node_resources[i].items():
                    bundle[k] = bundle.get(k, 0.0) + v
            out.append([dict(bundle) for _ in range(count)])
        return out

    def actor_options(self) -> dict[str, Any]:
        """num_cpus / num_gpus / resources for each worker actor."""
        b = self.bundle()
        opts: dict[str, Any] = {
            "num_cpus": b.get("CPU", 0.0) if self.actor_num_cpus is None else self.actor_num_cpus,
            "num_gpus": b.get("GPU", 0.0) if self.actor_num_gpus is None else self.actor_num_gpus,
        }
        if self.resources_per_process:
            opts["resources"] = dict(self.resources_per_process)
        return opts


def cluster_nodes_resources() -> list[dict[str, float]]:
    """The total resources of each alive node of the connected cluster."""
    return [
        {k: float(v) for k, v in (n.get("Resources") or {}).items()}
        for n in ray.nodes()  # type: ignore[no-untyped-call]
        if n.get("Alive")
    ]


def infeasibility(
    bundles: Sequence[Sequence[Mapping[str, float]]],
    strategy: PlacementStrategy | str,
    nodes: Sequence[Mapping[str, float]],
) -> str | None:
    """Why the nodes' *totals* can never hold these bundles (None: they might).

    Only necessary conditions are checked, so a group this accepts may still wait for
    resources other groups hold, but one it rejects could never be placed on this
    cluster as it stands: every resource asked in all fits the cluster's sum; each bundle
    fits one node; a STRICT_PACK group fits one node; a STRICT_SPREAD group has a
    distinct node for each bundle.
    """
    strategy = PlacementStrategy(strategy)

    def fits(need: Mapping[str, float], node: Mapping[str, float]) -> bool:
        return all(node.get(k, 0.0) + 1e-9 >= v for k, v in need.items() if v > 0)

    total: dict[str, float] = {}
    for node in nodes:
        for k, v in node.items():
            total[k] = total.get(k, 0.0) + v
    asked: dict[str, float] = {}
    for group in bundles:
        for bundle in group:
            for k, v in bundle.items():
                asked[k] = asked.get(k, 0.0) + float(v)
    short = [k for k in sorted(asked) if asked[k] > total.get(k, 0.0) + 1e-9]
    if short:
        return "not enough " + ", ".join(
            f"{k} ({asked[k]:g} asked, {total.get(k, 0.0):g} in the cluster)" for k in short
        )
    for i, group in enumerate(bundles):
        for bundle in group:
            if not any(fits(bundle, n) for n in nodes):
                return f"no node can hold one bundle of placement group {i} ({dict(bundle)})"
        if strategy is PlacementStrategy.STRICT_PACK:
            whole: dict[str, float] = {}
            for bundle in group:
                for k, v in bundle.items():
                    whole[k] = whole.get(k, 0.0) + float(v)
            if not any(fits(whole, n) for n in nodes):
                return (
                    f"STRICT_PACK needs {whole} of placement group {i} on one node; no node has it"
                )
        if strategy is PlacementStrategy.STRICT_SPREAD and group:
            hosts = sum(1 for n in nodes if fits(group[0], n))
            if hosts < len(group):
                return (
                    f"STRICT_SPREAD needs {len(group)} distinct nodes for placement group {i}; "
                    f"{hosts} can hold a bundle"
                )
    return None


def check_feasible(
    pool: ResourcePool, *, group_name: str, fix: str | None = None
) -> None:
    """Raise PlacementInfeasibleError at once when the cluster can never hold ``pool``."""
    bundles = pool.bundles()
    nodes = cluster_nodes_resources()
    reason = infeasibility(bundles, pool.strategy, nodes)
    if reason is None:
        return
    if fix is None:
        gpu_short = pool.use_gpu and not any(n.get("GPU", 0.0) > 0 for n in nodes)
        fix = (
            "ask for no GPUs (use_gpu=False) or add GPU nodes (ray start --num-gpus=N)"
            if gpu_short
            else "ask for less per process or fewer processes, or add nodes"
        )
    total: dict[str, float] = {}
    for node in nodes:
        for k, v in node.items():
            total[k] = total.get(k, 0.0) + v
    raise PlacementInfeasibleError(
        group_name=group_name,
        bundles=bundles,
        strategy=str(PlacementStrategy(pool.strategy).value),
        total=total,
        reason=reason,
        fix=fix,
    )


def create_placement_groups(
    pool: ResourcePool,
    *,
    group_name: str,
    ray_namespace: str,
    generation: int,
    detached: bool,
    timeout_s: float,
) -> list[PlacementGroup]:
    """Create and wait for the pool's placement groups, in spec order (never re-sorted).

    A pool the cluster's totals can never hold fails at once (PlacementInfeasibleError,
    before anything is created). On timeout every placement group created here is removed
    and PlacementTimeoutError says what was asked and what the cluster has.
    """
    check_feasible(pool, group_name=group_name)
    bundles = pool.bundles()
    pgs = [
        placement_group(
            bundles=group,
            strategy=str(PlacementStrategy(pool.strategy).value),
            name=naming.placement_group_name(
                ray_namespace=ray_namespace, group_name=group_name, generation=generation, index=i
            ),
            lifetime="detached" if (detached if pool.detached is None else pool.detached) else None,
        )
        for i, group in enumerate(bundles)
    ]
    deadline = time.monotonic() + timeout_s
    try:
        for pg in pgs:
            remaining = max(0.0, deadline - time.monotonic())
            if not pg.wait(timeout_seconds=remaining):
                raise PlacementTimeoutError(
                    group_name=group_name,
                    timeout_s=timeout_s,
                    bundles=bundles,
                    strategy=str(PlacementStrategy(pool.strategy).value),
                    available=ray.available_resources(),  # type: ignore[no-untyped-call]
                    total=ray.cluster_resources(),  # type: ignore[no-untyped-call]
                )
    except BaseException:
        for pg in pgs:
            _remove_quietly(pg)
        raise
    # Spec order: entry i's ranks and names go to placement group i, which has exactly
    # process_on_nodes[i] bundles. (Sorting by node IP here, as before, mismatched them.)
    return pgs


@dataclass(frozen=True)
class PlacementGroupInfo:
    name: str
    id_hex: str
    state: str


def find_placement_groups(*, ray_namespace: str, group_name: str) -> list[PlacementGroupInfo]:
    """Every not-yet-removed placement group of a group (all generations), by name."""
    prefix = naming.placement_group_prefix(ray_namespace=ray_namespace, group_name=group_name)
    out = []
    for pg_id, info in placement_group_table().items():
        name = info.get("name") or ""
        state = str(info.get("state", ""))
        if name.startswith(prefix) and state != "REMOVED":
            out.append(PlacementGroupInfo(name=name, id_hex=str(pg_id), state=state))
    return sorted(out, key=lambda p: p.name)


def remove_by_id(id_hex: str) -> None:
    remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(id_hex))))


def _remove_quietly(pg: PlacementGroup) -> None:
    with contextlib.suppress(Exception):
        remove_placement_group(pg)
