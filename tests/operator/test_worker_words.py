"""kubectl (the operator's status.workers) and ``tgctl status`` describe a worker in the same
words: one state vocabulary and one death-cause summary (tgapi.workers) on both paths."""

from __future__ import annotations

from typing import Any

import pytest

from tg_operator import status as S
from tg_operator.dashboard import ActorInfo
from tgapi.workers import NOT_FOUND_CAUSE, WorkerState, describe_worker
from tgruntime.controller.health import WorkerHealth

# Ray's death-cause record for a killed worker, as the GCS and the State API both hold it
KILLED: dict[str, Any] = {
    "actor_died_error_context": {
        "error_message": "The actor is dead because it was killed by `ray.kill`.\n\tpid=42",
        "reason": "RAY_KILL",
        "actor_id": "abc",
    }
}
CRASHED: dict[str, Any] = {
    "creation_task_failure_context": {
        "error_message": "Traceback (most recent call last):\n  File x\nValueError: bad vocab",
    }
}


def _operator_view(state: str | None, cause: Any) -> tuple[str, str]:
    # an earlier generation's dead actor: the namespace is known to the GCS (an empty one
    # means the head lost its state, tests/operator/test_head_lost.py)
    earlier = {"name": "w0-gen0", "state": "DEAD", "pid": 41, "actor_id": "z"}
    actors = [ActorInfo.from_wire(earlier)]
    if state is not None:
        wire = {"name": "w0", "state": state, "death_cause": cause, "pid": 42, "actor_id": "a"}
        actors.append(ActorInfo.from_wire(wire))
    (w,) = S.worker_statuses(worker_names=["w0"], actors=actors)
    return w.state, w.cause


def _tgctl_view(state: str | None, cause: Any) -> tuple[str, str]:
    # what tgruntime.entrypoints.cli.group_status does with each GCS actor row
    got_state, got_cause = describe_worker(ray_state=state, death_cause=cause)
    return str(got_state), got_cause


@pytest.mark.parametrize(
    ("state", "cause", "want"),
    [
        (
            "DEAD",
            KILLED,
            ("DEAD", "The actor is dead because it was killed by `ray.kill`. [RAY_KILL]"),
        ),
        ("DEAD", CRASHED, ("DEAD", "ValueError: bad vocab")),
        ("DEAD", None, ("DEAD", "the actor died (Ray gave no cause)")),
        ("ALIVE", None, ("ALIVE", "")),
        ("RESTARTING", None, ("UNREACHABLE", "actor is RESTARTING")),
        (None, None, ("NOT_FOUND", NOT_FOUND_CAUSE)),
    ],
)
def test_operator_and_tgctl_say_the_same(
    state: str | None, cause: Any, want: tuple[str, str]
) -> None:
    assert _operator_view(state, cause) == want
    assert _tgctl_view(state, cause) == want


def test_the_controllers_health_uses_the_same_states() -> None:
    field = WorkerHealth.__dataclass_fields__["state"]
    assert "WorkerState" in str(field.type)
    assert {s.value for s in WorkerState} == {"ALIVE", "DEAD", "NOT_FOUND", "UNREACHABLE"}
