"""Teardown of a group: kill its workers, remove its placement groups and its KV keys.

Works from names alone, so it needs nothing from the process that created the group and
still finds everything when the record (or some actors) are already gone:

- worker names from the record and from the ``members`` key claimed before creation;
- placement groups by their deterministic name prefix (all generations);
- any live actor of the Ray namespace placed in one of those placement groups (the GCS actor
  table: no dashboard needed).

The report lists what was checked and what could not be (``checked`` / ``not_checked``).

Idempotent: a second call finds nothing and reports nothing removed.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import ray
from ray.util.placement_group import placement_group_table

from tgruntime.controller import registry
from tgruntime.controller.resource_pool import find_placement_groups, remove_by_id


@dataclass(frozen=True)
class TeardownReport:
    """What teardown found and removed."""

    group_name: str
    ray_namespace: str
    actors_killed: tuple[str, ...]
    placement_groups_removed: tuple[str, ...]
    keys_removed: tuple[str, ...]
    complete: bool  # every actor found was killed and is gone, every placement group removed
    errors: tuple[str, ...] = ()
    checked: tuple[str, ...] = ()  # what was looked at, in words
    not_checked: tuple[str, ...] = ()  # what could not be looked at (and why)

    @property
    def removed_anything(self) -> bool:
        return bool(self.actors_killed or self.placement_groups_removed or self.keys_removed)


def teardown_group(
    *,
    group_name: str,
    ray_namespace: str,
    timeout_s: float = 30,
    extra_worker_names: Iterable[str] = (),
) -> TeardownReport:
    """Remove a group's actors, placement groups and record; safe to call repeatedly."""
    errors: list[str] = []
    names: set[str] = set(extra_worker_names)
    record = registry.load_record(group_name=group_name, ray_namespace=ray_namespace)
    if record is not None:
        names.update(record.worker_names)
    members = registry.load_members(group_name=group_name, ray_namespace=ray_namespace)
    if members is not None:
        names.update(members.worker_names)
    checked = ["group record and members key (GCS KV)"]
    not_checked: list[str] = []
    pgs = find_placement_groups(ray_namespace=ray_namespace, group_name=group_name)
    checked.append(f"placement groups named tg:{ray_namespace}:{group_name}:* (GCS)")
    pg_ids = {p.id_hex for p in pgs}
    if pg_ids:
        found = _actors_in_placement_groups(
            ray_namespace, pg_ids, timeout_s=min(10.0, timeout_s), errors=errors
        )
        if found is None:
            not_checked.append(
                "other actors in the group's placement groups (GCS actor table unreadable)"
            )
        else:
            checked.append("actors in the group's placement groups (GCS actor table)")
            names.update(found)

    killed: list[str] = []
    for name in sorted(names):
        try:
            handle = ray.get_actor(name, namespace=ray_namespace)
        except ValueError:
            continue
        try:
            ray.kill(handle, no_restart=True)
            killed.append(name)
        except Exception as exc:
            errors.append(f"kill {name}: {exc}")

    removed_pgs: list[str] = []
    for pg in pgs:
        try:
            remove_by_id(pg.id_hex)
            removed_pgs.append(pg.name)
        except Exception as exc:
            errors.append(f"remove placement group {pg.name}: {exc}")

    keys = registry.delete_group_keys(group_name=group_name, ray_namespace=ray_namespace)
    # A worker that could not be killed or a placement group that could not be removed may
    # still hold its resources: never complete, whatever the wait below finds.
    failed = [e for e in errors if e.startswith(("kill ", "remove placement group "))]
    complete = _wait_gone(ray_namespace, killed, {p.id_hex for p in pgs}, timeout_s=timeout_s)
    if not complete:
        errors.append(f"not everything was gone after {timeout_s:g}s")
    else:
        # Gone, and still gone a moment later: a creator racing this teardown (a group
        # re-created too early) would otherwise leave workers or placement groups behind
        # a report that says complete.
        time.sleep(_SETTLE_S)
        left = _still_there(group_name=group_name, ray_namespace=ray_namespace, names=killed)
        if left:
            complete = False
            errors.append(
                f"still there after teardown (created again meanwhile?): {', '.join(left)}"
            )
    complete = complete and not failed
    checked.append(
        f"every killed worker and removed placement group gone (waited up to {timeout_s:g}s)"
    )
    return TeardownReport(
        group_name=group_name,
        ray_namespace=ray_namespace,
        actors_killed=tuple(killed),
        placement_groups_removed=tuple(removed_pgs),
        keys_removed=tuple(keys),
        complete=complete,
        errors=tuple(errors),
        checked=tuple(checked),
        not_checked=tuple(not_checked),
    )


_SETTLE_S = 0.2


def _still_there(*, group_name: str, ray_namespace: str, names: Iterable[str]) -> list[str]:
    """What of the group exists now: bound worker names, placement groups, KV keys."""
    left = []
    for name in sorted(names):
        try:
            ray.get_actor(name, namespace=ray_namespace)
            left.append(f"actor {name}")
        except ValueError:
            pass
    left += [
        f"placement group {p.name}"
        for p in find_placement_groups(ray_namespace=ray_namespace, group_name=group_name)
    ]
    if registry.load_members(group_name=group_name, ray_namespace=ray_namespace) is not None:
        left.append("members key")
    if registry.load_record(group_name=group_name, ray_namespace=ray_namespace) is not None:
        left.append("record")
    return left


def _actors_in_placement_groups(
    ray_namespace: str, pg_ids: set[str], *, timeout_s: float, errors: list[str]
) -> set[str] | None:
    """Live named actors of the Ray namespace in those placement groups; None if unreadable."""
    from tgruntime.controller.gcs_view import actor_infos

    try:
        gcs = ray._private.worker.global_worker.gcs_client  # type: ignore[attr-defined]
        actors = actor_infos(gcs, ray_namespace=ray_namespace, timeout_s=timeout_s)
    except Exception as exc:
        errors.append(f"GCS actor table unreadable, relying on names only: {exc}")
        return None
    return {
        a.name for a in actors if a.name and a.state != "DEAD" and a.placement_group_id in pg_ids
    }


def _wait_gone(ray_namespace: str, names: list[str], pg_ids: set[str], *, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    pending_names = list(names)
    pending_pgs = set(pg_ids)
    delay = 0.02
    while True:
        still = []
        for name in pending_names:
            try:
                ray.get_actor(name, namespace=ray_namespace)
                still.append(name)
            except ValueError:
                pass
        pending_names = still
        if pending_pgs:
            table = placement_group_table()
            pending_pgs = {
                i for i in pending_pgs if str(table.get(i, {}).get("state", "REMOVED")) != "REMOVED"
            }
        if not pending_names and not pending_pgs:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 1.5, 0.25)
