"""A session whose heartbeat stops is expired by the server (TP=2 group, CPU, gloo).

Session A (the unmodified SDK) takes the group's one full-weight run, then its SDK's
heartbeat task is cancelled (as when the client process hangs or its network goes). Its
session times out after the registry's TTL (docs/tinker.md: 120 s; shortened here on the
served registry, which has no public setting for it), and the group's run is free: session B
takes it. A's late requests get the documented answers.

The registry's TTL and forget delay are the served registry's attributes, set for the test
and put back (``Registry(session_ttl_s=..., forget_s=...)`` has no service setting)."""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.service.test_sdk_flow import WAIT, _batch, _sc

pytestmark = [pytest.mark.ray, pytest.mark.megatron]

tinker = pytest.importorskip("tinker")
T = tinker.types
TTL_S = 20.0  # the SDK heartbeats every 10 s: a live session stays alive at 20 s
LAPSE_WAIT_S = 120.0


def _post(url: str, key: str, route: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        f"{url}/api/v1/{route}", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "X-API-Key": key},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def _stop_heartbeat(sc: Any) -> None:
    holder = sc._session_holder
    task = holder._session_heartbeat_task
    holder.get_loop().call_soon_threadsafe(task.cancel)


def _expire(served: dict[str, Any]) -> list[str]:
    """Run the server's expiry pass now, on its own event loop."""
    service = served["service"]

    async def go() -> list[str]:
        gone: list[str] = service.expire()
        return gone

    gone: list[str] = served["running"].submit(go()).result(timeout=60)
    return gone


def _wait_lapsed(registry: Any, sid: str) -> float:
    start = time.monotonic()
    while time.monotonic() - start < LAPSE_WAIT_S:
        s = registry.sessions.get(sid)
        if s is not None and not registry.alive(s):
            return time.monotonic() - start
        time.sleep(0.5)
    raise AssertionError(f"session {sid} still alive {LAPSE_WAIT_S} s after its heartbeat stopped")


@pytest.fixture
def short_ttl(served: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    registry = served["service"].registry
    monkeypatch.setattr(registry, "_ttl", TTL_S)
    yield registry


def _lapse_a_take_b(served: dict[str, Any], registry: Any) -> tuple[Any, Any, Any]:
    """A holds the group; A's heartbeat stops; B is refused until A lapses, then takes it."""
    sc_a = _sc(served)
    tc_a = sc_a.create_lora_training_client(base_model=served["base"], rank=4).result(
        timeout=WAIT
    )
    tc_a.forward_backward(_batch(1), "cross_entropy").result(timeout=WAIT)
    tc_a.optim_step(T.AdamParams(learning_rate=1e-3)).result(timeout=WAIT)
    sid_a = registry.models[tc_a.model_id].session_id
    _stop_heartbeat(sc_a)
    sc_b = _sc(served)
    # A still holds the group: B's full-weight run is refused, naming the way out
    with pytest.raises(Exception, match=r"already trains model .*heartbeat lapse"):
        sc_b.create_lora_training_client(base_model=served["base"], rank=4).result(
            timeout=WAIT
        )
    waited = _wait_lapsed(registry, sid_a)
    assert waited < TTL_S + 15, waited
    tc_b = sc_b.create_lora_training_client(base_model=served["base"], rank=4).result(
        timeout=WAIT
    )
    return (sc_a, tc_a, sid_a), sc_b, tc_b


def _close(sc: Any) -> None:
    with contextlib.suppress(Exception):
        sc.close("success").result(timeout=60)


def test_lapsed_session_frees_the_group_then_is_forgotten(
    served: dict[str, Any], short_ttl: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = short_ttl
    (sc_a, tc_a, sid_a), sc_b, tc_b = _lapse_a_take_b(served, registry)
    try:
        # B trains the group's run now
        loss = tc_b.forward_backward(_batch(2), "cross_entropy").result(timeout=WAIT)
        assert loss.metrics["loss:sum"] > 0
        tc_b.optim_step(T.AdamParams(learning_rate=1e-3)).result(timeout=WAIT)
        assert registry.active_model().model_id == tc_b.model_id
        # the expiry pass forgets A (forget delay 0 here; 10 minutes by default) with its
        # model, and keeps B
        monkeypatch.setattr(registry, "_forget_s", 0.0)
        _expire(served)  # first seen ended
        assert sid_a in _expire(served) or sid_a not in registry.sessions
        assert sid_a not in registry.sessions and tc_a.model_id not in registry.models
        assert tc_b.model_id in registry.models
        assert not [s for s in registry.samplers.values() if s.session_id == sid_a]
        # A's late heartbeat and late training request: 404, saying what to do
        st, body = _post(served["url"], served["key"], "session_heartbeat",
                         {"session_id": sid_a})
        assert st == 404 and "unknown session" in body["error"], (st, body)
        assert "create a new ServiceClient" in body["error"], body
        t0 = time.monotonic()
        with pytest.raises(Exception, match=f"unknown model id '{tc_a.model_id}'"):
            tc_a.forward_backward(_batch(1), "cross_entropy").result(timeout=WAIT)
        assert time.monotonic() - t0 < 30, "a late request is answered at once"
        # B is untouched and goes on
        assert tc_b.forward_backward(_batch(2), "cross_entropy").result(
            timeout=WAIT).metrics["loss:sum"] > 0
    finally:
        _close(sc_b)
        _close(sc_a)


def test_late_request_of_a_lapsed_holder_is_refused(
    served: dict[str, Any], short_ttl: Any
) -> None:
    registry = short_ttl
    (sc_a, tc_a, _), sc_b, tc_b = _lapse_a_take_b(served, registry)
    try:
        late: BaseException | None = None
        try:
            tc_a.forward_backward(_batch(1), "cross_entropy").result(timeout=WAIT)
        except Exception as exc:
            late = exc
        live = [m.model_id for m in registry.models.values()
                if m.retired is None and registry.alive(registry.sessions[m.session_id])]
        assert live == [tc_b.model_id], live
        assert late is not None and "no longer" in str(late), late
    finally:
        _close(sc_b)
        _close(sc_a)
