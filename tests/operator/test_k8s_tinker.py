"""The Tinker API server's objects against a real API server (local control plane), made by
the operator running with exactly ``tg_operator.rbac.OPERATOR_RULES`` (RBAC on).

kwok runs the server's pod (it never starts the container), so this checks what Kubernetes
sees: the objects, their owner, the key created once and never overwritten, ``status.apiURL``
once the Deployment is available, and the garbage collector removing them with the group.
The server itself in real pods: tests/e2e/phases/tinker.sh.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from hack import operator_plane as ks

pytestmark = [pytest.mark.k8s, pytest.mark.ray]
NAME = "tinkered"
KINDS = (
    "deployment",
    "service",
    "secret",
    "networkpolicy",
    "serviceaccount",
    "role",
    "rolebinding",
)


def _get(plane: Any, ns: str, kind: str, name: str) -> dict[str, Any] | None:
    proc = plane.kubectl("get", kind, name, "-n", ns, "-o", "json", check=False)
    return json.loads(proc.stdout) if proc.returncode == 0 else None


def _name(kind: str) -> str:
    return f"{NAME}-tinker-keys" if kind == "secret" else f"{NAME}-tinker"


def _key(plane: Any, ns: str) -> dict[str, str]:
    secret = _get(plane, ns, "secret", f"{NAME}-tinker-keys")
    assert secret is not None
    return {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}


def test_apply_creates_the_server_once_publishes_the_url_and_delete_removes_it(
    k8s_plane: Any, ns: str, operator: ks.OperatorProcess
) -> None:
    body = ks.noop(NAME, ns)
    k8s_plane.apply(body)
    objs = ks.wait_for(
        lambda: (
            {k: _get(k8s_plane, ns, k, _name(k)) for k in KINDS}
            if _get(k8s_plane, ns, "deployment", f"{NAME}-tinker")
            else None
        ),
        timeout=180,
        what="the Tinker server's Deployment",
        detail=operator.tail,
    )
    tg = ks.get_tg(k8s_plane, ns, NAME)
    assert tg is not None
    for kind, obj in objs.items():
        assert obj is not None, f"{kind} {_name(kind)} missing"
        (ref,) = obj["metadata"]["ownerReferences"]
        owner = (ref["kind"], ref["name"], ref["uid"])
        assert owner == ("TrainerGroup", NAME, tg["metadata"]["uid"])
    dep = objs["deployment"]
    assert dep is not None
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    # bash -ceu SERVER_SCRIPT tinker-server <python> -m tgruntime.service ...: the pod joins
    # the group's Ray cluster, then execs the server
    assert c["command"][:2] == ["bash", "-ceu"] and c["command"][3] == "tinker-server"
    assert c["command"][5:] == [
        "-m",
        "tgruntime.service",
        "--trainergroup",
        NAME,
        "--k8s-namespace",
        ns,
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--keys-dir",
        "/etc/tinker/keys",
    ]
    svc = objs["service"]
    assert svc is not None and svc["spec"]["ports"][0]["port"] == 8000
    keys = _key(k8s_plane, ns)
    assert list(keys) == ["default"] and keys["default"].startswith("tml-")

    # kwok makes the pod Ready: the Deployment is available, the status publishes the URL
    url = f"http://{NAME}-tinker.{ns}.svc:8000"
    ks.wait_for(
        lambda: ks.status_of(k8s_plane, ns, NAME).get("apiURL") == url,
        timeout=180,
        what="status.apiURL",
        detail=lambda: f"{ks.dump(ks.status_of(k8s_plane, ns, NAME))}\n{operator.tail()}",
    )
    wide = k8s_plane.kubectl("get", "tg", NAME, "-n", ns, "-o", "wide").stdout
    assert "API" in wide.splitlines()[0] and url in wide

    # a user adds a key; the Deployment is deleted by hand: re-created, the Secret untouched
    patch = json.dumps({"stringData": {"alice": "tml-alice-key"}})
    k8s_plane.kubectl("patch", "secret", f"{NAME}-tinker-keys", "-n", ns, "-p", patch)
    old_uid = dep["metadata"]["uid"]
    k8s_plane.kubectl("delete", "deployment", f"{NAME}-tinker", "-n", ns)
    ks.wait_for(
        lambda: (_get(k8s_plane, ns, "deployment", f"{NAME}-tinker") or {})
        .get("metadata", {})
        .get("uid", old_uid)
        != old_uid,
        timeout=180,
        what="the Deployment re-created",
        detail=operator.tail,
    )
    assert _key(k8s_plane, ns) == {"default": keys["default"], "alice": "tml-alice-key"}
    assert "ERROR" not in operator.tail(), operator.tail()

    # delete: the garbage collector removes every object with the group
    k8s_plane.kubectl("delete", "trainergroup", NAME, "-n", ns, "--wait=false")
    ks.wait_for(
        lambda: all(_get(k8s_plane, ns, k, _name(k)) is None for k in KINDS),
        timeout=300,
        what="the Tinker server's objects gone",
        detail=lambda: str({k: _get(k8s_plane, ns, k, _name(k)) is not None for k in KINDS}),
    )
