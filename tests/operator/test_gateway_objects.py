"""The Tinker gateway's objects (tg_operator.gateway, pure builders) and their sync
(tg_operator.gateway_sync) against a recording Kubernetes client: which TrainerGroups the
gateway lists (tgruntime.gateway.discover), who owns what, the gateway's one Role, restricted
pod security, the NetworkPolicies both ways, the settings."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tg_operator import gateway, gateway_sync
from tg_operator.settings import OperatorConfig, SettingsError


def _tg(name: str, *, ns: str = "ml") -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": ns, "uid": f"uid-{name}"},
        "spec": {"image": f"runtime:{name}", "model": {"name": f"org/{name}"}},
        "status": {"apiURL": f"http://{name}-tinker.{ns}.svc:8000"},
    }


def _entries(*bodies: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in (gateway.group_entry(b) for b in bodies) if e is not None]


def test_the_gateway_lists_serving_groups_as_the_operator_names_them() -> None:
    from tgruntime.gateway.discover import groups_from_trainergroups

    pending = _tg("later")
    pending["status"] = {}  # no apiURL yet: not routed to
    deleting = _tg("gone")
    deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    items = [_tg("teacher"), _tg("student"), pending, deleting]
    groups = groups_from_trainergroups(items, cluster=False)
    assert [(g.name, g.url, g.models) for g in groups] == [
        ("student", "http://student-tinker.ml.svc:8000", ("org/student", "student")),
        ("teacher", "http://teacher-tinker.ml.svc:8000", ("org/teacher", "teacher")),
    ]
    assert [g.name for g in groups_from_trainergroups(items, cluster=True)] == [
        "ml.student", "ml.teacher"]
    assert gateway.group_entry(deleting) is None


def test_gateway_objects_owners_and_restricted_pod() -> None:
    entries = _entries(_tg("b"), _tg("a"))
    dep = gateway.build_deployment("ml", entries, image="runtime:a", python="python3")
    # every group owns the Deployment (none as controller): it goes with the last of them
    assert [(o["name"], o["controller"]) for o in dep["metadata"]["ownerReferences"]] == [
        ("a", False), ("b", False)]
    objs = gateway.objects("ml", "dep-uid")
    assert [o["kind"] for o in objs] == [
        "ServiceAccount", "Role", "RoleBinding", "Service", "NetworkPolicy"]
    for o in objs:  # owned by the Deployment, so collected with it
        assert o["metadata"]["ownerReferences"][0]["uid"] == "dep-uid"
    sa, role, binding, _svc, np_ = objs
    assert role["rules"] == [{"apiGroups": ["trainergroup.io"], "resources": ["trainergroups"],
                              "verbs": ["get", "list", "watch"]}]
    assert binding["subjects"][0]["name"] == sa["metadata"]["name"] == "tinker-gateway"
    pod = dep["spec"]["template"]["spec"]
    # a start waits in one startup exec on healthz (no Unhealthy event from an early probe)
    startup = pod["containers"][0]["startupProbe"]
    assert "/healthz" in startup["exec"]["command"][-1] and startup["failureThreshold"] == 1
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (c,) = pod["containers"]
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["command"][:5] == ["python3", "-m", "tgruntime.gateway", "--trainergroups", "ml"]
    assert c["resources"]["limits"]
    rule = np_["spec"]["ingress"][0]
    assert rule["from"][0]["podSelector"]["matchExpressions"][0]["operator"] == "Exists"
    assert "namespaceSelector" not in rule["from"][0]
    # cluster-wide: '*', no owners, no Role (the chart's ClusterRole), any namespace's clients
    wide = gateway.build_deployment("ops", entries, image="i", python="p", cluster=True)
    assert "--trainergroups" in wide["spec"]["template"]["spec"]["containers"][0]["command"]
    assert "*" in wide["spec"]["template"]["spec"]["containers"][0]["command"]
    assert "ownerReferences" not in wide["metadata"]
    assert "Role" not in [o["kind"] for o in gateway.objects("ops", "u", cluster=True)]
    cluster_np = gateway.build_networkpolicy("ops", "u", cluster=True)
    assert cluster_np["spec"]["ingress"][0]["from"][0]["namespaceSelector"] == {}
    assert gateway.image_of(entries, "") == "runtime:a"
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

    async def apply_owned_deployment(self, body: dict[str, Any]) -> str:
        self.applied.append(body)
        return "dep-uid"

    async def create_object(self, body: dict[str, Any]) -> bool:
        self.created.append(body["kind"])
        return True

    async def scale_deployment(self, namespace: str, name: str, replicas: int) -> None:
        self.created.append(f"scale {name} {replicas}")


def test_sync_applies_only_changes() -> None:
    kube, done = Recorder(), dict[str, str]()
    one = _entries(_tg("a"))

    def sync(entries: list[dict[str, Any]], *, cluster: bool = False, ns: str = "ml") -> bool:
        return asyncio.run(gateway_sync.sync(
            kube, namespace=ns, entries=entries, cluster=cluster, image="", python="python",
            done=done,
        ))

    assert sync(one) and len(kube.applied) == 1
    # created with no pods, its ServiceAccount (owned by it) after it, then scaled up: a pod
    # never waits for a ServiceAccount that is not there yet
    assert kube.applied[0]["spec"]["replicas"] == 0
    assert kube.created == ["ServiceAccount", "Role", "RoleBinding", "Service", "NetworkPolicy",
                            "scale tinker-gateway 1"]
    assert not sync(one) and len(kube.applied) == 1  # unchanged: nothing applied
    assert sync(one + _entries(_tg("b"))) and len(kube.applied) == 2  # a new owner merged
    assert [o["name"] for o in kube.applied[-1]["metadata"]["ownerReferences"]] == ["a", "b"]
    assert not sync([])  # the last group gone: the garbage collector's job
    kube.created.clear()
    assert sync(one, cluster=True, ns="ops")
    assert kube.created == ["ServiceAccount", "Service", "NetworkPolicy", "NetworkPolicy",
                            "scale tinker-gateway 1"]
    assert gateway_sync.index_key(mode="off", namespace="ml") is None
    assert gateway_sync.index_key(mode="cluster", namespace="ml") == ""


def test_gateway_setting() -> None:
    assert OperatorConfig.from_env({}).gateway == "off"  # the chart sets "namespace"
    cfg = OperatorConfig.from_env({"TG_GATEWAY": "cluster", "TG_GATEWAY_IMAGE": "gw:1"})
    assert (cfg.gateway, cfg.gateway_image) == ("cluster", "gw:1")
    with pytest.raises(SettingsError, match="TG_GATEWAY='everywhere'"):
        OperatorConfig.from_env({"TG_GATEWAY": "everywhere"})
