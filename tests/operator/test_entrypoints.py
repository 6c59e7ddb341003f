"""Entrypoint command lines and the runtime's output lines (docs/contracts.md)."""

from __future__ import annotations

import base64
import json
import shlex

from tests.operator.helpers import trainergroup
from tg_operator import entrypoints, names
from tgapi import parse_resource, to_wire


def test_server_entrypoint_carries_the_whole_object() -> None:
    tg = trainergroup()
    cmd = shlex.split(entrypoints.server_entrypoint(tg, python="/opt/py env/python", generation=3))
    assert cmd[:3] == ["/opt/py env/python", "-m", "tgruntime.entrypoints.server"]
    assert cmd[cmd.index("--generation") + 1] == "3"
    doc = json.loads(base64.b64decode(cmd[cmd.index("--spec-b64") + 1]))
    assert doc["kind"] == "TrainerGroup" and doc["metadata"]["name"] == "demo"
    again = parse_resource(doc)
    assert to_wire(again.spec) == to_wire(tg.spec)


def test_teardown_entrypoint() -> None:
    cmd = shlex.split(
        entrypoints.teardown_entrypoint(
            trainergroup(), python="python", ray_namespace="tg-team-a-demo"
        )
    )
    assert cmd == [
        "python",
        "-m",
        "tgruntime.entrypoints.teardown",
        "--group",
        "demo",
        "--ray-namespace",
        "tg-team-a-demo",
    ]


def test_submission_ids_are_deterministic_and_per_object() -> None:
    tg = trainergroup()
    assert names.server_submission_id(tg, generation=2) == "tg-team-a-demo-0b1c2d3e-g2"
    assert (
        names.teardown_submission_id(tg, generation=2, attempt=1)
        == "tg-team-a-demo-0b1c2d3e-teardown-g2-1"
    )
    other = trainergroup(uid="ffffffff-0000-0000-0000-000000000000")
    assert names.server_submission_id(other, generation=2) != names.server_submission_id(
        tg, generation=2
    )


# The TG_GROUP_READY / TG_GROUP_FAILED / TG_TEARDOWN parsers are tested on the runtime's
# real lines in tests/operator/test_markers_contract.py.


def test_tail_of_the_logs() -> None:
    assert entrypoints.tail("a\n\nb\nc\nd\n", lines=2) == "c | d"
