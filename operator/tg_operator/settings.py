"""The operator's process settings, read once from the environment.

The variables and their defaults are the contract in ``docs/contracts.md``
("Operator process settings"); the Helm chart sets them.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path

DEFAULT_DASHBOARD_URL_TEMPLATE = "http://{cluster}-head-svc.{namespace}.svc:8265"
DEFAULT_GCS_ADDRESS_TEMPLATE = "{cluster}-head-svc.{namespace}.svc:6379"


class SettingsError(ValueError):
    """An environment variable holds a value the operator cannot use."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class OperatorConfig:
    """Everything the operator reads from its environment."""

    namespaces: tuple[str, ...] = ()
    """Namespaces to watch; empty means all namespaces (cluster-wide)."""
    dashboard_url_template: str = DEFAULT_DASHBOARD_URL_TEMPLATE
    gcs_address_template: str = DEFAULT_GCS_ADDRESS_TEMPLATE
    health_interval_s: float = 10.0
    metrics_port: int = 9090
    liveness_port: int = 8080
    watch_timeout_s: int = 300
    python: str = "python"
    """Interpreter used in the Ray job entrypoints."""
    dashboard_timeout_s: float = 10.0
    """Per-request timeout towards a Ray dashboard."""
    max_concurrent_jobs: int = 8
    """Ray jobs (server/teardown drivers) in flight per Ray cluster; 0 = no limit."""
    restart_backoff_s: float = 10.0
    """Wait before the second re-creation of a group; doubles each time after."""
    restart_backoff_max_s: float = 300.0
    """The longest wait between re-creations."""
    ray_node_check: bool = True
    """A RayCluster is ready only once Ray's node table has a live node per worker pod."""
    ray_auth_token: str = dataclasses.field(default="", repr=False)
    """Bearer token for Ray dashboards with token authentication (empty: none)."""
    ray_token_key: str = dataclasses.field(default="", repr=False)
    """Key the per-group Ray tokens are derived from (TG_RAY_TOKEN_KEY[_FILE])."""
    operator_namespace: str = ""
    """The operator pod's namespace, admitted to the dashboard by each group's NetworkPolicy."""
    operator_pod_labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Labels that select the operator's pods (TG_OPERATOR_POD_LABELS: k=v,k=v)."""
    gateway: str = "off"
    """The Tinker gateway (tg_operator.gateway): one per namespace with TrainerGroups
    (``namespace``: the chart's default), one in the operator's namespace for all
    (``cluster``), or none (``off``: an operator started without the variable); TG_GATEWAY."""
    gateway_image: str = ""
    """The gateway's image (TG_GATEWAY_IMAGE); empty: the runtime image of the namespace's
    first TrainerGroup by name."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> OperatorConfig:
        env = os.environ if environ is None else environ
        namespaces = tuple(
            ns.strip() for ns in env.get("TG_NAMESPACES", "").split(",") if ns.strip()
        )
        config = cls(
            namespaces=namespaces,
            dashboard_url_template=env.get(
                "TG_DASHBOARD_URL_TEMPLATE", DEFAULT_DASHBOARD_URL_TEMPLATE
            ),
            gcs_address_template=env.get("TG_GCS_ADDRESS_TEMPLATE", DEFAULT_GCS_ADDRESS_TEMPLATE),
            health_interval_s=_number(env, "TG_HEALTH_INTERVAL_SECONDS", 10.0, minimum=0.5),
            metrics_port=int(_number(env, "TG_METRICS_PORT", 9090, minimum=0)),
            liveness_port=int(_number(env, "TG_LIVENESS_PORT", 8080, minimum=0)),
            watch_timeout_s=int(_number(env, "TG_WATCH_TIMEOUT_SECONDS", 300, minimum=1)),
            python=env.get("TG_PYTHON", "python") or "python",
            dashboard_timeout_s=_number(env, "TG_DASHBOARD_TIMEOUT_SECONDS", 10.0, minimum=0.1),
            max_concurrent_jobs=int(_number(env, "TG_MAX_CONCURRENT_JOBS", 8, minimum=0)),
            restart_backoff_s=_number(env, "TG_RESTART_BACKOFF_SECONDS", 10.0, minimum=0),
            restart_backoff_max_s=_number(
                env, "TG_RESTART_BACKOFF_MAX_SECONDS", 300.0, minimum=0
            ),
            ray_node_check=_flag(env, "TG_RAY_NODE_CHECK", default=True),
            ray_auth_token=ray_auth_token(env),
            ray_token_key=_secret_value(env, "TG_RAY_TOKEN_KEY"),
            operator_namespace=(
                env.get("TG_OPERATOR_NAMESPACE") or env.get("POD_NAMESPACE") or ""
            ).strip(),
            operator_pod_labels=_labels(env, "TG_OPERATOR_POD_LABELS"),
            gateway=_gateway_mode(env),
            gateway_image=env.get("TG_GATEWAY_IMAGE", "").strip(),
        )
        config.dashboard_url(cluster="c", namespace="n")  # fail fast on a bad template
        config.gcs_address(cluster="c", namespace="n")
        return config

    def dashboard_url(self, *, cluster: str, namespace: str) -> str:
        """The Ray dashboard of a RayCluster (no trailing slash)."""
        return _render(
            self.dashboard_url_template, "TG_DASHBOARD_URL_TEMPLATE", cluster, namespace
        ).rstrip("/")

    def gcs_address(self, *, cluster: str, namespace: str) -> str:
        """The GCS address published as ``status.rayAddress``."""
        return _render(self.gcs_address_template, "TG_GCS_ADDRESS_TEMPLATE", cluster, namespace)


def ray_auth_token(env: Mapping[str, str]) -> str:
    """The Ray token, found the way Ray finds it (no Ray import).

    ``TG_RAY_AUTH_TOKEN`` or ``RAY_AUTH_TOKEN`` (the value), else the file named by
    ``TG_RAY_AUTH_TOKEN_FILE`` or ``RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``
    when it exists. Empty when there is none (dashboards without token auth).
    """
    for name in ("TG_RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN"):
        if env.get(name, "").strip():
            return env[name].strip()
    for name in ("TG_RAY_AUTH_TOKEN_FILE", "RAY_AUTH_TOKEN_PATH"):
        path = env.get(name, "").strip()
        if path:
            try:
                return Path(path).expanduser().read_text().strip()
            except OSError as exc:
                raise SettingsError(f"{name}={path!r} cannot be read: {exc.strerror}") from exc
    default = Path(env.get("HOME", str(Path.home()))) / ".ray" / "auth_token"
    try:
        return default.read_text().strip() if default.is_file() else ""
    except OSError:
        return ""


def _secret_value(env: Mapping[str, str], name: str) -> str:
    """``NAME`` (the value), else the file named by ``NAME_FILE``; "" when neither is set."""
    if env.get(name, "").strip():
        return env[name].strip()
    path = env.get(f"{name}_FILE", "").strip()
    if not path:
        return ""
    try:
        return Path(path).expanduser().read_text().strip()
    except OSError as exc:
        raise SettingsError(f"{name}_FILE={path!r} cannot be read: {exc.strerror}") from exc


def _labels(env: Mapping[str, str], name: str) -> dict[str, str]:
    raw = env.get(name, "").strip()
    out: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in raw.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SettingsError(f"{name}={raw!r}: {item!r} is not key=value (write k=v,k=v)")
        out[key.strip()] = value.strip()
    return out


def _number(env: Mapping[str, str], name: str, default: float, *, minimum: float) -> float:
    raw = env.get(name, "")
    if not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError as exc:
        raise SettingsError(f"{name}={raw!r} is not a number") from exc
    if value < minimum:
        raise SettingsError(f"{name}={raw!r} must be >= {minimum:g}")
    return value


def _flag(env: Mapping[str, str], name: str, *, default: bool) -> bool:
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"{name}={raw!r} is not a switch: use 1 or 0")


def _render(template: str, variable: str, cluster: str, namespace: str) -> str:
    try:
        return template.format(cluster=cluster, namespace=namespace)
    except (KeyError, IndexError, ValueError) as exc:
        raise SettingsError(
            f"{variable}={template!r} is not a valid template: use only {{cluster}} and "
            "{namespace} placeholders"
        ) from exc


def _gateway_mode(env: Mapping[str, str]) -> str:
    mode = (env.get("TG_GATEWAY") or "off").strip()
    if mode not in ("namespace", "cluster", "off"):
        raise SettingsError(
            f"TG_GATEWAY={mode!r}: expected 'namespace' (one Tinker gateway per namespace, the "
            "chart's default), 'cluster' (one in the operator's namespace) or 'off' (chart "
            "value gateway.mode)"
        )
    return mode
