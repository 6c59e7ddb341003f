"""Every outcome of the finalizer's pure rules (:mod:`tg_operator.deletion_rules`), one row each.

A row of :data:`ROWS` builds a deletion snapshot and names the rule that must decide, the
action it must take, whether the finalizer may go, the event and a piece of the message.
:data:`AFTER` gives an action's outcome to ``after`` and names the next decision. The same
steps run through the executor and the fakes of both ports in test_deletion_flow.py.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
from typing import Any

import pytest

from tests.operator.fakes import T0
from tests.operator.helpers import BASE_SPEC, trainergroup
from tests.operator.snapshots import TG, WORKERS, actors, cluster, running, snap
from tg_operator import backoff, deletion_rules, names
from tg_operator.dashboard import ActorInfo
from tg_operator.deletion_rules import (
    Cleanup,
    ClusterDeleted,
    DeleteOwnedCluster,
    DeletionSnapshot,
    ForgetJobs,
    JobsForgotten,
    ListWorkers,
    Outcome,
    TearDownGroup,
    TornDown,
    Unreachable,
    WorkersListed,
)
from tg_operator.group_teardown import STEP_DELAY_S, TeardownResult
from tg_operator.status import rfc3339
from tgapi import TrainerGroup, TrainerGroupStatus

_ref_spec = {k: v for k, v in copy.deepcopy(BASE_SPEC).items() if k != "rayCluster"}
_ref_spec["rayClusterRef"] = {"name": "shared"}
REF = trainergroup(spec=_ref_spec)


def dsnap(
    *,
    status: TrainerGroupStatus | None = None,
    tg: TrainerGroup | None = TG,
    attempt: int = 0,
    **seen: Any,
) -> DeletionSnapshot:
    """A deleted group whose owned RayCluster exists, unless ``seen`` says otherwise."""
    st = status if status is not None else running()
    group = None
    if tg is not None:
        owned = names.owns_cluster(tg)
        rc = seen.pop("raycluster") if "raycluster" in seen else cluster(tg) if owned else None
        group = dataclasses.replace(snap(status=st), tg=tg, raycluster=rc)
    return DeletionSnapshot(
        namespace="team-a",
        name="demo",
        uid=TG.uid,
        status=st,
        now=T0,
        attempt=attempt,
        group=group,
        **seen,
    )


GOING = {**cluster(), "metadata": {"name": "demo", "deletionTimestamp": "2026-01-01T00:00:00Z"}}
FT = deletion_rules.GCS_FT_FINALIZER


def finalizing(seconds: float | None, *finalizers: str, stamp: str | None = None) -> dict[str, Any]:
    """The owned RayCluster with ``finalizers`` (KubeRay's GCS-FT one by default), deleted
    ``seconds`` before T0 (None: not deleted yet)."""
    meta: dict[str, Any] = {"name": "demo", "finalizers": list(finalizers or (FT,))}
    if seconds is not None:
        meta["deletionTimestamp"] = stamp or rfc3339(T0 - datetime.timedelta(seconds=seconds))
    return {**cluster(), "metadata": meta}


WAITING = running(
    phase="Terminating",
    message=f"waiting for RayCluster demo to finish deleting: it still has the finalizers {FT}",
)

ROWS: dict[str, tuple[DeletionSnapshot, str, type | None, bool, str, str]] = {
    "force-delete-skips-the-cleanup": (
        dsnap(force=True),
        "force-delete",
        None,
        True,
        "ForceDeleted",
        f"actors in Ray namespace {TG.ray_namespace} may remain",
    ),
    "force-delete-of-an-invalid-spec-names-the-recorded-namespace": (
        dsnap(force=True, tg=None, status=running(ray_namespace="")),
        "force-delete",
        None,
        True,
        "ForceDeleted",
        "actors in Ray namespace ? may remain",
    ),
    "invalid-spec-created-nothing": (
        dsnap(tg=None),
        "invalid-spec",
        None,
        True,
        "",
        "the spec was invalid",
    ),
    "nothing-started": (
        dsnap(status=TrainerGroupStatus()),
        "nothing-started",
        None,
        True,
        "",
        "no worker group was started",
    ),
    "nothing-started-but-the-cluster-has-finalizers-goes-first": (
        dsnap(status=TrainerGroupStatus(), raycluster=finalizing(None)),
        "nothing-started-cluster-first",
        DeleteOwnedCluster,
        True,
        "",
        "no worker group was started",
    ),
    "nothing-started-and-the-cluster-finalizing": (
        dsnap(status=TrainerGroupStatus(), raycluster=finalizing(12)),
        "cluster-finalizing",
        None,
        False,
        "",
        "waiting for RayCluster demo to finish deleting",
    ),
    "a-server-job-the-status-missed-is-cleaned": (
        dsnap(status=TrainerGroupStatus(), server_job_seen=True),
        "clean-ray",
        TearDownGroup,
        False,
        "",
        "cleaning up",
    ),
    "owned-cluster-gone": (
        dsnap(raycluster=None),
        "cluster-gone",
        None,
        True,
        "NothingToClean",
        "RayCluster demo is gone",
    ),
    "owned-cluster-going": (
        dsnap(raycluster=GOING),
        "cluster-gone",
        None,
        True,
        "NothingToClean",
        "its Ray processes went with it",
    ),
    "owned-cluster-deleted-without-finalizers-costs-no-wait": (
        dsnap(raycluster={**GOING, "metadata": {**GOING["metadata"], "finalizers": []}}),
        "cluster-gone",
        None,
        True,
        "NothingToClean",
        "its Ray processes went with it",
    ),
    "owned-cluster-finalizing-waits-for-kuberay-redis-cleanup": (
        dsnap(raycluster=finalizing(42)),
        "cluster-finalizing",
        None,
        False,
        "",
        f"waiting for RayCluster demo to finish deleting: it still has the finalizers {FT} "
        "(waiting for KubeRay's cleanup of the group's GCS state in Redis, a Job with a 300s "
        "deadline); 40s so far, at most 330s",
    ),
    "owned-cluster-finalizing-any-finalizer-waits": (
        dsnap(raycluster=finalizing(3, "example.com/keep", FT)),
        "cluster-finalizing",
        None,
        False,
        "",
        f"finalizers example.com/keep, {FT} (waiting for KubeRay's cleanup",
    ),
    "owned-cluster-finalizing-a-foreign-finalizer": (
        dsnap(raycluster=finalizing(3, "example.com/keep")),
        "cluster-finalizing",
        None,
        False,
        "",
        "finalizers example.com/keep (waiting for the controllers that own them); 0s so far",
    ),
    "owned-cluster-finalizing-just-below-the-limit": (
        dsnap(raycluster=finalizing(329)),
        "cluster-finalizing",
        None,
        False,
        "",
        "320s so far, at most 330s",
    ),
    "owned-cluster-finalizers-past-the-limit-settle-with-a-warning": (
        dsnap(raycluster=finalizing(330), status=WAITING),
        "cluster-finalizers-timeout",
        None,
        True,
        "ClusterFinalizersTimeout",
        f"RayCluster demo still has the finalizers {FT} 330s after it was deleted",
    ),
    "an-unparsable-deletion-time-counts-from-terminating": (
        dsnap(raycluster=finalizing(0, stamp="yesterday"), status=running(phase="Terminating")),
        "cluster-finalizers-timeout",
        None,
        True,
        "ClusterFinalizersTimeout",
        "600s after it was deleted",
    ),
    "owned-cluster-gone-after-the-wait-posts-nothing": (
        dsnap(raycluster=None, status=WAITING),
        "cluster-finalized",
        None,
        True,
        "",
        "RayCluster demo finished deleting",
    ),
    "owned-cluster-finalizers-dropped-after-the-wait-posts-nothing": (
        dsnap(raycluster=GOING, status=WAITING),
        "cluster-finalized",
        None,
        True,
        "",
        "RayCluster demo finished deleting",
    ),
    "force-delete-does-not-wait-for-finalizers": (
        dsnap(force=True, raycluster=finalizing(10), status=WAITING),
        "force-delete",
        None,
        True,
        "ForceDeleted",
        "removed without cleaning Ray",
    ),
    "owned-cluster-up-is-cleaned": (
        dsnap(),
        "clean-ray",
        TearDownGroup,
        False,
        "",
        "cleaning up",
    ),
    "referenced-cluster-is-cleaned-even-if-unseen": (
        dsnap(tg=REF, raycluster=None),
        "clean-ray",
        TearDownGroup,
        False,
        "",
        "cleaning up",
    ),
    "a-second-step-keeps-the-terminating-message": (
        dsnap(status=running(phase="Terminating", message="tearing down the workers: x")),
        "clean-ray",
        TearDownGroup,
        False,
        "",
        "tearing down the workers: x",
    ),
}


@pytest.mark.parametrize(
    ("seen", "rule", "action", "settled", "event", "text"), ROWS.values(), ids=ROWS.keys()
)
def test_decide(
    seen: DeletionSnapshot, rule: str, action: type | None, settled: bool, event: str, text: str
) -> None:
    d = deletion_rules.decide(seen)
    assert d.rule == rule
    assert (type(d.action) if d.action is not None else None) is action
    assert d.step.done is settled
    assert [e.reason for e in d.events] == ([event] if event else [])
    assert d.status.phase == "Terminating"
    assert text in (d.step.message if settled else d.status.message), d


def test_the_rules_are_asked_in_order_and_the_last_always_answers() -> None:
    assert [r.__name__ for r in deletion_rules.RULES] == [
        "force_delete",
        "invalid_spec",
        "cluster_finalizing",
        "nothing_started",
        "cluster_gone",
        "clean_ray",
    ]


def test_the_teardown_uses_the_recorded_generation_and_namespace() -> None:
    d = deletion_rules.decide(dsnap(status=running(group_generation=3, ray_namespace="old")))
    assert d.action == TearDownGroup(generation=3, ray_namespace="old")


@pytest.mark.parametrize(
    ("seen", "probe", "cluster"),
    [
        (dsnap(force=True, status=TrainerGroupStatus()), False, False),
        (dsnap(tg=None, status=TrainerGroupStatus()), False, False),
        (dsnap(status=TrainerGroupStatus()), True, True),
        (dsnap(status=TrainerGroupStatus(), server_job_seen=True), True, True),
        (dsnap(), False, True),
        (dsnap(tg=REF), False, False),
    ],
    ids=["forced", "invalid-spec", "unrecorded", "crash-window", "recorded", "referenced"],
)
def test_only_the_reads_the_rules_need(seen: DeletionSnapshot, probe: bool, cluster: bool) -> None:
    assert deletion_rules.wants_job_probe(seen) is probe
    assert deletion_rules.wants_cluster(seen) is cluster


# -- after an action: the chain ----------------------------------------------------------
CLEAN = dsnap()
FIRST = deletion_rules.decide(CLEAN)
NS = TG.ray_namespace
LISTED = dataclasses.replace(FIRST, action=ListWorkers(ray_namespace=NS, summary="td"))
FORGET = dataclasses.replace(FIRST, action=ForgetJobs(up_to_generation=0, summary="td; gone"))
DELETE = Cleanup(
    rule="cleaned-up",
    status=FIRST.status,
    step=FIRST.step.settled("done"),
    action=DeleteOwnedCluster(name="demo"),
)
STRANGER = ActorInfo(actor_id="x", name="someone-else", state="ALIVE")

AFTER: dict[str, tuple[Cleanup, Outcome, str, Any, float | None, str]] = {
    "teardown-step-in-progress": (
        FIRST,
        TornDown(result=TeardownResult(done=False, message="submitted teardown job t")),
        "tearing-down",
        None,
        STEP_DELAY_S,
        "tearing down the workers: submitted teardown job t",
    ),
    "teardown-gave-up": (
        FIRST,
        TornDown(result=TeardownResult(done=False, failed=True, message="failed 20 times")),
        "tearing-down",
        None,
        backoff.RAY_RETRY_S,
        "failed 20 times",
    ),
    "teardown-done-then-look-at-the-workers": (
        FIRST,
        TornDown(result=TeardownResult(done=True, message="teardown t: 2 actor(s) killed")),
        "torn-down",
        ListWorkers(ray_namespace=NS, summary="teardown t: 2 actor(s) killed"),
        None,
        "",
    ),
    "workers-still-alive": (
        LISTED,
        WorkersListed(actors=actors()),
        "workers-alive",
        None,
        deletion_rules.WORKERS_GONE_POLL_S,
        f"workers are still alive: {', '.join(WORKERS)}",
    ),
    "only-others-alive-then-forget-the-jobs": (
        LISTED,
        WorkersListed(actors=(*actors(*WORKERS), STRANGER)),
        "workers-gone",
        ForgetJobs(up_to_generation=0, summary=f"td; no live workers left in Ray namespace {NS}"),
        None,
        "",
    ),
    "jobs-forgotten-then-delete-the-owned-cluster": (
        FORGET,
        JobsForgotten(removed=3),
        "cleaned-up",
        DeleteOwnedCluster(name="demo"),
        None,
        "td; gone; 3 job records removed",
    ),
    "cluster-deleted-ends-the-chain": (DELETE, ClusterDeleted(), "cleaned-up", None, None, "done"),
    "ray-unreachable": (
        FIRST,
        Unreachable(error="connection refused"),
        "ray-unreachable",
        None,
        1.0,
        "cannot reach Ray to remove the workers (connection refused); retrying in 1s",
    ),
}


@pytest.mark.parametrize(
    ("done", "outcome", "rule", "action", "delay", "text"), AFTER.values(), ids=AFTER.keys()
)
def test_after(
    done: Cleanup, outcome: Outcome, rule: str, action: Any, delay: float | None, text: str
) -> None:
    d = deletion_rules.after(CLEAN, done, outcome)
    assert d.rule == rule and d.action == action
    if delay is None:  # the chain goes on, or it ended and the finalizer may go
        assert d.action is not None or d.step.done
    else:
        assert not d.step.done and d.step.delay == delay and d.action is None
    assert text in d.step.message and (delay is None or text in d.status.message)


def test_the_cleaned_up_chain_posts_cleaned_up_and_a_referenced_cluster_is_left_alone() -> None:
    ref = dsnap(tg=REF)
    d = deletion_rules.after(ref, FORGET, JobsForgotten(removed=0))
    assert d.step.done and d.action is None
    assert [(e.type, e.reason) for e in d.events] == [("Normal", "CleanedUp")]


@pytest.mark.parametrize(
    ("attempt", "delay"), [(0, 1.0), (1, 2.0), (3, 8.0), (4, 16.0), (5, 30.0), (50, 30.0)]
)
def test_unreachable_ray_backs_off_and_says_how_to_force(attempt: int, delay: float) -> None:
    d = deletion_rules.after(dsnap(attempt=attempt), FIRST, Unreachable(error="refused"))
    assert d.step.delay == delay == backoff.cleanup_retry_s(attempt=attempt)
    assert f'{names.FORCE_DELETE_ANNOTATION}="true"' in d.status.message
    assert [(e.type, e.reason) for e in d.events] == [("Warning", "CleanupRetrying")]


def test_the_same_reason_again_posts_no_second_event() -> None:
    first = deletion_rules.after(dsnap(attempt=9), FIRST, Unreachable(error="refused"))
    again = dsnap(attempt=10, status=first.status)
    d = deletion_rules.after(again, deletion_rules.decide(again), Unreachable(error="refused"))
    assert d.status.message == first.status.message and d.events == ()


def test_the_whole_chain_from_one_decision() -> None:
    """What the executor does, with each action's outcome played back."""
    played: dict[type, Outcome] = {
        TearDownGroup: TornDown(result=TeardownResult(done=True, message="teardown t: ok")),
        ListWorkers: WorkersListed(actors=actors(*WORKERS)),
        ForgetJobs: JobsForgotten(removed=2),
        DeleteOwnedCluster: ClusterDeleted(),
    }
    d, ran = FIRST, []
    while d.action is not None:
        ran.append(type(d.action))
        d = deletion_rules.after(CLEAN, d, played[type(d.action)])
    assert ran == [TearDownGroup, ListWorkers, ForgetJobs, DeleteOwnedCluster]
    assert d.step.done and d.rule == "cleaned-up"
    assert d.step.message == (
        f"teardown t: ok; no live workers left in Ray namespace {NS}; 2 job records removed"
    )
    assert [e.reason for e in d.events] == ["CleanedUp"]


def test_the_finalizers_timeout_warning_names_them_and_the_force_annotation() -> None:
    d = deletion_rules.decide(dsnap(raycluster=finalizing(400, "example.com/keep", FT)))
    (event,) = d.events
    assert (event.type, event.reason) == ("Warning", "ClusterFinalizersTimeout")
    assert f"finalizers example.com/keep, {FT} 400s after it was deleted" in event.message
    assert "the TrainerGroup goes anyway after 330s" in event.message
    assert f'{names.FORCE_DELETE_ANNOTATION}="true"' in event.message
    assert d.step.message == event.message


def test_the_wait_is_written_in_steps_of_ten_seconds() -> None:
    """The poll is 2 s; the status (a watch event each) changes only every 10 s."""
    msgs = {
        deletion_rules.decide(dsnap(raycluster=finalizing(t))).status.message for t in range(10, 20)
    }
    assert len(msgs) == 1 and "10s so far" in msgs.pop()
    d = deletion_rules.decide(dsnap(raycluster=finalizing(12)))
    assert d.step.delay == deletion_rules.CLUSTER_FINALIZERS_POLL_S == 2.0


def test_cluster_deleted_with_finalizers_waits_and_keeps_the_cleaned_up_event() -> None:
    """The RayCluster read before the delete had KubeRay's finalizer: do not settle yet."""
    seen = dsnap(raycluster=finalizing(None))
    d = deletion_rules.after(seen, FORGET, JobsForgotten(removed=1))
    assert d.action == DeleteOwnedCluster(name="demo") and d.step.done
    d = deletion_rules.after(seen, d, ClusterDeleted())
    assert d.rule == "cluster-finalizing" and d.action is None
    assert not d.step.done and d.step.delay == deletion_rules.CLUSTER_FINALIZERS_POLL_S
    assert d.status.message.startswith(
        f"waiting for RayCluster demo to finish deleting: it still has the finalizers {FT} "
    )
    assert "0s so far, at most 330s" in d.status.message
    assert [e.reason for e in d.events] == ["CleanedUp"]
    assert d.events[0].message == "td; gone; 1 job records removed"


def test_the_whole_chain_with_a_finalizing_cluster_settles_once_it_is_gone() -> None:
    """Step 1 cleans and deletes; the next steps read the RayCluster again until it is gone."""
    played: dict[type, Outcome] = {
        TearDownGroup: TornDown(result=TeardownResult(done=True, message="teardown t: ok")),
        ListWorkers: WorkersListed(actors=actors(*WORKERS)),
        ForgetJobs: JobsForgotten(removed=2),
        DeleteOwnedCluster: ClusterDeleted(),
    }
    seen = dsnap(raycluster=finalizing(None))
    d = deletion_rules.decide(seen)
    while d.action is not None:
        d = deletion_rules.after(seen, d, played[type(d.action)])
    assert d.rule == "cluster-finalizing" and not d.step.done
    posted = [e.reason for e in d.events]
    for t in (2, 150, 298):
        again = deletion_rules.decide(dsnap(raycluster=finalizing(t), status=d.status))
        assert again.rule == "cluster-finalizing" and again.events == ()
        assert f"{t // 10 * 10}s so far" in again.status.message
        d = again
    last = deletion_rules.decide(dsnap(raycluster=None, status=d.status))
    assert last.rule == "cluster-finalized" and last.step.done and last.events == ()
    assert posted == ["CleanedUp"]


def test_backoff_schedules_share_one_doubling() -> None:
    assert [backoff.cleanup_retry_s(attempt=a) for a in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    restart = [backoff.restart_delay_s(restarts=r, base_s=10, cap_s=300) for r in range(7)]
    assert restart == [0, 10, 20, 40, 80, 160, 300]
    assert backoff.doubling(attempt=-1, base_s=3, cap_s=10) == 3
