"""Checkpoint lifecycle without a group (issue 38), over HTTP with a fake backend whose saves
write real bytes: DELETE as the SDK 0.38 sends it (owner-checked: another principal's answers
like a missing one), ``ttl_seconds`` kept beside the checkpoint and expired by the sweeper (and
at start-up), ``user_metadata`` of a run back in ``training_runs``, ``weights_info``,
``copy_weights``, ``save_weights_external`` with a bad recipient refused without holding up the
next seq_id (the export itself: test_checkpoint_archive.py), an
unknown run is a 404, and ``tgctl serve``'s default checkpoint directory. Disk use is measured
before and after each delete and expiry."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tests.service.fake_service import fake_service
from tgruntime.service.paths import disk_bytes, meta_path

MB = 1 << 20
A, B = "tml-aaa", "tml-bbb"


class _Done:
    def __init__(self, value: Any = None) -> None:
        self.value = value

    def result(self, timeout: float | None = None) -> Any:
        return self.value


class _DiskClient:
    """The group's saves, as files: ``save_state``/``save_run`` write 1 MiB, sampler weights
    256 KiB."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def _write(self, path: str, name: str, size: int) -> None:
        d = Path(path)
        d.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(b"\0" * size)

    def save_state(self, path: str) -> _Done:
        self._write(path, "model.pt", MB)
        (Path(path) / "meta.json").write_text("{}")
        return _Done(path)

    def save_run(self, path: str) -> _Done:
        self._write(path, "adapter.pt", MB)
        return _Done(path)

    def export_hf(self, path: str) -> _Done:
        """Hugging Face files, as the workers' export_hf leaves them."""
        self._write(path, "model.safetensors", MB // 2)
        (Path(path) / "config.json").write_text('{"model_type": "llama"}')
        return _Done({"path": path})

    def save_sampler_weights(self, name: str, path: str | None = None) -> _Done:
        if path:
            self._write(path, "weights.safetensors", MB // 4)
        return _Done({"name": name})

    def drop_sampler_weights(self, name: str) -> _Done:
        return _Done(True)

    def vocab_size(self) -> int:
        return 128

    def load_state(self, path: str, *, optimizer: bool = True) -> _Done:
        return _Done(0)

    def zero_grad(self) -> _Done:
        return _Done(None)


def _service(root: Path, *, lora: bool = False) -> Any:
    root.mkdir(parents=True, exist_ok=True)
    keys = root / "keys"
    keys.write_text(f"team-a {A}\nteam-b {B}\n")
    wire: dict[str, Any] = {
        "model": {"maxSequenceLength": 128},
        "training": {"sequenceLength": 128},
    }
    if lora:
        wire["lora"] = {"rank": 4, "alpha": 8}
    return fake_service(client=_DiskClient(), wire=wire, root=root, keys_file=keys)


class _Api:
    def __init__(self, http: Any) -> None:
        self.http = http

    async def call(self, method: str, route: str, key: str, body: Any = None) -> tuple[int, Any]:
        kw: dict[str, Any] = {"headers": {"X-API-Key": key}}
        if body is not None:
            kw["json"] = body
        r = await self.http.request(method, f"/api/v1/{route}", **kw)
        text = await r.text()
        return r.status, json.loads(text) if text else None

    async def post(self, route: str, key: str, body: Any) -> tuple[int, Any]:
        return await self.call("POST", route, key, body)

    async def result(self, key: str, got: Any, timeout_s: float = 10.0) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            code, out = await self.post("retrieve_future", key, {"request_id": got["request_id"]})
            if code != 408:
                return out
            await asyncio.sleep(0.01)
        raise AssertionError(f"no answer for {got}")

    async def model(self, key: str, meta: dict[str, str] | None = None) -> str:
        _, made = await self.post("create_session", key, {"tags": []})
        body = {"session_id": made["session_id"], "model_seq_id": 0, "base_model": "tiny",
                "lora_config": {"rank": 4}, "user_metadata": meta}
        code, got = await self.post("create_model", key, body)
        assert code == 200, got
        assert (await self.result(key, got)).get("model_id") == got["model_id"]
        return str(got["model_id"])

    async def save(self, key: str, model_id: str, seq: int, name: str, *, sampler: bool = False,
                   **extra: Any) -> str:
        route = "save_weights_for_sampler" if sampler else "save_weights"
        body = {"model_id": model_id, "path": name, "seq_id": seq, **extra}
        code, got = await self.post(route, key, body)
        assert code == 200, got
        out = await self.result(key, got)
        assert "path" in out, out
        return str(out["path"])


def _http(service: Any, main: Any) -> None:
    from aiohttp.test_utils import TestClient, TestServer

    from tgruntime.service.app import create_app

    async def run() -> None:
        async with TestClient(TestServer(create_app(service))) as http:
            await main(_Api(http))

    asyncio.run(run())


def _one(uri: str) -> str:
    """``training_runs/{run}/checkpoints/{kind}/{name}``: the path the SDK's
    ``delete_checkpoint_from_tinker_path`` builds from a tinker path."""
    from tinker import types

    p = types.ParsedCheckpointTinkerPath.from_tinker_path(uri)
    return f"training_runs/{p.training_run_id}/checkpoints/{p.checkpoint_id}"


def test_delete_frees_the_disk_and_is_owner_checked(tmp_path: Path) -> None:
    service = _service(tmp_path)
    folder = tmp_path / "tinker" / "principals" / "team-a"

    async def main(api: _Api) -> None:
        m = await api.model(A, {"renderer_name": "role_colon"})
        state = await api.save(A, m, 1, "s1")
        sampler = await api.save(A, m, 2, "w1", sampler=True)
        before = disk_bytes(folder)
        assert before >= MB + MB // 4
        code, missing = await api.call("DELETE", _one(f"tinker://{m}/weights/nope"), A)
        assert code == 404 and "no checkpoint at" in missing["error"]
        code, theirs = await api.call("DELETE", _one(state), B)  # B: like a missing one
        assert code == 404 and theirs["error"] == f"no checkpoint at {state}"
        assert disk_bytes(folder) == before
        code, _ = await api.call("DELETE", _one(state), A)
        assert code == 204
        after = disk_bytes(folder)
        assert before - after >= MB, (before, after)
        _, cps = await api.call("GET", f"training_runs/{m}/checkpoints", A)
        assert [c["tinker_path"] for c in cps["checkpoints"]] == [sampler]
        assert (await api.call("DELETE", _one(state), A))[0] == 404  # gone
        assert (await api.call("DELETE", _one(sampler), A))[0] == 204
        assert before - disk_bytes(folder) >= MB + MB // 4
        # a load of the deleted state fails like a missing one
        code, got = await api.post("load_weights", A, {"model_id": m, "path": state,
                                                       "seq_id": 3})
        assert code == 404, got
        print(f"disk of team-a: {before} -> {disk_bytes(folder)} bytes after two deletes")

    _http(service, main)


def test_ttl_is_kept_beside_the_checkpoint_and_expired_by_the_sweeper(tmp_path: Path) -> None:
    service = _service(tmp_path)
    folder = tmp_path / "tinker" / "principals" / "team-a"

    async def main(api: _Api) -> None:
        m = await api.model(A)
        for bad in (0, -5, "1h", True, 10**10):
            code, got = await api.post(
                "save_weights", A, {"model_id": m, "path": "bad", "ttl_seconds": bad}
            )
            assert code == 400 and "ttl_seconds" in got["error"], (bad, got)
        t0 = time.time()
        short = await api.save(A, m, 1, "short", ttl_seconds=3600,
                               user_metadata={"step": "1"})
        keep = await api.save(A, m, 2, "keep")
        smp = await api.save(A, m, 3, "smp", sampler=True, ttl_seconds=7200)
        _, cps = await api.call("GET", "checkpoints", A)
        by = {c["tinker_path"]: c for c in cps["checkpoints"]}
        assert by[keep]["expires_at"] is None and by[short]["user_metadata"] == {"step": "1"}
        assert by[short]["expires_at"] is not None and by[smp]["expires_at"] is not None
        d = folder / m / "weights" / "short"
        assert json.loads(meta_path(d).read_text())["ttl_seconds"] == 3600
        before = disk_bytes(folder)
        assert service.sweep(now=t0 + 3590) == []  # not yet
        gone = service.sweep(now=t0 + 3700)
        assert [p for p, _ in gone] == [str(d)] and gone[0][1] >= MB
        assert not d.exists() and not meta_path(d).exists()
        assert before - disk_bytes(folder) >= MB
        # the TTL changed later (PUT .../ttl, the SDK's set_checkpoint_ttl_from_tinker_path)
        assert (await api.call("PUT", f"{_one(smp)}/ttl", A, {"ttl_seconds": None}))[0] == 204
        assert service.sweep(now=t0 + 10**6) == []  # smp no longer expires
        code, _ = await api.call("PUT", f"{_one(keep)}/ttl", B, {"ttl_seconds": 3600})
        assert code == 404  # another principal's
        assert (await api.call("PUT", f"{_one(keep)}/ttl", A, {"ttl_seconds": 3600}))[0] == 204
        gone = service.sweep(now=time.time() + 3601)
        assert [p for p, _ in gone] == [str(folder / m / "weights" / "keep")]
        _, cps = await api.call("GET", "checkpoints", A)
        assert [c["tinker_path"] for c in cps["checkpoints"]] == [smp]
        print(f"disk of team-a: {before} -> {disk_bytes(folder)} bytes after two expiries")

    _http(service, main)


def test_expired_checkpoints_go_at_start_up(tmp_path: Path) -> None:
    first = _service(tmp_path)
    saved: dict[str, Any] = {}

    async def save(api: _Api) -> None:
        m = await api.model(A)
        saved["path"] = await api.save(A, m, 1, "old", ttl_seconds=3600)
        saved["dir"] = tmp_path / "tinker" / "principals" / "team-a" / m / "weights" / "old"
        first.paths.set_ttl(saved["dir"], 3600, now=time.time() - 7200)  # an hour ago

    _http(first, save)
    assert saved["dir"].is_dir()

    async def restarted(api: _Api) -> None:
        for _ in range(200):  # the sweeper runs once at start-up
            if not saved["dir"].exists():
                break
            await asyncio.sleep(0.01)
        assert not saved["dir"].exists()
        _, cps = await api.call("GET", "checkpoints", A)
        assert cps["checkpoints"] == []

    _http(_service(tmp_path), restarted)


def test_runs_user_metadata_unknown_run_and_restart(tmp_path: Path) -> None:
    meta = {"renderer_name": "role_colon", "wandb_link": "x"}
    ids: dict[str, str] = {}

    async def main(api: _Api) -> None:
        m = await api.model(A, meta)
        ids["m"] = m
        await api.save(A, m, 1, "s1")
        _, runs = await api.call("GET", "training_runs", A)
        assert [(r["training_run_id"], r["user_metadata"]) for r in runs["training_runs"]] == [
            (m, meta)
        ]
        code, run = await api.call("GET", f"training_runs/{m}", A)
        assert code == 200 and run["user_metadata"] == meta
        code, got = await api.call("GET", "training_runs/nope:train:0", A)
        assert code == 404 and "unknown training run" in got["error"]
        code, theirs = await api.call("GET", f"training_runs/{m}", B)
        assert code == 404 and theirs["error"] == f"unknown training run {m!r}"
        assert (await api.call("GET", "training_runs", B))[1]["training_runs"] == []

    _http(_service(tmp_path), main)

    async def after_restart(api: _Api) -> None:  # the run is read back from its run.json
        code, run = await api.call("GET", f"training_runs/{ids['m']}", A)
        assert code == 200 and run["user_metadata"] == meta, run
        from tinker import types

        assert types.TrainingRun.model_validate(run).user_metadata == meta

    _http(_service(tmp_path), after_restart)


def test_weights_info_full_and_lora(tmp_path: Path) -> None:
    async def full(api: _Api) -> None:
        m = await api.model(A)
        path = await api.save(A, m, 1, "s1")
        code, got = await api.post("weights_info", A, {"tinker_path": path})
        assert code == 200 and got["base_model"] == "tiny" and got["is_lora"] is False
        assert got["lora_rank"] is None
        code, got = await api.post("weights_info", B, {"tinker_path": path})
        assert code == 404 and got["error"] == f"no checkpoint at {path}"

    _http(_service(tmp_path / "full"), full)

    async def lora(api: _Api) -> None:
        from tinker import types

        m = await api.model(A)
        for path in (await api.save(A, m, 1, "s1"),
                     await api.save(A, m, 2, "w1", sampler=True)):
            code, got = await api.post("weights_info", A, {"tinker_path": path})
            assert code == 200, got
            info = types.WeightsInfoResponse.model_validate(got)
            assert (info.base_model, info.is_lora, info.lora_rank) == ("tiny", True, 4)
            assert (info.train_mlp, info.train_attn, info.train_unembed) == (True, True, True)

    _http(_service(tmp_path / "lora", lora=True), lora)


def test_copy_weights_and_save_weights_external(tmp_path: Path) -> None:
    service = _service(tmp_path)
    folder = tmp_path / "tinker" / "principals" / "team-a"

    async def main(api: _Api) -> None:
        m = await api.model(A)
        src = await api.save(A, m, 1, "s1")
        before = disk_bytes(folder)
        key = {"X-API-Key": A, "X-Idempotency-Key": "k1"}
        body = {"source_path": src, "destination_project_id": "p", "ttl_seconds": 3600}
        r = await api.http.post("/api/v1/copy_weights", json=body, headers=key)
        copy = (await r.json())["tinker_path"]
        assert r.status == 200 and copy.startswith("tinker://copy-") and copy.endswith(
            "/weights/s1")
        r = await api.http.post("/api/v1/copy_weights", json=body, headers=key)  # SDK retry
        assert (await r.json())["tinker_path"] == copy
        assert disk_bytes(folder) - before >= MB  # one copy, not two
        _, cps = await api.call("GET", "checkpoints", A)
        by = {c["tinker_path"]: c for c in cps["checkpoints"]}
        assert by[copy]["size_bytes"] == by[src]["size_bytes"] and by[copy]["expires_at"]
        assert (await api.post("copy_weights", B, body))[0] == 404  # not B's
        code, got = await api.post("copy_weights", A, {**body, "weights_access_token": "t"})
        assert code == 400 and "weights_access_token" in got["error"]
        # the copy loads like any state of one's own, and deletes on its own
        assert (await api.call("DELETE", _one(src), A))[0] == 204
        code, got = await api.post("weights_info", A, {"tinker_path": copy})
        assert code == 200 and got["base_model"] == "tiny"
        # save_weights_external with a bad recipient: 400 naming the field; the next seq_id is
        # not held up
        code, got = await api.post("save_weights_external", A,
                                   {"model_id": m, "path": "hf", "seq_id": 2,
                                    "age_encryption_recipients": ["age1xyz"]})
        assert code == 400 and "is not an age recipient" in got["error"]
        t = time.monotonic()
        await api.save(A, m, 3, "s3")
        assert time.monotonic() - t < 5.0
        code, got = await api.call("POST", f"{_one(copy)}/publish", A)
        assert code == 400 and "publishing" in got["error"]
        # pages of the listings (the SDK sends limit and offset)
        _, every = await api.call("GET", "checkpoints", A)
        newest_first = [f"tinker://{m}/weights/s3", copy]  # the copy keeps its source's time
        assert [c["tinker_path"] for c in every["checkpoints"]] == newest_first
        _, page = await api.call("GET", "checkpoints?limit=1&offset=1", A)
        assert page["checkpoints"] == every["checkpoints"][1:]
        assert page["cursor"] == {"offset": 1, "limit": 1, "total_count": 2}
        _, runs = await api.call("GET", "training_runs?limit=1&offset=0", A)
        assert len(runs["training_runs"]) == 1 and runs["cursor"]["total_count"] == 2
        assert (await api.call("GET", "checkpoints?limit=-1", A))[0] == 400

    _http(service, main)


def test_the_unmodified_sdk_drives_the_lifecycle(tmp_path: Path) -> None:
    """tinker 0.38's own calls, against the server on a port (the fake group behind it)."""
    import pytest
    import tinker

    from tgruntime.service.__main__ import Running

    running = Running(_service(tmp_path), "127.0.0.1", 0).start(60)
    folder = tmp_path / "tinker" / "principals" / "team-a"
    try:
        sc = tinker.ServiceClient(base_url=running.url, api_key=A)
        meta = {"renderer_name": "role_colon"}
        tc = sc.create_lora_training_client("tiny", rank=4, user_metadata=meta).result()
        path = tc.save_state("s1", ttl_seconds=3600, user_metadata={"step": "1"}).result().path
        rc = tinker.RestClient(base_url=running.url, api_key=A)
        assert rc.get_training_run_by_tinker_path(path).result().user_metadata == meta
        info = rc.get_weights_info_by_tinker_path(path).result()
        assert (info.base_model, info.is_lora, info.lora_rank) == ("tiny", False, None)
        (cp,) = rc.list_user_checkpoints().result().checkpoints
        assert cp.tinker_path == path and cp.user_metadata == {"step": "1"}
        assert cp.expires_at is not None and cp.size_bytes and cp.size_bytes >= MB
        rc.set_checkpoint_ttl_from_tinker_path(path, None).result()
        (cp,) = rc.list_user_checkpoints().result().checkpoints
        assert cp.expires_at is None
        copy = rc.copy_weights(path, "archive", ttl_seconds=7200).result()
        assert copy.startswith("tinker://copy-") and copy.endswith("/weights/s1")
        before = disk_bytes(folder)
        rc.delete_checkpoint_from_tinker_path(path).result()
        rc.delete_checkpoint_from_tinker_path(copy).result()
        assert before - disk_bytes(folder) >= 2 * MB
        assert rc.list_user_checkpoints().result().checkpoints == []
        with pytest.raises(tinker.NotFoundError):
            rc.delete_checkpoint_from_tinker_path(path).result()
        with pytest.raises(tinker.NotFoundError):
            rc.get_training_run("nope:train:0").result()
        with pytest.raises(tinker.BadRequestError, match="is not an age recipient"):
            tc.save_weights_external("hf", age_encryption_recipients=["age1xyz"]).result()
        t = time.monotonic()
        assert tc.save_state("s2").result().path.endswith("/weights/s2")  # not held up
        assert time.monotonic() - t < 10.0
    finally:
        running.stop()


def test_tgctl_serve_default_checkpoint_dir(tmp_path: Path, monkeypatch: Any) -> None:
    from tgruntime.entrypoints.cli import build_parser, serve_checkpoint_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

    def tg(ckpt: str | None) -> Any:
        spec = SimpleNamespace(training=SimpleNamespace(checkpoint_dir=ckpt))
        return SimpleNamespace(group_name="tiny", spec=spec)

    args = build_parser().parse_args(["serve", "-f", "x.yaml"])
    assert serve_checkpoint_dir(args, tg(None)) == str(
        tmp_path / "trainergroup" / "checkpoints" / "tiny"
    )
    assert serve_checkpoint_dir(args, tg("/data/ck")) == "/data/ck"
    args = build_parser().parse_args(["serve", "-f", "x.yaml", "--checkpoint-dir", "/o"])
    assert serve_checkpoint_dir(args, tg("/data/ck")) == "/o"
    assert isinstance(args, argparse.Namespace)


def test_audit_names_the_lifecycle_actions() -> None:
    from tgruntime.service.audit import action_of

    one = "/api/v1/training_runs/tg-1:train:0/checkpoints/weights/s1"
    assert action_of(one) == "delete_checkpoint"
    assert action_of(f"{one}/ttl") == "set_checkpoint_ttl"
    assert action_of(f"{one}/publish") == "publish_checkpoint"
    assert action_of(f"{one}/archive") == "checkpoint_archive_link"
    hf = "/api/v1/training_runs/tg-1:train:0/checkpoints/external_weights/hf"
    assert action_of(f"{hf}/external_weights_urls") == "external_weights_urls"
    assert action_of("/api/v1/training_runs/tg-1:train:0/checkpoints") is None  # a listing
    assert action_of("/api/v1/copy_weights") == "copy_weights"
    assert action_of("/api/v1/save_weights_external") == "save_weights_external"
    assert action_of("/api/v1/weights_info") is None
