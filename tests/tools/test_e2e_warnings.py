"""tests/e2e/warnings.py: which events make the kind suite's no-Warning check fail (pure)."""

from __future__ import annotations

from typing import Any

from tests.e2e.warnings import warnings, when


def _event(kind: str, stamp: str, *, type_: str = "Warning", **extra: Any) -> dict[str, Any]:
    return {"type": type_, "involvedObject": {"kind": kind, "name": "x"}, "reason": "Unhealthy",
            "message": "Liveness probe failed: success", "lastTimestamp": stamp, **extra}


def test_only_warnings_after_the_start_on_group_objects_count() -> None:
    since = when({"lastTimestamp": "2026-12-02T06:00:00Z"})
    events = [
        _event("Pod", "2026-12-02T06:05:00Z", count=3),
        _event("Pod", "2026-12-02T05:59:59Z"),  # before the apply
        _event("Node", "2026-12-02T06:05:00Z"),  # the node's own start-up
        _event("Pod", "2026-12-02T06:05:00Z", type_="Normal"),
    ]
    assert warnings(events, since=since, skip_kinds={"Node"}) == [
        "Pod/x Unhealthy x3: Liveness probe failed: success"
    ]


def test_a_series_counts_from_its_last_observation() -> None:
    e = _event("Pod", "2026-12-02T05:00:00Z", series={"lastObservedTime": "2026-12-02T07:00:00Z"})
    assert when(e) == when({"lastTimestamp": "2026-12-02T07:00:00Z"})


def test_the_kubelets_token_volume_sync_timeout_is_not_a_defect_but_other_mounts_are() -> None:
    since = when({"lastTimestamp": "2026-12-02T06:00:00Z"})
    token = (
        'MountVolume.SetUp failed for volume "kube-api-access-ft2hd" : failed to sync configmap '
        "cache: timed out waiting for the condition"
    )
    claim = 'MountVolume.SetUp failed for volume "ckpt" : hostPath type check failed'
    graph = (
        'MountVolume.SetUp failed for volume "kube-api-access-xf6wv" : failed to fetch token: '
        'serviceaccounts "default" is forbidden: User "system:node:tg-e2e-worker2" cannot '
        'create resource "serviceaccounts/token" in API group "" in the namespace "default": '
        "no relationship found between node 'tg-e2e-worker2' and this object"
    )
    events = [
        _event("Pod", "2026-12-02T06:05:00Z", reason="FailedMount", message=token),
        _event("Pod", "2026-12-02T06:05:00Z", reason="FailedMount", message=graph),
        _event("Pod", "2026-12-02T06:05:00Z", reason="FailedMount", message=claim),
    ]
    assert warnings(events, since=since, skip_kinds=set()) == [f"Pod/x FailedMount x1: {claim}"]


def test_the_endpoints_controllers_stale_create_is_not_a_defect_but_other_errors_are() -> None:
    since = when({"lastTimestamp": "2026-12-02T06:00:00Z"})
    race = (
        "Failed to create endpoint for service trainergroups/llama-tp2-head-svc: endpoints "
        '"llama-tp2-head-svc" already exists'
    )
    other = "Failed to update endpoint trainergroups/llama-tp2-head-svc: the server was slow"
    events = [
        _event("Endpoints", "2026-12-02T06:05:00Z", reason="FailedToCreateEndpoint", message=race),
        _event("Endpoints", "2026-12-02T06:05:00Z", reason="FailedToUpdateEndpoint", message=other),
        _event("Pod", "2026-12-02T06:05:00Z", reason="FailedToCreateEndpoint", message=race),
    ]
    assert warnings(events, since=since, skip_kinds=set()) == [
        f"Endpoints/x FailedToUpdateEndpoint x1: {other}",
        f"Pod/x FailedToCreateEndpoint x1: {race}",
    ]


def test_the_service_ip_repair_loops_race_is_not_a_defect_but_other_ip_warnings_are() -> None:
    since = when({"lastTimestamp": "2026-12-02T06:00:00Z"})
    race = "Cluster IP [IPv4]: 10.96.222.83 is not allocated; repairing"
    wrong = "the ClusterIP [IPv4]: 10.96.0.9 for Service ns/x has a wrong reference; repairing"
    events = [
        _event("Service", "2026-12-02T06:05:00Z", reason="ClusterIPNotAllocated", message=race),
        _event("Service", "2026-12-02T06:05:00Z", reason="ClusterIPNotAllocated", message=wrong),
        _event("Pod", "2026-12-02T06:05:00Z", reason="ClusterIPNotAllocated", message=race),
    ]
    assert warnings(events, since=since, skip_kinds=set()) == [
        f"Service/x ClusterIPNotAllocated x1: {wrong}",
        f"Pod/x ClusterIPNotAllocated x1: {race}",
    ]
