"""Run inside a probe pod: what can this pod do to a TrainerGroup's Ray cluster?

Prints one JSON line (``PROBE {...}``): TCP reachability of the dashboard and the GCS, the
HTTP status of a read (GET /api/jobs/) and of a job submission (POST /api/jobs/, the attack:
arbitrary code on the workers), and whether ``ray start --address`` (joining the GCS as a
node, which any driver needs before it can attach to the workers) succeeded. Standard library
and the ``ray`` CLI only; every step has a timeout.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request

HOST = os.environ["PROBE_HOST"]
TIMEOUT_S = float(os.environ.get("PROBE_TIMEOUT_S", "5"))


WAIT_S = float(os.environ.get("PROBE_WAIT_S", "30"))


def tcp(port: int) -> bool:
    """Whether a TCP connection opens within WAIT_S (the policy enforcer admits a new pod's
    IP a few seconds after the pod starts, so one refused attempt proves nothing)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            with socket.create_connection((HOST, port), timeout=TIMEOUT_S):
                return True
        except OSError:
            if time.monotonic() > deadline:
                return False
            time.sleep(1)


def http(method: str, path: str, body: dict[str, object] | None = None) -> int | None:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://{HOST}:8265{path}", data=data, method=method)
    req.add_header("Content-Type", "application/json")
    token = os.environ.get("PROBE_BEARER", "")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return None


def join() -> dict[str, object]:
    cmd = ["ray", "start", f"--address={HOST}:6379", "--num-cpus=0", "--num-gpus=0",
           "--disable-usage-stats"]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return {"joined": False, "why": "ray start did not finish in 120 s"}
    subprocess.run(["ray", "stop", "--force"], capture_output=True, timeout=60)
    lines = [ln for ln in (run.stdout + run.stderr).splitlines() if ln.strip()]
    hits = [ln for ln in lines if "auth" in ln.lower() or "token" in ln.lower()]
    return {"joined": run.returncode == 0, "why": (hits or lines or [""])[-1][:300]}


out: dict[str, object] = {"tcp_dashboard": tcp(8265), "tcp_gcs": tcp(6379)}
if out["tcp_dashboard"]:
    out["get_jobs"] = http("GET", "/api/jobs/")
    out["submit_job"] = http("POST", "/api/jobs/", {"entrypoint": "echo pwned"})
if out["tcp_gcs"] and os.environ.get("PROBE_JOIN") == "1":
    out.update(join())
print("PROBE " + json.dumps(out), flush=True)
