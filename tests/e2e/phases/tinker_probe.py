"""A probe pod of tests/e2e/phases/tinker.sh: what one pod sees of a group's Tinker server.

PROBE_MODE=tcp: can it open TCP to PROBE_HOST:PROBE_PORT within PROBE_SECONDS (retried: the
NetworkPolicy enforcer admits a new pod's IP a few seconds after it starts)?
PROBE_MODE=key: the unmodified SDK's get_server_capabilities with PROBE_KEY, retried until the
answer is PROBE_WANT (200 or 401) or PROBE_SECONDS pass (a key added to or removed from the
Secret takes effect once the kubelet syncs the mounted volume and the server re-reads it).

Prints one JSON line: PROBE {...}.
"""

from __future__ import annotations

import json
import os
import socket
import time


def tcp_open(host: str, port: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=3):
                return True
        except OSError:
            time.sleep(1)
    return False


def sdk_status(base_url: str, key: str) -> int | str:
    import tinker

    try:
        service = tinker.ServiceClient(base_url=base_url, api_key=key)
        service.get_server_capabilities()
        return 200
    except tinker.AuthenticationError:
        return 401
    except tinker.APIStatusError as exc:
        return int(exc.status_code)
    except Exception as exc:  # reported, not raised
        return f"{type(exc).__name__}: {exc}"[:300]


def main() -> None:
    e = os.environ
    host, port, seconds = e["PROBE_HOST"], int(e["PROBE_PORT"]), float(e["PROBE_SECONDS"])
    t0 = time.monotonic()
    out: dict[str, object] = {"mode": e["PROBE_MODE"]}
    if e["PROBE_MODE"] == "tcp":
        out["tcp"] = tcp_open(host, port, seconds)
    else:
        want = int(e["PROBE_WANT"])
        url = f"http://{host}:{port}"
        status: int | str = "not tried"
        while True:
            status = sdk_status(url, e["PROBE_KEY"])
            if status == want or time.monotonic() - t0 > seconds:
                break
            time.sleep(3)
        out.update(status=status, want=want)
    out["seconds"] = round(time.monotonic() - t0, 1)
    print("PROBE " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
