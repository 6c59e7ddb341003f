"""Each bad input gets a clear error at once, and the server and group keep working."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from typing import Any

import numpy as np
import pytest

from tests.service.test_sdk_flow import WAIT, _batch, _datum, _sc

pytestmark = [pytest.mark.ray, pytest.mark.megatron]

tinker = pytest.importorskip("tinker")
T = tinker.types


def _post(served: dict[str, Any], route: str, body: bytes, *, key: str | None = None,
          ctype: str = "application/json") -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": ctype}
    if key is not None:
        headers["X-API-Key"] = key
    req = urllib.request.Request(f"{served['url']}/api/v1/{route}", data=body, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def _wire(request: Any) -> bytes:
    """A tinker SDK request type as the SDK sends it (JSON)."""
    return json.dumps(request.model_dump(mode="json")).encode()


def create_model_refused(served: dict[str, Any], *want: str) -> None:
    """A raw ``create_model`` (a new session) on a group at capacity: HTTP 200 with a request
    id, not 409/429 (the SDK retries those for about a minute before the user sees the
    message), and the first ``retrieve_future`` already gives the failure: category ``user``,
    its message matching each of ``want`` (regular expressions: the cause and the fix)."""
    key = served["key"]
    code, session = _post(served, "create_session", _wire(
        T.CreateSessionRequest(tags=[], user_metadata=None, sdk_version="0.38.0")), key=key)
    assert code == 200, (code, session)
    sid = session["session_id"]
    try:
        model = T.CreateModelRequest(session_id=sid, model_seq_id=0, base_model=served["base"],
                                     lora_config=T.LoraConfig(rank=8))
        code, created = _post(served, "create_model", _wire(model), key=key)
        assert code == 200 and created.get("request_id"), (code, created)
        code, got = _post(served, "retrieve_future", _wire(
            T.FutureRetrieveRequest(request_id=created["request_id"])), key=key)
        assert code == 200 and got.get("category") == "user", (code, got)
        for pattern in want:
            assert re.search(pattern, got["error"]), (pattern, got)
    finally:
        _post(served, f"sessions/{sid}/finish", b"{}", key=key)


def _works(tc: Any) -> None:
    out = tc.forward(_batch(9, n=1), "cross_entropy").result(timeout=WAIT)
    assert np.isfinite(out.metrics["loss:sum"])


def test_keys_401_and_removed_key_stops_working(served: dict[str, Any]) -> None:
    code, body = _post(served, "create_session", b"{}")
    assert code == 401 and "X-API-Key" in body["error"]
    code, body = _post(served, "create_session", b"{}", key="tml-wrong")
    assert code == 401 and "invalid API key" in body["error"]
    keys = served["keys_file"]
    keys.write_text(served["key"] + "\ntml-second\n")
    ok = b'{"tags": [], "sdk_version": "0.38.0"}'
    assert _post(served, "create_session", ok, key="tml-second")[0] == 200
    keys.write_text(served["key"] + "\n")
    assert _post(served, "create_session", ok, key="tml-second")[0] == 401
    assert _post(served, "create_session", ok, key=served["key"])[0] == 200


def test_bad_inputs_are_refused_clearly(served: dict[str, Any]) -> None:
    with _sc(served) as sc:
        with pytest.raises(Exception, match="not served here"):
            sc.create_lora_training_client(base_model="meta-llama/Other", rank=8).result()
        tc = sc.create_lora_training_client(base_model=served["base"], rank=8).result()
        with pytest.raises(Exception, match="not supported"):
            tc.forward_backward(_batch(1), "no_such_loss").result(timeout=WAIT)
        _works(tc)
        bad = T.Datum(
            model_input=T.ModelInput.from_ints([3, 4, 5, 6]),
            loss_fn_inputs={"target_tokens": np.asarray([4, 5, 6], np.int64),
                            "weights": np.ones(3, np.float32)},
        )
        with pytest.raises(Exception, match="shape"):
            tc.forward_backward([bad], "cross_entropy").result(timeout=WAIT)
        over = _datum([3, 4, 5, 6, 500])
        with pytest.raises(Exception, match="outside the vocabulary"):
            tc.forward_backward([over], "cross_entropy").result(timeout=WAIT)
        _works(tc)
        # a second concurrent full-weight run on the group (another live session)
        with _sc(served) as other, pytest.raises(Exception, match="already trains"):
            other.create_lora_training_client(base_model=served["base"], rank=8).result()
        sampler = tc.save_weights_and_get_sampling_client()
        with pytest.raises(Exception, match="sequence limit"):
            sampler.sample(T.ModelInput.from_ints([1, 2, 3]), num_samples=1,
                           sampling_params=T.SamplingParams(max_tokens=1000)).result(
                timeout=WAIT)
        # raw requests: malformed protobuf, an old seq_id, an unknown model id
        key = served["key"]
        code, body = _post(served, "forward_backward", b"\xff\xff\xff\x01garbage", key=key,
                           ctype="application/x-protobuf")
        assert code == 400 and "malformed protobuf" in body["error"], body
        from tinker.proto import tinker_public_pb2 as pb

        msg = pb.ForwardBackwardRequest(model_id=tc.model_id, seq_id=1, loss_fn="cross_entropy")
        code, body = _post(served, "forward_backward", msg.SerializeToString(), key=key,
                           ctype="application/x-protobuf")
        assert code == 400 and "out of order" in body["error"], body
        msg = pb.ForwardBackwardRequest(model_id="nope:train:0", seq_id=1, loss_fn="ppo")
        code, body = _post(served, "forward_backward", msg.SerializeToString(), key=key,
                           ctype="application/x-protobuf")
        assert code == 404 and "unknown model id" in body["error"], body
        code, body = _post(served, "optim_step",
                           json.dumps({"model_id": "nope:train:3", "adam_params": {}}).encode(),
                           key=key)
        assert code == 404
        # still usable: train a step and sample
        tc.forward_backward(_batch(2), "cross_entropy").result(timeout=WAIT)
        tc.optim_step(T.AdamParams(learning_rate=1e-3)).result(timeout=WAIT)
        _works(tc)
        r = sampler.sample(T.ModelInput.from_ints([1, 2, 3]), num_samples=1,
                           sampling_params=T.SamplingParams(max_tokens=3, stop=[])).result(
            timeout=WAIT)
        assert len(r.sequences[0].tokens) == 3


def test_a_model_refused_for_another_sessions_run_fails_its_future_not_http_409(
    served: dict[str, Any],
) -> None:
    with _sc(served) as sc:
        tc = sc.create_lora_training_client(base_model=served["base"], rank=8).result()
        create_model_refused(
            served, f"already trains model {re.escape(tc.model_id)}", "Finish that session"
        )
        _works(tc)
