"""The per-Ray-cluster cap on in-flight job drivers."""

from __future__ import annotations

from tg_operator.job_slots import JobSlots
from tg_operator.settings import OperatorConfig


def test_slots_cap_each_cluster_separately() -> None:
    slots = JobSlots(limit=2)
    assert slots.acquire("http://a", "j1") and slots.acquire("http://a", "j2")
    assert slots.acquire("http://a", "j1")  # already held: idempotent
    assert not slots.acquire("http://a", "j3")
    assert slots.acquire("http://b", "j3")  # another cluster has its own slots
    slots.release("http://a", "j1")
    assert slots.acquire("http://a", "j3")
    assert slots.in_flight("http://a") == 2


def test_release_by_object_prefix_and_stale_slots() -> None:
    slots = JobSlots(limit=1, stale_after_s=0.0)
    assert slots.acquire("u", "tg-ns-a-12345678-g0")
    assert slots.acquire("u", "tg-ns-b-87654321-g0")  # the first one went stale
    slots = JobSlots(limit=2)
    slots.acquire("u", "tg-ns-a-12345678-g0")
    slots.acquire("u", "tg-ns-a-12345678-teardown-g0-0")
    slots.release_prefix("tg-ns-a-12345678-")
    assert slots.in_flight("u") == 0


def test_zero_means_no_limit_and_the_default_is_eight() -> None:
    slots = JobSlots(limit=0)
    assert all(slots.acquire("u", f"j{i}") for i in range(100))
    assert OperatorConfig.from_env({}).max_concurrent_jobs == 8
    assert OperatorConfig.from_env({"TG_MAX_CONCURRENT_JOBS": "3"}).max_concurrent_jobs == 3


def test_a_freed_slot_wakes_the_groups_that_waited_for_it() -> None:
    woken: list[str] = []
    slots = JobSlots(limit=1)
    slots.on_free = woken.append
    assert slots.acquire("u", "tg-ns-a-1-g0", waiter="ns/a")
    assert not slots.acquire("u", "tg-ns-b-2-g0", waiter="ns/b")
    assert not slots.acquire("u", "tg-ns-c-3-g0", waiter="ns/c")
    slots.release("u", "tg-ns-x-g0")  # not held: nobody is woken
    assert woken == []
    slots.release("u", "tg-ns-a-1-g0")
    assert woken == ["ns/b", "ns/c"]
    slots.release("u", "tg-ns-a-1-g0")
    assert woken == ["ns/b", "ns/c"]  # each wait is woken once
