"""The checkpoint claim's access mode (tg_operator.claims): the pure decision, then the reconcile
pass against the in-memory ports, then the real port's answers for a missing or unreadable claim.

The same refusal on a real API server, with the operator's least-privilege account (its ``get``
on claims): tests/operator/test_k8s_operator.py.
"""

from __future__ import annotations

import json
from typing import Any, cast

import pytest
from kubernetes.client import CoreV1Api

from tests.operator.fakes import World, cluster_key, world
from tests.operator.test_reconcile_flow import drive, phase_is, run
from tg_operator import claims, rbac
from tgapi import parse_resource

ONE_POD = claims.Mounters(worker_pods=1, worker_nodes=1, tinker=False, head=False)
WITH_SERVER = claims.Mounters(worker_pods=1, worker_nodes=1, tinker=True, head=False)
TWO_NODES = claims.Mounters(worker_pods=2, worker_nodes=2, tinker=False, head=False)


@pytest.mark.parametrize(
    ("who", "modes", "refused"),
    [
        (ONE_POD, ["ReadWriteOnce"], None),
        (ONE_POD, ["ReadWriteOncePod"], None),
        (ONE_POD, ["ReadWriteMany"], None),
        (ONE_POD, ["ReadOnlyMany"], "cannot write checkpoints"),
        (WITH_SERVER, ["ReadWriteOnce"], "one node at a time"),
        (WITH_SERVER, ["ReadWriteOncePod"], "attaches to one pod"),
        (WITH_SERVER, ["ReadWriteOnce", "ReadWriteMany"], None),
        (WITH_SERVER, ["ReadOnlyMany"], "cannot write checkpoints"),
        (TWO_NODES, ["ReadWriteOnce"], "with workers on 2 nodes"),
        (TWO_NODES, ["ReadWriteMany"], None),
        (WITH_SERVER, [], None),  # modes unknown: not judged
    ],
)
def test_refusal_table(who: claims.Mounters, modes: list[str], refused: str | None) -> None:
    why = claims.refusal(who, claim="ckpt", modes=modes)
    if refused is None:
        assert why is None, why
    else:
        assert why is not None and refused in why, why
        assert why.startswith("checkpoint claim ckpt is ") and "fix: use a ReadWriteMany" in why


def test_the_message_names_the_pods_and_the_way_out() -> None:
    who = claims.Mounters(worker_pods=2, worker_nodes=1, tinker=True, head=True)
    assert claims.refusal(who, claim="ckpt", modes=["ReadWriteOnce"]) == (
        "checkpoint claim ckpt is ReadWriteOnce, which attaches to one node at a time, but "
        "2 worker pods, the Tinker server (spec.api.tinker) and the head (model.pretrained) "
        "mount it: the pods that cannot attach it would wait in ContainerCreating "
        "(Multi-Attach); fix: use a ReadWriteMany claim (an NFS, CephFS, EFS or Filestore "
        "class) in rayCluster.storage.claimName, or have one pod mount it (one worker pod, "
        "spec.api.tinker: false)"
    )


def test_the_bound_volume_s_modes_win_over_the_request() -> None:
    pending = {"spec": {"accessModes": ["ReadWriteOnce"]}, "status": {"phase": "Pending"}}
    bound = {
        "spec": {"accessModes": ["ReadWriteOnce"]},
        "status": {"accessModes": ["ReadWriteMany"]},
    }
    assert claims.access_modes(pending) == ("ReadWriteOnce",)
    assert claims.access_modes(bound) == ("ReadWriteMany",)
    assert claims.access_modes({}) == ()


def _spec_with_storage(**api: Any) -> dict[str, Any]:
    w = world()
    spec: dict[str, Any] = w.obj["spec"]
    spec["rayCluster"]["storage"] = {"claimName": "ckpt", "mountPath": "/ckpt"}
    spec["training"]["checkpointDir"] = "/ckpt/demo"
    if api:
        spec["api"] = api
    return spec


def test_who_mounts_follows_the_spec() -> None:
    w = world()
    assert claims.mounters(parse_resource(w.obj)) is None  # no storage: nothing to judge
    w.obj["spec"] = _spec_with_storage()
    who = claims.mounters(parse_resource(w.obj))
    assert who == claims.Mounters(worker_pods=1, worker_nodes=1, tinker=True, head=False)
    w.obj["spec"] = _spec_with_storage(tinker=False)
    assert claims.mounters(parse_resource(w.obj)) == ONE_POD


def _world_with_claim(modes: list[str] | None, **api: Any) -> World:
    w = world()
    w.obj["spec"] = _spec_with_storage(**api)
    if modes is not None:
        ns = w.obj["metadata"]["namespace"]
        w.kube.claims[(ns, "ckpt")] = {
            "metadata": {"name": "ckpt", "namespace": ns},
            "spec": {"accessModes": modes},
            "status": {"phase": "Bound", "accessModes": modes},
        }
    return w


def test_a_readwriteonce_claim_shared_with_the_server_fails_the_group_before_any_pod() -> None:
    w = _world_with_claim(["ReadWriteOnce"])
    run(drive(w, until=phase_is("Failed"), passes=5))
    st = w.status
    assert st["phase"] == "Failed", st
    cond = {c["type"]: c for c in st["conditions"]}["RayClusterReady"]
    assert (cond["status"], cond["reason"]) == ("False", "ClaimAccessMode")
    assert cond["message"] == st["message"]
    assert "checkpoint claim ckpt is ReadWriteOnce" in st["message"]
    assert "the Tinker server (spec.api.tinker)" in st["message"]
    assert cluster_key(w) not in w.kube.clusters and w.kube.calls["create_raycluster"] == 0
    assert ("Warning", "ClaimAccessMode", st["message"]) in w.warnings()
    # settled: the next passes read nothing more until the spec changes
    calls = w.kube.calls["get_claim"]
    run(drive(w, passes=3))
    assert w.kube.calls["get_claim"] == calls and w.status["phase"] == "Failed"


def test_a_shareable_or_single_pod_or_unknown_claim_lets_the_group_start() -> None:
    for w in (
        _world_with_claim(["ReadWriteMany"]),
        _world_with_claim(["ReadWriteOnce"], tinker=False),  # one worker pod only
        _world_with_claim(None),  # missing, or not readable (no RBAC): the pods' events tell
    ):
        run(drive(w, until=phase_is("Ready")))
        assert w.status["phase"] == "Ready", w.status
        # read once, before the cluster was created; never on the health ticks
        assert w.kube.calls["get_claim"] == 1
        run(drive(w, passes=5))
        assert w.kube.calls["get_claim"] == 1


def test_the_operator_may_get_claims_and_nothing_more() -> None:
    rules = [r for r in rbac.OPERATOR_RULES if "persistentvolumeclaims" in r["resources"]]
    assert rules == [
        {"apiGroups": [""], "resources": ["persistentvolumeclaims"], "verbs": ["get"]}
    ]


def test_the_real_port_reads_a_missing_or_forbidden_claim_as_none() -> None:
    from kubernetes.client.exceptions import ApiException

    from tg_operator import kube

    class Resp:
        data = json.dumps({"spec": {"accessModes": ["ReadWriteMany"]}})

    def port(status: int) -> Any:
        class Core:
            def read_namespaced_persistent_volume_claim(self, *args: Any, **kwargs: Any) -> Any:
                assert args[:2] == ("ckpt", "team-a")
                if status == 200:
                    return Resp()
                raise ApiException(status=status)

        api = object.__new__(kube.KubeApi)
        api._core = cast(CoreV1Api, Core())  # the one method the code calls
        api._timeout = 1.0
        return api

    def get(api: Any) -> Any:
        return run(api.get_claim(namespace="team-a", name="ckpt"))

    assert get(port(200)) == {"spec": {"accessModes": ["ReadWriteMany"]}}
    assert get(port(404)) is None
    assert get(port(403)) is None
    with pytest.raises(ApiException):
        get(port(500))
