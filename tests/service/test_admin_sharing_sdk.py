"""Admin principals, sharing and key removal through the unmodified tinker SDK (issue 37): a
second Tinker server over the package's group with three principals (``ops`` the admin,
``team-a``, ``team-b``).

- A shares one sampler checkpoint and one state with B: B samples from the one (the same
  tokens as A, same seed) and starts a run from the other (the same loss as A's model), but
  gets the 404 of a missing checkpoint for A's unshared ones, and cannot delete what it reads.
- ``ops`` lists A's runs and checkpoints and deletes one, each act audited as admin.
- A's key, removed from the keys file, is refused within the recheck interval, and A's saved
  work stays listable, sampleable and loadable by ``ops``."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.service.test_sdk_flow import WAIT, _batch

pytestmark = [pytest.mark.ray, pytest.mark.megatron]

tinker = pytest.importorskip("tinker")
T = tinker.types
OPS, KA, KB = ("tml-" + uuid.uuid4().hex for _ in range(3))
RECHECK_S = 1.0
PROMPT = [5, 6, 7]


@pytest.fixture
def group(served: dict[str, Any], tmp_path: Path) -> Iterator[dict[str, Any]]:
    from tgruntime.service.__main__ import Running, build_service
    from tgruntime.service.auth import KeyStore
    from tgruntime.service.policy import Policy

    keys = tmp_path / "keys"
    keys.write_text(f"ops {OPS}\nteam-a {KA}\nteam-b {KB}\n")
    info = dataclasses.replace(served["info"], checkpoint_dir=str(tmp_path / "ckpt"))
    service = build_service(
        served["client"], info,
        KeyStore(keys_file=str(keys), recheck_s=RECHECK_S),
        policy=Policy(admins=frozenset({"ops"})),
    )
    running = Running(service, "127.0.0.1", 0).start()
    try:
        yield {**served, "url": running.url, "keys": keys, "service": service, "info": info}
    finally:
        running.stop()


def _sc(g: dict[str, Any], key: str) -> Any:
    return tinker.ServiceClient(base_url=g["url"], api_key=key)


def _rest(g: dict[str, Any], key: str) -> Any:
    return tinker.RestClient(base_url=g["url"], api_key=key)


def _share(g: dict[str, Any], path: str, reader: str, key: str = KA) -> dict[str, Any]:
    run, kind, name = path.removeprefix("tinker://").split("/")
    req = urllib.request.Request(
        f"{g['url']}/api/v1/training_runs/{run}/checkpoints/{kind}/{name}/readers/{reader}",
        method="PUT", headers={"X-API-Key": key},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        out: dict[str, Any] = json.loads(resp.read())
        return out


def _sample(sc: Any, path: str) -> list[int]:
    got = sc.create_sampling_client(model_path=path).result(timeout=WAIT).sample(
        T.ModelInput.from_ints(PROMPT), num_samples=1,
        sampling_params=T.SamplingParams(max_tokens=4, stop=[], seed=7),
    ).result(timeout=WAIT)
    return list(got.sequences[0].tokens)


def _loss(tc: Any) -> float:
    return float(tc.forward(_batch(3), "cross_entropy").result(timeout=WAIT).metrics["loss:sum"])


def _a_saves(g: dict[str, Any], tag: str) -> dict[str, Any]:
    """A trains one step and saves a state and two sampler checkpoints; its session ends."""
    with _sc(g, KA) as sc:
        tc = sc.create_lora_training_client(base_model=g["base"], rank=8).result()
        tc.forward_backward(_batch(0), "cross_entropy").result(timeout=WAIT)
        tc.optim_step(T.AdamParams(learning_rate=1e-2)).result(timeout=WAIT)
        out = {
            "run": tc.model_id,
            "w": tc.save_state(f"{tag}-w").result(timeout=WAIT).path,
            "w2": tc.save_state(f"{tag}-w2").result(timeout=WAIT).path,
            "s1": tc.save_weights_for_sampler(f"{tag}-s1").result(timeout=WAIT).path,
            "s2": tc.save_weights_for_sampler(f"{tag}-s2").result(timeout=WAIT).path,
            "loss": _loss(tc),
        }
        out["tokens"] = _sample(sc, out["s1"])
    return out


def _dir(g: dict[str, Any], owner: str, path: str) -> Path:
    run, kind, name = path.removeprefix("tinker://").split("/")
    return Path(g["info"].checkpoint_dir) / "tinker" / "principals" / owner / run / kind / name


def test_b_reads_what_a_shared_and_nothing_else(group: dict[str, Any]) -> None:
    a = _a_saves(group, "sh")
    assert _share(group, a["s1"], "team-b") == {"tinker_path": a["s1"], "readers": ["team-b"]}
    _share(group, a["w"], "team-b")
    with _sc(group, KB) as sc_b:
        assert _sample(sc_b, a["s1"]) == a["tokens"]  # A's weights, read by B
        with pytest.raises(tinker.NotFoundError, match="no checkpoint"):
            _sample(sc_b, a["s2"])  # not shared
        tc_b = sc_b.create_training_client_from_state(a["w"]).result()
        assert _loss(tc_b) == pytest.approx(a["loss"], rel=1e-6)  # A's state in B's run
        with pytest.raises(tinker.NotFoundError, match="no checkpoint"):
            sc_b.create_training_client_from_state(a["w2"]).result()
        # B's saves land in B's folder, never in A's path
        own = tc_b.save_state("b-w").result(timeout=WAIT).path
        assert own.startswith(f"tinker://{tc_b.model_id}/") and _dir(group, "team-b", own).is_dir()
        # B can neither delete nor re-time what it reads
        rest_b = _rest(group, KB)
        with pytest.raises(tinker.PermissionDeniedError, match="read-only"):
            rest_b.delete_checkpoint_from_tinker_path(a["s1"]).result()
        with pytest.raises(tinker.NotFoundError):
            rest_b.delete_checkpoint_from_tinker_path(a["s2"]).result()
        # B's listings stay B's own
        assert [c.tinker_path for c in rest_b.list_user_checkpoints().result().checkpoints] == [
            own]
    for key in ("s1", "s2", "w"):
        assert _dir(group, "team-a", a[key]).is_dir()


def test_admin_and_a_removed_key(
    group: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    a = _a_saves(group, "rm")
    rest_ops = _rest(group, OPS)
    runs = {r.training_run_id: r.model_owner
            for r in rest_ops.list_training_runs().result().training_runs}
    assert runs[a["run"]] == "team-a"
    assert [r.training_run_id for r in _rest(group, KB).list_training_runs().result()
            .training_runs] == []
    # A's key removed from the keys file: refused within the recheck interval
    assert _rest(group, KA).list_training_runs().result().training_runs
    group["keys"].write_text(f"ops {OPS}\nteam-b {KB}\n")
    t0 = time.monotonic()
    while True:
        try:
            _rest(group, KA).list_training_runs().result()
        except tinker.AuthenticationError as exc:
            assert "invalid API key" in str(exc)
            break
        assert time.monotonic() - t0 < RECHECK_S + 5, "the removed key still works"
        time.sleep(0.05)
    refused_after = time.monotonic() - t0
    assert refused_after <= RECHECK_S + 1.0
    # A's work stays readable by the admin: listed, sampled, loaded (as it was)
    with caplog.at_level(logging.INFO, logger="tgruntime.service.audit"):
        cps = {c.tinker_path for c in rest_ops.list_user_checkpoints().result().checkpoints}
        assert {a["w"], a["s1"], a["s2"]} <= cps
        with _sc(group, OPS) as sc_ops:
            assert _sample(sc_ops, a["s1"]) == a["tokens"]
            tc = sc_ops.create_training_client_from_state(a["w"]).result()
            assert _loss(tc) == pytest.approx(a["loss"], rel=1e-6)
        rest_ops.delete_checkpoint_from_tinker_path(a["s2"]).result()
        assert not _dir(group, "team-a", a["s2"]).exists()
    lines = [json.loads(r.getMessage()) for r in caplog.records
             if r.name == "tgruntime.service.audit" and r.getMessage().startswith("{")]
    admin = {(x["action"], x["status"]) for x in lines if x.get("admin")}
    assert {("checkpoints", 200), ("create_sampling_session", 200), ("load_weights", 200),
            ("delete_checkpoint", 204)} <= admin, admin
    assert all(x["owners"] == ["team-a"] for x in lines if x.get("admin"))
    print(f"\nremoved key refused after {refused_after:.2f} s (recheck every {RECHECK_S} s)")
