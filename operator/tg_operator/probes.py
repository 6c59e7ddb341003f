"""Container probes that hold on a busy 2-core node without hiding a real failure.

kubelet posts a Warning event (reason ``Unhealthy``) for every probe that fails, startup
probes included, so a probe that polls while the process is still starting makes a normal
run look faulty. KubeRay's default head probes did exactly that: ``raylet healthz && GCS
healthz`` with a one-second timeout from 30 s after start; on a loaded node the dashboard's
``gcs_healthz`` (the second check) was not answering yet, and kubelet reported
"Liveness probe failed: success" (the output of the first check).

So each container here gets:

- a **startup probe that waits** instead of polling: one exec that loops until the checks
  pass, bounded by its own ``timeoutSeconds`` (``failureThreshold: 1``): it succeeds once, or
  fails once when the process never came up in that time, and the container is restarted;
- then **liveness and readiness** with the same checks, each probe trying them up to
  ``CHECK_TRIES`` times before it reports a failure (kubelet posts an event for every failed
  probe, whatever its threshold: at load 37 on the cold run of 2026-12-03 one slow answer of
  the head's dashboard made a "Readiness probe failed" Warning in a fault-free run), timeouts
  sized for a busy node, and a liveness failure threshold of about two minutes of consecutive
  failures.
"""

from __future__ import annotations

from typing import Any

RAYLET_PORT = 52365
"""The dashboard agent, whose ``local_raylet_healthz`` fate-shares with the raylet."""
DASHBOARD_PORT = 8265
CHECK_TIMEOUT_S = 10
"""Each HTTP check's own timeout (wget -T / the read): a loaded dashboard answers in seconds."""
STARTUP_PERIOD_S = 5
"""How soon after the container starts kubelet runs the (waiting) startup probe."""
RAY_START_LIMIT_S = 900
"""How long a Ray node may take to come up (image already on the node) before a restart."""
CHECK_TRIES = 3
"""Tries of the checks within one liveness or readiness probe (2 s apart)."""


def ray_checks(*, head: bool) -> str:
    """The shell condition that a Ray node is healthy: raylet, plus GCS on the head."""
    checks = [_wget(RAYLET_PORT, "api/local_raylet_healthz")]
    if head:
        checks.append(_wget(DASHBOARD_PORT, "api/gcs_healthz"))
    return " && ".join(checks)


def http_200(*, port: int, path: str) -> str:
    """The shell condition that ``GET http://127.0.0.1:{port}{path}`` answers 200 (bash only:
    /dev/tcp, no curl or wget needed in the image)."""
    request = f"GET {path} HTTP/1.0\\r\\nHost: localhost\\r\\n\\r\\n"
    return (
        f"( exec 3<>/dev/tcp/127.0.0.1/{port} && printf '{request}' >&3 "
        f"&& IFS= read -r -t {CHECK_TIMEOUT_S} line <&3 && [[ $line == *' 200 '* ]] ) 2>/dev/null"
    )


def startup_wait(check: str, *, limit_s: int, every_s: int = 3) -> dict[str, Any]:
    """A startup probe that loops on ``check`` for up to ``limit_s`` (one result, no polling).

    ``periodSeconds`` stays short: kubelet's first tick comes before the container runs (that
    attempt is skipped), and the next one a period later, so a long period would delay the
    start by that much. A probe in flight blocks the next tick, so the loop still runs once.
    """
    return {
        **_exec(f"until {check}; do sleep {every_s}; done"),
        "periodSeconds": STARTUP_PERIOD_S,
        "timeoutSeconds": limit_s,
        "failureThreshold": 1,
    }


def patient(check: str, *, tries: int = CHECK_TRIES) -> str:
    """``check`` tried up to ``tries`` times, 2 s apart: true at the first success."""
    return f"for _ in $(seq {tries}); do {check} && exit 0; sleep 2; done; exit 1"


PATIENT_TIMEOUT_S = CHECK_TRIES * (2 * CHECK_TIMEOUT_S + 2)
"""A patient probe's bound: every try's two checks (head) at their timeout, plus the pauses."""


def liveness(check: str, *, failures: int = 12) -> dict[str, Any]:
    """Restart after ``failures`` consecutive failed probes, 10 s apart (2 min by default)."""
    return {**_exec(patient(check)), "periodSeconds": 10, "timeoutSeconds": PATIENT_TIMEOUT_S,
            "failureThreshold": failures}


def readiness(check: str) -> dict[str, Any]:
    return {**_exec(patient(check)), "periodSeconds": 10, "timeoutSeconds": PATIENT_TIMEOUT_S,
            "failureThreshold": 3}


def ray_node_probes(*, head: bool) -> dict[str, Any]:
    """startupProbe, livenessProbe and readinessProbe for a Ray head or worker container
    (KubeRay keeps probes a container already has)."""
    check = ray_checks(head=head)
    return {
        "startupProbe": startup_wait(check, limit_s=RAY_START_LIMIT_S),
        "livenessProbe": liveness(check),
        "readinessProbe": readiness(check),
    }


def _wget(port: int, path: str) -> str:
    return (
        f"wget --tries 1 -T {CHECK_TIMEOUT_S} -q -O- http://localhost:{port}/{path} "
        "| grep -q success"
    )


def _exec(script: str) -> dict[str, Any]:
    return {"exec": {"command": ["bash", "-c", script]}}
