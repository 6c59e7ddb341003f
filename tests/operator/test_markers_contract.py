"""The operator's parsers read the runtime's REAL output lines (tgapi.markers on both sides).

Each line here is produced by the runtime function that formats it in production (server's
failure path, ``report.ready_payload``, the teardown's report conversion, the client's step),
then parsed by the operator's ``entrypoints`` (or tgctl's reader). No hand-written payloads.
"""

from __future__ import annotations

import json
import types

import pytest

from tg_operator import entrypoints
from tgapi import markers
from tgruntime.controller.teardown import TeardownReport
from tgruntime.entrypoints import server
from tgruntime.entrypoints import teardown as runtime_teardown
from tgruntime.launch import report


def test_the_servers_failure_line_is_read_by_the_operator(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert server.main(["--spec-b64", "bm90LWpzb24="]) == 1  # base64("not-json")
    out = capsys.readouterr().out
    assert out.startswith(markers.GROUP_FAILED + " ")
    why = entrypoints.parse_group_failed("(job noise)\n" + out)
    assert why is not None and why == json.loads(out.split(" ", 1)[1])["error"]


def test_the_ready_line_is_read_by_the_operator() -> None:
    wg = types.SimpleNamespace(
        group_name="demo",
        ray_namespace="tg-team-a-demo",
        generation=2,
        worker_names=["demoTrainer_0:0", "demoTrainer_0:1"],
        world_size=2,
    )
    ranks = [{"device": "cuda:0", "backend": "nccl", "dtype": "bfloat16"}] * 2
    payload = report.ready_payload(
        wg,  # type: ignore[arg-type]
        mesh={"tp": 2, "pp": 1, "cp": 1, "dp": 1},
        worker_class="tgruntime.trainer.worker:MegatronWorker",
        use_gpu=True,
        device=report.device_summary(ranks),
    )
    text = f"INFO connecting\n{markers.line(payload)}\n(raylet) noise\n"
    rec = entrypoints.parse_group_ready(text)
    assert rec == payload
    assert (rec.ray_namespace, rec.device, rec.backend, rec.dtype) == (
        "tg-team-a-demo",
        "cuda",
        "nccl",
        "bfloat16",
    )
    wire = json.loads(markers.line(payload).split(" ", 1)[1])
    assert sorted(wire) == sorted(CONTRACT_READY_KEYS)


def test_the_teardown_report_is_read_by_the_operator() -> None:
    report = TeardownReport(
        group_name="demo",
        ray_namespace="tg-team-a-demo",
        actors_killed=("demoTrainer_0:0",),
        placement_groups_removed=("abc",),
        keys_removed=("record",),
        complete=False,
        errors=("placement group abc still exists",),
        checked=("group record",),
        not_checked=(),
    )
    line = markers.line(runtime_teardown.to_marker(report))
    parsed = entrypoints.parse_teardown("noise\n" + line)
    assert parsed is not None and not parsed.complete
    assert parsed.actors_killed == ("demoTrainer_0:0",) and parsed.ray_namespace == "tg-team-a-demo"
    wire = json.loads(line.split(" ", 1)[1])
    assert sorted(wire) == sorted(CONTRACT_TEARDOWN_KEYS)


def test_a_broken_last_line_reads_as_none_and_steps_parse_in_order() -> None:
    assert entrypoints.parse_group_ready("TG_GROUP_READY {not json}") is None
    assert entrypoints.parse_group_ready("nothing here") is None
    assert entrypoints.parse_teardown('TG_TEARDOWN {"complete": true}') is None  # no groupName
    steps = [
        markers.Step(
            step=i, loss=1.0 / i, grad_norm=0.5, tokens=8, step_time_s=0.1, tokens_per_s=80.0
        )
        for i in (1, 2)
    ]
    text = "\n".join(markers.line(s) for s in steps)
    assert markers.parse_all(markers.Step, text) == steps


# docs/contracts.md lists exactly these keys
CONTRACT_READY_KEYS = [
    "groupName",
    "rayNamespace",
    "generation",
    "workerNames",
    "worldSize",
    "mesh",
    "workerClass",
    "useGpu",
    "device",
    "backend",
    "dtype",
    "resumedFrom",
    "resumedStep",
]
CONTRACT_TEARDOWN_KEYS = [
    "groupName",
    "rayNamespace",
    "actorsKilled",
    "placementGroupsRemoved",
    "keysRemoved",
    "complete",
    "errors",
    "checked",
    "notChecked",
]
