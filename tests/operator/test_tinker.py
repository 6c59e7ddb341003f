"""The Tinker API server of a group (``spec.api.tinker``): the pure builders of its objects
and the decide() rows that create them and publish ``status.apiURL`` (pure, no fakes); the
same objects through the executor and the fake Kubernetes port at the end."""

from __future__ import annotations

import asyncio
import base64
import copy
from pathlib import Path
from typing import Any

import pytest

from tests.operator.fakes import world
from tests.operator.helpers import BASE_SPEC, trainergroup
from tests.operator.snapshots import SETTINGS, actors, running, snap
from tg_operator import decide, networkpolicy, reconcile, spec_change, tinker
from tg_operator.snapshot import ServeTinker, Snapshot, TinkerSeen
from tgapi import TrainerGroup

TG = trainergroup()
PY = "python"


def _tg(**api: Any) -> TrainerGroup:
    spec = copy.deepcopy(BASE_SPEC)
    spec["api"] = api
    return trainergroup(spec=spec)


def _available(tg: TrainerGroup = TG) -> dict[str, Any]:
    dep = tinker.build_deployment(tg, python=PY)
    dep["status"] = {
        "availableReplicas": 1,
        "conditions": [{"type": "Available", "status": "True"}],
    }
    return dep


def _owned(obj: dict[str, Any], tg: TrainerGroup = TG) -> None:
    (ref,) = obj["metadata"]["ownerReferences"]
    assert ref["kind"] == "TrainerGroup" and ref["name"] == tg.name and ref["uid"] == tg.uid
    assert ref["controller"] is True and ref["blockOwnerDeletion"] is True
    assert obj["metadata"]["namespace"] == tg.namespace
    assert obj["metadata"]["labels"][tinker.SERVER_LABEL] == tg.name


# -- builders -----------------------------------------------------------------------------------
def test_tinker_is_on_by_default_with_one_server_on_port_8000() -> None:
    assert tinker.wanted(TG)
    assert tinker.server_name(TG) == "demo-tinker"
    assert tinker.keys_secret_name(TG) == "demo-tinker-keys"
    assert tinker.base_url(TG) == "http://demo-tinker.team-a.svc:8000"
    assert not tinker.wanted(_tg(tinker=False))


def test_every_object_is_owned_by_the_group_and_the_deployment_comes_last() -> None:
    objs = tinker.objects(TG, python=PY)
    kinds = [o["kind"] for o in objs]
    assert kinds == [
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "Service",
        "NetworkPolicy",
        "Deployment",
    ]
    for o in (*objs, tinker.build_keys_secret(TG, key=tinker.new_api_key())):
        _owned(o)


def test_the_keys_secret_holds_one_random_tml_key() -> None:
    a, b = tinker.new_api_key(), tinker.new_api_key()
    assert a.startswith("tml-") and b.startswith("tml-") and a != b and len(a) >= 40
    secret = tinker.build_keys_secret(TG, key=a)
    assert secret["metadata"]["name"] == "demo-tinker-keys"
    assert secret["data"] == {"default": base64.b64encode(a.encode()).decode()}
    with pytest.raises(ValueError, match="tml-"):
        tinker.build_keys_secret(TG, key="not-a-key")


def test_the_service_selects_the_server_pod_on_port_8000() -> None:
    svc = tinker.build_service(TG)
    assert svc["metadata"]["name"] == "demo-tinker"
    assert svc["spec"]["selector"] == {tinker.SERVER_LABEL: "demo"}
    assert svc["spec"]["ports"] == [
        {"name": "http", "protocol": "TCP", "port": 8000, "targetPort": "http"}
    ]
    assert tinker.build_service(_tg(server={"port": 9000}))["spec"]["ports"][0]["port"] == 9000


def test_the_networkpolicy_admits_labelled_clients_on_the_port_and_the_ray_pods() -> None:
    pol = tinker.build_networkpolicy(TG)
    assert pol["spec"]["podSelector"] == {"matchLabels": {tinker.SERVER_LABEL: "demo"}}
    assert pol["spec"]["policyTypes"] == ["Ingress"]
    clients, ray = pol["spec"]["ingress"]
    assert clients == {
        "from": [
            {"podSelector": {"matchLabels": {networkpolicy.CLIENT_LABEL: "demo"}}},
            {"podSelector": {"matchLabels": {"trainergroup.io/gateway": "true"}}},
        ],
        "ports": [{"protocol": "TCP", "port": 8000}],
    }
    # the server is a Ray driver: the group's Ray pods call back into it (all ports)
    assert ray == {"from": [{"podSelector": {"matchLabels": {"ray.io/cluster": "demo"}}}]}
    # no namespaceSelector anywhere: only pods of the group's own namespace
    assert "namespaceSelector" not in str(pol["spec"])


def test_the_deployment_runs_the_server_entrypoint_from_the_runtime_image() -> None:
    dep = tinker.build_deployment(TG, python="/opt/venv/bin/python")
    spec = dep["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    assert spec["selector"] == {"matchLabels": {tinker.SERVER_LABEL: "demo"}}
    pod = spec["template"]
    labels = pod["metadata"]["labels"]
    assert labels[tinker.SERVER_LABEL] == "demo"
    assert labels[networkpolicy.CLIENT_LABEL] == "demo"  # the Ray NetworkPolicy admits it
    ps = pod["spec"]
    assert ps["serviceAccountName"] == "demo-tinker"
    (c,) = ps["containers"]
    assert c["image"] == TG.spec.image
    assert c["command"][:2] == ["bash", "-ceu"] and "ray start" in c["command"][2]
    assert c["command"][4:] == tinker.server_args(TG, python="/opt/venv/bin/python")
    assert tinker.server_args(TG, python="/opt/venv/bin/python") == [
        "/opt/venv/bin/python",
        "-m",
        "tgruntime.service",
        "--trainergroup",
        "demo",
        "--k8s-namespace",
        "team-a",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--keys-dir",
        "/etc/tinker/keys",
    ]
    env = {e["name"]: e for e in c["env"]}
    assert env["TG_TINKER_KEYS_DIR"]["value"] == tinker.KEYS_DIR
    assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "demo-ray-token"
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["keys"] == {"name": "keys", "mountPath": tinker.KEYS_DIR, "readOnly": True}
    volumes = {v["name"]: v for v in ps["volumes"]}
    # a volume, not env: the kubelet updates it, so a key removed from the Secret stops working
    assert volumes["keys"]["secret"]["secretName"] == "demo-tinker-keys"
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}  # half of 2Gi
    assert c["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    # liveness only once the server has answered: the start waits for the group (minutes)
    # (one exec that waits for healthz 200: a normal start posts no Unhealthy event)
    startup = c["startupProbe"]
    script = startup["exec"]["command"][-1]
    assert "/healthz" in script and f"/dev/tcp/127.0.0.1/{tinker.port(TG)}" in script
    assert startup["timeoutSeconds"] == tinker.STARTUP_LIMIT_S
    assert startup["failureThreshold"] == 1
    assert "initialDelaySeconds" not in c["livenessProbe"]
    # CPU requested, not capped (a cap at a small request throttles the start); memory both
    assert c["resources"]["requests"] == {"cpu": "1", "memory": "2Gi"}
    assert c["resources"]["limits"] == {"memory": "2Gi"}
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert dep["metadata"]["annotations"][tinker.HASH_ANNOTATION]


def _startup_check_waits_then_passes(tmp_path: Path) -> None:
    """The TLS startup check, run as the pod runs it (bash, this Python): it keeps polling in
    one process while nothing answers, and exits 0 once the HTTPS healthz answers 200."""
    import functools
    import http.server
    import socket
    import ssl
    import subprocess
    import sys
    import threading

    from tests.service.pki import make_pki

    pki = make_pki(tmp_path / "pki")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    spec = {**BASE_SPEC, "api": {"tls": {"secretName": "x"}, "server": {"port": free}}}
    check = tinker._healthy(trainergroup(spec=spec), python=sys.executable)
    waiting = subprocess.Popen(["bash", "-c", check])
    srv = None
    try:
        with pytest.raises(subprocess.TimeoutExpired):  # nothing listens yet: still polling
            waiting.wait(timeout=4)
        (tmp_path / "www").mkdir()
        (tmp_path / "www" / "healthz").write_text("ok")
        handler = functools.partial(
            http.server.SimpleHTTPRequestHandler, directory=str(tmp_path / "www"))
        srv = http.server.HTTPServer(("127.0.0.1", free), handler)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(pki["cert"], pki["key"])
        srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        assert waiting.wait(timeout=30) == 0
    finally:
        waiting.kill()
        if srv is not None:
            srv.shutdown()


def test_tls_and_admin_principals_reach_the_pod_and_the_api_url(tmp_path: Path) -> None:
    """spec.api.tls: the Secret mounted read-only, the flags, HTTPS probes and an https://
    apiURL; spec.api.adminPrincipals: --admin-principals. The server's own parser takes the
    command line the operator builds."""
    tg = _tg(adminPrincipals=["ops", "sre"], tls={"secretName": "demo-tls"})
    args = tinker.server_args(tg, python=PY)
    assert args[-6:] == [
        "--admin-principals", "ops,sre",
        "--tls-cert", "/etc/tinker/tls/tls.crt", "--tls-key", "/etc/tinker/tls/tls.key",
    ]
    dep = tinker.build_deployment(tg, python=PY)
    ps = dep["spec"]["template"]["spec"]
    (c,) = ps["containers"]
    assert c["command"][4:] == args
    volumes = {v["name"]: v for v in ps["volumes"]}
    assert volumes["tls"]["secret"] == {
        "secretName": "demo-tls",
        "defaultMode": 0o444,
        "items": [{"key": "tls.crt", "path": "tls.crt"}, {"key": "tls.key", "path": "tls.key"}],
    }
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["tls"] == {"name": "tls", "mountPath": tinker.TLS_DIR, "readOnly": True}
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "http", "scheme": "HTTPS"}
    script = c["startupProbe"]["exec"]["command"][-1]
    assert "https://127.0.0.1:8000/healthz" in script and script.count(f'"{PY}" -c') == 1
    assert "/dev/tcp" not in script  # bash cannot speak TLS
    _startup_check_waits_then_passes(tmp_path)
    assert tinker.base_url(tg) == "https://demo-tinker.team-a.svc:8000"
    assert tinker.api_url(tg, _available(tg)) == "https://demo-tinker.team-a.svc:8000"
    assert tinker.api_url(tg, None) == ""
    # a pod of another spec: turning TLS on replaces the template (the hash differs)
    plain = tinker.build_deployment(TG, python=PY)
    ann = tinker.HASH_ANNOTATION
    assert plain["metadata"]["annotations"][ann] != dep["metadata"]["annotations"][ann]
    assert tinker.outdated(tg, plain, python=PY)
    (pc,) = plain["spec"]["template"]["spec"]["containers"]
    assert "tls" not in {m["name"] for m in pc["volumeMounts"]}
    assert not {"--tls-cert", "--admin-principals"} & set(pc["command"])
    assert "scheme" not in pc["readinessProbe"]["httpGet"]
    # the server's flags take them (the light modules: the operator's tests load no Ray)
    import argparse

    from tgruntime.service import policy, tls

    parser = argparse.ArgumentParser()
    policy.add_flags(parser)
    tls.add_flags(parser)
    parsed, _ = parser.parse_known_args(args[3:])
    assert (parsed.admin_principals, parsed.tls_cert, parsed.tls_key) == (
        "ops,sre", "/etc/tinker/tls/tls.crt", "/etc/tinker/tls/tls.key",
    )
    assert policy.from_args(parsed).admins == {"ops", "sre"}


def test_tls_and_admin_names_are_checked_naming_the_field() -> None:
    from tgapi import SpecErrors

    with pytest.raises(SpecErrors, match=r"spec\.api\.adminPrincipals\[0\]: '\.\./x'"):
        _tg(adminPrincipals=["../x"])
    with pytest.raises(SpecErrors, match=r"spec\.api\.tls\.secretName: is required"):
        _tg(tls={})
    with pytest.raises(SpecErrors, match=r"spec\.api\.tls\.secretName"):
        _tg(tls={"secretName": "Not_A_Name"})
    # caBundle: PEM certificates or nothing; it is the gateway's, not the pod's (no rollout)
    with pytest.raises(SpecErrors, match=r"spec\.api\.tls\.caBundle: .*wrong format"):
        _tg(tls={"secretName": "demo-tls", "caBundle": "not a certificate"})
    pem = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
    with_ca = _tg(tls={"secretName": "demo-tls", "caBundle": pem})
    assert with_ca.spec.api.tls is not None and with_ca.spec.api.tls.ca_bundle == pem
    without = _tg(tls={"secretName": "demo-tls"})
    assert not tinker.outdated(with_ca, tinker.build_deployment(without, python=PY), python=PY)


def test_a_group_on_a_referenced_cluster_gets_a_server_without_a_claim() -> None:
    """rayClusterRef: the referenced cluster's volumes are not the operator's to know (the
    builder raised ValueError here, and the reconcile of such a group never got past it)."""
    spec = copy.deepcopy(BASE_SPEC)
    spec.pop("rayCluster", None)
    spec["rayClusterRef"] = {"name": "shared"}
    tg = trainergroup(spec=spec)
    (c,) = tinker.build_deployment(tg, python=PY)["spec"]["template"]["spec"]["containers"]
    assert "checkpoints" not in {m["name"] for m in c["volumeMounts"]}
    assert [o["kind"] for o in tinker.objects(tg, python=PY)][-1] == "Deployment"


def test_server_settings_reach_the_pod() -> None:
    tg = _tg(
        server={
            "port": 9000,
            "cpu": "1",
            "memory": "2Gi",
            "nodeSelector": {"pool": "cpu"},
            "tolerations": [{"key": "k", "operator": "Exists"}],
            "podLabels": {"team": "rl", tinker.SERVER_LABEL: "spoofed"},
            "podAnnotations": {"a": "b"},
        }
    )
    pod = tinker.build_deployment(tg, python=PY)["spec"]["template"]
    assert pod["metadata"]["labels"]["team"] == "rl"
    assert pod["metadata"]["labels"][tinker.SERVER_LABEL] == "demo"  # the operator's win
    assert pod["metadata"]["annotations"] == {"a": "b"}
    assert pod["spec"]["nodeSelector"] == {"pool": "cpu"}
    assert pod["spec"]["tolerations"] == [{"key": "k", "operator": "Exists"}]
    (c,) = pod["spec"]["containers"]
    assert c["ports"][0]["containerPort"] == 9000
    assert c["command"][c["command"].index("--port") + 1] == "9000"
    assert c["resources"]["limits"] == {"memory": "2Gi"}


def test_the_servers_role_reads_its_own_trainergroup_only() -> None:
    role = tinker.build_role(TG)
    assert role["rules"] == [
        {
            "apiGroups": ["trainergroup.io"],
            "resources": ["trainergroups"],
            "resourceNames": ["demo"],
            "verbs": ["get", "watch"],
        }
    ]
    binding = tinker.build_role_binding(TG)
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "demo-tinker",
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "demo-tinker", "namespace": "team-a"}
    ]


def test_replicas_other_than_one_are_refused_naming_the_field() -> None:
    from tgapi import SpecErrors

    with pytest.raises(SpecErrors, match=r"spec\.api\.server\.replicas: 2 is too large"):
        _tg(server={"replicas": 2})


def test_availability_and_the_api_url() -> None:
    assert not tinker.available(None)
    assert not tinker.available(tinker.build_deployment(TG, python=PY))  # no status yet
    assert tinker.available(_available())
    dep = _available()
    dep["status"]["conditions"] = [{"type": "Available", "status": "False"}]
    assert not tinker.available(dep)
    dep = _available()
    dep["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert not tinker.available(dep)
    dep = _available()
    dep["status"]["availableReplicas"] = "1"  # garbage in a status: not available, no crash
    assert not tinker.available(dep)
    assert tinker.api_url(TG, _available()) == "http://demo-tinker.team-a.svc:8000"
    assert tinker.api_url(TG, None) == ""


def test_the_index_keeps_a_slim_deployment_keyed_by_group() -> None:
    entry = tinker.deployment_entry(namespace="team-a", body=_available())
    ((key, slim),) = entry.items()
    assert key == ("team-a", "demo")
    assert tinker.available(slim)
    assert "spec" not in slim
    assert tinker.deployment_entry(namespace="team-a", body={"metadata": {"labels": {}}}) == {}


# -- decide() rows ------------------------------------------------------------------------------
NO_TINKER = _tg(tinker=False)
WITHOUT_STORAGE = TG


def _with_storage() -> TrainerGroup:
    spec = copy.deepcopy(BASE_SPEC)
    spec["rayCluster"] = {**spec["rayCluster"], "storage": {"claimName": "ckpt"}}
    spec["training"] = {**spec.get("training", {}), "checkpointDir": "/checkpoints/demo"}
    return trainergroup(spec=spec)


WITH_STORAGE = _with_storage()
# the group re-created on the new spec (the respec rule acted first): Ready again
RUNNING_WITH_STORAGE = dict(
    spec_hash=spec_change.group_hash(WITH_STORAGE.spec),
    cluster_hash=spec_change.cluster_hash(WITH_STORAGE.spec),
)
MISSING = TinkerSeen(deployment=None)

# id -> (snapshot, rule, action type, status.apiURL written)
ROWS: dict[str, tuple[Snapshot, str, type | None, str]] = {
    "deployment-missing-creates-the-server": (
        snap(status=running(), actors=actors(), tinker=MISSING),
        "serve-tinker",
        ServeTinker,
        "",
    ),
    "deployment-not-available-yet-no-url": (
        snap(
            status=running(),
            actors=actors(),
            tinker=TinkerSeen(deployment=tinker.build_deployment(TG, python=PY)),
        ),
        "watch",
        None,
        "",
    ),
    "deployment-available-publishes-the-url": (
        snap(status=running(), actors=actors(), tinker=TinkerSeen(deployment=_available())),
        "watch",
        None,
        "http://demo-tinker.team-a.svc:8000",
    ),
    "server-became-unavailable-clears-the-url": (
        snap(
            status=running(api_url="http://demo-tinker.team-a.svc:8000"),
            actors=actors(),
            tinker=TinkerSeen(deployment=None),
        ),
        "serve-tinker",
        ServeTinker,
        "",
    ),
    "not-looked-at-keeps-the-url": (
        snap(status=running(api_url="http://demo-tinker.team-a.svc:8000"), actors=actors()),
        "watch",
        None,
        "http://demo-tinker.team-a.svc:8000",
    ),
    "tinker-off-creates-nothing-and-clears-the-url": (
        snap(
            tg=NO_TINKER,
            status=running(api_url="http://demo-tinker.team-a.svc:8000"),
            actors=actors(),
        ),
        "watch",
        None,
        "",
    ),
    "outdated-deployment-gets-the-new-pod-template": (
        snap(
            status=running(**RUNNING_WITH_STORAGE),
            actors=actors(),
            tinker=TinkerSeen(deployment=_available(WITHOUT_STORAGE)),
            tg=WITH_STORAGE,
        ),
        "update-tinker",
        ServeTinker,
        "http://demo-tinker.team-a.svc:8000",
    ),
    "missing-cluster-comes-first": (
        snap(raycluster=None, pods=(), tinker=MISSING),
        "create-cluster",
        None,  # CreateCluster; the server follows at the next pass
        "",
    ),
    "available-while-a-worker-died-keeps-the-url": (
        snap(
            status=running(restarts=2, next_restart_time="2099-01-01T00:00:00Z"),
            actors=actors("w0-0"),
            tinker=TinkerSeen(deployment=_available()),
        ),
        "restart-back-off",
        None,
        "http://demo-tinker.team-a.svc:8000",
    ),
}


def test_a_spec_change_that_changes_the_pod_replaces_the_template_and_nothing_else() -> None:
    """rayCluster.storage added to a running group (the kind suite's resume phase): the server
    keeps its state on the claim, so its pod must mount it; the Deployment built before
    lacked it and the server crash-looped on 'Permission denied: /checkpoints'."""
    old = _available(WITHOUT_STORAGE)
    assert tinker.outdated(WITH_STORAGE, old, python=PY)
    assert not tinker.outdated(WITHOUT_STORAGE, old, python=PY)
    assert not tinker.outdated(WITH_STORAGE, None, python=PY)
    going = copy.deepcopy(old)
    going["metadata"]["deletionTimestamp"] = "2026-12-02T00:00:00Z"
    assert not tinker.outdated(WITH_STORAGE, going, python=PY)
    seen = snap(
        status=running(**RUNNING_WITH_STORAGE),
        actors=actors(),
        tinker=TinkerSeen(deployment=old),
        tg=WITH_STORAGE,
    )
    d = decide.decide(seen, settings=SETTINGS)
    assert isinstance(d.action, ServeTinker) and d.action.update
    (body,) = d.action.bodies
    assert body["kind"] == "Deployment"  # the keys Secret and the other objects stay
    (c,) = body["spec"]["template"]["spec"]["containers"]
    assert {"name": "checkpoints", "mountPath": "/checkpoints"} in c["volumeMounts"]
    # once the watch shows the new template, nothing more to do
    new = _available(WITH_STORAGE)
    again = snap(
        status=running(**RUNNING_WITH_STORAGE),
        actors=actors(),
        tinker=TinkerSeen(deployment=new),
        tg=WITH_STORAGE,
    )
    assert decide.decide(again, settings=SETTINGS).rule == "watch"


@pytest.mark.parametrize(("seen", "rule", "action", "url"), ROWS.values(), ids=ROWS.keys())
def test_decide(seen: Snapshot, rule: str, action: type | None, url: str) -> None:
    d = decide.decide(seen, settings=SETTINGS)
    assert d.rule == rule, d
    if action is not None:
        assert type(d.action) is action, d.action
    elif rule == "create-cluster":
        assert d.action is not None and type(d.action).__name__ == "CreateCluster"
    else:
        assert d.action is None, d.action
    assert d.status.api_url == url, d.status


def test_serve_tinker_keeps_the_status_and_carries_no_key() -> None:
    seen = snap(status=running(), actors=actors(), tinker=MISSING)
    d = decide.decide(seen, settings=SETTINGS)
    assert isinstance(d.action, ServeTinker)
    assert d.status.phase == "Ready" and not d.step.done
    assert d.action.secret_name == "demo-tinker-keys"
    assert [b["kind"] for b in d.action.bodies][-1] == "Deployment"
    # the key is drawn by the executor, never in the pure decision (nor twice the same)
    assert "tinker-keys" not in str([b["metadata"]["name"] for b in d.action.bodies])
    assert decide.decide(seen, settings=SETTINGS).action == d.action


# -- through the executor and the fake port -----------------------------------------------------
def test_the_reconcile_creates_the_server_once_and_never_replaces_the_key() -> None:
    from tests.operator.test_reconcile_flow import drive, phase_is

    w = world()
    asyncio.run(drive(w, until=phase_is("Ready")))
    kinds = sorted(k for k, ns, _ in w.kube.objects if ns == "team-a")
    assert kinds == sorted(
        [
            "Deployment",
            "NetworkPolicy",
            "Role",
            "RoleBinding",
            "Secret",
            "Service",
            "ServiceAccount",
        ]
    )
    key = w.kube.objects[("Secret", "team-a", "demo-tinker-keys")]["data"]["default"]
    assert base64.b64decode(key).decode().startswith("tml-")
    assert "TinkerKeysCreated" in w.reasons() and "TinkerServerCreated" in w.reasons()
    assert w.status.get("apiURL", "") == ""  # not available yet
    w.kube.make_tinker_available("team-a", "demo")
    asyncio.run(drive(w, passes=2))
    assert w.status["apiURL"] == "http://demo-tinker.team-a.svc:8000"
    # the Deployment deleted by hand: re-created, and the Secret (with its key) left alone
    del w.kube.objects[("Deployment", "team-a", "demo-tinker")]
    creates = w.kube.calls["create_secret"]
    asyncio.run(drive(w, passes=3))
    assert ("Deployment", "team-a", "demo-tinker") in w.kube.objects
    assert w.kube.objects[("Secret", "team-a", "demo-tinker-keys")]["data"]["default"] == key
    assert w.kube.calls["create_secret"] == creates + 1  # tried once, answered "exists"
    assert w.status["apiURL"] == ""


def test_a_server_the_watch_does_not_show_yet_is_not_created_twice() -> None:
    """Passes between the create and the watch's view of the Deployment create nothing (a
    second Service create would allocate a ClusterIP the API server then reclaims with a
    Warning event); once the grace has passed unseen, the server counts as missing again."""
    from tests.operator.test_reconcile_flow import drive

    w = world()
    w.kube.watch_lags.add(("team-a", "demo"))
    asyncio.run(drive(w, until=lambda w: w.kube.calls["create_deployment"] == 1))
    asyncio.run(drive(w, passes=2))  # 10 s apart: within the grace
    assert w.kube.calls["create_service"] == w.kube.calls["create_deployment"] == 1
    w.clock.advance(reconcile.TINKER_WATCH_GRACE.total_seconds() + 1)
    asyncio.run(drive(w, passes=2))
    assert w.kube.calls["create_deployment"] == 2  # unseen past the grace: tried again
    w.kube.watch_lags.clear()
    asyncio.run(drive(w, passes=3))
    assert w.kube.calls["create_deployment"] == 2 and w.ctx.tinker_created == {}


def test_the_reconcile_replaces_an_outdated_pod_template_once_and_keeps_the_key() -> None:
    """update-tinker through the executor and the fake port: a Deployment built from another
    spec (its hash differs) gets the current template by one update; the Secret stays."""
    from tests.operator.test_reconcile_flow import drive, phase_is

    w = world()
    asyncio.run(drive(w, until=phase_is("Ready")))
    dep = w.kube.objects[("Deployment", "team-a", "demo-tinker")]
    want = copy.deepcopy(dep["spec"]["template"])
    key = w.kube.objects[("Secret", "team-a", "demo-tinker-keys")]["data"]["default"]
    dep["metadata"]["annotations"][tinker.HASH_ANNOTATION] = "built-from-an-older-spec"
    dep["spec"]["template"]["spec"]["containers"][0]["image"] = "old:image"
    asyncio.run(drive(w, passes=3))
    assert w.kube.calls["update_deployment"] == 1
    assert dep["spec"]["template"] == want
    assert dep["metadata"]["annotations"][tinker.HASH_ANNOTATION] != "built-from-an-older-spec"
    assert "TinkerServerUpdated" in w.reasons()
    assert w.kube.objects[("Secret", "team-a", "demo-tinker-keys")]["data"]["default"] == key


def test_a_pretrained_checkpoint_on_the_claim_is_mounted_on_the_head_read_only() -> None:
    """The server job parses the spec on the head (local=True) and reads config.json there."""
    from tg_operator import raycluster, spec_change

    spec = copy.deepcopy(BASE_SPEC)
    spec["rayCluster"]["storage"] = {"claimName": "ckpt", "mountPath": "/ckpt"}
    plain = trainergroup(spec=copy.deepcopy(spec))
    spec["model"].update(pretrained="/ckpt/llama", positionEmbedding="rope")
    tg = trainergroup(spec=spec)
    head = raycluster.build_raycluster(tg, cluster_hash="h")["spec"]["headGroupSpec"]
    (c,) = head["template"]["spec"]["containers"]
    assert c["volumeMounts"] == [{"name": "checkpoints", "mountPath": "/ckpt", "readOnly": True}]
    (vol,) = head["template"]["spec"]["volumes"]
    assert vol["persistentVolumeClaim"] == {"claimName": "ckpt"}
    plain_head = raycluster.build_raycluster(plain, cluster_hash="h")["spec"]["headGroupSpec"]
    assert "volumeMounts" not in plain_head["template"]["spec"]["containers"][0]
    # a group without pretrained keeps its cluster hash (no rebuild on an operator upgrade)
    assert spec_change.cluster_hash(plain.spec) != spec_change.cluster_hash(tg.spec)
    assert spec_change.cluster_hash(TG.spec) == spec_change.cluster_hash(
        trainergroup(spec=copy.deepcopy(BASE_SPEC)).spec
    )
