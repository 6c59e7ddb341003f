"""tgctl's fast, quiet and honest paths, on a real local Ray head without the dashboard.

- ``status`` is not a Ray driver and imports neither torch nor the worker's module;
- ``down`` and attaching (the client) get actor handles without importing the worker's
  module (``gcs_view.use_light_handles``), and calls on them still reach the workers;
- with TG_RAY_INCLUDE_DASHBOARD=0 no dashboard URL is printed and ``down`` checks the
  placement groups' actors through the GCS actor table (nothing left unchecked);
- ``up`` reports progress while it works; ``--json`` gives machines one document;
- ``down --stop-ray`` stops the head tgctl started by its pid (no /proc scan);
- one address variable (RAY_ADDRESS; TG_RAY_ADDRESS deprecated) and the client's
  Kubernetes namespace from the pod's service account.

No timings are asserted here: bench/bench_cli.py measures them.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

import tgapi.kube_view
from tests.fixtures_ray import REPO_ROOT, tgctl_env
from tests.specs import tiny_spec
from tgruntime.controller import connect as ray_connect
from tgruntime.entrypoints import client_job as client

WORKER_MODULE = "tests.runtime.light_workers"


# ----------------------------------------------------------------------------- no Ray
def test_ray_address_is_one_variable_and_the_old_one_is_deprecated(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("TG_RAY_ADDRESS", raising=False)
    assert ray_connect.address_from_env() is None
    monkeypatch.setenv("TG_RAY_ADDRESS", "10.0.0.1:6379")
    monkeypatch.setattr(ray_connect, "_warned_deprecated", False)
    with caplog.at_level(logging.WARNING, logger="tgruntime.controller.connect"):
        assert ray_connect.address_from_env() == "10.0.0.1:6379"
    assert (
        "TG_RAY_ADDRESS is deprecated" in caplog.text and "RAY_ADDRESS=10.0.0.1:6379" in caplog.text
    )
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:6379")
    assert ray_connect.address_from_env() == "10.0.0.2:6379"  # RAY_ADDRESS wins


def test_client_namespace_defaults_to_the_pods(tmp_path: Path) -> None:
    sa = tmp_path / "namespace"
    sa.write_text("team-a\n")
    assert tgapi.kube_view.default_k8s_namespace(service_account_file=str(sa)) == "team-a"
    # outside a pod: the kubeconfig context's namespace, else "default"
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "contexts: [{name: c, context: {cluster: x, user: u, namespace: team-b}}]\n"
        "clusters: [{name: x, cluster: {server: 'https://127.0.0.1:1'}}]\nusers: [{name: u, user: "
        "{token: t}}]\n"
    )
    assert tgapi.kube_view.default_k8s_namespace(kubeconfig=str(kubeconfig)) == "team-b"
    absent = str(tmp_path / "absent")
    default = tgapi.kube_view.default_k8s_namespace
    assert default(kubeconfig=absent, service_account_file=absent) == (
        "default"
    )
    assert client.build_parser().parse_args([]).k8s_namespace is None  # resolved when waiting


def test_server_output_folds_megatron_notices(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """megatron-core's fallback lines (and 0.19's absl and GPTModel-deprecation lines, a
    decision of ours: docs/trainer.md) fold into one note; real warnings still show."""
    import io

    from tgruntime.entrypoints.cli import ServerOutput

    lines = [
        "x/optimizer.py:29: UserWarning: Transformer Engine and Apex are not installed.\n",
        "  warnings.warn(\n",
        "x/hyper_comm_grid.py:20: UserWarning: absl.logging is not installed. Using logging\n",
        "[WARNING  | megatron.core.models.gpt.gpt_model]: GPTModel IS DEPRECATED. GPTModel is\n",
        "WARNING tgruntime.trainer: something a person must see\n",
    ]
    out = ServerOutput(io.StringIO("".join(lines)), tmp_path / "up.log", verbose=False)
    out.join(10)
    assert out.notices == 4
    assert "4 such lines hidden" in out.note()
    err = capsys.readouterr().err
    assert "something a person must see" in err and "DEPRECATED" not in err
    assert (tmp_path / "up.log").read_text() == "".join(lines)


def test_client_wait_needs_a_trainergroup(capsys: pytest.CaptureFixture[str]) -> None:
    assert client.main(["wait", "--print-address"]) == 2
    assert "--trainergroup NAME is required" in capsys.readouterr().err
    args = client.build_wait_parser().parse_args(
        ["--trainergroup", "t", "--k8s-namespace", "n", "--timeout", "5", "--json"]
    )
    assert (args.trainergroup, args.k8s_namespace, args.wait, args.json) == ("t", "n", 5.0, True)


# ----------------------------------------------------------------------------- real Ray
def _env(tmp_path: Path) -> dict[str, str]:
    return tgctl_env(tmp_path, TG_RAY_INCLUDE_DASHBOARD="0")


def _py(env: dict[str, str], code: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _tgctl(
    env: dict[str, str], *args: str, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tgruntime.entrypoints.cli", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _spec(tmp_path: Path, cls: str) -> tuple[Path, dict[str, Any]]:
    name = f"f{uuid.uuid4().hex[:8]}"
    doc: dict[str, Any] = {
        "apiVersion": "trainergroup.io/v1alpha1",
        "kind": "TrainerGroup",
        "metadata": {"name": name},
        "spec": tiny_spec(
            k8s=False,
            workers={
                "cpusPerProcess": 0.1,
                "workerClass": f"{WORKER_MODULE}:{cls}",
                "rayNamespace": f"ns-{name}",
            },
            parallelism={"tensor": 2},
            training={"batchSize": 8},
        ),
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path, doc


@pytest.mark.ray
def test_tgctl_fast_quiet_paths_without_dashboard(tmp_path: Path) -> None:
    env = _env(tmp_path)
    path, doc = _spec(tmp_path, "SpecEcho")
    name, ns = doc["metadata"]["name"], doc["spec"]["workers"]["rayNamespace"]
    up = _tgctl(env, "up", "-f", str(path), "--num-cpus", "2", timeout=600)
    state = tmp_path / "cache" / "trainergroup" / "local-ray.json"
    try:
        assert up.returncode == 0, up.stdout + up.stderr[-4000:]
        # Progress while it worked, one line per step; no dashboard anywhere.
        for step in ("head: ", "placement: ", "actors: 2/2 alive", "init_model: done"):
            assert step in up.stderr, up.stderr
        assert "(no dashboard)" in up.stderr, up.stderr
        assert "dashboard" not in up.stdout.lower() and "http://" not in up.stdout + up.stderr
        assert "Connected to Ray cluster" not in up.stderr
        head = json.loads(state.read_text())
        assert head["dashboard_url"] == "" and isinstance(head["pid"], int)

        # status: no Ray driver, no torch, no worker module; --json for machines.
        st = _py(
            env,
            f"""
            import json, sys
            from tgruntime.entrypoints import cli
            rc = cli.main(["status", "-f", {str(path)!r}, "--json"])
            import ray
            print("PROBE " + json.dumps({{"rc": rc, "driver": ray.is_initialized(),
                "torch": "torch" in sys.modules,
                "worker_module": {WORKER_MODULE!r} in sys.modules}}))
        """,
        )
        assert st.returncode == 0, st.stderr[-3000:]
        body = json.loads(st.stdout.splitlines()[0])
        probe = json.loads(st.stdout.split("PROBE ", 1)[1])
        assert probe == {"rc": 0, "driver": False, "torch": False, "worker_module": False}
        assert body["phase"] == "Ready" and body["alive"] == 2 and body["dashboardUrl"] == ""
        assert [w["name"] for w in body["workers"]] == [
            f"{name}SpecEcho_0:0",
            f"{name}SpecEcho_0:1",
        ]
        human = _tgctl(env, "status", "-f", str(path))
        assert "phase: Ready" in human.stdout and "dashboard" not in human.stdout

        # Attach as the client does: light handles, and calls still reach the workers.
        att = _py(
            env,
            f"""
            import json, sys
            from tgruntime.controller.connect import connect
            from tgruntime.controller.gcs_view import use_light_handles
            from tgruntime.controller import WorkerGroup
            connect(address=json.load(open({str(state)!r}))["gcs_address"], ray_namespace={ns!r})
            assert use_light_handles()
            wg = WorkerGroup.attach(group_name={name!r}, ray_namespace={ns!r})
            out = wg.init_model()
            print("PROBE " + json.dumps({{"ranks": [r["rank"] for r in out],
                "worker_module": {WORKER_MODULE!r} in sys.modules}}))
        """,
        )
        assert att.returncode == 0, att.stderr[-3000:]
        assert json.loads(att.stdout.split("PROBE ", 1)[1]) == {
            "ranks": [0, 1],
            "worker_module": False,
        }

        # down: no worker module, everything checked through the GCS, said plainly.
        dn = _py(
            env,
            f"""
            import json, sys
            from tgruntime.entrypoints import cli
            rc = cli.main(["down", "-f", {str(path)!r}, "--json"])
            print("PROBE " + json.dumps({{"rc": rc, "torch": "torch" in sys.modules,
                "worker_module": {WORKER_MODULE!r} in sys.modules}}))
        """,
        )
        assert dn.returncode == 0, dn.stderr[-3000:]
        report = json.loads(dn.stdout.splitlines()[0])["teardown"]
        assert json.loads(dn.stdout.split("PROBE ", 1)[1]) == {
            "rc": 0,
            "torch": False,
            "worker_module": False,
        }
        assert report["complete"] is True and report["errors"] == []
        assert report["notChecked"] == []
        assert any("GCS actor table" in c for c in report["checked"]), report
        assert sorted(report["actorsKilled"]) == [f"{name}SpecEcho_0:0", f"{name}SpecEcho_0:1"]
        again = _tgctl(env, "down", "-f", str(path))
        assert again.returncode == 0 and "nothing was left" in again.stdout, again.stdout
        assert "complete: everything checked is gone" in again.stdout
    finally:
        stop = _tgctl(env, "down", "-f", str(path), "--stop-ray")
    assert "stopped the local Ray head" in stop.stdout, stop.stdout + stop.stderr[-2000:]
    assert not state.exists()
    assert not ray_connect.is_reachable(head["gcs_address"])
