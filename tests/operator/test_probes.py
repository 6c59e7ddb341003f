"""The probes: every Ray container and the Tinker server wait at startup in one exec (a normal
start posts no Unhealthy event), and the shell checks behave on a real HTTP server."""

from __future__ import annotations

import http.server
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.operator.helpers import trainergroup
from tg_operator import probes, raycluster


@pytest.fixture()
def server() -> Iterator[tuple[int, dict[str, int]]]:
    """A local HTTP server: /ok answers 200 with "success", anything else 503."""
    hits: dict[str, int] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            hits[self.path] = hits.get(self.path, 0) + 1
            ok = self.path.endswith("/ok")
            self.send_response(200 if ok else 503)
            self.end_headers()
            self.wfile.write(b"success" if ok else b"down")

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd.server_address[1], hits
    finally:
        httpd.shutdown()


def _bash(script: str, timeout: float = 30) -> int:
    return subprocess.run(["bash", "-c", script], timeout=timeout, check=False).returncode


def test_http_200_is_true_only_for_200(server: tuple[int, dict[str, int]]) -> None:
    port, hits = server
    assert _bash(probes.http_200(port=port, path="/ok")) == 0
    assert _bash(probes.http_200(port=port, path="/down")) != 0
    assert hits == {"/ok": 1, "/down": 1}
    assert _bash(probes.http_200(port=1, path="/ok")) != 0  # nothing listens: false, quietly


def test_startup_wait_loops_until_the_check_passes(tmp_path: Path) -> None:
    flag = f"{tmp_path}/up"
    probe = probes.startup_wait(f"test -e {flag}", limit_s=60, every_s=1)
    script = probe["exec"]["command"][-1]
    proc = subprocess.Popen(["bash", "-c", script])
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=2)  # still waiting: no result yet, so no failure event
        open(flag, "w").close()
        assert proc.wait(timeout=10) == 0
    finally:
        proc.kill()
    assert probe["failureThreshold"] == 1 and probe["timeoutSeconds"] == 60
    # a short period: kubelet's first tick precedes the container, the next is a period later
    assert probe["periodSeconds"] == probes.STARTUP_PERIOD_S <= 5


def test_every_ray_container_gets_the_three_probes() -> None:
    tg = trainergroup()
    manifest = raycluster.build_raycluster(tg, cluster_hash="h")
    head = manifest["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    (group,) = manifest["spec"]["workerGroupSpecs"]
    worker = group["template"]["spec"]["containers"][0]
    for container, head_node in ((head, True), (worker, False)):
        startup = container["startupProbe"]
        check = probes.ray_checks(head=head_node)
        assert startup["exec"]["command"] == ["bash", "-c", f"until {check}; do sleep 3; done"]
        assert startup["timeoutSeconds"] == probes.RAY_START_LIMIT_S
        assert container["livenessProbe"]["exec"]["command"][-1] == probes.patient(check)
        assert container["readinessProbe"]["exec"]["command"][-1] == probes.patient(check)
        # two minutes of consecutive failures before a restart, each check given 10 s
        live = container["livenessProbe"]
        assert live["periodSeconds"] * live["failureThreshold"] == 120
        assert live["timeoutSeconds"] >= 2 * probes.CHECK_TIMEOUT_S
    assert "gcs_healthz" in probes.ray_checks(head=True)
    assert "gcs_healthz" not in probes.ray_checks(head=False)


def test_a_patient_check_survives_one_slow_answer(tmp_path: Path) -> None:
    """A probe tries its check CHECK_TRIES times before it fails (kubelet posts a Warning for
    every failed probe): one failed try then a good one is a success; never good, a failure."""
    count = tmp_path / "n"
    flaky = f"echo x >> {count}; [ $(wc -l < {count}) -ge 2 ]"  # fails once, then passes
    assert subprocess.run(["bash", "-c", probes.patient(flaky)], timeout=30).returncode == 0
    assert count.read_text().count("x") == 2
    never = subprocess.run(["bash", "-c", probes.patient("false", tries=2)], timeout=30)
    assert never.returncode == 1
    assert probes.PATIENT_TIMEOUT_S >= probes.CHECK_TRIES * 2 * probes.CHECK_TIMEOUT_S
