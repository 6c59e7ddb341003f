"""Archive links and ``keepCheckpoints`` for named checkpoints (issue 38), with no group: the
fake backend of test_checkpoint_lifecycle writes real bytes, the server runs on a port.

- An archive link is issued only to who may read the checkpoint (owner, a reader it was shared
  with), asked for as tinker 0.34's ``get_checkpoint_archive_url`` asks (0.38 dropped the call);
  the link is fetched with no key by ``urllib.request.urlretrieve`` (what
  ``tinker_cookbook.weights.download`` does) and unpacks, under the cookbook's checks, to the
  checkpoint's exact files; a symlink in the checkpoint is left out.
- Altered (signature, path, owner, expiry), expired and foreign links answer 403; a link to a
  checkpoint deleted since answers 404.
- ``spec.training.keepCheckpoints: 2``: after each save a run keeps its newest two of each
  kind; disk use measured before and after; other runs untouched."""

from __future__ import annotations

import json
import tarfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.service.fake_service import fake_service
from tests.service.test_checkpoint_lifecycle import MB, _DiskClient
from tgruntime.service.paths import disk_bytes
from tgruntime.service.signed import LinkSigner

A, B, C = "tml-archive-a", "tml-archive-b", "tml-archive-c"


def _http(method: str, url: str, key: str | None = None, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", "accept": "application/json"}
    if key:
        headers["X-API-Key"] = key
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            text = r.read().decode()
            return r.status, json.loads(text) if text else None
    except urllib.error.HTTPError as e:
        text = e.read().decode()
        return e.code, json.loads(text) if text else None


class _Server:
    """The fake-backed service on a port, and the SDK's HTTP calls a test needs."""

    def __init__(self, root: Path, keep: int = 0) -> None:
        from tgruntime.service.__main__ import Running

        root.mkdir(parents=True, exist_ok=True)
        keys = root / "keys"
        keys.write_text(f"team-a {A}\nteam-b {B}\nteam-c {C}\n")
        wire: dict[str, Any] = {
            "model": {"maxSequenceLength": 128},
            "training": {"sequenceLength": 128, "keepCheckpoints": keep},
        }
        service = fake_service(client=_DiskClient(), wire=wire, root=root, keys_file=keys)
        self.root = root
        self.running = Running(service, "127.0.0.1", 0).start(60)
        self.url = self.running.url

    def api(self, method: str, route: str, key: str, body: Any = None) -> tuple[int, Any]:
        return _http(method, f"{self.url}/api/v1/{route}", key, body)

    def result(self, key: str, got: Any) -> Any:
        for _ in range(1000):
            code, out = self.api("POST", "retrieve_future", key, {"request_id": got["request_id"]})
            if code != 408:
                return out
            time.sleep(0.01)
        raise AssertionError(f"no answer for {got}")

    def finish_all(self) -> None:
        """Finish every live session (a full-weight group trains one run at a time)."""
        keys = {"team-a": A, "team-b": B, "team-c": C}
        for sid, sess in list(self.running.service.registry.sessions.items()):
            if not sess.finished:
                self.api("POST", f"sessions/{sid}/finish", keys[sess.owner], {})

    def model(self, key: str) -> str:
        """A new session and run (earlier sessions finished first)."""
        self.finish_all()
        _, made = self.api("POST", "create_session", key, {"tags": []})
        body = {
            "session_id": made["session_id"],
            "model_seq_id": 0,
            "base_model": "tiny",
            "lora_config": {"rank": 4},
        }
        code, got = self.api("POST", "create_model", key, body)
        assert code == 200, got
        self.result(key, got)
        return str(got["model_id"])

    def save(self, key: str, model_id: str, seq: int, name: str, sampler: bool = False) -> str:
        route = "save_weights_for_sampler" if sampler else "save_weights"
        code, got = self.api(
            "POST", route, key, {"model_id": model_id, "path": name, "seq_id": seq}
        )
        assert code == 200, got
        out = self.result(key, got)
        assert "path" in out, out
        return str(out["path"])

    def link(self, key: str, tinker_path: str) -> tuple[int, Any]:
        """tinker 0.34's ``get_checkpoint_archive_url_from_tinker_path``: GET .../archive of
        the run and checkpoint id (``<kind>/<name>``), JSON accepted."""
        run, cp = tinker_path.removeprefix("tinker://").split("/", 1)
        return self.api("GET", f"training_runs/{run}/checkpoints/{cp}/archive", key)

    def stop(self) -> None:
        self.running.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Server]:
    s = _Server(tmp_path_factory.mktemp("archive"))
    try:
        yield s
    finally:
        s.stop()


def _unpack(url: str, out: Path) -> None:
    """What the cookbook's download does with the link: urlretrieve it, refuse links and paths
    that leave ``out``, extract."""
    tmp = out.with_suffix(".tar")
    urllib.request.urlretrieve(url, str(tmp))
    base = out.resolve()
    with tarfile.open(tmp) as tar:
        for m in tar.getmembers():
            assert not (m.issym() or m.islnk()), m.name
            assert (out / m.name).resolve().is_relative_to(base), m.name
        tar.extractall(out, filter="data")


def _files(d: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(d)): p.read_bytes()
        for p in sorted(d.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def test_archive_link_fetches_and_unpacks_the_checkpoint(server: _Server, tmp_path: Path) -> None:
    model = server.model(A)
    path = server.save(A, model, 1, "s1", sampler=True)
    d = server.root / "tinker" / "principals" / "team-a" / model / "sampler_weights" / "s1"
    (d / "sub").mkdir()
    (d / "sub" / "config.json").write_text('{"n": 1}')
    (d / "escape").symlink_to(server.root / "keys")  # never archived
    code, got = server.link(A, path)
    assert code == 200, got
    parsed = urllib.parse.urlsplit(got["url"])
    assert parsed.netloc == urllib.parse.urlsplit(server.url).netloc
    q = urllib.parse.parse_qs(parsed.query)
    assert q["path"] == [path] and q["owner"] == ["team-a"] and len(q["signature"][0]) == 64
    left = int(q["expires"][0]) - time.time()
    assert 800 < left <= 900, left
    assert got["expires"].startswith(time.strftime("%Y-", time.gmtime()))
    out = tmp_path / "out"
    _unpack(got["url"], out)  # no key on the link
    want = _files(d)
    assert "escape" not in want and want["sub/config.json"] == b'{"n": 1}'
    assert _files(out) == want and len(want["weights.safetensors"]) == MB // 4
    # a second fetch of the same link works until it expires
    _unpack(got["url"], tmp_path / "again")
    assert _files(tmp_path / "again") == want


def test_links_only_for_readers_and_refused_when_altered_or_expired(server: _Server) -> None:
    model = server.model(A)
    path = server.save(A, model, 1, "w1")
    run, cp = path.removeprefix("tinker://").split("/", 1)
    assert server.link(B, path)[0] == 404  # another principal's: like a missing one
    assert server.link(A, f"tinker://{run}/weights/nope")[0] == 404
    assert server.api("GET", f"training_runs/{run}/checkpoints/{cp}/archive", "bad")[0] == 401
    code, _ = server.api("PUT", f"training_runs/{run}/checkpoints/{cp}/readers/team-b", A)
    assert code == 200
    code, got = server.link(B, path)  # a reader may fetch it
    assert code == 200, got
    url = got["url"]
    assert _get(url)[0] == 200
    base, query = url.split("?", 1)
    q = dict(urllib.parse.parse_qsl(query))

    def bent(**kw: str) -> str:
        return f"{base}?{urllib.parse.urlencode({**q, **kw})}"

    sig = q["signature"]
    for url2, why in (
        (bent(signature=("0" if sig[0] != "0" else "1") + sig[1:]), "signature"),
        (bent(path=f"tinker://{run}/weights/w2"), "signature"),
        (bent(owner="team-b"), "signature"),
        (bent(expires=str(int(q["expires"]) + 3600)), "signature"),
        (f"{base}?path={urllib.parse.quote(path)}", "lacks"),
    ):
        code, body = _get(url2)
        assert code == 403 and why in body["error"], (url2, body)
    # expired: a link signed an hour ago by the same server
    service = server.running.service
    old, _ = service.links.sign(owner="team-a", path=path, now=time.time() - 3600)
    code, body = _get(f"{base}?{old}")
    assert code == 403 and "expired" in body["error"], body
    # another server's secret
    other, _ = LinkSigner(secret=b"x" * 32).sign(owner="team-a", path=path)
    assert _get(f"{base}?{other}")[0] == 403
    # deleted since the link was issued
    assert server.api("DELETE", f"training_runs/{run}/checkpoints/{cp}", A)[0] == 204
    assert _get(url)[0] == 404


def _get(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            r.read()
            return r.status, None
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())


def test_link_signer_units() -> None:
    s = LinkSigner(secret=b"k" * 32, ttl_s=60)
    query, expires = s.sign(owner="p", path="tinker://m:train:0/weights/a", now=1000.0)
    q = dict(urllib.parse.parse_qsl(query))
    assert expires == 1060 and q["expires"] == "1060"
    assert s.check(q, now=1059.0).path == "tinker://m:train:0/weights/a"
    with pytest.raises(Exception, match="expired 1 s ago"):
        s.check(q, now=1061.0)
    with pytest.raises(ValueError, match="TG_TINKER_LINK_SECRET must hold at least 16"):
        LinkSigner(secret=b"short")


def test_keep_checkpoints_prunes_named_checkpoints(tmp_path: Path) -> None:
    """``keepCheckpoints: 2``: four saves of each kind leave the newest two of each; another
    run's and another principal's are untouched."""
    server = _Server(tmp_path / "keep", keep=2)
    try:
        folder = server.root / "tinker" / "principals"
        m2 = server.model(A)
        server.save(A, m2, 1, "other")
        mb = server.model(B)
        server.save(B, mb, 1, "b1")
        m1 = server.model(A)
        used = [disk_bytes(folder)]
        for i in range(1, 5):
            server.save(A, m1, 2 * i - 1, f"step-{i}")
            server.save(A, m1, 2 * i, f"step-{i}", sampler=True)
            used.append(disk_bytes(folder))
        _, got = server.api("GET", f"training_runs/{m1}/checkpoints", A)
        names = sorted(c["checkpoint_id"] for c in got["checkpoints"])
        assert names == [
            "sampler_weights/step-3",
            "sampler_weights/step-4",
            "weights/step-3",
            "weights/step-4",
        ], names
        assert not list((folder / "team-a" / m1 / "weights").glob(".step-1*"))  # sidecar gone
        assert server.api("GET", f"training_runs/{m2}/checkpoints", A)[1]["checkpoints"]
        assert server.api("GET", f"training_runs/{mb}/checkpoints", B)[1]["checkpoints"]
        per_save = MB + MB // 4  # one state (1 MiB) and one sampler copy (256 KiB)
        # grows for two rounds, then flat: each save deletes the oldest of its kind
        assert used[2] - used[0] >= 2 * per_save
        assert abs(used[4] - used[2]) < 4096 and abs(used[3] - used[2]) < 4096, used
    finally:
        server.stop()


def test_sdk_save_weights_external_and_its_urls(server: _Server, tmp_path: Path) -> None:
    """SDK 0.38's own calls: ``save_weights_external`` (the group's ``export_hf`` files),
    ``get_external_weights_urls``, each link fetched with no key; listed as ``external``;
    another principal gets a 404; deleted, its links answer 404."""
    import tinker

    server.finish_all()
    sc = tinker.ServiceClient(base_url=server.url, api_key=A)
    tc = sc.create_lora_training_client("tiny", rank=4).result()
    path = tc.save_weights_external("hf", ttl_seconds=3600).result().path
    run = path.removeprefix("tinker://").split("/")[0]
    assert path == f"tinker://{run}/external_weights/hf"
    d = server.root / "tinker" / "principals" / "team-a" / run / "external_weights" / "hf"
    rc = tinker.RestClient(base_url=server.url, api_key=A)
    got = rc.get_external_weights_urls(path).result()
    assert sorted(got.urls) == ["config.json", "model.safetensors"]
    assert 800 < (got.expires.timestamp() - time.time()) <= 900
    for name, url in got.urls.items():
        urllib.request.urlretrieve(url, str(tmp_path / name))
        assert (tmp_path / name).read_bytes() == (d / name).read_bytes()
    (cp,) = [c for c in rc.list_checkpoints(run).result().checkpoints]
    assert cp.checkpoint_type == "external" and cp.expires_at is not None
    # a file link opens that file only: another file, or the archive route, breaks the signature
    base, query = got.urls["config.json"].split("?", 1)
    q = dict(urllib.parse.parse_qsl(query))
    assert _get(f"{base}?{urllib.parse.urlencode({**q, 'file': 'model.safetensors'})}")[0] == 403
    assert _get(f"{server.url}/signed/archive?{query}")[0] == 403
    rb = tinker.RestClient(base_url=server.url, api_key=B)
    with pytest.raises(tinker.NotFoundError):
        rb.get_external_weights_urls(path).result()
    with pytest.raises(tinker.BadRequestError, match="Hugging Face files"):
        sc.create_training_client_from_state(path).result()
    rc.delete_checkpoint_from_tinker_path(path).result()
    assert not d.exists() and _get(got.urls["config.json"])[0] == 404
    server.finish_all()


def test_age_files_decrypt_for_every_recipient(tmp_path: Path) -> None:
    """service.age's files, for an X25519 and an SSH recipient, decrypt with each one's
    identity to the original bytes: empty, one byte, exactly one 64 KiB chunk of the age
    format, one byte more, several chunks. Bad recipients are refused by name; a wrong
    identity cannot decrypt."""
    import hashlib

    import pyrage
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from tgruntime.service import age
    from tgruntime.service.sessions import ServiceError

    for bad in ("ssh-ed25519 AAAAC3Nza", "age1notakey", 7, ""):
        with pytest.raises(ServiceError, match="is not an age recipient"):
            age.recipient(bad)
    with pytest.raises(ServiceError, match="a list of 1 to 64"):
        age.check_recipients([])
    x_ident = pyrage.x25519.Identity.generate()
    ssh_key = Ed25519PrivateKey.generate()
    ssh_public = (
        ssh_key.public_key()
        .public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        .decode()
    )
    ssh_private = ssh_key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    )
    recipients = age.check_recipients([str(x_ident.to_public()), ssh_public])
    identities = [x_ident, pyrage.ssh.Identity.from_buffer(ssh_private)]
    chunk = 64 * 1024
    sizes = [0, 1, chunk, chunk + 1, 3 * chunk + 7]
    for n in sizes:
        src = tmp_path / f"f{n}"
        src.write_bytes(bytes(range(256)) * (n // 256) + bytes(n % 256))
        dst = tmp_path / f"f{n}.age"
        assert age.encrypt_file(src, dst, recipients) == dst.stat().st_size
        assert not list(tmp_path.glob(".*.tmp"))
        want = hashlib.sha256(src.read_bytes()).hexdigest()
        for ident in identities:
            got = pyrage.decrypt(dst.read_bytes(), [ident])
            assert hashlib.sha256(got).hexdigest() == want
        with pytest.raises(pyrage.DecryptError):
            pyrage.decrypt(dst.read_bytes(), [pyrage.x25519.Identity.generate()])
