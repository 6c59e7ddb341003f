"""Turn ``docker save IMAGE`` (stdin) into an OCI archive holding only the layers a node lacks.

    docker save IMG | python3 hack/kind/image_delta.py --have DIGESTS --out delta.tar

``DIGESTS``: a file of ``sha256:...`` layer digests (one per line) that the kind node already
has unpacked (the layers of the image of the same name it holds now). The output is an OCI
image layout (``oci-layout``, ``index.json`` naming the image, ``blobs/sha256/...``) with the
manifest, the config and the other layers. ``ctr images import`` of it writes the new blobs;
its unpack finds the old layers' snapshots by chain ID and applies only the new ones, so a
code change in the runtime image costs its small top layers, not 6 GB per node.

Docker's legacy ``save`` format (Docker 20.10 here) names the layers only in ``manifest.json``,
at the end of the stream, so every ``layer.tar`` is hashed while it streams (its sha256 is its
diff ID: Docker's layer tars are uncompressed and reproducible) and spooled to a temporary file
that is dropped at once when the node has it. Standard library only. Prints one summary line
(layers kept / skipped, bytes) on stderr.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import posixpath
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import IO, Any

CHUNK = 1 << 20
KEEP_HAVE_BYTES = 64 << 20
"""A layer the node has is still kept up to this size: it may sit above a changed layer."""
MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
CONFIG_TYPE = "application/vnd.oci.image.config.v1+json"
LAYER_TYPE = "application/vnd.oci.image.layer.v1.tar"


def _spool(src: IO[bytes], dest: Path) -> tuple[str, int]:
    """Copy ``src`` to ``dest``; return its ``sha256:`` digest and size."""
    h, size = hashlib.sha256(), 0
    with dest.open("wb") as out:
        while chunk := src.read(CHUNK):
            h.update(chunk)
            out.write(chunk)
            size += len(chunk)
    return f"sha256:{h.hexdigest()}", size


def _hash(src: IO[bytes]) -> tuple[str, int]:
    h, size = hashlib.sha256(), 0
    while chunk := src.read(CHUNK):
        h.update(chunk)
        size += len(chunk)
    return f"sha256:{h.hexdigest()}", size


def read_save(stream: IO[bytes], *, have: set[str], work: Path) -> dict[str, Any]:
    """Read a docker-save stream: the manifest, configs, and each layer's digest and size; the
    layers not in ``have``, and those in it up to ``KEEP_HAVE_BYTES``, are kept as files under
    ``work`` (which of them the delta needs is known only from the manifest, at the end)."""
    layers: dict[str, tuple[str, int, Path | None]] = {}  # tar path -> digest, size, file
    links: dict[str, str] = {}  # tar path -> the tar path of the layer it links to
    files: dict[str, bytes] = {}
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        for member in tar:
            if member.issym() and member.name.endswith("/layer.tar"):
                # a layer that occurs twice is saved once and linked to; the link may come
                # before the layer in the stream, so links are resolved at the end
                links[member.name] = posixpath.normpath(
                    posixpath.join(posixpath.dirname(member.name), member.linkname)
                )
                continue
            if not member.isfile():
                continue
            src = tar.extractfile(member)
            assert src is not None
            if member.name.endswith("/layer.tar"):
                spool = work / f"layer{len(layers)}.tar"
                digest, size = _spool(src, spool)
                if digest in have and size > KEEP_HAVE_BYTES:
                    spool.unlink()
                    layers[member.name] = (digest, size, None)
                else:
                    layers[member.name] = (digest, size, spool)
            elif member.name == "manifest.json" or member.name.endswith(".json"):
                files[member.name] = src.read()
            else:
                _hash(src)
    for name, target in links.items():
        if target not in layers:
            raise SystemExit(f"image_delta: {name} links to {target}, which the stream lacks")
        layers[name] = layers[target]
    return {"layers": layers, "files": files}


def write_oci(saved: dict[str, Any], *, out: Path, have: list[str]) -> dict[str, int]:
    """Write the OCI layout for the one image in ``saved``; return counts for the summary.

    ``have``: the node's image's layers, in order. A snapshot is found by its chain ID (the
    layers below it and itself), so only the layers of the common prefix are left out; every
    layer from the first changed one up is in the archive, even one the node has further up
    (an empty layer recurs in most images). One of those not kept (over ``KEEP_HAVE_BYTES``)
    fails the delta, and the caller loads the whole image."""
    manifest_list = json.loads(saved["files"]["manifest.json"])
    if len(manifest_list) != 1:
        raise SystemExit(f"image_delta: expected one image in the stream, got {len(manifest_list)}")
    entry = manifest_list[0]
    config_bytes: bytes = saved["files"][entry["Config"]]
    config_digest = f"sha256:{hashlib.sha256(config_bytes).hexdigest()}"
    diff_ids = json.loads(config_bytes)["rootfs"]["diff_ids"]
    descriptors, kept, skipped, kept_bytes = [], 0, 0, 0
    blobs: list[tuple[str, Path | bytes]] = [(config_digest, config_bytes)]
    prefix = 0
    while prefix < min(len(diff_ids), len(have)) and diff_ids[prefix] == have[prefix]:
        prefix += 1
    for i, (path, diff_id) in enumerate(zip(entry["Layers"], diff_ids, strict=True)):
        digest, size, spool = saved["layers"][path]
        if digest != diff_id:
            raise SystemExit(
                f"image_delta: layer {path} hashes to {digest}, its diff ID is {diff_id}"
            )
        descriptors.append({"mediaType": LAYER_TYPE, "digest": digest, "size": size})
        if i < prefix:
            skipped += 1
        elif spool is None:
            raise SystemExit(
                f"image_delta: layer {i} ({digest}, {size >> 20} MiB) is above a changed layer "
                "and was not kept: load the whole image"
            )
        elif all(d != digest for d, _ in blobs):
            blobs.append((digest, spool))
            kept += 1
            kept_bytes += size
    manifest = {
        "schemaVersion": 2,
        "mediaType": MANIFEST_TYPE,
        "config": {"mediaType": CONFIG_TYPE, "digest": config_digest, "size": len(config_bytes)},
        "layers": descriptors,
    }
    manifest_bytes = json.dumps(manifest, separators=(",", ":")).encode()
    manifest_digest = f"sha256:{hashlib.sha256(manifest_bytes).hexdigest()}"
    blobs.append((manifest_digest, manifest_bytes))
    tags = [normalized(t) for t in entry.get("RepoTags") or []]
    index = {
        "schemaVersion": 2,
        "manifests": [
            {
                "mediaType": MANIFEST_TYPE,
                "digest": manifest_digest,
                "size": len(manifest_bytes),
                "annotations": {
                    "io.containerd.image.name": t,
                    "org.opencontainers.image.ref.name": t,
                },
            }
            for t in tags
        ],
    }
    with tarfile.open(out, "w") as tar:
        _add_bytes(tar, "oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
        for digest, blob in blobs:
            name = "blobs/sha256/" + digest.split(":", 1)[1]
            if isinstance(blob, bytes):
                _add_bytes(tar, name, blob)
            else:
                tar.add(str(blob), arcname=name)
        _add_bytes(tar, "index.json", json.dumps(index).encode())
    return {"kept": kept, "skipped": skipped, "kept_bytes": kept_bytes}


def normalized(ref: str) -> str:
    """The name containerd gives a docker-save tag: ``busybox:1`` -> ``docker.io/library/busybox:1``
    (a first component without a dot, a colon or ``localhost`` is not a registry)."""
    first, _, rest = ref.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        return ref
    return f"docker.io/{ref}" if rest else f"docker.io/library/{ref}"


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--have", type=Path, required=True, help="the layer digests of the node's image, in order"
    )
    ap.add_argument("--out", type=Path, required=True, help="the OCI archive to write")
    args = ap.parse_args(argv)
    have = [line.strip() for line in args.have.read_text().splitlines() if line.strip()]
    work = Path(tempfile.mkdtemp(prefix="image-delta.", dir=str(args.out.parent)))
    try:
        saved = read_save(sys.stdin.buffer, have=set(have), work=work)
        counts = write_oci(saved, out=args.out, have=have)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"image_delta: {counts['kept']} layers kept ({counts['kept_bytes'] >> 20} MiB), "
        f"{counts['skipped']} skipped (the node has them)",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
