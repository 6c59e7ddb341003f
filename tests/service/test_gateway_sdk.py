"""The Tinker gateway (issue 38) with the unmodified SDK: two Tinker servers serving different
base models (``org/student``, ``org/teacher``; each its own server, registry and checkpoint
directory, both over the package's TP=2 group: the routing is what is under test, and a second
group would double the test's CPU) behind one gateway, reached by one ServiceClient.

- The distillation shape: one session trains the student on one server and samples the
  teacher on the other; the student's loss on the teacher's tokens falls; each object lives on
  the server of its model, the session on both.
- A restarted gateway (nothing learned) carries on with the same clients: the model, sampler
  and request ids it never saw are found by asking the servers.
- Another principal (a key valid on both servers) reaches none of it: the same 404 as an id
  nobody holds; an unknown base model is a 404 naming the served ones; capabilities list both.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.service.conftest import KA, KB
from tests.service.test_sdk_flow import WAIT

pytestmark = [pytest.mark.ray, pytest.mark.megatron]

tinker = pytest.importorskip("tinker")
T = tinker.types
PROMPT = [5, 6, 7, 8]


def _post(url: str, path: str, body: dict[str, Any], key: str) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        f"{url}/api/v1/{path}", data=json.dumps(body).encode(), method="POST",
        headers={"X-API-Key": key, "Content-Type": "application/json"},
    )
    return _open(req)


def _get(url: str, path: str, key: str) -> tuple[int, dict[str, Any]]:
    return _open(urllib.request.Request(f"{url}/api/v1/{path}", headers={"X-API-Key": key}))


def _open(req: urllib.request.Request) -> tuple[int, dict[str, Any]]:
    """(status, the JSON answer; a protobuf one as ``{"proto": bytes}``)."""
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            raw, ctype, status = resp.read(), resp.headers.get("Content-Type", ""), resp.status
    except urllib.error.HTTPError as err:
        raw, ctype, status = err.read(), err.headers.get("Content-Type", ""), err.code
    return status, (json.loads(raw or b"{}") if "json" in ctype else {"proto": raw})


def _datum(tokens: list[int]) -> Any:
    return T.Datum(
        model_input=T.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.asarray(tokens[1:], np.int64),
                        "weights": np.ones(len(tokens) - 1, np.float32)},
    )


def _step(tc: Any, data: list[Any]) -> float:
    fb = tc.forward_backward(data, "cross_entropy").result(timeout=WAIT)
    tc.optim_step(T.AdamParams(learning_rate=2e-2)).result(timeout=WAIT)
    return float(fb.metrics["loss:sum"])


def test_one_client_trains_one_group_and_samples_another(gateway: dict[str, Any]) -> None:
    gw, servers = gateway["gw"], gateway["servers"]
    student, teacher = servers["student"].service, servers["teacher"].service
    params = T.SamplingParams(max_tokens=8, stop=[], seed=11)

    status, caps = _get(gw.url, "get_server_capabilities", KA)
    assert status == 200
    assert {m["model_name"] for m in caps["supported_models"]} == {"org/student", "org/teacher"}
    status, nope = _post(gw.url, "create_model", {"session_id": "tg-" + "0" * 32,
                                                   "base_model": "org/nope"}, KA)
    assert status == 404 and "org/student" in nope["error"] and "org/teacher" in nope["error"]

    with tinker.ServiceClient(base_url=gw.url, api_key=KA) as sc:
        tc = sc.create_lora_training_client(base_model="org/student", rank=8).result(timeout=WAIT)
        teacher_client = sc.create_sampling_client(base_model="org/teacher").result(timeout=WAIT)
        out = teacher_client.sample(T.ModelInput.from_ints(PROMPT), num_samples=2,
                                    sampling_params=params).result(timeout=WAIT)
        data = [_datum(PROMPT + list(s.tokens)) for s in out.sequences]
        losses = [_step(tc, data) for _ in range(3)]
        assert losses[-1] < losses[0], losses  # the student learns the teacher's tokens

        sid = tc.model_id.split(":train:")[0]
        assert sid in student.registry.sessions and sid in teacher.registry.sessions
        assert tc.model_id in student.registry.models
        assert tc.model_id not in teacher.registry.models
        teacher_samplers = [s for s in teacher.registry.samplers.values() if s.session_id == sid]
        assert len(teacher_samplers) == 1 and not any(
            s.session_id == sid for s in student.registry.samplers.values())
        own = tc.save_weights_and_get_sampling_client().result(timeout=WAIT)  # on the student
        assert own.sample(T.ModelInput.from_ints(PROMPT), num_samples=1,
                          sampling_params=params).result(timeout=WAIT).sequences

        sampler = teacher_samplers[0].sampling_session_id
        status, sent = _post(gw.url, "asample", {
            "sampling_session_id": sampler, "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
            "sampling_params": {"max_tokens": 2, "stop": [], "seed": 3},
        }, KA)
        assert status == 200

        # a restarted gateway, same port, nothing learned: the same clients carry on
        port = gw.port
        gw.stop()
        gateway["gw"] = gw = gateway["start"](port)
        assert gw.port == port
        # a request id from before: found by asking every server (bob's key: the 410 of an
        # id nobody holds, and his asking does not consume alice's result)
        rid = {"request_id": sent["request_id"]}
        assert _post(gw.url, "retrieve_future", rid, KB)[0] == 410
        status, result = _post(gw.url, "retrieve_future", rid, KA)
        assert status == 200 and result.get("proto")
        losses.append(_step(tc, data))
        again = teacher_client.sample(T.ModelInput.from_ints(PROMPT), num_samples=2,
                                      sampling_params=params).result(timeout=WAIT)
        assert [list(s.tokens) for s in again.sequences] == [list(s.tokens) for s in out.sequences]
        path = tc.save_state("gw-state").result(timeout=WAIT).path
        assert (Path(student.info.checkpoint_dir) / "tinker" / "principals" / "alice").is_dir()

        # bob (a key of both servers) reaches nothing of alice's: the 404 of a missing id
        for mid in (tc.model_id, f"{sid}:train:99"):
            status, err = _post(gw.url, "get_info", {"model_id": mid}, KB)
            assert status == 404 and err["error"].startswith(f"unknown model id {mid!r}")
        status, _ = _get(gw.url, f"samplers/{sampler}", KB)
        assert status == 404
        made_up = path.replace(tc.model_id, f"{sid}:train:99")
        got = [_post(gw.url, "weights_info", {"tinker_path": p}, KB) for p in (path, made_up)]
        assert got[0][0] == got[1][0] == 404
        assert got[0][1]["error"].replace(path, "P") == got[1][1]["error"].replace(made_up, "P")
        status, runs = _get(gw.url, "training_runs", KB)
        assert status == 200 and runs["training_runs"] == []
        status, runs = _get(gw.url, "training_runs", KA)
        assert tc.model_id in {r["training_run_id"] for r in runs["training_runs"]}
    assert all(s.finished for s in (student.registry.sessions[sid], teacher.registry.sessions[sid]))
