"""Models by their Hugging Face names, the tokenizer served to an offline client, EOS stopping
for ``stop=None`` and lost futures answering 410 (issue 38), without a group: the server over a
fake group whose sampler emits a fixed token stream and halts at the stop sequences it is given
(as the real one does), driven by the unmodified SDK 0.38 and, where the cookbook venv is built,
by tinker-cookbook 0.5.8's own tokenizer and renderer helpers. The tokenizer is one the test
builds (word level, with Qwen3's chat special tokens), served under ``Qwen/Qwen3-8B``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.service.fake_service import fake_service
from tests.service.test_checkpoint_lifecycle import A, _DiskClient, _Done
from tests.service.test_cookbook import COOKBOOK_PY

NAME = "Qwen/Qwen3-8B"  # a name in cookbook 0.5.8's model_info table (it lacks Qwen3-0.6B)
STREAM = [10, 11, 12, 1, 13, 14, 15, 16, 17, 18, 19, 20]
"""What the fake sampler emits (id 1 is the tokenizer's ``<eos>``; ids 4-8 its specials)."""
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>"]


class _Sampler(_DiskClient):
    """``sample``: STREAM, cut after the first stop sequence it meets (the worker's rule)."""

    def __init__(self) -> None:
        super().__init__()
        self.stops: list[Any] = []

    def sample(self, prompts: list[list[int]], **p: Any) -> _Done:
        self.stops.append(p["stop"])
        out = []
        for _ in prompts:
            toks, reason = list(STREAM[: p["max_tokens"]]), "length"
            for i in range(len(toks)):
                if any(toks[max(0, i + 1 - len(s)) : i + 1] == list(s) for s in p["stop"] or []):
                    toks, reason = toks[: i + 1], "stop"
                    break
            seq = {"tokens": toks, "logprobs": [-1.0] * len(toks), "stop_reason": reason}
            out.append({"sequences": [seq] * p["num_samples"], "prompt_logprobs": None})
        return _Done(out)


def build_named_tokenizer(path: Path) -> Path:
    """A word-level tokenizer (``<eos>`` = 1) with Qwen3's chat special tokens, and a
    generation_config.json listing two EOS ids (1 and ``<|im_end|>``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(
        vocab_size=120, special_tokens=["<unk>", "<eos>", "<bos>", "<pad>", *SPECIALS]
    )
    tk.train_from_iterator(["user assistant system the a of is and to in 1 2 3 + = ?"], trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tk, unk_token="<unk>", eos_token="<eos>", bos_token="<bos>",
        pad_token="<pad>", additional_special_tokens=SPECIALS,
    )
    fast.save_pretrained(str(path))
    im_end = fast.convert_tokens_to_ids("<|im_end|>")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, im_end]}))
    return path


def _service(root: Path, tok: Path) -> Any:
    root.mkdir(parents=True, exist_ok=True)
    (root / "keys").write_text(f"team-a {A}\n")
    wire = {"model": {"maxSequenceLength": 128, "name": NAME},
            "training": {"sequenceLength": 128}}
    return fake_service(client=_Sampler(), wire=wire, root=root, keys_file=root / "keys",
                        tokenizer=str(tok))


@pytest.fixture(scope="module")
def named(tmp_path_factory: pytest.TempPathFactory) -> Any:
    pytest.importorskip("tinker")
    from tgruntime.service.__main__ import Running

    root = tmp_path_factory.mktemp("named")
    tok = build_named_tokenizer(root / "tokenizer")
    running = Running(_service(root / "ckpt", tok), "127.0.0.1", 0).start(60)
    try:
        yield running, tok
    finally:
        running.stop()


def _get(url: str, headers: dict[str, str]) -> tuple[int, bytes, Any]:
    req = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read(), r.headers
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), exc.headers


def test_spec_model_name_is_validated() -> None:
    import tgapi

    spec = tgapi.parse_spec({"model": {"name": NAME}}, local=True)
    assert spec.model.name == NAME
    for bad in ("Qwen3-0.6B", "Qwen/Qwen3/x", "/abs/path", "org/"):
        with pytest.raises(tgapi.SpecErrors, match=r"spec\.model\.name"):
            tgapi.parse_spec({"model": {"name": bad}}, local=True)


def test_group_info_names_aliases_and_eos(named: Any) -> None:
    running, tok = named
    info = running.service.info
    assert info.base_model == NAME and "tiny" in info.aliases
    assert info.accepts(NAME) and info.accepts("tiny") and not info.accepts("Qwen/Other")
    assert info.tokenizer_name == NAME  # get_info's tokenizer_id
    from transformers import AutoTokenizer

    im_end = AutoTokenizer.from_pretrained(str(tok)).convert_tokens_to_ids("<|im_end|>")
    assert info.eos_token_ids == (1, im_end)  # the tokenizer's, then generation_config's


def test_sdk_by_name_alias_capabilities_and_eos_stop(named: Any) -> None:
    import tinker
    from tinker import types as T

    running, _ = named
    with tinker.ServiceClient(base_url=running.url, api_key=A) as sc:
        rest = tinker.RestClient(base_url=running.url, api_key=A)
        caps = rest.get_server_capabilities().result(timeout=60)
        assert [m.model_name for m in caps.supported_models] == [NAME]
        tc = sc.create_lora_training_client(base_model=NAME, rank=4).result()
        info = tc.get_info()
        assert info.model_data.model_name == NAME and info.model_data.tokenizer_id == NAME
        with pytest.raises(Exception, match="not served here"):
            sc.create_sampling_client(base_model="Qwen/Qwen3-32B").result()
        sampler = sc.create_sampling_client(base_model="tiny").result()  # group name: an alias
        prompt = T.ModelInput.from_ints([5, 6])
        got = sampler.sample(prompt, 1, T.SamplingParams(max_tokens=10)).result(timeout=60)
        seq = got.sequences[0]
        assert list(seq.tokens) == STREAM[:4] and seq.stop_reason == "stop"  # ends at <eos>
        free = sampler.sample(prompt, 1, T.SamplingParams(max_tokens=10, stop=[])).result(60)
        assert list(free.sequences[0].tokens) == STREAM[:10]
        assert free.sequences[0].stop_reason == "length"
        assert running.service.backend.client.stops[0] == [[1], [info_eos(running)]]


def info_eos(running: Any) -> int:
    return int(running.service.info.eos_token_ids[1])


def test_hub_endpoint_errors_and_key(named: Any) -> None:
    running, _ = named
    base = f"{running.url}/hf"
    ok = {"Authorization": f"Bearer {A}"}
    code, body, h = _get(f"{base}/{NAME}/resolve/main/tokenizer.json", ok)
    assert code == 200 and json.loads(body)["model"]["type"] == "WordLevel"
    assert len(h["X-Repo-Commit"]) == 40
    code, _, h = _get(f"{base}/{NAME}/resolve/main/model.safetensors", ok)
    assert code == 404 and h["X-Error-Code"] == "EntryNotFound"
    code, _, h = _get(f"{base}/Qwen/Qwen3-32B/resolve/main/tokenizer.json", ok)
    assert code == 404 and h["X-Error-Code"] == "RepoNotFound"
    code, _, h = _get(f"{base}/{NAME}/resolve/v9/tokenizer.json", ok)
    assert code == 404 and h["X-Error-Code"] == "RevisionNotFound"
    code, body, _ = _get(f"{base}/{NAME}/resolve/main/tokenizer.json", {})
    assert code == 401 and b"HF_TOKEN" in body
    code, body, _ = _get(f"{base}/api/models/{NAME}", {"X-API-Key": A})
    files = {s["rfilename"] for s in json.loads(body)["siblings"]}
    assert code == 200 and "tokenizer.json" in files and "model.safetensors" not in files


SDK_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import tinker
    url, key, name, local = sys.argv[1:5]
    from transformers import AutoTokenizer
    want = AutoTokenizer.from_pretrained(local)
    text = "the user is 1 + 2 = 3 <|im_end|>"
    with tinker.ServiceClient(base_url=url, api_key=key) as sc:
        tc = sc.create_lora_training_client(base_model=name, rank=4).result()
        tok = tc.get_tokenizer()
        assert tok.encode(text) == want.encode(text), (tok.encode(text), want.encode(text))
        stok = sc.create_sampling_client(base_model=name).result().get_tokenizer()
        assert stok.encode(text) == want.encode(text)
    print(json.dumps({"ok": True, "ids": tok.encode(text)}))
    """
)

COOKBOOK_SCRIPT = textwrap.dedent(
    """
    import json, sys
    url, key, name, local = sys.argv[1:5]
    from transformers import AutoTokenizer
    from tinker_cookbook import model_info, renderers
    from tinker_cookbook.tokenizer_utils import get_tokenizer
    tok = get_tokenizer(name)
    want = AutoTokenizer.from_pretrained(local)
    assert tok.encode("the user is") == want.encode("the user is")
    rname = model_info.get_recommended_renderer_name(name)
    renderer = renderers.get_renderer(rname, tok)
    prompt = renderer.build_generation_prompt([{"role": "user", "content": "1 + 2 = ?"}])
    text = tok.decode(prompt.to_ints())
    print(json.dumps({"renderer": rname, "text": text,
                      "stops": [str(s) for s in renderer.get_stop_sequences()]}))
    """
)


def _offline_env(running: Any, tmp: Path) -> dict[str, str]:
    """No hub: HF_ENDPOINT is this server, the key is HF_TOKEN, an empty HF cache."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env.pop("PYTHONPATH", None)
    env.update(HF_ENDPOINT=f"{running.url}/hf", HF_TOKEN=A, HF_HOME=str(tmp / "hf"),
               HF_HUB_DISABLE_TELEMETRY="1", TINKER_API_KEY=A, TINKER_TELEMETRY="0",
               NO_PROXY="127.0.0.1,localhost", HTTPS_PROXY="http://127.0.0.1:9")
    return env


def test_sdk_get_tokenizer_offline_by_name(named: Any, tmp_path: Path) -> None:
    running, tok = named
    proc = subprocess.run(
        [sys.executable, "-c", SDK_SCRIPT, running.url, A, NAME, str(tok)],
        env=_offline_env(running, tmp_path), capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout.splitlines()[-1])["ok"]


def test_cookbook_tokenizer_and_renderer_resolve_from_the_name(
    named: Any, tmp_path: Path
) -> None:
    if not COOKBOOK_PY.exists():
        pytest.skip(f"no cookbook venv at {COOKBOOK_PY}: build it with hack/cookbook-venv.sh")
    running, tok = named
    proc = subprocess.run(
        [str(COOKBOOK_PY), "-c", COOKBOOK_SCRIPT, running.url, A, NAME, str(tok)],
        env=_offline_env(running, tmp_path), capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["renderer"] == "qwen3"
    words = out["text"].split()  # a word-level tokenizer decodes with spaces between tokens
    assert words[:2] == ["<|im_start|>", "user"] and words[-2:] == ["<|im_start|>", "assistant"]


def test_lost_future_is_410_and_the_sdk_retries_a_sample(named: Any) -> None:
    """A future the server no longer holds (as after a restart): raw HTTP sees 410 (well-formed
    id) or 404 (any other shape); the SDK's sampling client re-sends the sample by itself."""
    import tinker
    from tinker import types as T

    running, _ = named
    store = running.service.futures

    def post(rid: str) -> tuple[int, dict[str, Any]]:
        req = urllib.request.Request(
            f"{running.url}/api/v1/retrieve_future", data=json.dumps({"request_id": rid}).encode(),
            headers={"X-API-Key": A, "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    code, out = post("0123456789ab-" + "f" * 32)
    assert code == 410 and out["category"] == "server" and "restarted" in out["error"]
    assert post("not-an-id")[0] == 404
    real_new, lost = store.new, list[str]()

    def new_then_lose(owner: str = "default") -> str:  # the first sample's future is lost
        rid: str = real_new(owner)
        if not lost:
            lost.append(rid)
            store._entries.pop(rid)
            store._queued[owner] -= 1
        return rid

    store.new = new_then_lose
    try:
        with tinker.ServiceClient(base_url=running.url, api_key=A) as sc:
            sampler = sc.create_sampling_client(base_model=NAME).result()
            lost.clear()
            got = sampler.sample(T.ModelInput.from_ints([5]), 1,
                                 T.SamplingParams(max_tokens=3, stop=[])).result(timeout=120)
            assert list(got.sequences[0].tokens) == STREAM[:3] and len(lost) == 1
    finally:
        store.new = real_new


def test_concurrent_first_stop_string_samples_all_get_the_tokenizer(
    named: Any, tmp_path: Path
) -> None:
    """Issue 38's math_rl bug: its first rollouts sample concurrently with the role_colon
    renderer's stop string; all but the first were refused ("this server has none") while the
    first loaded the tokenizer. The load is now one, behind a lock, done at start-up."""
    import asyncio

    import tinker
    from tinker import types as T

    running, tok = named
    fresh = _service(tmp_path / "fresh", tok)  # not prepared: the first uses race the load

    async def race() -> list[Any]:
        return list(await asyncio.gather(*(fresh._stop(["\n\nUser:"]) for _ in range(8))))

    got = asyncio.run(race())
    assert all(g == got[0] for g in got) and got[0][1] == ("\n\nUser:",)

    async def rollouts() -> list[Any]:  # the SDK calls math_rl's rollouts make, at once
        with tinker.ServiceClient(base_url=running.url, api_key=A) as sc:
            sampler = await sc.create_sampling_client(base_model=NAME)
            p = T.SamplingParams(max_tokens=8, temperature=1.0, stop=["\n\nUser:"])
            prompt = T.ModelInput.from_ints([10, 11])
            return list(await asyncio.gather(
                *(sampler.sample(prompt, num_samples=1, sampling_params=p)
                  for _ in range(8))
            ))

    for r in asyncio.run(rollouts()):  # every one answered: it ends at <eos> (stop ids too)
        assert list(r.sequences[0].tokens) == STREAM[:4] and r.sequences[0].stop_reason == "stop"
