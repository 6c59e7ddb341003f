"""stable_reinforce's sampling-time records (service.stability) and provenance (service.codec,
service.provenance), with no group: ownership by principal and session, the day renewed by
use, the byte cap, every provenance check, and the SDK's own protobuf spans decoded."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tgruntime.service.codec import DatumIn, decode_forward_backward
from tgruntime.service.provenance import Span
from tgruntime.service.sessions import ServiceError
from tgruntime.service.stability import (
    DAY_S,
    StabilityStore,
    bound,
    check_recordable,
    sampled_from,
    stability_inputs,
)

PROMPT = [5, 6, 7]
SEQS: list[dict[str, Any]] = [{"tokens": [9, 10, 11], "logprobs": [-0.5, -1.5, -2.5]},
                              {"tokens": [12, 13], "logprobs": [-0.25, -0.75]}]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _store(clock: Clock | None = None, **kw: Any) -> StabilityStore:
    store = StabilityStore(clock=clock or Clock(), **kw)
    store.record("r1", sampled_from(owner="alice", session_id="s1", prompt=PROMPT,
                                    sequences=SEQS))
    return store


def test_records_belong_to_their_principal_and_session() -> None:
    store = _store()
    rec, i = store.sequence("r1:1", owner="alice", session_id="s1")
    assert i == 1 and rec.tokens[1].tolist() == [12, 13]
    for sid, owner, session in (("r1:1", "bob", "s1"), ("r1:1", "alice", "s2"),
                                ("r1:2", "alice", "s1"), ("r2:0", "alice", "s1"),
                                ("r1", "alice", "s1")):
        with pytest.raises(ServiceError, match="record_stability_info=True") as err:
            store.sequence(sid, owner=owner, session_id=session)
        assert "has no stability record" in str(err.value)


def test_a_day_after_last_use_and_renewed_by_use() -> None:
    clock = Clock()
    store = _store(clock)
    clock.now += DAY_S - 1
    store.sequence("r1:0", owner="alice", session_id="s1")  # restarts the day
    clock.now += DAY_S - 1
    store.sequence("r1:0", owner="alice", session_id="s1")
    clock.now += DAY_S
    with pytest.raises(ServiceError, match="more than a day"):
        store.sequence("r1:0", owner="alice", session_id="s1")
    assert len(store) == 0 and store.bytes == 0


def test_the_byte_cap_drops_the_least_recently_used_first() -> None:
    one = sampled_from(owner="a", session_id="s", prompt=PROMPT, sequences=SEQS).nbytes
    store = StabilityStore(max_bytes=3 * one, clock=Clock())
    for r in ("r1", "r2", "r3"):
        store.record(r, sampled_from(owner="a", session_id="s", prompt=PROMPT, sequences=SEQS))
    store.sequence("r1:0", owner="a", session_id="s")  # r1 used: r2 is now the oldest
    store.record("r4", sampled_from(owner="a", session_id="s", prompt=PROMPT, sequences=SEQS))
    assert store.bytes == 3 * one and store.dropped_for_room == 1
    store.sequence("r1:0", owner="a", session_id="s")
    with pytest.raises(ServiceError):
        store.sequence("r2:0", owner="a", session_id="s")
    with pytest.raises(ServiceError, match="TG_STABILITY_MAX_MB"):
        store.check_fits(prompt_tokens=10, num_samples=8, max_tokens=1000)
    store.check_fits(prompt_tokens=3, num_samples=2, max_tokens=3)
    assert bound(prompt_tokens=3, num_samples=2, max_tokens=3) >= one
    assert store.forget_sessions({"s"}) == 3 and store.bytes == 0


def test_recording_needs_a_session_and_the_reported_distribution() -> None:
    kw: dict[str, Any] = {"temperature": 1.0, "top_k": -1, "top_p": 1.0, "vocab": 128}
    assert check_recordable(session_id="s1", **kw) == "s1"
    assert check_recordable(session_id="s1", **{**kw, "top_k": 128}) == "s1"  # no filter
    with pytest.raises(ServiceError, match="needs a sampling session"):
        check_recordable(session_id=None, **kw)
    for bad in ({"temperature": 0.7}, {"top_k": 5}, {"top_p": 0.9}):
        with pytest.raises(ServiceError, match=r"temperature 1\.0, top_k -1 and top_p 1\.0"):
            check_recordable(session_id="s1", **{**kw, **bad})


def _rl_loop_datum(seq: int = 0, *, targets_on_prompt: int = 0) -> DatumIn:
    """As the cookbook's rl_loop builds it: prompt + sampled[:-1] in, (placeholders on the
    prompt) + sampled out; runs: prompt then sampled, on both fields."""
    toks = SEQS[seq]["tokens"]
    p, s = len(PROMPT), len(toks)
    n = p + s - 1
    target = np.asarray([targets_on_prompt] * (p - 1) + toks, np.int64)
    d = DatumIn(np.asarray(PROMPT + toks[:-1], np.int64),
                {"target_tokens": target, "advantages": np.ones(n, np.float32)})
    sid = f"r1:{seq}"
    d.input_spans = (Span(kind="prompt", sequence_id=sid, offset=0, length=p),
                     Span(kind="sampled", sequence_id=sid, offset=0, length=s - 1))
    d.target_spans = (Span(kind="prompt", sequence_id=sid, offset=1, length=p - 1),
                      Span(kind="sampled", sequence_id=sid, offset=0, length=s))
    return d


def test_inputs_carry_the_recorded_logprobs_on_sampled_targets() -> None:
    store = _store()
    data = [_rl_loop_datum(0), _rl_loop_datum(1, targets_on_prompt=6)]
    out = stability_inputs(store, data, owner="alice", session_id="s1", rows=4, width=5)
    assert out["stability_mask"].tolist() == [[0, 0, 1, 1, 1], [0, 0, 1, 1, 0],
                                              [0] * 5, [0] * 5]
    assert out["stability_log_probs"][0].tolist() == [0, 0, -0.5, -1.5, -2.5]
    assert out["stability_log_probs"][1].tolist() == [0, 0, -0.25, -0.75, 0]
    with pytest.raises(ServiceError, match="has no stability record"):  # another session
        stability_inputs(store, data, owner="alice", session_id="s2", rows=2, width=5)


def _refused(d: DatumIn, match: str) -> None:
    with pytest.raises(ServiceError, match=match):
        stability_inputs(_store(), [d], owner="alice", session_id="s1", rows=1, width=5)


def test_every_provenance_claim_is_checked() -> None:
    d = _rl_loop_datum(0)
    d.input_spans = None
    _refused(d, "needs provenance on every datum.*record_stability_info=True")
    d = _rl_loop_datum(0)
    assert d.target_spans is not None
    d.target_spans = d.target_spans[1:]
    _refused(d, "loss_fn_inputs runs cover 3 positions but the field has 5")
    d = _rl_loop_datum(0)
    d.tokens = d.tokens.copy()
    d.tokens[3] = 99
    _refused(d, "model_input position 3 holds token 99.*sampled position 0.*token 9")
    d = _rl_loop_datum(0)
    d.inputs["target_tokens"][4] = 42
    _refused(d, "target_tokens position 4 holds token 42.*sampled position 2")
    d = _rl_loop_datum(0)
    d.target_spans = (Span(kind="prompt", sequence_id="r1:0", offset=0, length=2),
                      Span(kind="sampled", sequence_id="r1:0", offset=1, length=3))
    _refused(d, r"sampled positions \[1, 4\) of sequence 'r1:0', which has 3")
    d = _rl_loop_datum(0)
    d.target_spans = (Span(kind="prompt", sequence_id="r1:0", offset=0, length=3),
                      Span(kind="prompt", sequence_id="r1:0", offset=0, length=2))
    _refused(d, "none of its targets is a sampled token")


def test_the_sdks_provenance_spans_are_decoded() -> None:
    tinker = pytest.importorskip("tinker")
    from tinker.proto.request_conv import forward_backward_request_to_proto

    T = tinker.types
    base = T.Datum(model_input=T.ModelInput.from_ints([5, 6, 7, 9]),
                   loss_fn_inputs={"target_tokens": np.asarray([0, 0, 9, 10], np.int64),
                                   "advantages": np.ones(4, np.float32)})
    spans = base.with_provenance(
        model_input=[T.PromptProvenanceSpan(sequence_id="r1:0", length=3),
                     T.SampledProvenanceSpan(sequence_id="r1:0", length=1)],
        loss_fn_inputs=[T.PromptProvenanceSpan(sequence_id="r1:0", offset=1, length=2),
                        T.SampledProvenanceSpan(sequence_id="r1:0", length=2)],
    )
    req = T.ForwardBackwardRequest(
        model_id="m", seq_id=1,
        forward_backward_input=T.ForwardBackwardInput(data=[spans, base],
                                                      loss_fn="stable_reinforce"),
    )
    fb = decode_forward_backward(forward_backward_request_to_proto(req).SerializeToString())
    with_spans, without = fb.data
    assert with_spans.input_spans == (
        Span(kind="prompt", sequence_id="r1:0", offset=0, length=3),
        Span(kind="sampled", sequence_id="r1:0", offset=0, length=1),
    )
    assert with_spans.target_spans == (
        Span(kind="prompt", sequence_id="r1:0", offset=1, length=2),
        Span(kind="sampled", sequence_id="r1:0", offset=0, length=2),
    )
    assert without.input_spans is None and without.target_spans is None
