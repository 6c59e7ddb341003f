"""A crash-looping group on the real control plane: restarts back off, then RestartLimit.

The operator runs as in test_k8s_operator.py (a subprocess against the local control plane
and the local Ray). Its workers (``hack.noop_worker:CrashingWorker``) exit a few seconds
after they start, so every group generation dies. The assertions are on what the operator
records (``status.restarts``, ``lastRestartTime``, ``nextRestartTime``, the Restarting
events, the final phase), not on how long anything took.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import pytest

from hack import operator_plane as ks

pytestmark = [pytest.mark.k8s, pytest.mark.ray]
BACKOFF_S = 4
MAX_RESTARTS = 2
OPERATOR_ENV = {"TG_RESTART_BACKOFF_SECONDS": str(BACKOFF_S)}


def _time(value: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))


def test_a_crash_looping_group_backs_off_and_ends_restart_limit(
    k8s_plane: Any, ns: str, operator: ks.OperatorProcess, tmp_path: Path
) -> None:
    name = "crashloop"
    body = ks.noop(name, ns, maxRestarts=MAX_RESTARTS)
    body["spec"]["workers"]["workerClass"] = "hack.noop_worker:CrashingWorker"
    k8s_plane.apply(body)
    seen: list[dict[str, Any]] = []

    def failed() -> bool:
        st = ks.status_of(k8s_plane, ns, name)
        if st and (not seen or seen[-1] != st):
            seen.append(st)
        return st.get("phase") == "Failed"

    ks.wait_for(failed, timeout=600, interval=0.3, what="Failed", detail=operator.tail)
    final = seen[-1]
    assert final["restarts"] == MAX_RESTARTS, ks.dump(final)
    reasons = {c["type"]: c["reason"] for c in final["conditions"]}
    assert reasons["WorkersReady"] == "RestartLimit", final["conditions"]
    assert f"spec.maxRestarts ({MAX_RESTARTS}) is reached" in final["message"]
    assert final["groupGeneration"] == MAX_RESTARTS
    # restarts only go up, one at a time
    counts = [s.get("restarts", 0) for s in seen]
    assert counts == sorted(counts) and set(counts) == set(range(MAX_RESTARTS + 1)), counts
    # the second re-creation waited for its back-off: nextRestartTime was set BACKOFF_S or
    # more after the first re-creation (it counts from when the death was seen)
    waits = [
        (_time(s["nextRestartTime"]) - _time(s["lastRestartTime"])).total_seconds()
        for s in seen
        if s.get("nextRestartTime") and s.get("lastRestartTime") and s.get("restarts") == 1
    ]
    assert waits and min(waits) >= BACKOFF_S, [s.get("nextRestartTime") for s in seen]
    events = ks.events_of(k8s_plane, ns, name)
    restarting = [e["message"] for e in events if e["reason"] == "Restarting"]
    assert len(restarting) == MAX_RESTARTS, restarting
    assert any(f"in {BACKOFF_S}s (restart 2 of at most" in m for m in restarting), restarting
    assert any("now (restart 1 of at most" in m for m in restarting), restarting
    k8s_plane.kubectl("delete", "trainergroup", name, "-n", ns, "--wait=false", check=False)
    ks.wait_for(
        lambda: ks.get_tg(k8s_plane, ns, name) is None,
        timeout=300,
        what=f"TrainerGroup {name} to be gone",
        detail=operator.tail,
    )
