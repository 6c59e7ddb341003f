"""Malformed status or annotations written by someone else never crash the operator.

The operator reads back its own status (tgapi.parse_status: every reconcile, deletion and
client wait) and kopf's progress/last-handled annotations (tg_operator.storage). Over random
garbage (hypothesis): they never raise, keep what is well-formed, default the rest, and warn
once per field.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import kopf
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tgapi
from tests.api.strategies import GARBAGE
from tg_operator import names, spec_change, storage
from tg_operator import status as status_mod

FAST = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])

STATUS_KEYS = [
    "phase", "message", "conditions", "observedGeneration", "rayClusterName", "rayAddress",
    "workerNames", "workers", "worldSize", "readyWorkers", "mesh", "restarts",
    "groupGeneration", "submissionId", "specHash", "clusterHash", "device", "phaseSince",
]
PLAUSIBLE = st.one_of(
    GARBAGE,
    st.sampled_from(list(tgapi.PHASES)),
    st.lists(st.fixed_dictionaries({"type": GARBAGE, "status": st.sampled_from(["True", "x"])},
                                   optional={"reason": GARBAGE, "observedGeneration": GARBAGE}),
             max_size=3),
    st.lists(st.fixed_dictionaries({"name": GARBAGE, "rank": GARBAGE},
                                   optional={"pid": GARBAGE, "state": GARBAGE}), max_size=3),
    st.fixed_dictionaries({}, optional={"tp": GARBAGE, "dp": GARBAGE}),
)
STATUSES = st.one_of(
    GARBAGE, st.dictionaries(st.sampled_from(STATUS_KEYS) | st.text(max_size=5), PLAUSIBLE,
                             max_size=8))


@FAST
@given(raw=STATUSES)
def test_status_reader_is_total(raw: Any) -> None:
    st_ = tgapi.parse_status(raw)
    assert st_.phase in tgapi.PHASES
    assert all(isinstance(n, str) for n in st_.worker_names)
    assert all(isinstance(c, tgapi.Condition) and isinstance(c.type, str) for c in st_.conditions)
    for counter in (st_.restarts, st_.group_generation, st_.world_size, st_.ready_workers,
                    st_.observed_generation):
        assert type(counter) is int and counter >= 0
    # what the operator then does with it must not raise either
    spec = tgapi.parse_spec({"rayClusterRef": {"name": "x"}})
    spec_change.classify(st_, spec)
    now = status_mod.parse_rfc3339("2026-01-01T00:00:00Z")
    assert now is not None
    status_mod.seconds_in_phase(st_, now=now)
    status_mod.set_condition(st_.conditions, type="WorkersReady", status="True", reason="r",
                             message="m", now=_now(), generation=1)
    status_mod.failed(st_, reason="InvalidSpec", message="m", now=_now(), generation=1)
    tgapi.to_wire(st_)


def _now() -> Any:
    import datetime

    return datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)


def test_status_reader_keeps_the_good_and_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    raw = {"phase": "Ready", "restarts": "three", "groupGeneration": -4,
           "workerNames": ["a", 5, "b"], "conditions": [{"type": "WorkersReady"}, "x",
                                                        {"type": "Degraded", "status": "False"}],
           "mesh": {"tp": "2", "dp": 2}, "submissionId": "sid"}
    with caplog.at_level(logging.WARNING, logger="tgapi.status"):
        st_ = tgapi.parse_status(raw)
        tgapi.parse_status(raw)
    assert (st_.phase, st_.restarts, st_.group_generation) == ("Ready", 0, 0)
    assert st_.worker_names == ["a", "b"] and st_.submission_id == "sid"
    assert [c.type for c in st_.conditions] == ["Degraded"]
    assert st_.mesh == tgapi.MeshStatus(tp=1, dp=2)
    warned = [m for m in (r.getMessage() for r in caplog.records)
              if "ignoring status.restarts" in m]
    assert len(warned) <= 1  # once per field for the process (earlier tests may have warned)


ANNOTATION_VALUES = st.one_of(
    st.text(max_size=30),
    GARBAGE.map(json.dumps),
    st.fixed_dictionaries({}, optional={"started": GARBAGE, "retries": GARBAGE,
                                        "success": GARBAGE, "message": GARBAGE,
                                        "subrefs": GARBAGE, "delayed": GARBAGE}).map(json.dumps),
)


def _body(annotations: dict[str, Any]) -> kopf.Body:
    return kopf.Body({"apiVersion": "trainergroup.io/v1alpha1", "kind": "TrainerGroup",
                      "metadata": {"name": "a", "namespace": "n", "annotations": annotations},
                      "spec": {}})


@FAST
@given(value=ANNOTATION_VALUES)
def test_kopf_storages_read_garbage_as_absent(value: str) -> None:
    progress = storage.TotalProgressStorage(prefix=names.STORAGE_PREFIX)
    diffbase = storage.TotalDiffBaseStorage(prefix=names.STORAGE_PREFIX,
                                            key="last-handled-configuration")
    handler = kopf.HandlerId(names.RECONCILE_HANDLER)
    keys = [*progress.make_keys(handler, body=_body({})),
            *diffbase.make_keys(diffbase.key, body=_body({}))]
    body = _body({k: value for k in keys})
    record = progress.fetch(key=handler, body=body)
    assert record is None or storage.progress_problem(record) is None
    essence = diffbase.fetch(body=body)
    assert essence is None or isinstance(essence, dict)


def test_kopf_storages_keep_what_kopf_wrote() -> None:
    progress = storage.TotalProgressStorage(prefix=names.STORAGE_PREFIX)
    handler = kopf.HandlerId(names.RECONCILE_HANDLER)
    (key, *_) = progress.make_keys(handler, body=_body({}))
    good = {"started": "2026-01-01T00:00:00.000000+00:00", "stopped": None, "delayed": None,
            "purpose": "create", "retries": 2, "success": False, "failure": False,
            "message": "waiting", "subrefs": None}
    assert progress.fetch(key=handler, body=_body({key: json.dumps(good)})) == good
    assert progress.fetch(key=handler, body=_body({key: "{not json"})) is None
    bad = {**good, "started": "yesterday"}
    assert progress.fetch(key=handler, body=_body({key: json.dumps(bad)})) is None
    # the stock kopf reader raises on the same annotations: what these subclasses are for
    with pytest.raises(ValueError):
        kopf.AnnotationsProgressStorage(prefix=names.STORAGE_PREFIX).fetch(
            key=handler, body=_body({key: "{not json"}))


@FAST
@given(payload=st.one_of(GARBAGE, st.fixed_dictionaries(
    {"workerNames": st.one_of(st.lists(st.text(max_size=5), max_size=3), GARBAGE)},
    optional={"mesh": GARBAGE, "generation": GARBAGE, "worldSize": GARBAGE,
              "groupName": GARBAGE, "device": GARBAGE})))
def test_the_ready_line_reader_is_total(payload: Any) -> None:
    """The server job's TG_GROUP_READY line: any code in the job can print one."""
    from tg_operator import entrypoints

    logs = f"noise\n{entrypoints.READY_MARKER} {json.dumps(payload)}\n"
    record = entrypoints.parse_group_ready(logs)
    if record is not None:
        assert all(type(v) is int and v > 0 for v in record.mesh.values())
        assert record.generation >= 0 and record.world_size >= 0
