"""A worker killed by SIGKILL mid-run: the SDK gets a clear error within a bounded time, never
a hang, and the server stays up and says the same to every later request (TP=2 group of its
own, CPU, gloo: the kill ends that group).

The server holds no state of its own (docs/tinker.md), so what recovers is the service, not
the dead group: the server answers healthz and new sessions, every request on the dead group
fails fast naming the dead worker, and the group's health shows the worker DEAD (what the
operator reads to re-create the group under a new generation, after which healthz says
stale: tests/service/test_health.py)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.service.test_sdk_flow import _batch

pytestmark = [pytest.mark.ray, pytest.mark.megatron]

tinker = pytest.importorskip("tinker")
T = tinker.types
WAIT = 300.0  # a healthy call on a loaded machine
BOUND_S = 120.0  # a call on a dead group must fail within this


@pytest.fixture(scope="module")
def doomed(service_driver: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tests.service.conftest import MODEL, serving
    from tests.trainer.scenarios import tiny_spec

    root = tmp_path_factory.mktemp("crash")
    spec = tiny_spec(tp=2, checkpoint_dir=str(root / "ckpt"), **MODEL)  # type: ignore[arg-type]
    with serving(spec, root, prefix="crash") as s:
        yield s


def _healthz(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _fails_fast(call: Any, what: str) -> str:
    """``call()`` must raise within BOUND_S; its message."""
    t0 = time.monotonic()
    try:
        call()
    except Exception as exc:
        took = time.monotonic() - t0
        assert took < BOUND_S, f"{what} took {took:.0f} s to fail"
        return str(exc)
    raise AssertionError(f"{what} succeeded on a group with a dead worker")


def test_worker_sigkill_mid_run_fails_fast_and_server_stays_up(doomed: dict[str, Any]) -> None:
    group = doomed["client"].group
    health = group.health()
    assert [h.state for h in health] == ["ALIVE", "ALIVE"], health
    # rank 1, not rank 0: the results are gathered in rank order, so a survivor blocked in
    # a collective comes first
    victim = next(w["pid"] for w in group.call("health") if w["rank"] == 1)
    adam = T.AdamParams(learning_rate=1e-3)
    with tinker.ServiceClient(base_url=doomed["url"], api_key=doomed["key"]) as sc:
        tc = sc.create_lora_training_client(base_model=doomed["base"], rank=4).result(
            timeout=WAIT
        )
        data = _batch(3, n=4, length=40)
        tc.forward_backward(data, "cross_entropy").result(timeout=WAIT)
        tc.optim_step(adam).result(timeout=WAIT)
        # a run in flight: a training loop in a thread, the worker killed after a few steps
        steps: list[int] = [0]
        ended: dict[str, Any] = {}

        def loop() -> None:
            try:
                while steps[0] < 100_000:
                    tc.forward_backward(data, "cross_entropy").result(timeout=BOUND_S + 60)
                    tc.optim_step(adam).result(timeout=BOUND_S + 60)
                    steps[0] += 1
            except Exception as exc:
                ended["error"], ended["at"] = exc, time.monotonic()

        runner = threading.Thread(target=loop, daemon=True)
        runner.start()
        deadline = time.monotonic() + WAIT
        while steps[0] < 3 and runner.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert steps[0] >= 3 and runner.is_alive(), (steps, ended)
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        runner.join(BOUND_S + 90)
        assert not runner.is_alive(), f"the loop still waits {time.monotonic() - killed:.0f} s"
        assert "error" in ended and ended["at"] - killed < BOUND_S, ended
        messages = [str(ended["error"])]
        # every request after the kill: the same clear error, at once
        messages.append(_fails_fast(
            lambda: tc.forward_backward(data, "cross_entropy").result(timeout=BOUND_S + 60),
            "a request after the kill"))
        for m in messages:
            assert "died" in m and "rank 1" in m, m
        # the server is up: healthz answers, a new session is created and told the same
        status, _ = _healthz(doomed["url"])
        assert status in (200, 503)
    with tinker.ServiceClient(base_url=doomed["url"], api_key=doomed["key"]) as sc2:
        m = _fails_fast(
            lambda: sc2.create_lora_training_client(base_model=doomed["base"], rank=4).result(
                timeout=BOUND_S + 60), "a new session's model")
        assert "died" in m, m
    # the group's health shows the kill (the operator's input to re-create the group)
    deadline = time.monotonic() + 60
    while (state := group.health()[1].state) != "DEAD" and time.monotonic() < deadline:
        time.sleep(1.0)
    assert state == "DEAD", group.health()
