"""Operator settings from the environment (docs/contracts.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tg_operator.settings import OperatorConfig, SettingsError


def test_defaults_match_the_contract() -> None:
    c = OperatorConfig.from_env({})
    assert c.namespaces == ()
    assert c.dashboard_url(cluster="tg", namespace="ns") == "http://tg-head-svc.ns.svc:8265"
    assert c.gcs_address(cluster="tg", namespace="ns") == "tg-head-svc.ns.svc:6379"
    assert (c.health_interval_s, c.metrics_port, c.liveness_port, c.watch_timeout_s) == (
        10.0,
        9090,
        8080,
        300,
    )
    assert c.python == "python"
    assert c.ray_node_check is True


def test_overrides() -> None:
    c = OperatorConfig.from_env(
        {
            "TG_NAMESPACES": " a, b ,,",
            "TG_DASHBOARD_URL_TEMPLATE": "http://127.0.0.1:8265/",
            "TG_GCS_ADDRESS_TEMPLATE": "127.0.0.1:6379",
            "TG_HEALTH_INTERVAL_SECONDS": "2.5",
            "TG_PYTHON": "/venv/bin/python",
            "TG_RAY_NODE_CHECK": "0",
        }
    )
    assert c.ray_node_check is False
    assert c.namespaces == ("a", "b")
    assert c.dashboard_url(cluster="x", namespace="y") == "http://127.0.0.1:8265"
    assert c.gcs_address(cluster="x", namespace="y") == "127.0.0.1:6379"
    assert c.health_interval_s == 2.5
    assert c.python == "/venv/bin/python"


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"TG_HEALTH_INTERVAL_SECONDS": "soon"}, "not a number"),
        ({"TG_HEALTH_INTERVAL_SECONDS": "0"}, "must be >="),
        ({"TG_RAY_NODE_CHECK": "maybe"}, "TG_RAY_NODE_CHECK='maybe' is not a switch"),
        ({"TG_DASHBOARD_URL_TEMPLATE": "http://{clustr}:8265"}, "{cluster}"),
    ],
)
def test_bad_values_are_named(env: dict[str, str], needle: str) -> None:
    with pytest.raises(SettingsError, match=None) as info:
        OperatorConfig.from_env(env)
    assert needle in str(info.value)
    assert next(iter(env)) in str(info.value)


def test_ray_token_is_found_the_way_ray_finds_it(tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    assert OperatorConfig.from_env({"HOME": str(home)}).ray_auth_token == ""
    (home / ".ray" / "auth_token").write_text("from-home\n")
    assert OperatorConfig.from_env({"HOME": str(home)}).ray_auth_token == "from-home"
    token_file = tmp_path / "tok"
    token_file.write_text("from-file")
    env = {"HOME": str(home), "RAY_AUTH_TOKEN_PATH": str(token_file)}
    assert OperatorConfig.from_env(env).ray_auth_token == "from-file"
    assert (
        OperatorConfig.from_env({**env, "RAY_AUTH_TOKEN": "from-env"}).ray_auth_token == "from-env"
    )
    assert OperatorConfig.from_env({**env, "TG_RAY_AUTH_TOKEN": "ours"}).ray_auth_token == "ours"
    assert "ours" not in repr(OperatorConfig.from_env({"TG_RAY_AUTH_TOKEN": "ours"}))
    with pytest.raises(SettingsError, match="TG_RAY_AUTH_TOKEN_FILE"):
        OperatorConfig.from_env({"TG_RAY_AUTH_TOKEN_FILE": str(tmp_path / "missing")})
