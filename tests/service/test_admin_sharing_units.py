"""Admin principals and read grants without a group (issue 37): the policy's decisions, and
the real server over HTTP (aiohttp's test server) on checkpoints laid out on disk as saves
leave them: an admin lists, reads, deletes and finishes everyone's, each act audited and
marked admin; a checkpoint shared with B is readable by B and by nobody else, and B cannot
delete, re-time or re-share it; a grant survives a restart and a revoke ends it."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from tgruntime.service.policy import Act, Policy, admin_uses, parse_admins, track_admin_uses
from tgruntime.service.sessions import ServiceError

KEYS = "ops tml-ops\nteam-a tml-aaa\nteam-b tml-bbb\nteam-c tml-ccc\n"
RUN_A = "tg-" + "a" * 32 + ":train:0"


def test_the_policy_decides_each_act() -> None:
    p = Policy(admins=frozenset({"ops"}))
    for act in Act:
        assert p.may("a", "a", act)  # the owner may everything
        assert not p.may("b", "a", act)  # another principal nothing
        assert p.may("ops", "a", act) is (act is not Act.USE)  # an admin all but use
    assert p.may("b", "a", Act.READ, readers={"b"})  # a reader reads
    for act in (Act.USE, Act.DELETE, Act.FINISH, Act.SHARE):
        assert not p.may("b", "a", act, readers={"b"})  # and nothing else
    uses = track_admin_uses()
    assert p.may("ops", "ops") and p.may("ops", "ops", Act.READ, readers={"ops"})
    assert uses == set()  # its own objects: no admin right used
    assert p.may("ops", "a", Act.DELETE) and p.may("ops", "b", Act.READ)
    assert admin_uses() == {"a", "b"}
    assert not Policy().is_admin("ops") and p.is_admin("ops")


def test_admin_names_are_checked() -> None:
    assert parse_admins("ops, sre-1,") == frozenset({"ops", "sre-1"})
    assert parse_admins(None) == frozenset() and parse_admins(["x"]) == frozenset({"x"})
    with pytest.raises(ValueError, match=r"--admin-principals: '\.\./x' is not a principal name"):
        parse_admins("ops,../x")


def test_both_entrypoints_take_the_admin_and_tls_flags() -> None:
    from tgruntime.entrypoints.cli import build_parser as tgctl
    from tgruntime.service.__main__ import build_parser as server

    for argv in (["serve", "-f", "tg.yaml"], []):
        parse = tgctl().parse_args if argv else server().parse_args
        args = parse([*argv, "--admin-principals", "ops,sre", "--tls-cert", "c", "--tls-key", "k"])
        assert (args.admin_principals, args.tls_cert, args.tls_key) == ("ops,sre", "c", "k")
        plain = parse(argv)
        assert plain.admin_principals is plain.tls_cert is plain.tls_key is None


def _layout(root: Path) -> dict[str, Path]:
    """A's run as its saves leave it: a training state and two sampler checkpoints."""
    from tgruntime.service.paths import Paths

    p = Paths(str(root))
    out = {}
    for kind, name in (("weights", "w1"), ("sampler_weights", "s1"), ("sampler_weights", "s2")):
        d = p.directory("team-a", RUN_A, kind, name)
        d.mkdir(parents=True)
        (d / "meta.json").write_text("{}")
        p.saved(d, ttl=None, user_metadata=None, base_model="tiny")
        out[name] = d
    return out


def _service(root: Path) -> Any:
    import tgapi
    from tgruntime.service.__main__ import group_info
    from tgruntime.service.app import TinkerService
    from tgruntime.service.auth import KeyStore
    from tgruntime.service.backend import Backend

    keys = root / "keys"
    keys.write_text(KEYS)
    info = group_info("tiny", tgapi.parse_spec({}, local=True), checkpoint_dir=str(root))
    return TinkerService(
        Backend(client=None, info=info),  # type: ignore[arg-type]
        KeyStore(keys_file=str(keys), recheck_s=0.0),
        policy=Policy(admins=parse_admins("ops")),
    )


def _audit(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [json.loads(r.getMessage()) for r in caplog.records
            if r.name == "tgruntime.service.audit"]


def test_an_admin_lists_reads_deletes_and_finishes_everyones_and_is_audited(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from aiohttp.test_utils import TestClient, TestServer

    from tgruntime.service.app import create_app

    dirs = _layout(tmp_path)
    service = _service(tmp_path)
    s1 = f"tinker://{RUN_A}/sampler_weights/s1"
    one = f"training_runs/{RUN_A}/checkpoints/sampler_weights/s1"

    async def main() -> None:
        async with TestClient(TestServer(create_app(service))) as http:

            async def call(method: str, route: str, key: str, body: Any = None) -> Any:
                r = await http.request(method, f"/api/v1/{route}", json=body,
                                       headers={"X-API-Key": key})
                return r.status, (await r.json() if r.status != 204 else None)

            # B sees nothing of A's; the admin sees A's run, its owner and checkpoints
            assert (await call("GET", "training_runs", "tml-bbb"))[1]["training_runs"] == []
            code, runs = await call("GET", "training_runs", "tml-ops")
            assert code == 200
            assert [(r["training_run_id"], r["model_owner"]) for r in runs["training_runs"]] == [
                (RUN_A, "team-a")]
            code, cps = await call("GET", "checkpoints", "tml-ops")
            assert sorted(c["tinker_path"] for c in cps["checkpoints"]) == sorted(
                f"tinker://{RUN_A}/{k}/{n}"
                for k, n in (("weights", "w1"), ("sampler_weights", "s1"),
                             ("sampler_weights", "s2")))
            assert (await call("GET", f"training_runs/{RUN_A}/checkpoints", "tml-ops"))[0] == 200
            assert (await call("GET", f"training_runs/{RUN_A}/checkpoints", "tml-bbb"))[0] == 404
            code, info = await call("POST", "weights_info", "tml-ops", {"tinker_path": s1})
            assert code == 200 and info["base_model"] == "tiny"
            # delete: B gets the 404 of a missing checkpoint, the admin deletes it
            assert (await call("DELETE", one, "tml-bbb"))[0] == 404
            assert dirs["s1"].is_dir()
            assert (await call("DELETE", one, "tml-ops"))[0] == 204
            assert not dirs["s1"].exists()
            # sessions: the admin finishes A's, but cannot use it (heartbeat, a model in it)
            code, made = await call("POST", "create_session", "tml-aaa", {"tags": []})
            sid = made["session_id"]
            assert (await call("POST", "session_heartbeat", "tml-ops", {"session_id": sid}))[
                0] == 404
            assert (await call("POST", f"sessions/{sid}/finish", "tml-bbb", {}))[0] == 404
            assert not service.registry.sessions[sid].finished
            assert (await call("POST", f"sessions/{sid}/finish", "tml-ops", {}))[0] == 200
            assert service.registry.sessions[sid].finished
            # the owner's own listing: an ordinary read, not audited
            assert (await call("GET", "checkpoints", "tml-aaa"))[0] == 200
            # a model of A's: the admin reads its info, but cannot train it
            sid = (await call("POST", "create_session", "tml-aaa", {"tags": []}))[1]["session_id"]
            code, model = await call("POST", "create_model", "tml-aaa",
                                     {"session_id": sid, "model_seq_id": 0, "base_model": "tiny"})
            assert code == 200, model
            mid = model["model_id"]
            code, info = await call("POST", "get_info", "tml-ops", {"model_id": mid})
            assert code == 200 and info["model_id"] == mid
            assert (await call("POST", "get_info", "tml-bbb", {"model_id": mid}))[0] == 404
            step = {"model_id": mid, "seq_id": 1, "adam_params": {"learning_rate": 0.1}}
            assert (await call("POST", "optim_step", "tml-ops", step))[0] == 404

    with caplog.at_level(logging.INFO, logger="tgruntime.service.audit"):
        asyncio.run(main())
    got = [(x["principal"], x["action"], x["status"], x.get("admin"), x.get("owners"))
           for x in _audit(caplog)]
    assert got == [
        ("ops", "training_runs", 200, True, ["team-a"]),
        ("ops", "checkpoints", 200, True, ["team-a"]),
        ("ops", "training_runs/checkpoints", 200, True, ["team-a"]),
        ("ops", "weights_info", 200, True, ["team-a"]),
        ("team-b", "delete_checkpoint", 404, None, None),
        ("ops", "delete_checkpoint", 204, True, ["team-a"]),
        ("team-a", "create_session", 200, None, None),
        ("team-b", "finish", 404, None, None),
        ("ops", "finish", 200, True, ["team-a"]),
        ("team-a", "create_session", 200, None, None),
        ("team-a", "create_model", 200, None, None),
        ("ops", "get_info", 200, True, ["team-a"]),
        ("ops", "optim_step", 404, None, None),
    ]  # B's listing and get_info, the admin's refused heartbeat, A's own reads: not audited


def test_a_shared_checkpoint_is_readable_by_its_reader_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from aiohttp.test_utils import TestClient, TestServer

    from tgruntime.service.app import create_app

    dirs = _layout(tmp_path)
    s1, s2 = (f"tinker://{RUN_A}/sampler_weights/{n}" for n in ("s1", "s2"))
    one = f"training_runs/{RUN_A}/checkpoints/sampler_weights/s1"

    async def main(service: Any, *, before_restart: bool) -> None:
        async with TestClient(TestServer(create_app(service))) as http:

            async def call(method: str, route: str, key: str, body: Any = None) -> Any:
                r = await http.request(method, f"/api/v1/{route}", json=body,
                                       headers={"X-API-Key": key})
                return r.status, (await r.json() if r.status != 204 else None)

            sessions = {}
            for key in ("tml-bbb", "tml-ccc"):
                sessions[key] = (await call("POST", "create_session", key, {"tags": []}))[1][
                    "session_id"]

            async def sampler(key: str, path: str) -> tuple[int, Any]:
                body = {"session_id": sessions[key], "model_path": path}
                code, got = await call("POST", "create_sampling_session", key, body)
                return code, got

            if before_restart:
                assert (await sampler("tml-bbb", s1))[0] == 404  # not shared yet
                # only the owner (or an admin) shares, and only with a valid principal name
                assert (await call("PUT", f"{one}/readers/team-b", "tml-bbb"))[0] == 404
                code, bad = await call("PUT", f"{one}/readers/bad%20name", "tml-aaa")
                assert code == 400 and "principal 'bad name'" in bad["error"]
                code, own = await call("PUT", f"{one}/readers/team-a", "tml-aaa")
                assert code == 400 and "own checkpoint" in own["error"]
                code, shared = await call("PUT", f"{one}/readers/team-b", "tml-aaa")
                assert code == 200 and shared == {"tinker_path": s1, "readers": ["team-b"]}
            # B reads the shared path: a sampler over it, its weights_info
            code, made = await sampler("tml-bbb", s1)
            assert code == 200, made
            ss = service.registry.samplers[made["sampling_session_id"]]
            assert ss.weights == str(dirs["s1"]) and ss.owner == "team-b"
            assert (await call("POST", "weights_info", "tml-bbb", {"tinker_path": s1}))[0] == 200
            # ... and nothing else of A's: the unshared path, and C nothing at all
            assert (await sampler("tml-bbb", s2))[0] == 404
            assert (await sampler("tml-ccc", s1))[0] == 404
            # B may not delete, re-time, re-share or list the readers of what it reads
            for method, route, body in (
                ("DELETE", one, None),
                ("PUT", f"{one}/ttl", {"ttl_seconds": 3600}),
                ("PUT", f"{one}/readers/team-c", None),
                ("GET", f"{one}/readers", None),
            ):
                code, why = await call(method, route, "tml-bbb", body)
                assert code == 403 and "shared with you read-only" in why["error"], (route, why)
            assert dirs["s1"].is_dir()
            # C's delete of it: the 404 of a missing one
            assert (await call("DELETE", one, "tml-ccc"))[0] == 404
            if not before_restart:  # the owner revokes: B is back to a 404
                code, left = await call("DELETE", f"{one}/readers/team-b", "tml-aaa")
                assert code == 200 and left["readers"] == []
                assert (await sampler("tml-bbb", s1))[0] == 404
                assert (await call("GET", f"{one}/readers", "tml-aaa"))[1]["readers"] == []
                # and the sampler B made while it was shared samples no more
                code, gone = await call("POST", "asample", "tml-bbb", {
                    "sampling_session_id": made["sampling_session_id"], "num_samples": 1,
                    "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]},
                    "sampling_params": {"max_tokens": 1}})
                assert code == 404 and gone["error"] == f"no checkpoint at {s1}"

    with caplog.at_level(logging.INFO, logger="tgruntime.service.audit"):
        asyncio.run(main(_service(tmp_path), before_restart=True))
        asyncio.run(main(_service(tmp_path), before_restart=False))  # a new server: kept
    acts = [(x["principal"], x["action"], x["status"]) for x in _audit(caplog)
            if "share" in x["action"]]
    assert ("team-a", "share_checkpoint", 200) in acts
    assert ("team-a", "unshare_checkpoint", 200) in acts
    assert ("team-b", "share_checkpoint", 403) in acts


def test_grants_refuse_what_the_owner_could_not_name(tmp_path: Path) -> None:
    from tgruntime.service.paths import Paths
    from tgruntime.service.sharing import MAX_READERS, CheckpointAccess

    _layout(tmp_path)
    access = CheckpointAccess(paths=Paths(str(tmp_path)), policy=Policy())
    s1 = f"tinker://{RUN_A}/sampler_weights/s1"
    for n in range(MAX_READERS):
        access.grant(s1, "team-a", f"p{n}")
    with pytest.raises(ServiceError, match="already shared with 256"):
        access.grant(s1, "team-a", "one-more")
    with pytest.raises(ServiceError, match="no checkpoint") as info:
        access.locate(f"tinker://{RUN_A}/sampler_weights/nope", "p1")
    assert info.value.status == 404
    assert access.locate(s1, "p1").owner == "team-a"


def test_a_key_removed_from_a_secret_volume_stops_within_the_recheck(tmp_path: Path) -> None:
    """The kubelet's layout of a Secret volume (``..data`` -> a timestamped directory, one
    symlink per key) and its atomic update: the removed principal is refused on the first
    request after the recheck interval, the others go on."""
    import os
    import time

    from tgruntime.service.auth import KeyStore

    def publish(stamp: str, keys: dict[str, str]) -> None:
        d = tmp_path / f"..{stamp}"
        d.mkdir()
        for name, key in keys.items():
            (d / name).write_text(key)
        tmp = tmp_path / "..data_tmp"
        os.symlink(d.name, tmp)
        os.replace(tmp, tmp_path / "..data")  # the kubelet's atomic swap
        for name in keys:
            if not (tmp_path / name).is_symlink():
                os.symlink(f"..data/{name}", tmp_path / name)
        for link in tmp_path.iterdir():
            if not link.name.startswith(".") and link.name not in keys:
                link.unlink()  # a key gone from the Secret

    publish("2026_12_05_01", {"default": "tml-d", "team-a": "tml-aaa", "ops": "tml-ops"})
    store = KeyStore(keys_dir=str(tmp_path), recheck_s=0.3)
    assert store.resolve("tml-aaa") == ("team-a", None)
    publish("2026_12_05_02", {"default": "tml-d", "ops": "tml-ops"})
    t0 = time.monotonic()
    while store.resolve("tml-aaa")[0] is not None:
        assert time.monotonic() - t0 < 0.3 + 1.0, "the removed key still works"
        time.sleep(0.02)
    assert time.monotonic() - t0 <= 0.3 + 0.1
    who, why = store.resolve("tml-aaa")
    assert who is None and why is not None and "was it removed?" in why
    assert store.resolve("tml-ops") == ("ops", None)


def test_bad_admin_or_tls_flags_stop_the_server_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tgruntime.entrypoints.cli import main as tgctl
    from tgruntime.service.__main__ import main as server

    cert = tmp_path / "c.pem"
    cert.write_text("not a certificate")
    cases = [
        (["--tls-cert", str(cert)], "--tls-cert needs --tls-key"),
        (["--tls-cert", str(cert), "--tls-key", str(cert)], "cannot load them as a PEM"),
        (["--admin-principals", "ops,../x"], "'../x' is not a principal name"),
    ]
    for flags, want in cases:
        assert server(["--spec", "tg.yaml", *flags]) == 2
        assert want in capsys.readouterr().err
        assert tgctl(["serve", "-f", "tg.yaml", *flags]) == 2
        assert want in capsys.readouterr().err
