"""The Tinker gateway's objects (tg_operator.gateway, pure builders) and their sync
(tg_operator.gateway_sync) against a recording Kubernetes client: which groups are listed,
who owns what, restricted pod security, the NetworkPolicies both ways, the settings."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tg_operator import gateway, gateway_sync
from tg_operator.settings import OperatorConfig, SettingsError


def _tg(name: str, *, url: str = "", model: str | None = None, ns: str = "ml") -> dict[str, Any]:
    spec: dict[str, Any] = {"image": f"runtime:{name}", "model": {}}
    if model:
        spec["model"]["name"] = model
    return {
        "metadata": {"name": name, "namespace": ns, "uid": f"uid-{name}"},
        "spec": spec,
        "status": {"apiURL": url} if url else {},
    }


def _entries(*bodies: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in (gateway.group_entry(b) for b in bodies) if e is not None]


def test_groups_listed_once_they_serve() -> None:
    a = _tg("student", url="http://student-tinker.ml.svc:8000", model="org/student")
    b = _tg("teacher", url="http://teacher-tinker.ml.svc:8000")
    pending = _tg("later", model="org/later")  # no apiURL yet: not routed to
    entries = _entries(b, a, pending)
    doc = gateway.config_doc(entries)
    assert doc == {"groups": [
        {"name": "student", "url": "http://student-tinker.ml.svc:8000",
         "models": ["org/student", "student"]},
        {"name": "teacher", "url": "http://teacher-tinker.ml.svc:8000", "models": ["teacher"]},
    ]}
    # the runtime's parser reads what the operator writes
    from tgruntime.gateway.groups import from_document

    cm = gateway.build_configmap("ml", entries)
    groups = from_document(json.loads(cm["data"][gateway.CONFIG_FILE]), "cm")
    assert [g.models for g in groups] == [("org/student", "student"), ("teacher",)]
    # every group owns the list (none as controller): it goes with the last of them
    assert [(o["name"], o["controller"]) for o in cm["metadata"]["ownerReferences"]] == [
        ("student", False), ("teacher", False)]
    cluster = gateway.config_doc(entries, cluster=True)
    assert [g["name"] for g in cluster["groups"]] == ["ml.student", "ml.teacher"]
    deleting = _tg("x", url="http://x")
    deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert gateway.group_entry(deleting) is None


def test_gateway_pod_is_restricted_and_reads_no_api() -> None:
    objs = gateway.objects("ml", "cm-uid", image="runtime:a", python="python3")
    kinds = [o["kind"] for o in objs]
    assert kinds == ["ServiceAccount", "Service", "NetworkPolicy", "Deployment"]
    for o in objs:  # owned by the ConfigMap, so collected with it
        assert o["metadata"]["ownerReferences"][0]["uid"] == "cm-uid"
    sa, _svc, np_, dep = objs
    assert sa["automountServiceAccountToken"] is False
    pod = dep["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (c,) = pod["containers"]
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["command"][:3] == ["python3", "-m", "tgruntime.gateway"]
    assert "--config" in c["command"] and c["resources"]["limits"]
    rule = np_["spec"]["ingress"][0]
    assert rule["from"][0]["podSelector"]["matchExpressions"][0]["operator"] == "Exists"
    assert "namespaceSelector" not in rule["from"][0]
    cluster_np = gateway.build_networkpolicy("ops", "u", cluster=True)
    assert cluster_np["spec"]["ingress"][0]["from"][0]["namespaceSelector"] == {}
    assert gateway.image_of(_entries(_tg("b", url="http://b"), _tg("a", url="http://a")),
                            "") == "runtime:a"
    assert gateway.image_of([], "gw:1") == "gw:1"


def test_group_server_admits_the_gateway() -> None:
    from tests.operator.helpers import BASE_SPEC, trainergroup
    from tg_operator import tinker

    tg = trainergroup(spec=BASE_SPEC)
    peers = tinker.build_networkpolicy(tg)["spec"]["ingress"][0]["from"]
    assert {"podSelector": {"matchLabels": {gateway.GATEWAY_LABEL: "true"}}} in peers
    assert gateway.SERVER_LABEL == tinker.SERVER_LABEL
    # cluster-wide, a policy of its own in the group's namespace admits the gateway's
    cross = gateway.build_cross_namespace_ingress("ml", "ops")
    (peer,) = cross["spec"]["ingress"][0]["from"]
    assert peer["namespaceSelector"] == {"matchLabels": {gateway.NAMESPACE_LABEL: "ops"}}
    assert cross["metadata"]["namespace"] == "ml"


class Recorder:
    """A Kubernetes client that records what it is asked (its answers are what the API
    server answers to a first create)."""

    def __init__(self) -> None:
        self.applied: list[dict[str, Any]] = []
        self.created: list[str] = []

    async def apply_configmap(self, body: dict[str, Any]) -> str:
        self.applied.append(body)
        return "cm-uid"

    async def create_object(self, body: dict[str, Any]) -> bool:
        self.created.append(body["kind"])
        return True


def test_sync_writes_only_changes() -> None:
    kube, done = Recorder(), dict[str, str]()
    entries = _entries(_tg("a", url="http://a-tinker.ml.svc:8000", model="org/a"))

    def sync(entries: list[dict[str, Any]]) -> bool:
        return asyncio.run(gateway_sync.sync(
            kube, namespace="ml", entries=entries, cluster=False, image="", python="python",
            done=done,
        ))

    assert sync(entries) and len(kube.applied) == 1
    assert kube.created == ["ServiceAccount", "Service", "NetworkPolicy", "Deployment"]
    assert not sync(entries) and len(kube.applied) == 1  # unchanged: nothing written
    more = entries + _entries(_tg("b", url="http://b-tinker.ml.svc:8000"))
    assert sync(more) and len(kube.applied) == 2
    assert not sync([])  # the last group gone: the garbage collector's job
    kube.created.clear()
    asyncio.run(gateway_sync.sync(
        kube, namespace="ops", entries=entries, cluster=True, image="gw:1", python="python",
        done=done,
    ))
    assert kube.created[-1] == "NetworkPolicy" and len(kube.created) == 5  # + ml's ingress
    assert gateway_sync.index_key(mode="off", namespace="ml") is None
    assert gateway_sync.index_key(mode="cluster", namespace="ml") == ""


def test_gateway_setting() -> None:
    assert OperatorConfig.from_env({}).gateway == "namespace"
    cfg = OperatorConfig.from_env({"TG_GATEWAY": "cluster", "TG_GATEWAY_IMAGE": "gw:1"})
    assert (cfg.gateway, cfg.gateway_image) == ("cluster", "gw:1")
    with pytest.raises(SettingsError, match="TG_GATEWAY='everywhere'"):
        OperatorConfig.from_env({"TG_GATEWAY": "everywhere"})
