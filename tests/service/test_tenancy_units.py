"""Principals without a group (issue 37): keys -> principals, the policy, owned stores,
unguessable ids, the strict tinker:// parser and registry expiry."""

from __future__ import annotations

import asyncio
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from tgruntime.service.auth import DEFAULT, KeyStore
from tgruntime.service.futures import FutureStore, Outcome
from tgruntime.service.paths import Paths, parse_uri
from tgruntime.service.policy import Policy
from tgruntime.service.sessions import Model, Registry, SamplingSession, ServiceError

HEX32 = re.compile(r"[0-9a-f]{32}$")


# -- keys -> principals ------------------------------------------------------------------
def test_keys_file_names_principals_and_bare_keys_are_default(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("# team keys\nteam-a tml-a\nteam-b tml-b\ntml-bare\nbad/name tml-x\n")
    store = KeyStore(keys_file=str(f), keys=["tml-env"], recheck_s=0.0)
    assert store.resolve("tml-a") == ("team-a", None)
    assert store.resolve("tml-b") == ("team-b", None)
    assert store.resolve("tml-bare") == (DEFAULT, None)
    assert store.resolve("tml-env") == (DEFAULT, None)
    who, why = store.resolve("tml-x")  # an invalid principal name: the line is ignored
    assert who is None and "invalid" in (why or "")
    assert store.resolve(None)[0] is None and store.check("tml-a") is None
    f.write_text("team-a tml-a2\n")  # re-read: the old key stops working
    assert store.resolve("tml-a")[0] is None and store.resolve("tml-a2")[0] == "team-a"
    assert store.principals() == {"team-a", DEFAULT}


def test_keys_dir_entry_name_is_the_principal(tmp_path: Path) -> None:
    d = tmp_path / "secret"
    d.mkdir()
    (d / "default").write_text("tml-gen\n")  # the operator's generated key
    (d / "team-a").write_text("tml-a")
    (d / ".hidden").write_text("tml-h")
    store = KeyStore(keys_dir=str(d), recheck_s=0.0)
    assert store.resolve("tml-gen") == (DEFAULT, None)
    assert store.resolve("tml-a") == ("team-a", None)
    assert store.resolve("tml-h")[0] is None


def test_a_key_given_to_two_principals_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("team-a tml-same\nteam-b tml-same\nteam-c tml-c\n")
    store = KeyStore(keys_file=str(f), recheck_s=0.0)
    assert store.resolve("tml-same")[0] is None
    assert store.resolve("tml-c")[0] == "team-c"


# -- the policy (fakes) ------------------------------------------------------------------
@dataclass
class Thing:
    owner: str


def test_policy_answers_another_principals_object_like_a_missing_one() -> None:
    policy = Policy()
    mine, theirs = Thing("a"), Thing("b")

    def missing() -> Exception:
        return ServiceError("unknown thing", status=404)

    assert policy.get("a", mine, missing) is mine
    errors = []
    for obj in (theirs, None):
        with pytest.raises(ServiceError) as info:
            policy.get("a", obj, missing)
        errors.append((str(info.value), info.value.status))
    assert errors[0] == errors[1] == ("unknown thing", 404)
    assert policy.visible("a", [mine, theirs, Thing("a")]) == [mine, Thing("a")]
    assert policy.may_see("b", "b") and not policy.may_see("b", "a")


# -- owned stores --------------------------------------------------------------------------
def test_registry_lookups_check_the_owner_and_ids_are_random() -> None:
    reg = Registry()
    a = reg.new_session([], None, "a")
    b = reg.new_session([], None, "b")
    assert a.session_id.startswith("tg-") and HEX32.search(a.session_id)
    reg.add_model(Model("run-1", a.session_id, "m", None, owner="a"))
    reg.samplers["smp-1"] = SamplingSession("smp-1", a.session_id, None, None, "m", owner="a")
    calls = (
        lambda: reg.session(a.session_id, "b"),
        lambda: reg.finish(a.session_id, "b"),
        lambda: reg.model("run-1", "b"),
        lambda: reg.sampler("smp-1", "b"),
    )
    for call in calls:
        with pytest.raises(ServiceError) as info:
            call()
        assert info.value.status == 404
    assert not a.finished and reg.model("run-1", "a").owner == "a"
    with pytest.raises(ServiceError, match="unknown session") as same:
        reg.session("tg-nope", "b")
    with pytest.raises(ServiceError) as other:
        reg.session(a.session_id, "b")
    assert str(same.value).replace("'tg-nope'", "X") == str(other.value).replace(
        repr(a.session_id), "X"
    )
    assert reg.owned_model("run-1", "b") is None and reg.session(b.session_id, "b") is b


def test_futures_of_another_principal_are_unknown_ids() -> None:
    async def run() -> None:
        store = FutureStore()
        rid = store.new("a")
        assert HEX32.search(rid) and rid.startswith(store.boot + "-")
        assert store.new("a") != rid
        store.resolve(rid, Outcome(body={"secret": 1}))
        errors = []
        for other in (rid, f"{store.boot}-{'0' * 32}"):  # theirs, and one never made
            try:
                await store.wait(other, 0.01, "b")
            except ServiceError as exc:
                errors.append((str(exc).replace(other, "X"), exc.status, exc.category))
        assert len(errors) == 2 and errors[0] == errors[1] and errors[0][1] == 410, errors
        mine = await store.wait(rid, 0.01, "a")
        assert mine is not None and mine.body == {"secret": 1}

    asyncio.run(run())


def test_registry_expires_what_no_live_session_holds() -> None:
    reg = Registry(session_ttl_s=0.0, forget_s=0.0)  # every session ended at once
    s = reg.new_session([], None, "a")
    t = reg.new_session([], None, "a")
    reg.models["run-1"] = Model("run-1", s.session_id, "m", None, owner="a")
    reg.models["run-2"] = Model("run-2", t.session_id, "m", None, owner="a")
    reg.samplers["smp-1"] = SamplingSession("smp-1", s.session_id, None, None, "m", owner="a")
    reg.expire(held={"run-2"})  # first seen ended: forgotten after forget_s (0 here)
    gone = reg.expire(held={"run-2"})
    assert s.session_id in gone or s.session_id not in reg.sessions
    assert "run-1" not in reg.models and "smp-1" not in reg.samplers
    assert "run-2" in reg.models and t.session_id in reg.sessions  # the workers hold it
    reg.expire()
    reg.expire()
    assert not reg.models and not reg.sessions
    live = Registry(forget_s=0.0)
    u = live.new_session([], None, "a")
    live.expire()
    live.expire()
    assert u.session_id in live.sessions  # alive: kept


# -- the strict tinker:// parser ---------------------------------------------------------------
@pytest.mark.parametrize(
    "uri",
    [
        "tinker://../weights/x",
        "tinker://run-1/weights/..",
        "tinker://run-1/weights/.hidden",
        "tinker://./weights/x",
        "tinker:///etc/weights/x",
        "tinker://run-1/weights/a/b",
        "tinker://run-1/weights/a%2Fb",
        "tinker://run-1%2F..%2Fx/weights/a",
        "tinker://run-1/weights/a\\b",
        "tinker://run-1/weights/",
        "tinker://run-1/weights/a b",
        "tinker://run-1/other/a",
        "tinker://run-1/weights",
        "file:///etc/passwd",
        "/abs/run-1/weights/a",
        "tinker://" + "x" * 200 + "/weights/a",
    ],
)
def test_malformed_and_traversal_paths_are_refused(uri: str) -> None:
    with pytest.raises(ServiceError) as info:
        parse_uri(uri)
    assert info.value.status == 400


def test_good_paths_parse() -> None:
    assert parse_uri("tinker://run-ab12/weights/step-3") == ("run-ab12", "weights", "step-3")
    assert parse_uri("tinker://tg-1:train:0/sampler_weights/s.v1") == (
        "tg-1:train:0", "sampler_weights", "s.v1",
    )


def test_paths_stay_in_the_principals_folder(tmp_path: Path) -> None:
    p = Paths(str(tmp_path))
    a = p.directory("team-a", "run-1", "weights", "w")
    a.mkdir(parents=True)
    assert p.parse("tinker://run-1/weights/w", "team-a")[3] == a
    with pytest.raises(ServiceError, match="no checkpoint") as other:  # B's own folder: none
        p.parse("tinker://run-1/weights/w", "team-b")
    assert other.value.status == 404
    assert p.listing("team-b") == [] and p.runs("team-b") == []
    assert [c["tinker_path"] for c in p.listing("team-a")] == ["tinker://run-1/weights/w"]
    # a symlink in B's folder pointing at A's checkpoint (or out of the root) is refused
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    b_run = p.folder("team-b") / "run-9" / "weights"
    b_run.mkdir(parents=True)
    os.symlink(a, b_run / "to-a")
    os.symlink(outside, b_run / "out")
    for name in ("to-a", "out"):
        with pytest.raises(ServiceError) as info:
            p.parse(f"tinker://run-9/weights/{name}", "team-b")
        assert info.value.status == 404
        with pytest.raises(ServiceError, match="leaves"):
            p.directory("team-b", "run-9", "weights", name)
    assert p.listing("team-b") == []
    os.symlink(outside, p.folder("team-b") / "run-out")  # a whole run dir pointing out
    assert "run-out" not in p.runs("team-b")


def test_saves_from_before_principals_are_the_default_principals(tmp_path: Path) -> None:
    p = Paths(str(tmp_path))
    old = tmp_path / "tinker" / "tg-1:train:0" / "weights" / "w"
    old.mkdir(parents=True)
    assert p.parse("tinker://tg-1:train:0/weights/w")[3] == old
    assert [c["training_run_id"] for c in p.listing(DEFAULT)] == ["tg-1:train:0"]
    with pytest.raises(ServiceError, match="no checkpoint"):
        p.parse("tinker://tg-1:train:0/weights/w", "team-a")
    assert p.listing("team-a") == []
    with pytest.raises(ServiceError):
        p.parse("tinker://principals/weights/w")  # the folder of principals is no run


# -- through HTTP, without a group: principals at the door, the audit log -----------------------
def test_principals_over_http_and_one_audit_line_per_mutating_request(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import json
    import logging

    from aiohttp.test_utils import TestClient, TestServer

    import tgapi
    from tgruntime.service.__main__ import group_info
    from tgruntime.service.app import TinkerService, create_app
    from tgruntime.service.backend import Backend

    keys = tmp_path / "keys"
    keys.write_text("team-a tml-aaa\nteam-b tml-bbb\n")
    info = group_info("tiny", tgapi.parse_spec({}, local=True), checkpoint_dir=str(tmp_path))
    service = TinkerService(
        Backend(client=None, info=info),  # type: ignore[arg-type]
        KeyStore(keys_file=str(keys), recheck_s=0.0),
    )

    async def main() -> None:
        async with TestClient(TestServer(create_app(service))) as http:

            async def post(route: str, body: dict[str, object], key: str) -> tuple[int, dict]:  # type: ignore[type-arg]
                r = await http.post(f"/api/v1/{route}", json=body, headers={"X-API-Key": key})
                return r.status, await r.json()

            code, made = await post("create_session", {"tags": []}, "tml-aaa")
            assert code == 200
            sid = made["session_id"]
            assert service.registry.sessions[sid].owner == "team-a"
            assert (await post("session_heartbeat", {"session_id": sid}, "tml-bbb"))[0] == 404
            assert (await post(f"sessions/{sid}/finish", {}, "tml-bbb"))[0] == 404
            assert not service.registry.sessions[sid].finished
            assert (await post("session_heartbeat", {"session_id": sid}, "tml-aaa"))[0] == 200
            assert (await post("create_session", {}, "tml-nope"))[0] == 401
            code, _ = await post("sessions/" + sid + "/finish", {}, "tml-aaa")
            assert code == 200 and service.registry.sessions[sid].finished
            r = await http.get("/api/v1/training_runs", headers={"X-API-Key": "tml-bbb"})
            assert r.status == 200 and (await r.json())["training_runs"] == []

    with caplog.at_level(logging.INFO, logger="tgruntime.service.audit"):
        asyncio.run(main())
    lines = [json.loads(r.getMessage()) for r in caplog.records
             if r.name == "tgruntime.service.audit"]
    got = [(x["principal"], x["action"], x["status"], x["outcome"]) for x in lines]
    assert got == [
        ("team-a", "create_session", 200, "ok"),
        ("team-b", "finish", 404, "refused"),
        (None, "create_session", 401, "refused"),
        ("team-a", "finish", 200, "ok"),
    ]  # heartbeats and reads are not audited
    assert lines[0]["result"]["session_id"] == lines[1]["object"]["session_id"]
    text = caplog.text
    assert "tml-aaa" not in text and "tml-bbb" not in text and "tml-nope" not in text


def test_tgctl_serve_takes_a_keys_file() -> None:
    from tgruntime.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve", "-f", "tg.yaml", "--keys-file", "keys"])
    assert args.keys_file == "keys"
    assert build_parser().parse_args(["serve", "-f", "tg.yaml"]).keys_file is None
