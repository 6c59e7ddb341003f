"""tests/shard.py: a phase split between two lanes loses no test file and runs none twice."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tests import shard

REPO = Path(__file__).resolve().parents[2]


def test_every_file_lands_in_exactly_one_shard_and_the_split_is_stable() -> None:
    rng = random.Random(7)
    files = [f"tests/x/test_{i}.py" for i in range(40)]
    weights = {f: rng.uniform(1, 100) for f in files[:30]}  # ten files the weights do not name
    for count in (1, 2, 3):
        got = shard.assign(files, weights=weights, count=count, start=[50.0])
        assert set(got) == set(files) and set(got.values()) <= set(range(count))
        again = shard.assign(reversed(files), weights=weights, count=count, start=[50.0])
        assert again == got  # the order files were collected in does not matter


def test_the_split_balances_time_with_the_lanes_start_loads() -> None:
    weights = {"a": 500.0, "b": 300.0, "c": 200.0, "d": 100.0, "e": 100.0}
    got = shard.assign(weights, weights=weights, count=2, start=[600.0, 0.0])
    loads = [600.0 + sum(w for f, w in weights.items() if got[f] == 0),
             sum(w for f, w in weights.items() if got[f] == 1)]
    assert got["a"] == 1  # the heaviest goes to the lane that starts empty
    assert abs(loads[0] - loads[1]) <= 200.0, (got, loads)


@pytest.mark.parametrize(
    ("value", "start", "says"),
    [("2", "", "expected k/n"), ("2/2", "", "k must be in 0..n-1"), ("0/2", "x", "TG_SHARD_START"),
     ("0/2", "types+nope", "phases known: \\['ray', 'types'\\]")],
)
def test_bad_shard_settings_name_the_variable(value: str, start: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        shard.parse(value, start, {"types": 80.0, "ray": 440.0})


def test_start_loads_add_phases_seconds_from_the_weights() -> None:
    got = shard.parse("1/2", "types+ray,120", {"types": 80.0, "ray": 440.0})
    assert got == (1, 2, [520.0, 120.0])


def test_the_committed_weights_name_real_test_files() -> None:
    data = json.loads(shard.WEIGHTS.read_text())
    assert data["wall_s"], "tests/shard-weights.json has no weights"
    starts = {"types", "unit", "ray", "plane", "kind"}  # tools/test.sh's TG_SHARD_START
    assert starts <= set(data["phase_s"]), sorted(starts - set(data["phase_s"]))
    _, phases, _ = shard.load_weights()
    quick = {"quick.types", "quick.ray", "quick.unit"}  # and its --quick one
    assert quick <= set(phases), sorted(quick - set(phases))
    missing = [f for f in data["wall_s"] if not (REPO / f).is_file()]
    missing += [t for t in data.get("test_s", {}) if not (REPO / t.split("::")[0]).is_file()]
    assert not missing, f"weights for files that do not exist (refresh the file): {missing}"


def test_two_shards_of_a_real_collection_partition_it(tmp_path: Path) -> None:
    """pytest itself, on this directory: shard 0 and shard 1 together collect every test once."""

    def collected(env_shard: str) -> set[str]:
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
             "tests/tools"],
            cwd=REPO, capture_output=True, text=True, timeout=120,
            env={**os.environ, "TG_SHARD": env_shard},
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        return {line for line in proc.stdout.splitlines() if "::" in line}

    every, a, b = collected(""), collected("0/2"), collected("1/2")
    assert a and b and not (a & b) and a | b == every


def test_a_file_weighs_the_tests_it_keeps() -> None:
    """--quick deselects the flow tests: a file is split by the seconds of what it still runs."""
    tests = {"a.py::x": 100.0, "a.py::y": 2.0, "b.py::z": 10.0, "c.py::w": 4.0}
    assert shard.file_weights(["a.py::y", "b.py::z"], tests) == {"a.py": 2.0, "b.py": 10.0}
    # a test the weights do not name weighs their median
    assert shard.file_weights(["d.py::new"], tests) == {"d.py": 7.0}
    assert shard.file_weights(["d.py::new"], {}) == {"d.py": 1.0}
