"""hack/kind/image_delta.py: a changed image reaches a containerd that holds its older version
as the layers it lacks only, and runs there with old and new layers both.

The containerd is Docker's own (Debian's docker.io runs one; a private namespace here), version
1.6 like the kind nodes'. The flow is load-image.sh's: a whole import, the layer blobs dropped,
then the next version as a delta with the previous image tagged during the import.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import tarfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from hack.kind import image_delta

REPO = Path(__file__).resolve().parents[2]
DELTA = REPO / "hack" / "kind" / "image_delta.py"
SOCKET = Path("/run/docker/containerd/containerd.sock")
BUILD_DOCKER = "/usr/bin/docker" if Path("/usr/bin/docker").exists() else "docker"


def test_tags_are_named_the_way_containerd_names_them() -> None:
    assert image_delta.normalized("busybox:1") == "docker.io/library/busybox:1"
    assert image_delta.normalized("me/app:2") == "docker.io/me/app:2"
    assert image_delta.normalized("ghcr.io/trainergroup/runtime:0.1.0") == (
        "ghcr.io/trainergroup/runtime:0.1.0"
    )
    assert image_delta.normalized("localhost/x:1") == "localhost/x:1"


def test_a_layer_linked_before_it_appears_in_the_stream(tmp_path: Path) -> None:
    """docker save writes a layer that occurs twice once, and the other occurrence as a link to
    it; the link can come first in the stream (the runtime image's did, 2026-12-07). Both
    occurrences resolve to the layer, which is kept when the node lacks it."""
    layer = b"x" * 1000
    digest = f"sha256:{hashlib.sha256(layer).hexdigest()}"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        link = tarfile.TarInfo("b/layer.tar")
        link.type, link.linkname = tarfile.SYMTYPE, "../a/layer.tar"
        tar.addfile(link)
        for name, data in (("a/layer.tar", layer), ("manifest.json", b"[]")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    buf.seek(0)
    saved = image_delta.read_save(buf, have=set(), work=tmp_path)
    a, b = saved["layers"]["a/layer.tar"], saved["layers"]["b/layer.tar"]
    assert a == b and a[:2] == (digest, len(layer)) and a[2] is not None
    buf.seek(0)
    kept = image_delta.read_save(buf, have={digest}, work=tmp_path)["layers"]["b/layer.tar"]
    assert kept[:2] == (digest, len(layer))


def _saved_image(layers: list[bytes]) -> io.BytesIO:
    """A docker-save stream of one image with these layers (each saved once per content)."""
    buf, paths, diff_ids = io.BytesIO(), [], []
    seen: dict[str, str] = {}
    with tarfile.open(fileobj=buf, mode="w") as tar:

        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))

        for i, data in enumerate(layers):
            digest = f"sha256:{hashlib.sha256(data).hexdigest()}"
            path = f"l{i}/layer.tar"
            if digest in seen:
                link = tarfile.TarInfo(path)
                link.type, link.linkname = tarfile.SYMTYPE, f"../{seen[digest]}"
                tar.addfile(link)
            else:
                add(path, data)
                seen[digest] = path
            paths.append(path)
            diff_ids.append(digest)
        add("c.json", json.dumps({"rootfs": {"type": "layers", "diff_ids": diff_ids}}).encode())
        add("manifest.json", json.dumps(
            [{"Config": "c.json", "RepoTags": ["x:1"], "Layers": paths}]).encode())
    buf.seek(0)
    return buf


def _sha(data: bytes) -> str:
    return f"sha256:{hashlib.sha256(data).hexdigest()}"


def test_every_layer_above_the_first_changed_one_is_in_the_delta(tmp_path: Path) -> None:
    """A snapshot is found by its chain ID, so a layer the node has but above a changed one
    (the empty layer that recurs in an image; the runtime image's first delta in a kind node
    failed on it, 2026-12-07) must come with the delta; the common prefix stays out."""
    base, old, new, empty = b"b" * 100, b"old" * 10, b"new" * 10, b"\0" * 1024
    have = [_sha(base), _sha(empty), _sha(old), _sha(empty)]
    saved = image_delta.read_save(
        _saved_image([base, empty, new, empty]), have=set(have), work=tmp_path
    )
    out = tmp_path / "delta.tar"
    counts = image_delta.write_oci(saved, out=out, have=have)
    assert counts == {"kept": 2, "skipped": 2, "kept_bytes": len(new) + len(empty)}
    with tarfile.open(out) as tar:
        blobs = {n.rsplit("/", 1)[1] for n in tar.getnames() if n.startswith("blobs/")}
    assert {_sha(new)[7:], _sha(empty)[7:]} <= blobs and _sha(base)[7:] not in blobs


def test_a_layer_above_a_change_that_was_not_kept_fails_the_delta(tmp_path: Path) -> None:
    base, old, new, big = b"b" * 100, b"old", b"new", b"g" * 4096
    have = [_sha(base), _sha(old), _sha(big)]
    saved = image_delta.read_save(
        _saved_image([base, new, big]), have=set(have), work=tmp_path
    )
    path, (digest, size, _) = next(
        (k, v) for k, v in saved["layers"].items() if v[0] == _sha(big)
    )
    saved["layers"][path] = (digest, size, None)  # as a layer over KEEP_HAVE_BYTES is dropped
    with pytest.raises(SystemExit, match="above a changed layer"):
        image_delta.write_oci(saved, out=tmp_path / "d.tar", have=have)


def _run(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    proc = subprocess.run(list(args), input=stdin, capture_output=True, timeout=600, check=False)
    assert proc.returncode == 0, (args, proc.stderr.decode()[-3000:])
    return proc


@pytest.fixture
def ctr() -> Iterator[list[str]]:
    if shutil.which("docker") is None or shutil.which("ctr") is None or not SOCKET.exists():
        pytest.skip(f"needs Docker with its containerd at {SOCKET} and ctr (hack/docker/up.sh)")
    ns = f"tgdelta-{uuid.uuid4().hex[:6]}"
    base = ["ctr", "-a", str(SOCKET), "-n", ns]
    yield base
    for ref in subprocess.run(
        [*base, "images", "ls", "-q"], capture_output=True, text=True, check=False
    ).stdout.split():
        subprocess.run([*base, "images", "rm", "--sync", ref], capture_output=True, check=False)
    subprocess.run(
        ["ctr", "-a", str(SOCKET), "namespaces", "rm", ns], capture_output=True, check=False
    )


@pytest.mark.docker
def test_a_code_change_loads_as_its_new_layer_only(ctr: list[str], tmp_path: Path) -> None:
    base = _run(
        "docker", "image", "ls", "--format", "{{.Repository}}:{{.Tag}}",
        "--filter", "reference=trainergroup.local/debian",
    )
    if not base.stdout.split():
        pytest.skip("no stand-in Debian base (hack/images/build-bases.sh builds it)")
    tag = f"tgdelta-{uuid.uuid4().hex[:6]}"
    (tmp_path / "Dockerfile").write_text(
        f"FROM {base.stdout.split()[0].decode()}\n"
        "RUN head -c 8000000 /dev/urandom > /big.bin && echo big > /big\nRUN true\n"
        "COPY f /f\nRUN true\n"  # an empty layer below and above the change, as in the runtime
    )
    ref = f"docker.io/library/{tag}:cur"
    try:
        for version in ("one", "two"):
            (tmp_path / "f").write_text(version)
            # BuildKit, as hack/images/build.sh builds (Debian's CLI has it built in): it writes
            # the empty layers that the legacy builder leaves out
            _run("env", "DOCKER_BUILDKIT=1", BUILD_DOCKER, "build", "-q", "-t",
                 f"{tag}:{version}", str(tmp_path))
        # the node's state after load-image.sh: v1 imported whole, its layer blobs dropped
        _run("docker", "tag", f"{tag}:one", f"{tag}:cur")
        saved = _run("docker", "save", f"{tag}:cur").stdout
        _run(
            *ctr, "images", "import", "--all-platforms", "--snapshotter=overlayfs", "-", stdin=saved
        )
        manifest = json.loads(_run(*ctr, "content", "get", _digest(ctr, ref)).stdout)
        layers = [layer["digest"] for layer in manifest["layers"]]
        for digest in layers:
            _run(*ctr, "content", "rm", digest)
        (tmp_path / "have").write_text("\n".join(layers) + "\n")

        _run("docker", "tag", f"{tag}:two", f"{tag}:cur")
        saved = _run("docker", "save", f"{tag}:cur").stdout
        out = tmp_path / "delta.tar"
        _run(
            "python3", str(DELTA), "--have", str(tmp_path / "have"), "--out", str(out), stdin=saved
        )
        assert out.stat().st_size < 200_000 < len(saved)  # the 8 MB layer stayed behind
        _run(*ctr, "images", "tag", "--force", ref, f"{ref}-previous")
        _run(
            *ctr,
            "images",
            "import",
            "--all-platforms",
            "--snapshotter=overlayfs",
            "-",
            stdin=out.read_bytes(),
        )
        _run(*ctr, "images", "rm", f"{ref}-previous")

        config = json.loads(_run(*ctr, "content", "get", _digest(ctr, ref)).stdout)["config"]
        image_id = _run("docker", "image", "inspect", "-f", "{{.Id}}", f"{tag}:two").stdout
        assert config["digest"] == image_id.decode().strip()
        # the container writes into a bind-mounted file, not to ctr's stdout: under load (a CI
        # run, 2026-12-07 07:14) ctr returned 0 with an empty stdout for this short-lived task
        host = tmp_path / "out"
        host.mkdir()
        name = f"t{uuid.uuid4().hex[:6]}"
        _run(
            *ctr, "run", "--rm", "--snapshotter", "overlayfs",
            "--mount", f"type=bind,src={host},dst=/out,options=rbind:rw",
            ref, name, "sh", "-c", "cat /f /big > /out/got",
        )
        got = (host / "got").read_text()
        assert got == "twobig\n", got  # the new top layer over the old lower ones
    finally:
        subprocess.run(
            ["docker", "rmi", "-f", f"{tag}:one", f"{tag}:two", f"{tag}:cur"],
            capture_output=True,
            check=False,
        )


def _digest(ctr: list[str], ref: str) -> str:
    for line in _run(*ctr, "images", "ls").stdout.decode().splitlines()[1:]:
        fields = line.split()
        if fields and fields[0] == ref:
            return fields[2]
    raise AssertionError(f"{ref} is not in the namespace")
