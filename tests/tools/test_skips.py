"""tools/skips.py: skips counted by reason, and a reason outside the allow-list fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SKIPS = ROOT / "tools" / "skips.py"


def _run(work: Path, allow: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SKIPS), str(work), str(allow)], capture_output=True, text=True
    )


def _hook_output(tmp_path: Path, env_name: str, name: str, source: str) -> list[str]:
    """Run pytest on one test file ``source`` with tests/conftest.py beside it and the file
    named by ``env_name`` set; the lines its hooks wrote there."""
    (tmp_path / name).write_text(source)
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    out = tmp_path / "hook.tsv"
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", name],
        cwd=tmp_path, env={**os.environ, env_name: str(out), "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, check=False,
    )
    return out.read_text().splitlines()


def test_allowed_reasons_pass_and_are_counted(tmp_path: Path) -> None:
    (tmp_path / "ray.skips.tsv").write_text(
        "tests/a.py::t1\tneeds an NVIDIA GPU (CUDA)\ntests/a.py::t2\tneeds an NVIDIA GPU (CUDA)\n"
    )
    (tmp_path / "kind.skips.tsv").write_text("tests/e2e/x.py::t\tTG_SKIP_KIND=1\n")
    got = _run(tmp_path, ROOT / "tests" / "skip-allow.txt")
    assert got.returncode == 0, got.stdout
    assert "skipped tests: 3" in got.stdout
    assert "    2  needs an NVIDIA GPU (CUDA)" in got.stdout


def test_a_broken_install_fails_the_run(tmp_path: Path) -> None:
    (tmp_path / "unit.skips.tsv").write_text(
        "tests/b.py::t\tcould not import 'tinker': No module named 'tinker'\n"
        "tests/a.py::t1\tneeds an NVIDIA GPU (CUDA)\n"
    )
    got = _run(tmp_path, ROOT / "tests" / "skip-allow.txt")
    assert got.returncode == 1
    assert "NOT ALLOWED  could not import 'tinker'" in got.stdout
    assert "NOT ALLOWED  needs an NVIDIA" not in got.stdout


def test_the_conftest_hook_writes_skips_not_xfails(tmp_path: Path) -> None:
    lines = _hook_output(
        tmp_path, "TG_SKIPS_FILE", "test_x.py",
        "import pytest\n"
        "def test_s():\n    pytest.skip('no widget here')\n"
        "@pytest.mark.xfail(reason='known')\ndef test_x():\n    assert False\n"
        "def test_ok():\n    pass\n",
    )
    assert lines == ["test_x.py::test_s\tno widget here"], lines


def test_the_conftest_hook_writes_failures_with_their_first_error_line(tmp_path: Path) -> None:
    """tools/test.sh ends a failed run with these lines (its ``failures``): a failed call and a
    setup error each give one, an xfail and a pass none."""
    assert _hook_output(
        tmp_path, "TG_FAILS_FILE", "test_f.py",
        "import pytest\n"
        "def test_a():\n    assert 1 == 2, 'one is not two'\n"
        "@pytest.fixture\ndef bad():\n    raise RuntimeError('setup broke')\n"
        "def test_b(bad):\n    pass\n"
        "@pytest.mark.xfail(reason='known')\ndef test_x():\n    assert False\n"
        "def test_ok():\n    pass\n",
    ) == [
        "test_f.py::test_a\tcall\tAssertionError: one is not two",
        "test_f.py::test_b\tsetup\tRuntimeError: setup broke",
    ]
