"""The gateway's pure parts (tgruntime.gateway.routing, groups, owners): which route each
request of the Tinker API takes, the ids learned from answers, the model id of a protobuf
body read from its first bytes, merged listings, the group list's errors. No server."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from tgruntime.gateway import routing
from tgruntime.gateway.groups import GroupsError, GroupSource, from_document, from_flags
from tgruntime.gateway.owners import Owners
from tgruntime.gateway.routing import How, Route, route

SID = "tg-" + "a" * 32
MID = f"{SID}:train:0"
RID = "0123456789ab-" + "f" * 32


@pytest.mark.parametrize(
    ("method", "path", "body", "want"),
    [
        ("GET", "/healthz", None, Route(how=How.LOCAL)),
        ("POST", "/api/v1/telemetry", {}, Route(how=How.LOCAL)),
        ("POST", "/api/v1/client/config", {}, Route(how=How.ANY)),
        ("POST", "/api/v1/create_session", {"tags": []}, Route(how=How.NEW_SESSION)),
        ("POST", "/api/v1/session_heartbeat", {"session_id": SID},
         Route(how=How.SESSION, key=SID)),
        ("POST", f"/api/v1/sessions/{SID}/finish", None, Route(how=How.SESSION, key=SID)),
        ("POST", "/api/v1/create_model", {"session_id": SID, "base_model": "org/a"},
         Route(how=How.BASE, key="org/a", session=SID)),
        ("POST", "/api/v1/get_info", {"model_id": MID}, Route(how=How.MODEL, key=MID)),
        ("POST", "/api/v1/optim_step", {"model_id": MID}, Route(how=How.MODEL, key=MID)),
        ("POST", "/api/v1/save_weights_for_sampler", {"model_id": MID},
         Route(how=How.MODEL, key=MID)),
        ("POST", "/api/v1/load_weights", {"model_id": MID, "path": "tinker://x/weights/a"},
         Route(how=How.MODEL, key=MID)),
        ("POST", "/api/v1/load_weights", {"session_id": SID, "path": "tinker://r/weights/a"},
         Route(how=How.PATH, key="tinker://r/weights/a", session=SID)),
        ("POST", "/api/v1/create_sampling_session",
         {"session_id": SID, "base_model": "org/b"}, Route(how=How.BASE, key="org/b",
                                                           session=SID)),
        ("POST", "/api/v1/create_sampling_session",
         {"session_id": SID, "model_path": "tinker://r/sampler_weights/s"},
         Route(how=How.PATH, key="tinker://r/sampler_weights/s", session=SID)),
        ("POST", "/api/v1/asample", {"sampling_session_id": "smp-1", "base_model": "x"},
         Route(how=How.SAMPLER, key="smp-1")),
        ("POST", "/api/v1/asample", {"base_model": "org/b"}, Route(how=How.BASE, key="org/b")),
        ("POST", "/api/v1/retrieve_future", {"request_id": RID}, Route(how=How.FUTURE, key=RID)),
        ("POST", "/api/v1/weights_info", {"tinker_path": "tinker://r/weights/a"},
         Route(how=How.PATH, key="tinker://r/weights/a")),
        ("POST", "/api/v1/copy_weights", {"source_path": "tinker://r/weights/a"},
         Route(how=How.PATH, key="tinker://r/weights/a")),
        ("GET", "/api/v1/get_server_capabilities", None,
         Route(how=How.ALL, merge="get_server_capabilities")),
        ("GET", "/api/v1/training_runs", None, Route(how=How.ALL, merge="training_runs")),
        ("GET", "/api/v1/checkpoints", None, Route(how=How.ALL, merge="checkpoints")),
        ("GET", "/api/v1/samplers/smp-9", None, Route(how=How.SAMPLER, key="smp-9")),
        ("GET", f"/api/v1/training_runs/{MID}", None, Route(how=How.MODEL, key=MID)),
        ("DELETE", "/api/v1/training_runs/r/checkpoints/weights/a", None,
         Route(how=How.PATH, key="tinker://r/weights/a")),
        ("PUT", "/api/v1/training_runs/r/checkpoints/sampler_weights/s/readers/bob", None,
         Route(how=How.PATH, key="tinker://r/sampler_weights/s")),
        ("HEAD", "/hf/Qwen/Qwen3-8B/resolve/main/tokenizer.json", None,
         Route(how=How.HUB, key="Qwen/Qwen3-8B")),
        ("GET", "/hf/api/models/Qwen/Qwen3-8B/revision/main", None,
         Route(how=How.HUB, key="Qwen/Qwen3-8B")),
    ],
)
def test_routes(method: str, path: str, body: dict[str, object] | None, want: Route) -> None:
    assert route(method=method, path=path, body=body) == want


def test_forward_backward_routes_by_the_protobuf_model_id() -> None:
    pb = pytest.importorskip("tinker.proto.tinker_public_pb2")
    msg = pb.ForwardBackwardRequest(model_id=MID, seq_id=3, loss_fn="cross_entropy")
    for _ in range(50):
        msg.data.add().model_input.add().encoded_text.tokens = b"\x01\x00\x00\x00" * 100
    raw = msg.SerializeToString()
    # a few bytes suffice (model_id is field 1, written first); fewer say "more, please"
    assert routing.proto_string(raw[:80], 1, final=False) == MID
    assert routing.proto_string(raw[:20], 1, final=False) is None
    assert route(method="POST", path="/api/v1/forward_backward", proto_model_id=MID) == Route(
        how=How.MODEL, key=MID
    )
    # a field after others is still found (they are skipped by wire type, not decoded)
    later = pb.ForwardBackwardRequest(seq_id=7, loss_fn="ppo", model_id="m:train:1")
    reordered = later.SerializeToString()
    assert routing.proto_string(reordered, 4, final=True) == "ppo"
    assert routing.proto_string(pb.ForwardBackwardRequest(seq_id=1).SerializeToString(), 1,
                                final=True) == ""
    with pytest.raises(ValueError, match="ends inside"):
        routing.proto_string(raw[:20], 1, final=True)


def test_signed_links_route_by_their_query_path() -> None:
    """service.signed's links carry no key: the gateway routes them by the tinker:// path in
    the query (to the run's learned owner)."""
    path = f"tinker://{MID}/weights/step-1"
    for where in ("/signed/archive", "/signed/file"):
        got = route(method="GET", path=where, query={"path": path, "signature": "x"})
        assert got == Route(how=How.SIGNED, key=path)
    assert route(method="GET", path="/signed/archive").key is None


def test_unknown_paths_are_not_routed() -> None:
    for method, path in [("GET", "/api/v1/nope"), ("POST", "/admin"), ("GET", "/hf/x"),
                         ("GET", "/api/v1/create_session")]:
        with pytest.raises(routing.NotRouted):
            route(method=method, path=path, body={})


def test_ids_learned_from_answers() -> None:
    answer = {"request_id": RID, "model_id": MID, "sampling_session_id": "smp-2",
              "path": "tinker://copy-1/weights/w"}
    assert set(routing.learned(answer)) == {
        ("boot", "0123456789ab"), ("model", MID), ("sampler", "smp-2"), ("model", "copy-1"),
    }
    listing = {"checkpoints": [{"tinker_path": "tinker://r2/weights/a", "training_run_id": "r2"}]}
    assert set(routing.learned(listing)) == {("model", "r2")}
    assert routing.boot_of("not-a-request-id") is None
    assert routing.run_of("tinker://m:train:0/weights/a") == "m:train:0"
    assert routing.run_of("s3://x") is None
    assert routing.session_of(MID) == SID


def test_merged_capabilities_and_listings() -> None:
    caps = routing.merge_capabilities([
        {"supported_models": [{"model_name": "org/a"}], "vocab_size": 128},
        {"supported_models": [{"model_name": "org/b"}, {"model_name": "org/a"}]},
    ])
    assert [m["model_name"] for m in caps["supported_models"]] == ["org/a", "org/b"]
    assert caps["vocab_size"] == 128 and len(caps["groups"]) == 2
    cps = routing.merge_listing(
        [{"checkpoints": [{"time": "2026-01-02"}, {"time": "2026-01-04"}]},
         {"checkpoints": [{"time": "2026-01-03"}]}],
        name="checkpoints", offset=1, limit=1,
    )
    assert cps == {"checkpoints": [{"time": "2026-01-03"}],
                   "cursor": {"offset": 1, "limit": 1, "total_count": 3}}
    runs = routing.merge_listing(
        [{"training_runs": [{"training_run_id": "b"}]},
         {"training_runs": [{"training_run_id": "a"}]}],
        name="training_runs", offset=0, limit=None,
    )
    assert [r["training_run_id"] for r in runs["training_runs"]] == ["a", "b"]


def test_group_lists_and_their_errors(tmp_path: Path) -> None:
    gs = from_flags(["http://127.0.0.1:8001", "teacher=http://127.0.0.1:8002/"])
    assert [(g.name, g.url) for g in gs] == [
        ("group-0", "http://127.0.0.1:8001"), ("teacher", "http://127.0.0.1:8002")]
    with pytest.raises(GroupsError, match="not a group's base URL"):
        from_flags(["127.0.0.1:8001"])
    with pytest.raises(GroupsError, match="unique"):
        from_flags(["a=http://h:1", "a=http://h:2"])
    with pytest.raises(GroupsError, match=r"groups\[0\].models"):
        from_document({"groups": [{"name": "a", "url": "http://h:1", "models": "org/a"}]}, "f")
    path = tmp_path / "groups.json"
    path.write_text(json.dumps({"groups": [{"name": "a", "url": "http://h:1",
                                            "models": ["org/a"]}]}))
    src = GroupSource(path=str(path), recheck_s=0.0)
    assert [g.models for g in src.groups()] == [("org/a",)]
    path.write_text("{broken")
    import os

    os.utime(path, (1, 1))
    assert [g.name for g in src.groups()] == ["a"] and src.error  # the last good list stays


def test_owners_are_bounded_and_forget_a_group() -> None:
    o = Owners(max_ids=2)
    o.learn("model", "m1", "a")
    o.learn("model", "m2", "b")
    o.owner("model", "m1")  # used: kept
    o.learn("sampler", "s", "a")
    assert o.owner("model", "m2") is None and o.owner("model", "m1") == "a"
    o.forget_group("a")
    assert o.owner("model", "m1") is None and o.owner("sampler", "s") is None


def test_a_group_server_takes_the_gateways_session_id() -> None:
    from tgruntime.service.sessions import Registry, ServiceError

    reg = Registry()
    s = reg.new_session([], None, "alice", session_id=SID)
    assert s.session_id == SID
    assert reg.new_session(["again"], None, "alice", session_id=SID) is s  # after a restart
    with pytest.raises(ServiceError) as taken:
        reg.new_session([], None, "bob", session_id=SID)
    assert taken.value.status == 409
    for bad in ("tg-xyz", "../etc", SID.upper(), "tg-" + "a" * 33):
        with pytest.raises(ServiceError, match="not a session id"):
            reg.new_session([], None, "alice", session_id=bad)
    reg.finish(SID, "alice")
    with pytest.raises(ServiceError):  # a finished session's id is not reopened
        reg.new_session([], None, "alice", session_id=SID)


def test_trainergroup_listing_keeps_the_last_good_list() -> None:
    import threading

    from tgruntime.gateway.discover import TrainerGroupSource

    listings: list[object] = [
        [{"metadata": {"name": "g", "namespace": "ml"}, "spec": {"model": {"name": "org/g"}},
          "status": {"apiURL": "http://g-tinker.ml.svc:8000"}}],
        RuntimeError("Forbidden"),
    ]
    seen = threading.Event()

    class Listed(TrainerGroupSource):
        def _list(self) -> list[Mapping[str, Any]]:
            got = listings.pop(0) if listings else None
            if not listings:
                seen.set()
            if isinstance(got, Exception):
                raise got
            return got if isinstance(got, list) else []

    src = Listed(namespace="ml", every_s=0.01)
    assert src.groups() == () and src.error  # not listed yet
    src.start()
    assert seen.wait(10)
    import time

    deadline = time.monotonic() + 10
    while "Forbidden" not in (src.error or "") and time.monotonic() < deadline:
        time.sleep(0.01)
    src.stop()
    assert [(g.name, g.models) for g in src.groups()] == [("g", ("org/g", "g"))]
    assert src.error is not None and "Forbidden" in src.error


def test_tgctl_gateway_flags() -> None:
    from tgruntime.entrypoints.cli import build_parser
    from tgruntime.gateway.__main__ import source_from_args

    args = build_parser().parse_args(["gateway", "--group", "a=http://127.0.0.1:1", "--port", "0"])
    assert [g.name for g in source_from_args(args).groups()] == ["a"]
    for argv in (["gateway"], ["gateway", "--group", "http://h:1", "--config", "f.json"]):
        with pytest.raises(GroupsError, match="one way"):
            source_from_args(build_parser().parse_args(argv))


def test_an_https_groups_own_ca_from_flags_documents_and_trainergroups(tmp_path: Path) -> None:
    """Issue 38: the CA an https:// group's server is verified against: ``--ca-file`` for
    ``--group``s, ``ca``/``caFile`` in a document, ``spec.api.tls.caBundle`` of a TrainerGroup;
    the upstream trusts that CA alone for that group (one context per CA) and the system's roots
    for the others."""
    import ssl

    from tests.service.pki import make_pki
    from tgruntime.entrypoints.cli import build_parser
    from tgruntime.gateway.__main__ import source_from_args
    from tgruntime.gateway.discover import groups_from_trainergroups
    from tgruntime.gateway.upstream import Upstream

    pki = make_pki(tmp_path / "pki")
    pem = pki["ca"].read_text()
    gs = from_flags(["a=https://h:1", "b=http://h:2"], ca=pem)
    assert [g.ca for g in gs] == [pem, ""]  # plain HTTP needs none
    doc = {"groups": [{"name": "a", "url": "https://h:1", "ca": pem},
                      {"name": "b", "url": "https://h:2", "caFile": str(pki["ca"])},
                      {"name": "c", "url": "https://h:3"}]}
    assert [g.ca for g in from_document(doc, "f")] == [pem, pem, ""]
    for bad, needle in (
        ({"ca": "hello"}, r"groups\[0\].ca: not a PEM certificate"),
        ({"ca": pem.replace("M", "A", 40)}, r"groups\[0\].ca: the CA certificates do not load"),
        ({"caFile": str(tmp_path / "nope")}, r"groups\[0\].caFile: .*nope: cannot read it"),
        ({"ca": pem, "caFile": "x"}, "not both"),
    ):
        with pytest.raises(GroupsError, match=needle):
            from_document({"groups": [{"name": "a", "url": "https://h:1", **bad}]}, "f")
    # tgctl gateway --ca-file: for --group servers only
    args = build_parser().parse_args(
        ["gateway", "--group", "a=https://h:1", "--ca-file", str(pki["ca"])])
    assert [g.ca for g in source_from_args(args).groups()] == [pem]
    with pytest.raises(GroupsError, match="--ca-file verifies --group servers"):
        source_from_args(build_parser().parse_args(
            ["gateway", "--config", "f.json", "--ca-file", str(pki["ca"])]))
    # a TrainerGroup's spec.api.tls.caBundle, on https:// only
    listing = [
        {"metadata": {"name": n, "namespace": "ml"},
         "spec": {"api": {"tls": {"secretName": "s", "caBundle": pem}}},
         "status": {"apiURL": f"{scheme}://{n}-tinker.ml.svc:8000"}}
        for n, scheme in (("x", "https"), ("y", "http"))
    ]
    assert [(g.name, g.ca) for g in groups_from_trainergroups(listing, cluster=False)] == [
        ("x", pem), ("y", "")]
    up = Upstream(timeout_s=1, connect_timeout_s=1)
    a, b, c = from_document(doc, "f")
    ctx = up.tls(a)
    assert isinstance(ctx, ssl.SSLContext) and up.tls(b) is ctx  # one context per CA
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    assert len(ctx.get_ca_certs()) == 1  # that CA alone, not the system's roots beside it
    assert up.tls(c) is True and up.tls(gs[1]) is True  # aiohttp's default verification
