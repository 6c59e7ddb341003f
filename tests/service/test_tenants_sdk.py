"""Two principals on one LoRA group (issue 37): principal B, through the unmodified tinker
SDK and raw HTTP, tries every endpoint that names an object of principal A. Each attempt is
answered exactly like a missing object (the same 404 and message), changes nothing, and A's
run afterwards follows, bit for bit, the curve of a run nobody touched."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.fixtures_ray import RayCluster
from tests.service.conftest import MODEL, serving
from tests.service.test_bad_inputs import _post, _wire
from tests.service.test_lora_sdk import WAIT, _steps, _until_no_runs

pytestmark = [pytest.mark.ray, pytest.mark.megatron]

tinker = pytest.importorskip("tinker")
T = tinker.types
KEY_A = "tml-a-" + uuid.uuid4().hex
KEY_B = "tml-b-" + uuid.uuid4().hex


@pytest.fixture(scope="module")
def tenants(
    service_driver: RayCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    import tgapi
    from tests.trainer.scenarios import tiny_spec

    root = tmp_path_factory.mktemp("tinker-tenants")
    wire = tgapi.to_wire(tiny_spec(tp=2, checkpoint_dir=str(root / "ckpt"), **MODEL))  # type: ignore[arg-type]
    wire["lora"] = {"rank": 32, "alpha": 16}
    wire["api"] = {**wire.get("api", {}), "maxRuns": 3}
    spec = tgapi.parse_spec(wire, local=True)
    with serving(spec, root, prefix="svc-ten") as s:
        # the keys file is re-read on change: two named principals beside the default key
        s["keys_file"].write_text(f"{s['key']}\nteam-a {KEY_A}\nteam-b {KEY_B}\n")
        yield s


def _sc(served: dict[str, Any], key: str) -> Any:
    return tinker.ServiceClient(base_url=served["url"], api_key=key)


def _get(served: dict[str, Any], route: str, key: str) -> tuple[int, dict[str, Any]]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"{served['url']}/api/v1/{route}", headers={"X-API-Key": key})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def _like_missing(
    served: dict[str, Any], route: str, body: dict[str, Any] | bytes, real: str, fake: str,
    *, ctype: str = "application/json",
) -> None:
    """B's request naming A's object ``real`` answers exactly as the same request naming the
    missing ``fake``: 404 and the same message (with the id swapped)."""

    def send(ident: str) -> tuple[int, dict[str, Any]]:
        if isinstance(body, bytes):
            data = body.replace(real.encode(), ident.encode())
        else:
            data = json.dumps(body).replace(real, ident).encode()
        if route.startswith("GET "):
            return _get(served, route[4:].replace(real, ident), KEY_B)
        return _post(served, route.replace(real, ident), data, key=KEY_B, ctype=ctype)

    code, got = send(real)
    code_missing, missing = send(fake)
    assert code == code_missing == 404, (route, code, got, code_missing, missing)
    assert json.dumps(got).replace(real, "ID") == json.dumps(missing).replace(fake, "ID"), (
        route, got, missing,
    )


def _snapshot(served: dict[str, Any]) -> dict[str, Any]:
    service = served["service"]
    files = sorted(
        (str(p.relative_to(served["root"])), p.stat().st_size, p.stat().st_mtime_ns)
        for p in (served["root"] / "ckpt").rglob("*")
        if p.is_file()
    )
    return {
        "sessions": {k: s.finished for k, s in service.registry.sessions.items()},
        "models": {k: m.retired for k, m in service.registry.models.items()},
        "samplers": sorted(service.registry.samplers),
        "runs": {k: (r.steps, r.rank) for k, r in service.lora.runs.items()},
        "files": files,
    }


def test_b_can_touch_nothing_of_a(tenants: dict[str, Any]) -> None:
    from tinker.proto import tinker_public_pb2 as pb

    base = tenants["base"]
    with _sc(tenants, KEY_A) as sc_a:
        tc = sc_a.create_lora_training_client(base_model=base, rank=8, seed=1).result()
        first = _steps(tc, [0])
        weights = tc.save_state("a1").result(timeout=WAIT).path
        sampler_path = tc.save_weights_for_sampler("s1").result(timeout=WAIT).path
        sampler = tc.save_weights_and_get_sampling_client().result(timeout=WAIT)
        sid_a, model_a = sc_a.holder.get_session_id(), tc.model_id
        sampler_a = sampler._sampling_session_id
        # a request id of A's: a sample from its path
        code, sampled = _post(tenants, "asample", json.dumps({
            "model_path": sampler_path, "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
            "sampling_params": {"max_tokens": 2, "stop": []},
        }).encode(), key=KEY_A)
        assert code == 200, sampled
        rid = sampled["request_id"]
        import urllib.error
        import urllib.request

        req = urllib.request.Request(
            f"{tenants['url']}/api/v1/retrieve_future",
            data=json.dumps({"request_id": rid}).encode(),
            headers={"X-API-Key": KEY_A, "Content-Type": "application/json"},
        )
        for _ in range(10):  # 408 while pending (30 s long polls)
            try:
                with urllib.request.urlopen(req, timeout=120) as resp:  # A's own: protobuf
                    assert resp.status == 200 and "protobuf" in resp.headers["Content-Type"]
                    break
            except urllib.error.HTTPError as exc:
                assert exc.code == 408, exc
        else:
            raise AssertionError(f"A's sample {rid} never finished")

        # the ids are unguessable: 128 random bits each
        assert len(sid_a.removeprefix("tg-")) == 32 and len(rid.split("-")[-1]) == 32
        assert model_a == f"{sid_a}:train:0"

        before = _snapshot(tenants)
        fake_sid = "tg-" + uuid.uuid4().hex
        fake_model = f"{fake_sid}:train:0"
        # sessions: heartbeat and finish
        _like_missing(tenants, "session_heartbeat", {"session_id": sid_a}, sid_a, fake_sid)
        _like_missing(tenants, f"sessions/{sid_a}/finish", b"{}", sid_a, fake_sid)
        # models: get_info, forward, forward_backward, optim_step, save, load
        _like_missing(tenants, "get_info", {"model_id": model_a}, model_a, fake_model)
        for forward_only in (True, False):
            msg = pb.ForwardBackwardRequest(model_id=model_a, seq_id=99, loss_fn="cross_entropy",
                                            forward_only=forward_only)
            _like_missing(tenants, "forward_backward", msg.SerializeToString(), model_a,
                          fake_model, ctype="application/x-protobuf")
        _like_missing(tenants, "optim_step", {"model_id": model_a, "seq_id": 99,
                                              "adam_params": {"learning_rate": 1.0}},
                      model_a, fake_model)
        _like_missing(tenants, "save_weights", {"model_id": model_a, "path": "stolen"},
                      model_a, fake_model)
        _like_missing(tenants, "save_weights_for_sampler",
                      {"model_id": model_a, "path": "stolen"}, model_a, fake_model)
        _like_missing(tenants, "load_weights", {"model_id": model_a, "path": weights},
                      model_a, fake_model)
        # futures: A's request id
        fake_rid = rid[: -32] + uuid.uuid4().hex
        code, theirs = _post(tenants, "retrieve_future", json.dumps({"request_id": rid}).encode(),
                             key=KEY_B)
        code2, missing = _post(tenants, "retrieve_future",
                               json.dumps({"request_id": fake_rid}).encode(), key=KEY_B)
        assert code == code2 == 410 and theirs["category"] == missing["category"] == "server"
        assert theirs["error"].replace(rid, "ID") == missing["error"].replace(fake_rid, "ID")
        # listings
        run_a = model_a
        _like_missing(tenants, f"GET training_runs/{run_a}", b"", run_a, fake_model)
        _like_missing(tenants, f"GET training_runs/{run_a}/checkpoints", b"", run_a, fake_model)
        _like_missing(tenants, f"GET samplers/{sampler_a}", b"", sampler_a,
                      "smp-" + uuid.uuid4().hex)

        with _sc(tenants, KEY_B) as sc_b:
            sid_b = sc_b.holder.get_session_id()
            # sampling: a sampler over A's path, a sample from it, A's sampler
            fake_path = sampler_path.replace(model_a, fake_model)
            body = {"session_id": sid_b, "model_path": sampler_path}
            _like_missing(tenants, "create_sampling_session", body, sampler_path, fake_path)
            prompt = {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]}
            for params in ({"max_tokens": 2, "stop": []}, {"max_tokens": 1}):  # + logprobs
                body = {"model_path": sampler_path, "num_samples": 1, "prompt": prompt,
                        "sampling_params": params, "prompt_logprobs": "max_tokens" in params}
                _like_missing(tenants, "asample", body, sampler_path, fake_path)
                body = {"sampling_session_id": sampler_a, "num_samples": 1, "prompt": prompt,
                        "sampling_params": params}
                _like_missing(tenants, "asample", body, sampler_a, "smp-" + uuid.uuid4().hex)
            # a new run of B's own from A's state (the SDK's create_training_client_from_state)
            for with_optimizer in (False, True):
                with pytest.raises(tinker.NotFoundError, match="no checkpoint"):
                    if with_optimizer:
                        sc_b.create_training_client_from_state_with_optimizer(weights).result()
                    else:
                        sc_b.create_training_client_from_state(weights).result()
            with pytest.raises(tinker.NotFoundError):
                sc_b.create_sampling_client(model_path=sampler_path).sample(
                    T.ModelInput.from_ints([5, 6, 7]), num_samples=1,
                    sampling_params=T.SamplingParams(max_tokens=1),
                ).result(timeout=WAIT)
            # B's own run: its listings show it and nothing of A's
            tc_b = sc_b.create_lora_training_client(base_model=base, rank=4).result()
            b_path = tc_b.save_state("b1").result(timeout=WAIT).path
            rest_b = sc_b.create_rest_client()
            runs_b = [r.training_run_id for r in rest_b.list_training_runs().result().training_runs]
            assert runs_b == [tc_b.model_id]
            cps_b = [c.tinker_path for c in rest_b.list_user_checkpoints().result().checkpoints]
            assert cps_b == [b_path]
            with pytest.raises(tinker.NotFoundError):
                rest_b.list_checkpoints(model_a).result()
            # and A's listing shows nothing of B's
            rest_a = sc_a.create_rest_client()
            runs_a = [r.training_run_id for r in rest_a.list_training_runs().result().training_runs]
            assert runs_a == [model_a]
            cps_a = {c.tinker_path for c in rest_a.list_user_checkpoints().result().checkpoints}
            assert cps_a == {weights, sampler_path}
            # on disk: one folder per principal
            ckpt = tenants["root"] / "ckpt" / "tinker" / "principals"
            assert (ckpt / "team-a" / model_a / "weights" / "a1").is_dir()
            assert (ckpt / "team-b" / tc_b.model_id / "weights" / "b1").is_dir()
        _until_no_runs_of(tenants, tc_b.model_id)

        after = _snapshot(tenants)  # what A had is as it was; B's own work came beside it
        for part in ("sessions", "models", "runs"):
            assert {k: after[part].get(k) for k in before[part]} == before[part], part
        assert set(before["samplers"]) <= set(after["samplers"])
        b_files = [f for f in after["files"] if "/team-b/" in f[0]]
        assert before["sessions"][sid_a] is False and after["sessions"][sid_a] is False
        assert after["models"][model_a] is None  # A's run: not retired, not finished
        assert [f for f in after["files"] if f not in b_files] == before["files"]
        assert not list((tenants["root"] / "ckpt").rglob("stolen"))
        # A's run goes on as if B never existed
        second = _steps(tc, [1])
        r = sampler.sample(T.ModelInput.from_ints([5, 6, 7]), num_samples=1,
                           sampling_params=T.SamplingParams(max_tokens=2, stop=[])).result(
            timeout=WAIT)
        assert len(r.sequences[0].tokens) == 2
    _until_no_runs(tenants)
    with _sc(tenants, KEY_A) as sc_ref:  # the same run, untouched
        ref = sc_ref.create_lora_training_client(base_model=base, rank=8, seed=1).result()
        assert _steps(ref, [0, 1]) == first + second


def _until_no_runs_of(served: dict[str, Any], run_id: str, timeout_s: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while run_id in served["service"].lora.runs:
        assert time.monotonic() < deadline, f"run {run_id} left after its session"
        time.sleep(0.2)


def test_the_default_key_is_a_principal_of_its_own(tenants: dict[str, Any]) -> None:
    """The generated key (principal ``default``) sees nothing of team-a's either."""
    code, runs = _get(tenants, "training_runs", tenants["key"])
    assert code == 200
    code_a, runs_a = _get(tenants, "training_runs", KEY_A)
    assert code_a == 200
    ids = {r["training_run_id"] for r in runs["training_runs"]}
    ids_a = {r["training_run_id"] for r in runs_a["training_runs"]}
    assert ids_a and not ids & ids_a
    code, cps = _get(tenants, "checkpoints", tenants["key"])
    assert code == 200 and cps["checkpoints"] == []
    code, _ = _post(tenants, "create_session", _wire(
        T.CreateSessionRequest(tags=[], user_metadata=None, sdk_version="0.38.0")),
        key="tml-nobody")
    assert code == 401
