"""What secures a group's own RayCluster: the token env on every Ray container, the token
Secret, the NetworkPolicy, and KubeRay's gcsFaultToleranceOptions (pure builders)."""

from __future__ import annotations

import base64
import copy
from typing import Any

import pytest

from tests.operator.helpers import BASE_SPEC, trainergroup
from tg_operator import networkpolicy, owners, ray_token, tinker
from tg_operator.raycluster import build_raycluster, ray_containers
from tg_operator.settings import OperatorConfig, SettingsError
from tgapi import SpecErrors, TrainerGroup


def _with_cluster(**fields: Any) -> TrainerGroup:
    spec = copy.deepcopy(BASE_SPEC)
    spec["rayCluster"].update(fields)
    return trainergroup(spec=spec)


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e for e in container.get("env") or []}


def test_every_ray_container_gets_token_auth_from_the_groups_secret() -> None:
    tg = trainergroup()
    containers = ray_containers(build_raycluster(tg, cluster_hash="h"))
    assert len(containers) == 2  # head and the worker group
    for c in containers:
        env = _env(c)
        assert env["RAY_AUTH_MODE"]["value"] == "token"
        ref = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "demo-ray-token", "key": "auth_token"}


def test_the_users_worker_env_is_kept_after_the_token_env() -> None:
    spec = copy.deepcopy(BASE_SPEC)
    spec["rayCluster"]["workers"]["env"] = [{"name": "FOO", "value": "1"}]
    rc = build_raycluster(trainergroup(spec=spec), cluster_hash="h")
    worker = rc["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert [e["name"] for e in worker["env"]] == [
        "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "NCCL_DEBUG", "TORCHINDUCTOR_COMPILE_THREADS", "FOO"
    ]


def test_auth_disabled_is_the_documented_opt_out() -> None:
    tg = _with_cluster(auth="disabled")
    assert not ray_token.uses_token(tg)
    for c in ray_containers(build_raycluster(tg, cluster_hash="h")):
        env = _env(c)
        assert env["RAY_AUTH_MODE"]["value"] == "disabled"
        assert "RAY_AUTH_TOKEN" not in env


def test_a_misspelt_auth_mode_is_refused_with_the_choices() -> None:
    with pytest.raises(SpecErrors, match=r"spec\.rayCluster\.auth.*token, disabled"):
        _with_cluster(auth="tokens")


def test_the_secret_is_owned_by_the_group_and_round_trips_the_token() -> None:
    tg = trainergroup()
    token = ray_token.new_token()
    assert len(token) == 64 and token != ray_token.new_token()
    secret = ray_token.build_secret(tg, token=token)
    assert secret["metadata"]["name"] == "demo-ray-token"
    assert secret["metadata"]["namespace"] == "team-a"
    (owner,) = secret["metadata"]["ownerReferences"]
    assert owner["uid"] == tg.uid and owner["controller"] is True
    assert base64.b64decode(secret["data"]["auth_token"]).decode() == token
    assert ray_token.token_from_secret(secret) == token
    assert ray_token.token_from_secret({"data": {}}) == ""
    assert ray_token.token_from_secret({"data": {"auth_token": "%%%"}}) == ""


def test_rayclusterref_groups_get_no_secret() -> None:
    spec = {k: v for k, v in copy.deepcopy(BASE_SPEC).items() if k != "rayCluster"}
    spec["rayClusterRef"] = {"name": "shared"}
    assert not ray_token.uses_token(trainergroup(spec=spec))


def test_networkpolicy_admits_the_cluster_its_clients_and_the_operator_on_8265() -> None:
    tg = trainergroup()
    labels = {"app.kubernetes.io/component": "operator"}
    pol = networkpolicy.build_networkpolicy(
        tg, operator_namespace="trainergroup-system", operator_labels=labels
    )
    assert pol["metadata"]["name"] == "demo-ray"
    assert pol["metadata"]["ownerReferences"][0]["uid"] == tg.uid
    spec = pol["spec"]
    assert spec["podSelector"] == {"matchLabels": {"ray.io/cluster": "demo"}}
    assert spec["policyTypes"] == ["Ingress"]
    own, clients, operator = spec["ingress"]
    assert own == {"from": [{"podSelector": {"matchLabels": {"ray.io/cluster": "demo"}}}]}
    assert clients == {
        "from": [{"podSelector": {"matchLabels": {"trainergroup.io/client": "demo"}}}]
    }
    peer = operator["from"][0]
    assert peer["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": "trainergroup-system"}
    }
    assert peer["podSelector"] == {"matchLabels": labels}
    assert operator["ports"] == [{"protocol": "TCP", "port": 8265}]


def test_networkpolicy_without_a_known_operator_namespace_has_no_operator_rule() -> None:
    pol = networkpolicy.build_networkpolicy(
        trainergroup(), operator_namespace="", operator_labels={}
    )
    assert len(pol["spec"]["ingress"]) == 2


def test_networkpolicy_opt_out() -> None:
    assert networkpolicy.wanted(trainergroup())
    assert not networkpolicy.wanted(_with_cluster(networkPolicy=False))


def test_gcs_fault_tolerance_is_off_unless_asked_for() -> None:
    assert "gcsFaultToleranceOptions" not in build_raycluster(trainergroup(), cluster_hash="h")[
        "spec"
    ]


def test_gcs_fault_tolerance_with_redis_and_its_password_secret() -> None:
    tg = _with_cluster(
        gcsFaultTolerance={"redisAddress": "redis.ns.svc:6379", "redisPasswordSecret": "redis"}
    )
    ft = build_raycluster(tg, cluster_hash="h")["spec"]["gcsFaultToleranceOptions"]
    assert ft == {
        "redisAddress": "redis.ns.svc:6379",
        "redisPassword": {"valueFrom": {"secretKeyRef": {"name": "redis", "key": "password"}}},
    }


def test_gcs_fault_tolerance_needs_a_host_port_address() -> None:
    with pytest.raises(SpecErrors, match=r"spec\.rayCluster\.gcsFaultTolerance\.redisAddress"):
        _with_cluster(gcsFaultTolerance={"redisAddress": "redis"})
    with pytest.raises(SpecErrors, match=r"gcsFaultTolerance\.redisAddress"):
        _with_cluster(gcsFaultTolerance={})


def test_operator_namespace_and_pod_labels_settings() -> None:
    cfg = OperatorConfig.from_env(
        {"POD_NAMESPACE": "ops", "TG_OPERATOR_POD_LABELS": "a=1, b=two", "HOME": "/nonexistent"}
    )
    assert cfg.operator_namespace == "ops"
    assert dict(cfg.operator_pod_labels) == {"a": "1", "b": "two"}
    with pytest.raises(SettingsError, match=r"TG_OPERATOR_POD_LABELS.*k=v"):
        OperatorConfig.from_env({"TG_OPERATOR_POD_LABELS": "novalue", "HOME": "/nonexistent"})


def test_group_tokens_are_derived_per_uid_from_the_operators_key() -> None:
    a = ray_token.derive_token(key="k1", uid="uid-a")
    assert a == ray_token.derive_token(key="k1", uid="uid-a")  # recomputable: no Secret read
    assert len(a) == 64 and int(a, 16) >= 0
    assert a != ray_token.derive_token(key="k1", uid="uid-b")
    assert a != ray_token.derive_token(key="k2", uid="uid-a")
    with pytest.raises(ValueError, match="key"):
        ray_token.derive_token(key="", uid="uid-a")


def test_token_key_setting_from_value_or_file(tmp_path: Any) -> None:
    base = {"HOME": "/nonexistent"}
    assert OperatorConfig.from_env(base).ray_token_key == ""
    assert OperatorConfig.from_env({**base, "TG_RAY_TOKEN_KEY": " k "}).ray_token_key == "k"
    f = tmp_path / "key"
    f.write_text("from-file\n")
    cfg = OperatorConfig.from_env({**base, "TG_RAY_TOKEN_KEY_FILE": str(f)})
    assert cfg.ray_token_key == "from-file"
    assert "from-file" not in repr(cfg)
    with pytest.raises(SettingsError, match="TG_RAY_TOKEN_KEY_FILE"):
        OperatorConfig.from_env({**base, "TG_RAY_TOKEN_KEY_FILE": str(tmp_path / "none")})


def test_every_object_the_operator_makes_carries_the_one_owner_reference() -> None:
    tg = trainergroup()
    ref = owners.owner_reference(tg)
    made = [
        build_raycluster(tg, cluster_hash="h"),
        ray_token.build_secret(tg, token=ray_token.new_token()),
        networkpolicy.build_networkpolicy(tg, operator_namespace="", operator_labels={}),
        tinker.build_keys_secret(tg, key=tinker.new_api_key()),
        *tinker.objects(tg, python="python"),
    ]
    for obj in made:
        assert obj["metadata"]["ownerReferences"] == [ref], obj["kind"]
