"""The gateway over two Tinker servers on fake groups (no Ray: tests/service/fake_service.py,
saves write real files) serving ``org/a`` and ``org/b``, and a third group that is down,
driven by the unmodified SDK and raw HTTP: health, an unknown endpoint and base model, a
session opened on the groups that answer, checkpoints listed from every group, a restarted
gateway that finds a path it never saw, a 503 (not a wrong 404) while a group that may hold
an unseen id is down, and a streamed non-JSON answer (the hub's tokenizer file)."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.service.conftest import build_tokenizer, gateway_over
from tests.service.fake_service import fake_service
from tests.service.test_checkpoint_lifecycle import _DiskClient

tinker = pytest.importorskip("tinker")
KEY = "tml-gateway-routes"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def routed(tmp_path: Path) -> Iterator[dict[str, Any]]:
    keys = tmp_path / "keys"
    keys.write_text(f"alice {KEY}\n")
    tok = build_tokenizer(tmp_path / "tok", vocab=32)

    def make(name: str) -> Any:
        wire = {"model": {"maxSequenceLength": 128, "name": f"org/{name}"},
                "training": {"sequenceLength": 128}}
        return fake_service(client=_DiskClient(), wire=wire, root=tmp_path / name,
                            keys_file=keys, tokenizer=str(tok))

    down = f"down=http://127.0.0.1:{_closed_port()}"
    with gateway_over(make, ("a", "b"), extra=[down], timeout_s=20) as state:
        yield state


def _call(url: str, path: str, *, body: Any = None, method: str | None = None,
          key: str = KEY) -> tuple[int, Any, dict[str, str]]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method, headers={
        "X-API-Key": key, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            raw, headers, status = resp.read(), dict(resp.headers), resp.status
    except urllib.error.HTTPError as err:
        raw, headers, status = err.read(), dict(err.headers), err.code
    is_json = "json" in headers.get("Content-Type", "")
    return status, json.loads(raw) if is_json else raw, headers


def test_routes_over_fake_groups(routed: dict[str, Any]) -> None:
    gw, servers = routed["gw"], routed["servers"]
    status, health, _ = _call(gw.url, "/healthz")
    assert status == 200 and [g["name"] for g in health["groups"]] == ["a", "b", "down"]
    assert _call(gw.url, "/api/v1/nope", body={})[0] == 404
    status, err, _ = _call(gw.url, "/api/v1/create_model",
                           body={"session_id": "tg-" + "1" * 32, "base_model": "org/zzz"})
    assert status == 404 and "served: ['org/a', 'org/b']" in err["error"]

    sc = tinker.ServiceClient(base_url=gw.url, api_key=KEY)  # a session on a and b; down skipped
    tc = sc.create_lora_training_client("org/b", rank=4).result()
    path = tc.save_state("s1").result().path
    sid = tc.model_id.split(":train:")[0]
    assert all(sid in r.service.registry.sessions for r in servers.values())
    assert tc.model_id in servers["b"].service.registry.models
    rc = tinker.RestClient(base_url=gw.url, api_key=KEY)
    (cp,) = rc.list_user_checkpoints().result().checkpoints
    assert cp.tinker_path == path

    # the hub's tokenizer file, streamed back untouched, routed by the org/model of its path
    status, raw, _ = _call(gw.url, "/hf/org/b/resolve/main/tokenizer.json")
    assert status == 200 and raw == (Path(servers["b"].service.info.tokenizer_id)
                                     / "tokenizer.json").read_bytes()

    gw.stop()  # restarted: nothing learned; the path is found by asking every group
    routed["gw"] = gw = routed["start"](gw.port)
    info = rc.get_weights_info_by_tinker_path(path).result()
    assert info.base_model == "org/b"
    # an id no group that answered holds, while a group is down: 503 (retry), not 404
    unseen = path.replace(tc.model_id, f"{sid}:train:77")
    status, err, _ = _call(gw.url, "/api/v1/weights_info", body={"tinker_path": unseen})
    assert status == 503 and "'down'" in err["error"]
    rc.delete_checkpoint_from_tinker_path(path).result()
    assert rc.list_user_checkpoints().result().checkpoints == []
