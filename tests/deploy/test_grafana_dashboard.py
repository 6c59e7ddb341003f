"""The chart's Grafana dashboard (charts/trainergroup/dashboards/trainergroup.json): it plots
only metrics the operator exports (tg_operator.metrics.EXPORTED_METRICS), and the chart ships
it as a ConfigMap for Grafana's dashboard sidecar only when metrics.grafanaDashboard.enabled.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from typing import Any

import yaml

from tests.deploy.chart import CHART, by_kind, one, template

K8S_VERSION = "1.34.0"  # as in test_chart_render.py (hack/versions.env KUBERNETES_VERSION)
DASHBOARD_FILE = CHART / "dashboards" / "trainergroup.json"
METRIC = re.compile(r"\btrainergroup_[a-z_]+")
LEGEND = "{{namespace}}/{{name}}"


def dashboard() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(DASHBOARD_FILE.read_text())
    return doc


def panels(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, including those nested in (collapsed) rows; rows themselves are skipped."""
    for panel in node.get("panels", []):
        if panel.get("type") != "row":
            yield panel
        yield from panels(panel)


def by_title() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for panel in panels(dashboard()):
        assert panel["title"] not in out, f"two panels titled {panel['title']!r}"
        out[panel["title"]] = panel
    return out


def exprs(panel: dict[str, Any]) -> list[str]:
    return [t["expr"] for t in panel.get("targets", []) if t.get("expr")]


def exported_metrics() -> frozenset[str]:
    # The operator's own list of what /metrics carries (counters with their _total suffix).
    from tg_operator.metrics import EXPORTED_METRICS

    assert isinstance(EXPORTED_METRICS, frozenset) and EXPORTED_METRICS
    return EXPORTED_METRICS


# ---- the dashboard file ----------------------------------------------------------------------


def test_dashboard_identity_and_variables() -> None:
    d = dashboard()
    assert d["uid"] == "trainergroup" and d["title"] == "TrainerGroup"
    assert d["schemaVersion"] == 39
    assert "id" not in d or d["id"] is None  # Grafana assigns it on import
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert {"datasource", "namespace", "name"} <= set(variables), sorted(variables)
    ds = variables["datasource"]
    assert (ds["type"], ds["query"]) == ("datasource", "prometheus")
    for name in ("namespace", "name"):
        var = variables[name]
        assert var["type"] == "query", name
        assert var["datasource"]["uid"] == "${datasource}", name
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = re.fullmatch(r"label_values\((trainergroup_[a-z_]+)(\{[^}]*\})?, *(\w+)\)", query)
        assert m, f"${name}: {query!r} is not label_values(<metric>, <label>)"
        assert m.group(1) in exported_metrics(), query
        assert m.group(3) == name, query
    # the name list follows the chosen namespace(s)
    assert "$namespace" in variables["name"]["query"]["query"]


def test_every_panel_queries_only_exported_metrics() -> None:
    exported = exported_metrics()
    all_panels = list(panels(dashboard()))
    assert all_panels
    used: set[str] = set()
    for panel in all_panels:
        targets = panel.get("targets", [])
        assert targets, f"panel {panel['title']!r} has no target"
        for target in targets:
            expr = target.get("expr", "")
            assert expr, f"panel {panel['title']!r}: target {target.get('refId')} has no expr"
            names = set(METRIC.findall(expr))
            assert names, f"panel {panel['title']!r}: {expr!r} uses no trainergroup_ metric"
            unknown = names - exported
            assert not unknown, (
                f"panel {panel['title']!r} queries {sorted(unknown)}, which the operator does "
                f"not export (tg_operator.metrics.EXPORTED_METRICS)"
            )
            used |= names
            # every query follows the dashboard's variables and its data source
            assert 'namespace=~"$namespace"' in expr and 'name=~"$name"' in expr, expr
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
    assert {
        "trainergroup_training_loss",
        "trainergroup_training_tokens_per_second",
        "trainergroup_phase",
    } <= used


def test_the_named_panels_plot_what_they_say() -> None:
    titled = by_title()
    want = {
        "Loss": "trainergroup_training_loss",
        "Tokens per second": "trainergroup_training_tokens_per_second",
        "Step": "trainergroup_training_step",
        "Phase": "trainergroup_phase",
        "Restarts": "trainergroup_restarts_total",
        "Queue wait": "trainergroup_queue_wait_seconds",
        "Seconds since last step": "trainergroup_training_last_step_timestamp_seconds",
    }
    missing = set(want) - set(titled)
    assert not missing, f"no panel titled {sorted(missing)}"
    for title, metric in want.items():
        panel = titled[title]
        assert [set(METRIC.findall(e)) for e in exprs(panel)] == [{metric}], (title, exprs(panel))
        for target in panel["targets"]:
            assert target["legendFormat"].startswith(LEGEND), (title, target["legendFormat"])
        if title != "Phase":
            assert panel["type"] == "timeseries", title
    phase = titled["Phase"]
    assert phase["type"] in {"state-timeline", "table"}
    (expr,) = exprs(phase)
    assert re.search(r"==\s*1$", expr), expr  # the current phase only
    assert "{{phase}}" in phase["targets"][0]["legendFormat"]
    (stale,) = exprs(titled["Seconds since last step"])
    assert stale.startswith("time() - trainergroup_training_last_step_timestamp_seconds{"), stale
    for title in ("Queue wait", "Seconds since last step"):
        assert titled[title]["fieldConfig"]["defaults"]["unit"] == "s", title


def test_panels_do_not_overlap() -> None:
    cells: dict[tuple[int, int], str] = {}
    for panel in panels(dashboard()):
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24, panel["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]
    ids = [p["id"] for p in panels(dashboard())]
    assert len(ids) == len(set(ids)), ids


# ---- the chart's ConfigMap (helm template) ---------------------------------------------------


def test_values_default_to_no_dashboard_with_the_sidecar_label() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["metrics"]["grafanaDashboard"] == {
        "enabled": False,
        "labels": {"grafana_dashboard": "1"},
        "annotations": {},
        "namespace": "",
    }
    helmignore = CHART / ".helmignore"
    patterns = helmignore.read_text().splitlines() if helmignore.exists() else []
    dropped = {"dashboards", "dashboards/", "dashboards/*", "*.json", "*/", "*"}
    assert not dropped & {p.strip() for p in patterns}, "the packaged chart would lack it"


def test_chart_ships_the_dashboard_only_when_enabled(helm: str) -> None:
    docs = template(helm, {})
    assert isinstance(docs, list) and docs
    assert not by_kind(docs, "ConfigMap")  # off by default (and manifests/ has none)

    on = {"metrics": {"grafanaDashboard": {"enabled": True}}}
    docs = template(helm, on)
    assert isinstance(docs, list)
    cm = one(docs, "ConfigMap")
    meta = cm["metadata"]
    assert meta["name"] == "trainergroup-dashboard"
    assert meta["namespace"] == "trainergroup-system"  # the release namespace by default
    assert meta["labels"]["grafana_dashboard"] == "1"
    assert meta["labels"]["app.kubernetes.io/part-of"] == "trainergroup"
    assert "annotations" not in meta
    assert set(cm["data"]) == {"trainergroup.json"}
    import kubernetes_validate as kv

    kv.validate(cm, K8S_VERSION, strict=True)
    text = cm["data"]["trainergroup.json"]
    assert json.loads(text) == dashboard()
    assert text == DASHBOARD_FILE.read_text().rstrip("\n")  # verbatim, not re-encoded

    custom = {
        "metrics": {
            "grafanaDashboard": {
                "enabled": True,
                "labels": {"grafana_dashboard": "yes", "team": "ml"},
                "annotations": {"grafana_folder": "Training"},
                "namespace": "monitoring",
            }
        }
    }
    docs = template(helm, custom, release="tg")
    assert isinstance(docs, list)
    meta = one(docs, "ConfigMap")["metadata"]
    assert meta["name"] == "tg-trainergroup-dashboard"
    assert meta["namespace"] == "monitoring"
    assert meta["labels"]["grafana_dashboard"] == "yes" and meta["labels"]["team"] == "ml"
    assert meta["annotations"] == {"grafana_folder": "Training"}


def test_values_schema_closes_the_dashboard_values(helm: str) -> None:
    for setting, error in [
        (
            "metrics.grafanaDashboard.bogus=1",
            "at '/metrics/grafanaDashboard': additional properties 'bogus' not allowed",
        ),
        ("metrics.grafanaDashboard.namespace=Not_A_Namespace", "don't meet the specifications"),
        ("metrics.grafanaDashboard.enabled=maybe", "don't meet the specifications"),
    ]:
        proc = template(helm, extra=("--set", setting), check=False)
        assert isinstance(proc, subprocess.CompletedProcess), f"--set {setting} was accepted"
        assert error in proc.stderr, (setting, proc.stderr)
