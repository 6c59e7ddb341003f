"""Quotas and limits without a group (issue 37, service.limits): the pure logic, the settings
(flags and environment), and over HTTP with a fake backend: each refusal names the limit, its
value and its setting, with the status the SDK does (429 + Retry-After) or does not (400, 403,
413) retry, leaves nothing created, and never touches another principal's requests."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from tests.service.fake_service import fake_service
from tgruntime.service.futures import FutureStore, Outcome
from tgruntime.service.limits import LimitError, Limits, TokenRate, flag, from_env


# -- pure logic ----------------------------------------------------------------------------
def test_per_request_limits_name_the_limit_its_value_and_the_setting() -> None:
    lim = Limits(max_num_samples=8, max_tokens=100, max_datums=4, max_body_mb=1)
    lim.check_sample(8, 100)
    lim.check_datums(4)
    with pytest.raises(LimitError) as err:
        lim.check_sample(9, 10)
    e = err.value
    assert (e.status, e.limit, e.value, e.retry_after) == (400, "num_samples", 8, None)
    assert "num_samples 9 exceeds" in str(e) and "--max-num-samples" in str(e)
    assert "TG_TINKER_MAX_NUM_SAMPLES" in str(e) and e.headers() == {}
    with pytest.raises(LimitError, match=r"max_tokens 101 .* limit of 100 .*--max-tokens"):
        lim.check_sample(1, 101)
    with pytest.raises(LimitError, match=r"datums in one request 5 .*--max-datums"):
        lim.check_datums(5)
    big = lim.body_error(2 << 20)
    assert big.status == 413 and "1 MiB" in str(big) and "--max-body-mb" in str(big)
    assert lim.max_body_bytes == 1 << 20
    off = Limits(max_num_samples=0, max_tokens=0, max_datums=0, max_body_mb=0)
    off.check_sample(10**6, 10**6)
    off.check_datums(10**6)
    assert off.max_body_bytes >= 1 << 40


def test_per_principal_counts_refuse_without_retry_and_the_queue_with_retry_after() -> None:
    lim = Limits(max_runs_per_principal=2, max_sampling_sessions=3, max_queued_requests=5)
    lim.check_runs("a", 1)
    with pytest.raises(LimitError) as runs:
        lim.check_runs("a", 2)
    assert runs.value.status == 400 and runs.value.retry_after is None
    assert "principal 'a' holds 2 training runs" in str(runs.value)
    assert "--max-runs-per-principal" in str(runs.value)
    with pytest.raises(LimitError) as smp:
        lim.check_sampling_sessions("a", 3)
    assert smp.value.status == 403 and smp.value.headers() == {}  # 403: the SDK never retries
    lim.check_queued("a", 4)
    with pytest.raises(LimitError) as q:
        lim.check_queued("a", 5)
    assert q.value.status == 429 and q.value.headers() == {"Retry-After": "1"}
    assert "5 requests queued" in str(q.value) and "--max-queued-requests" in str(q.value)


def test_token_rate_admits_until_empty_charges_afterwards_and_refills() -> None:
    now = [0.0]
    rate = TokenRate(60, clock=lambda: now[0])  # one token a second
    rate.admit("a")
    rate.charge("a", 90)  # charged what was sampled: may go below zero
    assert rate.left("a") == -30
    with pytest.raises(LimitError) as err:
        rate.admit("a")
    assert err.value.status == 429 and err.value.retry_after == pytest.approx(31)
    assert err.value.headers() == {"Retry-After": "31"}
    assert "60 tokens per minute" in str(err.value)
    assert "--sampled-tokens-per-minute" in str(err.value)
    rate.admit("b")  # another principal's bucket is its own
    now[0] = 31.0
    rate.admit("a")
    now[0] = 1000.0
    assert rate.left("a") == 60  # refills up to one minute's tokens, no more
    off = TokenRate(0)
    off.charge("a", 10**9)
    off.admit("a")


def test_futures_count_each_principals_queued_requests() -> None:
    store = FutureStore()
    ids = [store.new("a") for _ in range(3)] + [store.new("b")]
    assert (store.queued("a"), store.queued("b"), store.queued("c")) == (3, 1, 0)
    store.resolve(ids[0], Outcome(body={}))
    store.resolve(ids[0], Outcome(body={}))  # twice: counted once
    store.fail(ids[3], "x")
    assert (store.queued("a"), store.queued("b")) == (2, 0)


def test_settings_from_flags_and_environment() -> None:
    from tgruntime.entrypoints.cli import build_parser
    from tgruntime.service.__main__ import build_parser as service_parser
    from tgruntime.service.limits import from_args

    env = {"TG_TINKER_MAX_NUM_SAMPLES": "16", "TG_TINKER_SAMPLED_TOKENS_PER_MINUTE": "1000"}
    assert from_env(env) == Limits(max_num_samples=16, sampled_tokens_per_minute=1000)
    with pytest.raises(ValueError, match="TG_TINKER_MAX_TOKENS"):
        from_env({"TG_TINKER_MAX_TOKENS": "lots"})
    args = build_parser().parse_args(
        ["serve", "-f", "tg.yaml", "--max-num-samples", "3", "--max-body-mb", "2"]
    )
    got = from_args(args)
    assert (got.max_num_samples, got.max_body_mb, got.max_datums) == (3, 2, Limits().max_datums)
    got = from_args(service_parser().parse_args(["--spec", "x", "--max-queued-requests", "7"]))
    assert got.max_queued_requests == 7
    assert flag("max_datums") == "--max-datums / TG_TINKER_MAX_DATUMS"


# -- over HTTP, without a group ------------------------------------------------------------
class _FakeClient:
    def drop_sampler_weights(self, name: str) -> Any:
        raise RuntimeError("no group")


def _service(tmp_path: Path, limits: Limits, *, lora: bool = False) -> Any:
    keys = tmp_path / "keys"
    keys.write_text("team-a tml-aaa\nteam-b tml-bbb\n")
    wire: dict[str, Any] = {
        "model": {"maxSequenceLength": 128},
        "training": {"sequenceLength": 128},
    }
    if lora:
        wire["lora"] = {"rank": 4, "alpha": 8}
        wire["api"] = {"maxRuns": 8}
    return fake_service(client=_FakeClient(), wire=wire, root=tmp_path, keys_file=keys,
                        limits=limits)


def _sample(n: int = 1, max_tokens: int = 4) -> dict[str, Any]:
    return {
        "base_model": "tiny", "num_samples": n,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
        "sampling_params": {"max_tokens": max_tokens, "stop": []},
    }


def _http(service: Any, main: Any) -> None:
    from aiohttp.test_utils import TestClient, TestServer

    from tgruntime.service.app import create_app

    async def run() -> None:
        async with TestClient(TestServer(create_app(service))) as http:

            async def post(route: str, body: Any, key: str, **kw: Any) -> tuple[int, Any, Any]:
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                r = await http.post(
                    f"/api/v1/{route}", data=data, headers={"X-API-Key": key, **kw}
                )
                return r.status, await r.json(), r.headers

            await main(post, http)

    asyncio.run(run())


def test_request_limits_over_http(tmp_path: Path) -> None:
    service = _service(tmp_path, Limits(max_num_samples=4, max_tokens=8, max_body_mb=1))

    async def main(post: Any, http: Any) -> None:
        code, got, headers = await post("asample", _sample(n=5), "tml-aaa")
        assert code == 400 and "num_samples 5 exceeds the server's limit of 4" in got["error"]
        assert "--max-num-samples" in got["error"] and "Retry-After" not in headers
        code, got, _ = await post("asample", _sample(max_tokens=9), "tml-aaa")
        assert code == 400 and "max_tokens 9" in got["error"] and "--max-tokens" in got["error"]
        code, got, _ = await post("asample", b"x" * (2 << 20), "tml-aaa")  # Content-Length
        assert code == 413 and "2097152 bytes" in got["error"] and "1 MiB" in got["error"]

        async def chunks() -> Any:  # no Content-Length: refused once read past the limit
            for _ in range(3):
                yield b"y" * (1 << 20)

        r = await http.post(
            "/api/v1/asample", data=chunks(), headers={"X-API-Key": "tml-aaa"}
        )
        got = await r.json()
        assert r.status == 413 and "--max-body-mb" in got["error"], got
        cfg = await (await http.post("/api/v1/client/config", json={}, headers={
            "X-API-Key": "tml-aaa"})).json()
        assert cfg["fwdbwd_max_chunk_len"] == 1024
        assert cfg["fwdbwd_max_chunk_bytes_count"] == (1 << 20) // 8
        assert service.futures.queued("team-a") == 0  # nothing was accepted

    _http(service, main)


def test_principal_quotas_over_http_leave_the_other_principal_alone(tmp_path: Path) -> None:
    service = _service(
        tmp_path,
        Limits(max_queued_requests=3, sampled_tokens_per_minute=600, max_sampling_sessions=2),
    )

    async def main(post: Any, http: Any) -> None:
        held = [service.futures.new("team-a") for _ in range(3)]  # A's queue is full
        code, got, headers = await post("asample", _sample(), "tml-aaa")
        assert code == 429 and headers["Retry-After"] == "1", got
        assert "'team-a' has 3 requests queued" in got["error"]
        assert "--max-queued-requests" in got["error"]
        code, got, _ = await post("asample", _sample(), "tml-bbb")
        assert code == 200 and "request_id" in got  # B is not held back
        for rid in held:
            service.futures.resolve(rid, Outcome(body={}))
        service.rate.charge("team-a", 1200)  # A sampled two minutes' worth
        code, got, headers = await post("asample", _sample(), "tml-aaa")
        assert code == 429 and 60 <= int(headers["Retry-After"]) <= 61, (got, headers)
        assert "600 tokens per minute" in got["error"]
        assert (await post("asample", _sample(), "tml-bbb"))[0] == 200
        # live sampling sessions: 403 (not retried), nothing registered
        _, made, _ = await post("create_session", {"tags": []}, "tml-aaa")
        sid = made["session_id"]
        body = {"session_id": sid, "base_model": "tiny"}
        for _ in range(2):
            assert (await post("create_sampling_session", body, "tml-aaa"))[0] == 200
        before = set(service.registry.samplers)
        code, got, headers = await post("create_sampling_session", body, "tml-aaa")
        assert code == 403 and "holds 2 sampling sessions" in got["error"], got
        assert "--max-sampling-sessions" in got["error"] and "Retry-After" not in headers
        assert set(service.registry.samplers) == before
        _, made_b, _ = await post("create_session", {"tags": []}, "tml-bbb")
        body_b = {"session_id": made_b["session_id"], "base_model": "tiny"}
        assert (await post("create_sampling_session", body_b, "tml-bbb"))[0] == 200
        await post(f"sessions/{sid}/finish", {}, "tml-aaa")  # A's finished session frees them
        _, made, _ = await post("create_session", {"tags": []}, "tml-aaa")
        body = {"session_id": made["session_id"], "base_model": "tiny"}
        assert (await post("create_sampling_session", body, "tml-aaa"))[0] == 200

    _http(service, main)


def test_runs_per_principal_refused_through_the_future_nothing_half_created(
    tmp_path: Path,
) -> None:
    service = _service(tmp_path, Limits(max_runs_per_principal=1), lora=True)

    async def main(post: Any, http: Any) -> None:
        async def create(key: str, seq: int) -> tuple[str, dict[str, Any]]:
            _, made, _ = await post("create_session", {"tags": []}, key)
            body = {"session_id": made["session_id"], "model_seq_id": seq,
                    "base_model": "tiny", "lora_config": {"rank": 4}}
            code, got, _ = await post("create_model", body, key)
            assert code == 200, got
            for _ in range(50):
                code, out, _ = await post("retrieve_future", {"request_id": got["request_id"]},
                                          key)
                if code != 408:
                    return got["model_id"], out
            raise AssertionError("no answer")

        first, out = await create("tml-aaa", 0)
        assert out.get("model_id") == first, out
        runs = dict(service.lora.runs)
        models = set(service.registry.models)
        second, out = await create("tml-aaa", 0)
        assert "error" in out and "holds 1 training runs" in out["error"], out
        assert "--max-runs-per-principal" in out["error"]
        assert dict(service.lora.runs) == runs and set(service.registry.models) == models
        assert second not in service.registry.models
        b_run, out = await create("tml-bbb", 0)  # B's run is created meanwhile
        assert out.get("model_id") == b_run and b_run in service.lora.runs

    _http(service, main)


def test_a_models_inflight_clients_count_once_against_the_sampling_sessions(
    tmp_path: Path,
) -> None:
    """An RL loop of kind="inflight" saves makes a sampling session a step, all on the model's
    one shared weights: they count as one live session, each snapshot client as its own."""
    from tgruntime.service.sampler_weights import inflight_name

    service = _service(tmp_path, Limits(max_sampling_sessions=3))
    sid = service.registry.new_session([], None, "team-a").session_id
    service.ephemeral.inflight_saved("m1", inflight_name("m1"))
    for _ in range(5):
        service._new_sampler(sid, None, None, "team-a", inflight=True)  # full weights
        service._new_sampler(sid, inflight_name("m1"), None, "team-a", inflight=True)  # LoRA
    assert service._live_samplers("team-a") == 2
    service._new_sampler(sid, "/ckpt/sampler_weights/s0", None, "team-a")
    assert service._live_samplers("team-a") == 3
    with pytest.raises(Exception, match="holds 3 sampling sessions"):
        service.limits.check_sampling_sessions("team-a", service._live_samplers("team-a"))
    assert service._live_samplers("team-b") == 0
