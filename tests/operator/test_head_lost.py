"""Losing the Ray head without GCS fault tolerance: the status says the head lost the group.

A new GCS knows no actor of the group's Ray namespace (a killed worker pod leaves DEAD actors
with a cause instead); the operator re-creates the group and each worker's cause, the Degraded
condition and the phase message say why. Pure decision logic (tg_operator.status).
"""

from __future__ import annotations

from tg_operator import status as S
from tg_operator.dashboard import ActorInfo
from tgapi.workers import NOT_FOUND_CAUSE


def test_no_actor_left_in_the_namespace_says_the_head_lost_the_group() -> None:
    workers = S.worker_statuses(worker_names=["w0", "w1"], actors=[])
    assert [w.state for w in workers] == ["NOT_FOUND", "NOT_FOUND"]
    assert all(w.cause == S.HEAD_LOST_CAUSE for w in workers)
    assert "gcsFaultTolerance" in S.HEAD_LOST_CAUSE
    said = S.describe_dead(workers)
    assert said.startswith("rank 0 (w0) is NOT_FOUND: the Ray head lost the group")


def test_one_missing_worker_among_known_actors_is_only_not_found() -> None:
    alive = ActorInfo.from_wire({"name": "w1", "state": "ALIVE", "pid": 7, "actor_id": "b"})
    w0, w1 = S.worker_statuses(worker_names=["w0", "w1"], actors=[alive])
    assert (w0.state, w0.cause) == ("NOT_FOUND", NOT_FOUND_CAUSE)
    assert (w1.state, w1.cause) == ("ALIVE", "")

