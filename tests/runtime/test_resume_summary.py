"""The TG_GROUP_READY line says where the workers resumed from (report.resume_summary)."""

from __future__ import annotations

from tgruntime.launch import report


def test_every_rank_resumed_from_one_checkpoint() -> None:
    ranks = [{"resumed_from": "/ckpt/g/step_00000005", "step": 5, "tp_rank": r} for r in (0, 1)]
    assert report.resume_summary(ranks) == {
        "resumedFrom": "/ckpt/g/step_00000005",
        "resumedStep": 5,
    }


def test_a_fresh_group_resumed_from_nothing() -> None:
    ranks = [{"resumed_from": None, "step": 0}, {"resumed_from": None, "step": 0}]
    assert report.resume_summary(ranks) == {"resumedFrom": "", "resumedStep": 0}


def test_ranks_that_disagree_are_reported_as_mixed() -> None:
    ranks = [{"resumed_from": "/a", "step": 5}, {"resumed_from": None, "step": 0}]
    assert report.resume_summary(ranks) == {"resumedFrom": "mixed", "resumedStep": -1}


def test_a_worker_class_that_reports_nothing_adds_nothing() -> None:
    assert report.resume_summary([None, None]) == {}
    assert report.resume_summary(None) == {}
