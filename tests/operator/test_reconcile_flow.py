"""Every outcome of the reconcile pass, against the in-memory ports (tests/operator/fakes.py).

Time is simulated: the loop below moves the fake clock by the delay each pass asks for
(what the group's loop would sleep), so a crash loop of an hour runs in milliseconds.
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import json
from collections.abc import Callable
from typing import Any

from tests.operator.fakes import NODE, World, cluster_key, world
from tg_operator import group_loop, names, reconcile, spec_change
from tg_operator.context import Step
from tg_operator.job_slots import JobSlots
from tgapi import parse_resource
from tgapi.progress import TrainingProgress, progress_filename


async def drive(
    w: World,
    *,
    until: Callable[[World], bool] | None = None,
    passes: int = 60,
    kuberay: bool = True,
) -> Step:
    """Passes as the group's loop makes them; KubeRay's part done by the fake."""
    step = Step.settled()
    for _ in range(passes):
        key = cluster_key(w)
        if kuberay and key in w.kube.clusters and key not in w.kube.pods:
            w.kube.make_ready(*key)
        step = await reconcile.advance(w.ctx, obj=w.obj, sink=w.sink)
        if until is not None and until(w):
            return step
        phase = w.status.get("phase", "")
        w.clock.advance(
            group_loop.next_sleep(
                step, phase=phase, health_interval_s=w.ctx.config.health_interval_s
            )
        )
    return step


def phase_is(*phases: str) -> Callable[[World], bool]:
    return lambda w: w.status.get("phase") in phases


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_apply_to_ready_posts_only_normal_events() -> None:
    w = world()
    run(drive(w, until=phase_is("Ready")))
    st = w.status
    assert st["phase"] == "Ready" and st["readyWorkers"] == 2
    assert st["workerNames"] == ["w0-0", "w0-1"]
    assert w.warnings() == []
    assert "RayClusterCreated" in w.reasons() and "ServerSubmitted" in w.reasons()
    assert w.kube.calls["create_raycluster"] == 1 and w.ray.calls["submit_job"] == 1


def test_a_settled_group_costs_four_dashboard_calls_and_no_api_call_per_health_tick() -> None:
    w = world()
    run(drive(w, until=phase_is("Ready")))
    kube, ray = sum(w.kube.calls.values()), sum(w.ray.calls.values())
    patches = w.kube.calls["patch_status"]
    run(drive(w, passes=10))
    assert w.status["phase"] == "Ready"
    # each tick: the cluster from the watch (no API call); on Ray version, alive_worker_nodes
    # (every worker pod's raylet registered), list_actors and rank 0's progress file
    # get_raycluster + list_pods + the Tinker server's Deployment: all three from the indexes
    assert sum(w.kube.calls.values()) - kube == 10 * 3
    assert w.kube.calls["patch_status"] == patches  # nothing changed: nothing written
    assert sum(w.ray.calls.values()) - ray == 10 * 4


def _progress(w: World, *, step: int, loss: float | None = 2.5) -> None:
    """Rank 0's progress file as the trainer writes it (tgapi.progress)."""
    record = TrainingProgress(
        step=step,
        loss=loss,
        grad_norm=1.5,
        tokens_per_s=1000.0,
        last_step_at=w.clock.now.timestamp(),
    )
    st = w.status
    filename = progress_filename(ray_namespace=st["rayNamespace"], group_name=st["groupName"])
    w.ray.files[(NODE, filename)] = json.dumps(record.to_wire()) + "\n"


def _training(w: World) -> tuple[str, str]:
    (cond,) = [c for c in w.status["conditions"] if c["type"] == "Training"]
    return cond["status"], cond["reason"]


def test_training_progress_reaches_the_status_once_per_step_and_a_stall_turns_the_condition() -> (
    None
):
    w = world()
    w.obj["spec"].setdefault("training", {})["stallSeconds"] = 300
    run(drive(w, until=phase_is("Ready")))
    assert "training" not in w.status and _training(w) == ("Unknown", "NoStepYet")

    _progress(w, step=3)
    run(drive(w, passes=1))
    training = w.status["training"]
    assert training["step"] == 3 and training["loss"] == 2.5
    assert training["tokensPerSecond"] == 1000.0 and training["gradNorm"] == 1.5
    assert training["lastStepTime"] and training["runs"] == 1
    assert _training(w) == ("True", "StepsArriving")

    # health ticks with no new step write nothing; each new step is one write
    patches = w.kube.calls["patch_status"]
    run(drive(w, passes=5))
    assert w.kube.calls["patch_status"] == patches
    for step in (4, 5):
        _progress(w, step=step)
        run(drive(w, passes=3))
    assert w.kube.calls["patch_status"] == patches + 2 and w.status["training"]["step"] == 5

    # no step for longer than stallSeconds: False, Stalled; the message names the field
    w.clock.advance(301)
    run(drive(w, passes=1))
    assert _training(w) == ("False", "Stalled")
    (cond,) = [c for c in w.status["conditions"] if c["type"] == "Training"]
    assert "spec.training.stallSeconds (300 s)" in cond["message"], cond["message"]
    assert w.status["phase"] == "Ready"  # a stalled run is not a failed group
    patches = w.kube.calls["patch_status"]
    run(drive(w, passes=5))
    assert w.kube.calls["patch_status"] == patches  # the message does not tick with the clock
    _progress(w, step=6)
    run(drive(w, passes=1))
    assert _training(w) == ("True", "StepsArriving") and w.status["training"]["step"] == 6


def test_an_unreadable_progress_file_keeps_the_last_progress() -> None:
    w = world()
    run(drive(w, until=phase_is("Ready")))
    _progress(w, step=7)
    run(drive(w, passes=1))
    for key in w.ray.files:
        w.ray.files[key] = '{"step": 8, "loss'  # cut off mid-write
    run(drive(w, passes=2))
    assert w.status["training"]["step"] == 7


def test_cluster_conflict_fails_without_touching_the_foreign_cluster() -> None:
    w = world()
    w.kube.foreign_cluster(*cluster_key(w))
    run(drive(w, until=phase_is("Failed"), kuberay=False))
    assert w.status["phase"] == "Failed"
    assert "not owned by this TrainerGroup" in w.status["message"]
    assert ("Warning", "ClusterConflict") in [(t, r) for t, r, _ in w.sink.events]
    assert w.kube.calls["delete_raycluster"] == 0


def test_cluster_timeout_fails_after_cluster_ready_seconds() -> None:
    w = world(timeouts={"clusterReadySeconds": 120})
    run(drive(w, until=phase_is("Failed"), kuberay=False))
    assert "clusterReadySeconds (120s)" in w.status["message"]
    # the pass slept on the watch, not in 2 s polls: a handful of passes in 120 s
    assert w.kube.calls["list_pods"] <= 8


def test_workers_timeout_stops_the_server_job_and_fails() -> None:
    w = world(timeouts={"workersReadySeconds": 30})
    w.ray.script.server_runs = True
    run(drive(w, until=phase_is("Failed"), passes=400))
    assert w.status["phase"] == "Failed"
    assert "timeouts.workersReadySeconds (30s)" in w.status["message"]
    sid = w.status["submissionId"]
    assert w.ray.jobs[sid].status == "STOPPED"
    assert ("Warning", "WorkersTimeout") in [(t, r) for t, r, _ in w.sink.events]


def test_server_failure_fails_with_its_output() -> None:
    w = world()
    w.ray.script.server_status = "FAILED"
    run(drive(w, until=phase_is("Failed")))
    assert "FAILED" in w.status["message"]


def test_a_cluster_spec_change_replaces_the_raycluster() -> None:
    w = world()
    run(drive(w, until=phase_is("Ready")))
    w.obj["spec"]["rayCluster"]["workers"]["cpu"] = "3"
    w.obj["metadata"]["generation"] = 2
    run(drive(w, until=lambda w: w.kube.calls["delete_raycluster"] > 0, kuberay=False))
    assert "RayClusterReplaced" in w.reasons()
    run(drive(w, until=phase_is("Ready")))
    rc = w.kube.clusters[cluster_key(w)]
    hash_now = spec_change.cluster_hash(parse_resource(w.obj).spec)
    assert rc["metadata"]["annotations"][names.CLUSTER_HASH_ANNOTATION] == hash_now
    assert w.status["groupGeneration"] == 1


def test_teardown_is_skipped_when_ray_is_gone_and_its_cluster_is_rebuilt() -> None:
    w = world()
    run(drive(w, until=phase_is("Ready")))
    w.ray.script.reachable = False
    w.obj["spec"]["rayCluster"]["workers"]["cpu"] = "3"
    w.obj["metadata"]["generation"] = 2
    run(drive(w, until=lambda w: "TeardownSkipped" in w.reasons(), kuberay=False))
    assert w.status["groupGeneration"] == 1
    w.ray.script.reachable = True
    run(drive(w, until=phase_is("Ready")))


def test_a_group_spec_change_on_unreachable_ray_waits_and_says_why() -> None:
    w = world()
    run(drive(w, until=phase_is("Ready")))
    w.ray.script.reachable = False
    w.obj["spec"]["training"]["batchSize"] = 8
    w.obj["metadata"]["generation"] = 2
    step = run(drive(w, passes=3, kuberay=False))
    assert not step.done and "cannot tear down group generation 0" in w.status["message"]
    assert w.status["groupGeneration"] == 0


def test_the_job_slot_wait_holds_the_submission() -> None:
    w = world(env={"TG_MAX_CONCURRENT_JOBS": "1"})
    w.ctx.slots = JobSlots(limit=1)
    w.ctx.slots.acquire(w.ray.base_url, "someone-else")
    step = run(drive(w, passes=6))
    assert "waiting for a free Ray job slot" in w.status["message"]
    assert w.ray.calls["submit_job"] == 0 and not step.done
    w.ctx.slots.release(w.ray.base_url, "someone-else")
    run(drive(w, until=phase_is("Ready")))


def test_restart_policy_never_fails_on_a_dead_worker() -> None:
    w = world(restartPolicy="Never")
    run(drive(w, until=phase_is("Ready")))
    w.ray.kill("w0-1")
    run(drive(w, until=phase_is("Failed")))
    assert "restartPolicy: Never" in w.status["message"]
    assert "rank 1 (w0-1) is DEAD" in w.status["message"]
    assert w.status["restarts"] == 0


def test_a_dead_worker_re_creates_the_group_under_the_next_generation() -> None:
    w = world()
    run(drive(w, until=phase_is("Ready")))
    w.ray.kill("w0-0")
    run(drive(w, until=lambda w: w.status.get("groupGeneration") == 1 and phase_is("Ready")(w)))
    st = w.status
    assert st["restarts"] == 1 and st["lastRestartTime"] and not st.get("nextRestartTime")
    assert st["workerNames"] == ["w1-0", "w1-1"]
    assert [r for t, r, _ in w.sink.events if t == "Warning"] == ["Degraded", "Restarting"]


def test_an_incomplete_teardown_is_never_taken_as_done() -> None:
    w = world()
    run(drive(w, until=phase_is("Ready")))
    incomplete = {"complete": False, "errors": ["placement group still exists"]}
    w.ray.script.teardown_reports = [incomplete, incomplete]
    w.ray.kill("w0-0")

    def teardowns() -> list[str]:
        return sorted(j for j in w.ray.jobs if "-teardown-" in j)

    run(drive(w, until=lambda w: len(teardowns()) == 2, passes=30))
    # two incomplete attempts: the group is still generation 0, Degraded, not re-created
    assert w.status["groupGeneration"] == 0 and w.status["phase"] == "Degraded"
    assert w.ray.calls["submit_job"] == 1 + 2
    run(drive(w, until=lambda w: w.status.get("groupGeneration") == 1 and phase_is("Ready")(w)))
    assert [j.rsplit("-", 1)[1] for j in teardowns()] == ["0", "1", "2"]


def test_restarts_back_off_exponentially_and_stop_at_max_restarts() -> None:
    w = world(maxRestarts=4, env={"TG_RESTART_BACKOFF_SECONDS": "10"})
    w.ray.script.workers_die = True
    restart_times: list[str] = []

    def note(w: World) -> bool:
        t = w.status.get("lastRestartTime")
        if t and (not restart_times or restart_times[-1] != t):
            restart_times.append(t)
        return w.status.get("phase") == "Failed"

    run(drive(w, until=note, passes=500))
    st = w.status
    assert st["phase"] == "Failed" and st["restarts"] == 4
    assert "spec.maxRestarts (4) is reached" in st["message"]
    stamps = [datetime.datetime.fromisoformat(t) for t in restart_times]
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(stamps)]
    # the first re-creation at once, then 10, 20, 40 s (plus the seconds a re-creation takes)
    for gap, want in zip(gaps, (10, 20, 40), strict=True):
        assert want <= gap < want + 10, gaps


def test_a_crash_looping_group_does_not_storm_the_api_server_or_ray() -> None:
    w = world(maxRestarts=1000, env={"TG_RESTART_BACKOFF_MAX_SECONDS": "300"})
    w.ray.script.workers_die = True
    hour = 3600.0
    end = w.clock.now.timestamp() + hour

    async def loop() -> None:
        while w.clock.now.timestamp() < end:
            await drive(w, passes=1)

    run(loop())
    restarts = w.status["restarts"]
    # back-off 0, 10, 20, ... 300 s: about 15 re-creations in an hour, not thousands
    assert 10 <= restarts <= 20, restarts
    writes = w.kube.calls["patch_status"] + w.kube.calls["create_raycluster"]
    assert writes <= 20 * restarts, w.kube.calls
    assert w.ray.calls["submit_job"] <= 2 * restarts + 2, w.ray.calls
    assert sum(w.ray.calls.values()) <= 400, w.ray.calls


def test_an_invalid_spec_fails_once_and_settles() -> None:
    w = world()
    w.obj["spec"]["parallelism"]["tensor"] = 3
    step = run(drive(w, passes=3))
    assert step.done and w.status["phase"] == "Failed"
    assert w.kube.calls["patch_status"] == 1 and w.kube.calls["create_raycluster"] == 0


def test_a_spec_change_revives_a_failed_group_with_a_fresh_restart_budget() -> None:
    w = world(maxRestarts=1)
    w.ray.script.workers_die = True
    run(drive(w, until=phase_is("Failed"), passes=200))
    assert w.status["restarts"] == 1 and "spec.maxRestarts (1)" in w.status["message"]
    w.ray.script.workers_die = False
    w.obj["spec"]["maxRestarts"] = 3  # in no hash: only the Failed phase says "tear down"
    w.obj["metadata"]["generation"] = 2
    run(drive(w, until=lambda w: phase_is("Ready")(w), passes=50))
    st = w.status
    assert st["restarts"] == 0 and st["groupGeneration"] == 2, st
    assert st["observedGeneration"] == 2


def test_raising_workers_ready_seconds_revives_a_timed_out_group() -> None:
    w = world(timeouts={"workersReadySeconds": 30})
    w.ray.script.server_runs = True
    run(drive(w, until=phase_is("Failed"), passes=400))
    assert "WorkersTimeout" in [r for t, r, _ in w.sink.events if t == "Warning"]
    w.ray.script.server_runs = False
    w.obj["spec"]["timeouts"] = {"workersReadySeconds": 600}
    w.obj["metadata"]["generation"] = 2
    run(drive(w, until=phase_is("Ready"), passes=50))
    assert w.status["groupGeneration"] == 1 and w.status["workerNames"] == ["w1-0", "w1-1"]


def test_a_lost_head_waits_for_the_worker_nodes_then_re_creates_and_says_why() -> None:
    # the head restarted without GCS FT: the new GCS knows no actor and, until the old
    # worker pod's raylet gives up and re-registers, no worker node (the pod stays Ready)
    w = world()
    run(drive(w, until=phase_is("Ready")))
    w.ray.actors.clear()
    w.ray.worker_nodes = 0
    run(drive(w, passes=5))
    assert w.status["phase"] == "Degraded"
    assert "Ray sees 0 of" in w.status["message"], w.status["message"]
    assert w.ray.calls["submit_job"] == 1  # nothing submitted to a head without workers
    w.ray.worker_nodes = 64
    run(drive(w, until=lambda x: phase_is("Ready")(x) and x.ray.calls["submit_job"] == 2))
    assert w.status["phase"] == "Ready" and w.status["restarts"] == 1
    restarting = [m for t, r, m in w.sink.events if r == "Restarting"]
    assert restarting and "the Ray head lost the group" in restarting[0]
