"""Pure logic of the server: seq_id order, keys, paths, the training-run lock (no group)."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import pytest

from tgruntime.service.auth import KeyStore
from tgruntime.service.futures import FutureStore, Outcome
from tgruntime.service.paths import Paths
from tgruntime.service.sessions import Model, Registry, SeqOrder, ServiceError


def test_seq_order_admits_in_order_waits_for_gaps_refuses_old() -> None:
    async def run() -> list[int]:
        order = SeqOrder(gap_timeout_s=5.0)
        seen: list[int] = []

        async def one(seq: int) -> None:
            await order.admit(seq)
            seen.append(seq)
            await order.done(seq)

        await asyncio.gather(one(3), one(2), one(1))
        with pytest.raises(ServiceError, match="out of order"):
            await order.admit(2)
        short = SeqOrder(gap_timeout_s=0.05)
        with pytest.raises(ServiceError, match="never came"):
            await short.admit(2)
        return seen

    assert asyncio.run(run()) == [1, 2, 3]


def test_keys_file_and_dir_are_reread(tmp_path: Path) -> None:
    d = tmp_path / "secret"
    d.mkdir()
    (d / "a").write_text("tml-a\n")
    (d / ".hidden").write_text("tml-hidden")
    store = KeyStore(keys_dir=str(d), keys=["tml-env"], recheck_s=0.0)
    assert store.check("tml-a") is None and store.check("tml-env") is None
    assert store.check("tml-hidden") is not None
    assert "missing" in (store.check(None) or "")
    (d / "a").unlink()
    assert "invalid" in (store.check("tml-a") or "")


def test_futures_long_poll_and_restart() -> None:
    async def run() -> None:
        store = FutureStore()
        rid = store.new()
        assert await store.wait(rid, 0.01) is None  # pending: a 408
        store.resolve(rid, Outcome(body={"ok": 1}))
        out = await store.wait(rid, 0.01)
        assert out is not None and out.body == {"ok": 1}
        old = f"deadbeef0000-{'7' * 32}"  # well-formed, from before a restart: 410 (gone)
        with pytest.raises(ServiceError, match="restarted") as gone:
            await store.wait(old, 0.01)
        assert gone.value.status == 410 and gone.value.category == "server"
        with pytest.raises(ServiceError, match="no longer held") as expired:
            await store.wait(f"{store.boot}-{'0' * 32}", 0.01)  # this boot's, not held
        assert expired.value.status == 410
        for odd in ("deadbeef0000-7", "x", "", "../etc"):  # other shapes: 404
            with pytest.raises(ServiceError, match="unknown request id") as nf:
                await store.wait(odd, 0.01)
            assert nf.value.status == 404

    asyncio.run(run())


def test_fetched_futures_are_bounded_by_count_and_bytes_per_owner() -> None:
    """A loop that fetches every result holds at most ``delivered_keep_n`` of them per owner
    (and ``delivered_keep_bytes`` of payload), however fast it runs; a fetched result is still
    answered again while it is among the newest; an unfetched one and another owner's stay."""

    async def run() -> None:
        store = FutureStore(delivered_keep_n=4, delivered_keep_bytes=250)
        unfetched = store.new("a")
        store.resolve(unfetched, Outcome(proto=b"u" * 100))
        other = store.new("b")
        store.resolve(other, Outcome(proto=b"o"))
        assert await store.wait(other, 0.01, "b") is not None
        fetched = []
        owner = "a"
        for i in range(10):
            rid = store.new("a")
            store.resolve(rid, Outcome(proto=bytes([i]) * 10))
            assert (await store.wait(rid, 0.01, owner)) is not None
            fetched.append(rid)
        # the newest four of a's fetched results, the unfetched one, b's one
        assert len(store) == 4 + 1 + 1
        for rid in fetched[-4:]:  # a retried fetch of a recent one is answered again
            out = await store.wait(rid, 0.01, owner)
            assert out is not None and out.proto == bytes([fetched.index(rid)]) * 10
        with pytest.raises(ServiceError, match="no longer held") as gone:
            await store.wait(fetched[0], 0.01, "a")
        assert gone.value.status == 410
        assert await store.wait(unfetched, 0.01, "a") is not None  # fetched now: counts from here
        assert await store.wait(other, 0.01, "b") is not None  # b's is not a's to evict
        # bytes: two 200-byte results exceed 250, so only the newest stays (never none)
        owner = "c"
        for _ in range(2):
            rid = store.new("c")
            store.resolve(rid, Outcome(proto=b"x" * 200))
            assert await store.wait(rid, 0.01, owner) is not None
        assert sum(1 for e in store._entries.values() if e.owner == "c") == 1

    asyncio.run(run())


def test_unfetched_futures_are_bounded_by_count_and_bytes_per_owner() -> None:
    """A client that sends and never fetches holds at most ``keep_n`` finished results (and
    ``keep_bytes`` of payload) per owner, the newest; an older one is gone (410), a pending
    one and another owner's are not counted, and a fetched one leaves the unfetched list."""

    async def run() -> None:
        store = FutureStore(keep_n=3, keep_bytes=250)
        pending = store.new("a")
        other = store.new("b")
        store.resolve(other, Outcome(proto=b"o"))
        sent = []
        for i in range(6):
            rid = store.new("a")
            store.resolve(rid, Outcome(proto=bytes([i]) * 10))
            sent.append(rid)
        assert len(store) == 1 + 1 + 3  # the pending one, b's, a's newest three
        with pytest.raises(ServiceError, match="no longer held") as gone:
            await store.wait(sent[0], 0.01, "a")
        assert gone.value.status == 410
        out = await store.wait(sent[-3], 0.01, "a")  # fetched: no longer counts as unfetched
        assert out is not None and out.proto == bytes([3]) * 10
        store.resolve(pending, Outcome(proto=b"p"))
        assert all(rid in store._entries for rid in (sent[-3], sent[-2], sent[-1], pending))
        assert await store.wait(other, 0.01, "b") is not None
        # bytes: two 200-byte results exceed 250, so only the newest stays (never none)
        for _ in range(2):
            store.resolve(store.new("c"), Outcome(proto=b"x" * 200))
        assert sum(1 for e in store._entries.values() if e.owner == "c") == 1

    asyncio.run(run())


def test_one_full_weight_run_per_group() -> None:
    reg = Registry()
    a, b = reg.new_session([], None), reg.new_session([], None)
    reg.add_model(Model(f"{a.session_id}:train:0", a.session_id, "m", 8))
    with pytest.raises(ServiceError, match="already trains"):
        reg.add_model(Model(f"{b.session_id}:train:0", b.session_id, "m", 8))
    reg.add_model(Model(f"{a.session_id}:train:1", a.session_id, "m", None))  # same session
    with pytest.raises(ServiceError, match="superseded"):
        reg.model(f"{a.session_id}:train:0")
    reg.finish(a.session_id)
    reg.add_model(Model(f"{b.session_id}:train:0", b.session_id, "m", 8))


def test_paths_map_to_the_checkpoint_dir(tmp_path: Path) -> None:
    p = Paths(str(tmp_path))
    d = p.directory("default", "s:train:0", "weights", "w1")
    assert d == tmp_path / "tinker" / "principals" / "default" / "s:train:0" / "weights" / "w1"
    with pytest.raises(ServiceError, match="no checkpoint"):
        p.parse("tinker://s:train:0/weights/w1")
    d.mkdir(parents=True)
    assert p.parse("tinker://s:train:0/weights/w1")[3] == d
    with pytest.raises(ServiceError, match="expected"):
        p.parse("tinker://s:train:0/other/w1")
    with pytest.raises(ServiceError, match="checkpoint name"):
        p.directory("default", "s:train:0", "weights", "../x")
    assert [c["tinker_path"] for c in p.listing()] == ["tinker://s:train:0/weights/w1"]
    with pytest.raises(ServiceError, match="checkpointDir"):
        Paths("").directory("default", "m", "weights", "x")


def test_tgctl_key_generated_0600(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tgruntime.entrypoints.cli import tinker_key

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("TG_TINKER_API_KEY", raising=False)
    key, where = tinker_key("g")
    assert key.startswith("tml-") and len(key) > 20
    assert stat.S_IMODE(os.stat(where).st_mode) == 0o600
    assert tinker_key("g") == (key, where)
    monkeypatch.setenv("TG_TINKER_API_KEY", "tml-mine")
    assert tinker_key("g")[0] == "tml-mine"


def test_stop_strings_cut_at_the_first_decoded_stop(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from tests.service.conftest import build_tokenizer
    from tgruntime.service.stops import cut_sequences, load_tokenizer, stop_at, token_stops

    tok = load_tokenizer(str(build_tokenizer(tmp_path / "tok")))
    ids = tok.encode("the a of is and", add_special_tokens=False)
    assert token_stops(tok, ["of", "zzz-unknown"]) == ((ids[2],),)  # unknown: decode only
    assert stop_at(tok, ids, ["of"]) == 3
    assert stop_at(tok, ids, ["f i"]) == 4  # across tokens: the token that completes it
    assert stop_at(tok, ids, ["nope"]) is None
    seqs = [{"tokens": ids, "logprobs": [-1.0] * 5, "stop_reason": "length"}]
    out = cut_sequences(tok, seqs, ["is", "of"])[0]
    assert out == {"tokens": ids[:3], "logprobs": [-1.0] * 3, "stop_reason": "stop"}


def test_a_lora_group_takes_its_run_limits_from_the_spec_and_checks_lora_configs() -> None:
    """spec.lora and spec.api -> GroupInfo; the SDK's LoraConfig -> the workers' settings
    (alpha from spec.lora), bad values refused before any group call."""
    import tgapi
    from tgruntime.service.__main__ import group_info
    from tgruntime.service.app import TinkerService
    from tgruntime.service.backend import Backend

    spec = tgapi.parse_spec(
        {"lora": {"rank": 8, "alpha": 16}, "api": {"maxRuns": 2, "idleRunSeconds": 30}},
        local=True,
    )
    info = group_info("tiny", spec)
    assert (info.lora_rank, info.lora_alpha, info.max_runs, info.idle_run_seconds) == (
        8, 16.0, 2, 30,
    )
    assert group_info("tiny", tgapi.parse_spec({}, local=True)).lora_rank is None
    service = TinkerService(Backend(client=None, info=info), KeyStore(keys=["k"]))  # type: ignore[arg-type]
    assert service.lora is not None and service.lora.max_runs == 2
    assert service._run_settings({"rank": 4, "seed": 3, "train_mlp": False}) == {
        "rank": 4, "alpha": 16.0, "train_attn": True, "train_mlp": False,
        "train_unembed": True, "seed": 3,
    }
    assert service._run_settings(None)["rank"] == 8  # the group's rank by default
    for bad, field in (({"rank": 0}, "rank"), ({"rank": True}, "rank"),
                       ({"rank": 4, "train_attn": "yes"}, "train_attn")):
        with pytest.raises(ServiceError, match=f"lora_config.{field}"):
            service._run_settings(bad)


def test_fair_turns_serve_runs_round_robin_and_survive_cancellation() -> None:
    """One run queues six calls, another two, a third one: the turns alternate between the
    runs that wait (FIFO within a run); a waiter cancelled in the queue loses its place only."""
    from tgruntime.service.runs import FairTurns

    async def main() -> list[str]:
        turns = FairTurns()
        log: list[str] = []
        gate = asyncio.Event()

        async def call(run: str, n: int) -> None:
            async with turns.turn(run):
                if not gate.is_set():
                    await gate.wait()  # the first holder keeps the group until all queue
                log.append(f"{run}{n}")
                await asyncio.sleep(0)

        tasks = [asyncio.create_task(call("a", i)) for i in range(6)]
        await asyncio.sleep(0.01)
        tasks += [asyncio.create_task(call("b", i)) for i in range(2)]
        doomed = asyncio.create_task(call("c", 9))
        tasks.append(asyncio.create_task(call("c", 0)))
        await asyncio.sleep(0.01)
        doomed.cancel()
        gate.set()
        await asyncio.gather(*tasks)
        assert doomed.cancelled()
        return log

    assert asyncio.run(main()) == ["a0", "b0", "c0", "a1", "b1", "a2", "a3", "a4", "a5"]


def test_idle_runs_are_the_unparked_ones_past_the_limit() -> None:
    from tgruntime.service.runs import LoraRuns, RunState

    runs = LoraRuns(max_runs=2, idle_run_s=60)
    runs.runs = {
        "old": RunState("old", 8, last_call=100.0),
        "new": RunState("new", 8, last_call=150.0),
        "parked": RunState("parked", 8, last_call=0.0, parked=True),
    }
    assert runs.idle(170.0) == ["old"]
    assert runs.full()
    runs.touch("parked")
    assert not runs.runs["parked"].parked
    assert LoraRuns(max_runs=2, idle_run_s=0).idle(1e12) == []
