"""Stop strings (cut at the decoded stop text, tokens and logprobs together) and a server
restart on the same group and checkpoint dir (re-attach by name, saved weights readable,
an old future fails with a retryable error)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import numpy as np
import pytest

from tests.service.test_sdk_flow import WAIT, _batch, _sc

pytestmark = [pytest.mark.ray, pytest.mark.megatron]

tinker = pytest.importorskip("tinker")
T = tinker.types


def _tok(served: dict[str, Any]) -> Any:
    from tgruntime.service.stops import load_tokenizer

    return load_tokenizer(served["info"].tokenizer_id)


def _first_hit(tok: Any, tokens: list[int], s: str) -> int | None:
    for n in range(1, len(tokens) + 1):
        if s in tok.decode(tokens[:n], skip_special_tokens=False):
            return n
    return None


def test_stop_strings_cut_tokens_and_logprobs(served: dict[str, Any]) -> None:
    tok = _tok(served)
    prompt = T.ModelInput.from_ints([5, 6, 7, 8])
    free = T.SamplingParams(max_tokens=24, temperature=1.0, seed=3, stop=[])
    with _sc(served) as sc:
        tc = sc.create_lora_training_client(base_model=served["base"], rank=4).result()
        sampler = tc.save_weights_and_get_sampling_client().result(timeout=WAIT)
        full = sampler.sample(prompt, num_samples=1, sampling_params=free).result(timeout=WAIT)
        toks = list(full.sequences[0].tokens)
        lps = list(full.sequences[0].logprobs)
        # a word the text completes first at token k (>= 3), exactly encodable: the sampler
        # is told its token id too
        word, k = None, None
        for i in range(2, len(toks) - 1):
            w = tok.decode([toks[i]], skip_special_tokens=False)
            if w.strip() and not w.startswith("<") and _first_hit(tok, toks, w) == i + 1:
                word, k = w, i + 1
                break
        assert word is not None and k is not None, tok.decode(toks)
        for stop in (word, [word, "no-such-stop-text"]):
            p = T.SamplingParams(max_tokens=24, temperature=1.0, seed=3, stop=stop)
            r = sampler.sample(prompt, num_samples=1, sampling_params=p).result(timeout=WAIT)
            seq = r.sequences[0]
            assert seq.stop_reason == "stop"
            assert list(seq.tokens) == toks[:k], (stop, seq.tokens, toks)
            assert len(seq.logprobs) == len(seq.tokens)
            np.testing.assert_allclose(seq.logprobs, lps[:k], atol=1e-4)
            assert tok.decode(list(seq.tokens)).endswith(word)
        # a stop string that is no token's text (a word's tail): only the decode rule sees it
        tail = next(
            (tok.decode([t]).lstrip()[1:] for t in toks if len(tok.decode([t]).strip()) >= 3),
            None,
        )
        if tail:
            want = _first_hit(tok, toks, tail)
            p = T.SamplingParams(max_tokens=24, temperature=1.0, seed=3, stop=[tail])
            seq = sampler.sample(prompt, num_samples=1, sampling_params=p).result(
                timeout=WAIT).sequences[0]
            assert want is not None and list(seq.tokens) == toks[:want]
            assert seq.stop_reason == "stop" and len(seq.logprobs) == want
        # a stop string never produced: the whole sequence, stop_reason length
        p = T.SamplingParams(max_tokens=24, temperature=1.0, seed=3, stop="zzz-never")
        seq = sampler.sample(prompt, num_samples=1, sampling_params=p).result(
            timeout=WAIT).sequences[0]
        assert list(seq.tokens) == toks and seq.stop_reason == "length"


def _post(url: str, key: str, route: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        f"{url}/api/v1/{route}", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "X-API-Key": key},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        out: dict[str, Any] = json.loads(resp.read() or b"{}")
        return out


def _copies(served: dict[str, Any]) -> list[str]:
    """The in-memory sampler copies (save_weights_and_get_sampling_client's) the group holds."""
    info = served["client"].sampler_weights_info().result(timeout=WAIT)
    return [n for n in info["names"] if "/ephemeral/" in n]


def test_restart_reattaches_weights_readable_old_future_fails(served: dict[str, Any]) -> None:
    """A second server on the group is started, used, stopped with a sample in flight, and a
    fresh one (a new TrainerClient attached by name, new futures) takes over. In-memory sampler
    copies: a graceful stop frees its own, a new server frees those a killed one left."""
    from tgruntime import TrainerClient
    from tgruntime.service.__main__ import serve
    from tgruntime.service.auth import KeyStore

    group = served["client"].group

    def start() -> Any:
        client = TrainerClient.connect_local(
            group_name=group.group_name, ray_namespace=group.ray_namespace
        )
        keys = KeyStore(keys_file=str(served["keys_file"]), recheck_s=0.0)
        return serve(client, served["info"], keys, host="127.0.0.1", port=0)

    prompt = T.ModelInput.from_ints([5, 6, 7, 8])
    params = T.SamplingParams(max_tokens=8, temperature=1.0, seed=5, stop=[])
    data = _batch(4)
    first = start()
    try:
        sc = tinker.ServiceClient(base_url=first.url, api_key=served["key"])
        tc = sc.create_lora_training_client(base_model=served["base"], rank=4).result()
        tc.forward_backward(data, "cross_entropy").result(timeout=WAIT)
        tc.optim_step(T.AdamParams(learning_rate=5e-3)).result(timeout=WAIT)
        spath = tc.save_weights_for_sampler("restart").result(timeout=WAIT).path
        state = tc.save_state("restart").result(timeout=WAIT).path
        want = sc.create_sampling_client(model_path=spath).result(timeout=WAIT).sample(
            prompt, num_samples=1, sampling_params=params).result(timeout=WAIT)
        loss = tc.forward(data, "cross_entropy").result(timeout=WAIT).metrics["loss:sum"]
        tc.save_weights_and_get_sampling_client().result(timeout=WAIT)  # an in-memory copy
        mine = f"{tc.model_id}/ephemeral/"
        assert any(n.startswith(mine) for n in _copies(served)), _copies(served)
        # a future in flight at the crash: a long sample, asked for over raw HTTP
        pending = _post(first.url, served["key"], "asample", {
            "model_path": spath, "num_samples": 4,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7, 8]}]},
            "sampling_params": {"max_tokens": 120, "temperature": 1.0, "stop": []},
        })
        rid = pending["request_id"]
        sc.__exit__(None, None, None)  # end the session (the new server has no run lock)
    finally:
        first.stop()
    # a graceful stop frees the copies that server made
    assert not any(n.startswith(mine) for n in _copies(served)), _copies(served)
    # a server killed outright leaves its copies in the workers: its successor frees them
    crashed = "killed-server-model/ephemeral/0"
    served["client"].save_sampler_weights(crashed, None).result(timeout=WAIT)
    assert crashed in _copies(served)
    second = start()
    assert _copies(served) == [], _copies(served)
    try:
        with tinker.ServiceClient(base_url=second.url, api_key=served["key"]) as sc2:
            # the old future: 410 (gone, retryable) at once, not a hang
            with pytest.raises(urllib.error.HTTPError) as gone:
                _post(second.url, served["key"], "retrieve_future", {"request_id": rid})
            out = json.loads(gone.value.read())
            assert gone.value.code == 410, out
            assert out.get("category") == "server" and "restarted" in out["error"], out
            # the saved sampler weights, through the new server
            got = sc2.create_sampling_client(model_path=spath).result(timeout=WAIT).sample(
                prompt, num_samples=1, sampling_params=params).result(timeout=WAIT)
            assert list(got.sequences[0].tokens) == list(want.sequences[0].tokens)
            np.testing.assert_allclose(
                got.sequences[0].logprobs, want.sequences[0].logprobs, atol=1e-4)
            # the saved state, through the new server
            tc2 = sc2.create_training_client_from_state(state).result(timeout=WAIT)
            again = tc2.forward(data, "cross_entropy").result(timeout=WAIT).metrics["loss:sum"]
            assert abs(again - loss) < 1e-4 * max(1.0, abs(loss)), (again, loss)
            # the checkpoints on disk are listed by the new server
            cps = sc2.create_rest_client().list_checkpoints(tc.model_id).result(timeout=WAIT)
            assert {c.tinker_path for c in cps.checkpoints} >= {spath, state}
    finally:
        second.stop()
