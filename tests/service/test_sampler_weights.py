"""service/sampler_weights.py: when save_weights_and_get_sampling_client's in-memory copies
are dropped (pure bookkeeping, table-tested; the SDK flow over a real group is in
test_sampler_memory.py)."""

from __future__ import annotations

import pytest

from tgruntime.service.routes.models import _inflight_kind
from tgruntime.service.sampler_weights import EphemeralWeights, FreedWeights, inflight_name
from tgruntime.service.sessions import ServiceError

A1, A2, A3 = "m1/ephemeral/0", "m1/ephemeral/1", "m1/ephemeral/2"
B1 = "m2/ephemeral/0"


def test_a_newer_copy_frees_the_idle_older_one_at_once() -> None:
    e = EphemeralWeights()
    assert e.saved("m1", A1) == []
    assert e.saved("m1", A2) == [A1]
    assert e.saved("m1", A3) == [A2]
    assert e.resident() == 1
    with pytest.raises(FreedWeights, match="saved newer ones \\(m1/ephemeral/2\\)"):
        e.begin(A1)


def test_an_older_copy_in_use_is_freed_when_its_last_request_ends() -> None:
    e = EphemeralWeights()
    e.saved("m1", A1)
    e.begin(A1)
    e.begin(A1)
    assert e.saved("m1", A2) == []  # two requests still on A1
    assert e.resident() == 2
    assert e.end(A1) == []
    assert e.end(A1) == [A1]
    assert e.end(A1) == []  # an extra end changes nothing
    assert e.resident() == 1


def test_requests_on_the_newest_copy_never_free_it() -> None:
    e = EphemeralWeights()
    e.saved("m1", A1)
    for _ in range(3):
        e.begin(A1)
        assert e.end(A1) == []
    e.begin(None)  # the training weights, and named copies on disk, are not managed here
    assert e.end(None) == []
    assert e.end("/ckpt/sampler_weights/s0") == []


def test_models_are_independent_and_a_gone_model_frees_its_copy() -> None:
    e = EphemeralWeights()
    e.saved("m1", A1)
    e.saved("m2", B1)
    assert e.saved("m1", A2) == [A1]
    e.begin(B1)
    assert e.forget_model("m2") == []  # in use: freed when the request ends
    assert e.end(B1) == [B1]
    assert e.forget_model("m2") == []
    with pytest.raises(FreedWeights, match="its session ended"):
        e.begin(B1)


def test_the_freed_names_kept_for_messages_are_bounded() -> None:
    e = EphemeralWeights(max_freed=3)
    for i in range(10):
        e.saved("m1", f"m1/ephemeral/{i}")
    assert len(e.freed) == 3 and "m1/ephemeral/8" in e.freed


def test_the_inflight_target_outlives_every_save_and_goes_with_its_model() -> None:
    e = EphemeralWeights()
    target = inflight_name("m1")
    assert target == "m1/ephemeral/inflight"
    e.inflight_saved("m1", target)
    e.inflight_sessions["m1"] = "smp-1"
    assert e.saved("m1", A1) == []  # a snapshot save does not supersede the target
    e.inflight_saved("m1", target)  # written in place again
    assert e.saved("m1", A2) == [A1]
    assert e.names() == {A2, target} and e.resident() == 2 and e.models() == {"m1"}
    e.begin(target)
    assert sorted(e.forget_model("m1")) == [A2]  # the target is in use: freed at its end
    assert e.end(target) == [target]
    assert e.resident() == 0 and e.models() == set() and e.inflight_sessions == {}
    with pytest.raises(FreedWeights, match="its session ended"):
        e.begin(target)


@pytest.mark.parametrize(
    ("kind", "name", "want"),
    [(None, None, False), ("snapshot", "s0", False), ("inflight", None, True)],
)
def test_the_save_kinds(kind: str | None, name: str | None, want: bool) -> None:
    assert _inflight_kind(kind, name) is want


@pytest.mark.parametrize(
    ("kind", "name", "message"),
    [
        ("live", None, "kind must be 'snapshot' .* or 'inflight' .*, not 'live'"),
        ("inflight", "s0", "kind='inflight' takes no path"),
    ],
)
def test_bad_save_kinds_are_refused_naming_the_field(
    kind: str, name: str | None, message: str
) -> None:
    with pytest.raises(ServiceError, match=message):
        _inflight_kind(kind, name)
