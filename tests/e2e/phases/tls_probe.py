"""The probe pod of tests/e2e/phases/tls.sh: what a client pod sees of a Tinker server on TLS.

Three tries at PROBE_HOST:PROBE_PORT, standard library only (no SDK import: cheap):

* ``plain``: an ``http://`` GET /healthz. A TLS-only port gives no HTTP answer (the handshake
  fails and the connection closes): the result is the error's type, or the status if one came.
* ``public_cas``: an ``https://`` GET with the default trust store only: the certificate must
  not verify (it comes from the phase's own CA).
* ``with_ca``: an ``https://`` GET trusting PROBE_CA (the CA from the ConfigMap) and checking
  the hostname: the HTTP status of /healthz.

Each is retried until PROBE_SECONDS pass while the answer is a connection error (the
NetworkPolicy enforcer admits a new pod's IP a few seconds after it starts). Prints one line:
``PROBE {...}``.
"""

from __future__ import annotations

import http.client
import json
import os
import ssl
import time


def attempt(*, host: str, port: int, context: ssl.SSLContext | None) -> int | str:
    """The HTTP status of GET /healthz, or the type of the error that stopped it."""
    if context is None:
        conn: http.client.HTTPConnection = http.client.HTTPConnection(host, port, timeout=10)
    else:
        conn = http.client.HTTPSConnection(host, port, timeout=10, context=context)
    try:
        conn.request("GET", "/healthz")
        return conn.getresponse().status
    except ssl.SSLCertVerificationError as exc:
        return f"SSLCertVerificationError: {exc.verify_message}"
    except (OSError, http.client.HTTPException) as exc:
        return type(exc).__name__
    finally:
        conn.close()


RETRIED = ("ConnectionRefusedError", "TimeoutError", "gaierror", "OSError")
"""Errors that mean "not reachable yet", not an answer."""


def probe(*, host: str, port: int, context: ssl.SSLContext | None, seconds: float) -> int | str:
    deadline = time.monotonic() + seconds
    while True:
        got = attempt(host=host, port=port, context=context)
        if got not in RETRIED or time.monotonic() > deadline:
            return got
        time.sleep(2)


def main() -> None:
    e = os.environ
    host, port, seconds = e["PROBE_HOST"], int(e["PROBE_PORT"]), float(e["PROBE_SECONDS"])
    t0 = time.monotonic()
    trusted = ssl.create_default_context(cafile=e["PROBE_CA"])
    out: dict[str, object] = {
        "plain": probe(host=host, port=port, context=None, seconds=seconds),
        "public_cas": probe(
            host=host, port=port, context=ssl.create_default_context(), seconds=seconds
        ),
        "with_ca": probe(host=host, port=port, context=trusted, seconds=seconds),
    }
    out["seconds"] = round(time.monotonic() - t0, 1)
    print("PROBE " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
