"""tinker-cookbook 0.5.8's ``math_rl`` recipe (env arithmetic, its default importance_sampling
loss, the role_colon renderer), unmodified, through ``tgctl up`` + ``tgctl serve`` on a local
group whose ``spec.model.pretrained`` directory holds a tiny Llama and its tokenizer, exactly
as issue 38 reported it: every sample carries the renderer's stop string, and every one was
refused with 400 "stop strings need the base model's tokenizer, and this server has none"
(the first rollouts sample concurrently, and all but the first arrived while the first was
loading the tokenizer). Only ``base_url``, ``model_name`` and the size knobs are set.

Learning is asserted on the part of the env's reward a tiny model can learn in a CPU minute:
the format reward (a clean end with the stop string: 0, else -0.1; no sum comes out right).
A random model almost never ends cleanly within ``max_tokens``, so every reward is -0.1 and a
group has no signal; the test's base model is first taught to emit the stop token at about 12%
of positions (``teach_stop_rate``: a base model that sometimes ends cleanly, as a real one
does), and the recipe's RL must raise that. Measured (2026-12-06, 10 steps of 8 groups x 8
rollouts, lr 1e-2): rewards -0.053, -0.014, -0.016, -0.005, -0.003, then 0.0 (every rollout
ends cleanly). Every step's rollouts are sampled with the stop string and scored, none is
refused. Skipped where the cookbook venv is not built (hack/cookbook-venv.sh; math_rl needs
its pylatexenc)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures_ray import REPO_ROOT, RayCluster
from tests.flow.test_local_flow import write_spec
from tests.service.conftest import build_tokenizer
from tests.service.test_cookbook import COOKBOOK_PY

pytestmark = [pytest.mark.ray, pytest.mark.megatron, pytest.mark.flow]

STEPS = int(os.environ.get("TG_MATH_RL_STEPS", "6"))
LR = float(os.environ.get("TG_MATH_RL_LR", "1e-2"))
STOP_RATE = float(os.environ.get("TG_MATH_RL_STOP_RATE", "0.12"))
GROUP, GROUPS = 8, 8
RECIPE = textwrap.dedent(
    """
    import asyncio, sys
    from tinker_cookbook.recipes.math_rl.train import CLIConfig, cli_main
    url, model, log, steps, lr, group, groups = sys.argv[1:8]
    cfg = CLIConfig(
        model_name=model, base_url=url, log_path=log, renderer_name="role_colon",
        env="arithmetic", lora_rank=4, group_size=int(group), groups_per_batch=int(groups),
        max_tokens=5, learning_rate=float(lr), max_steps=int(steps), eval_every=0,
        save_every=0, behavior_if_log_dir_exists="delete",
    )
    asyncio.run(cli_main(cfg))
    """
)


def tiny_llama(path: Path, spec_model: dict[str, Any]) -> Path:
    """A tiny LlamaForCausalLM initialised by transformers (nothing downloaded) and the test's
    word-level tokenizer, as ``spec.model.pretrained`` takes them."""
    import torch
    import transformers

    import tgapi
    from tgruntime.trainer.hf_weights import LlamaShape

    wire = {"model": spec_model, "training": {"sequenceLength": 32}}
    model = tgapi.parse_spec(wire, local=True).model
    shape = LlamaShape.from_model_spec(model, position_embedding="rope")
    config = transformers.LlamaConfig.from_dict(shape.hf_config(dtype=torch.float32))
    torch.manual_seed(5)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    build_tokenizer(path, vocab=spec_model["vocabSize"] - 1)
    # role_colon's stop string as one token, so that a sample can end with it (a word-level
    # tokenizer decodes with spaces, never "\n\n")
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    tok.add_tokens([transformers.AddedToken("\n\nUser:", normalized=False, special=False)])
    assert len(tok) <= spec_model["vocabSize"], len(tok)
    tok.save_pretrained(str(path))
    return path


def teach_stop_rate(path: Path, *, rate: float, steps: int = 80) -> None:
    """Train the saved model so that it emits role_colon's stop token at about ``rate`` of its
    positions, whatever came before (cross-entropy on random sequences with that token at
    that rate), and save it again: the arithmetic env's format reward (a clean end with the
    stop string: 0, else -0.1) then varies within a group of rollouts, which is the signal RL
    follows. A random model almost never ends cleanly within ``max_tokens`` (rewards all
    -0.1: no signal)."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    stop = int(tok.convert_tokens_to_ids("\n\nUser:"))  # type: ignore[arg-type]
    model = transformers.LlamaForCausalLM.from_pretrained(str(path))
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        ids = torch.randint(4, vocab, (16, 32), generator=g)
        ids = torch.where(torch.rand(ids.shape, generator=g) < rate, stop, ids)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(str(path))


def test_math_rl_unmodified_through_tgctl_serve(ray_cluster: RayCluster, tmp_path: Path) -> None:
    if not COOKBOOK_PY.exists():
        pytest.skip(f"no cookbook venv at {COOKBOOK_PY}: build it with hack/cookbook-venv.sh")
    shape = {"vocabSize": 128, "hiddenSize": 64, "numLayers": 2, "numAttentionHeads": 4,
             "ffnHiddenSize": 128, "maxSequenceLength": 128, "positionEmbedding": "rope"}
    pretrained = tiny_llama(tmp_path / "tiny-llama", shape)
    teach_stop_rate(pretrained, rate=STOP_RATE)
    overrides: dict[str, Any] = {
        "model.pretrained": str(pretrained), "model.positionEmbedding": "rope",
        "model.maxSequenceLength": 128, "training.checkpointDir": str(tmp_path / "ckpt"),
    }
    path, _ = write_spec(tmp_path, **overrides)
    env = ray_cluster.env({"XDG_CACHE_HOME": str(tmp_path / "cache")})
    cli = [sys.executable, "-m", "tgruntime.entrypoints.cli"]
    addr = ["--address", ray_cluster.gcs_address]
    up = subprocess.run([*cli, "up", "-f", str(path), *addr], cwd=REPO_ROOT, env=env,
                        capture_output=True, text=True, timeout=600)
    assert up.returncode == 0, up.stderr[-4000:]
    serve = subprocess.Popen(
        [*cli, "serve", "-f", str(path), "--port", "0", "--json", *addr], cwd=REPO_ROOT,
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert serve.stdout is not None
        line = serve.stdout.readline()  # the JSON document once it serves
        assert line, serve.stderr.read()[-4000:] if serve.stderr else "tgctl serve exited"
        out = json.loads(line)
        assert out["baseModel"] == str(pretrained)
        assert 1 in out["eosTokenIds"]  # <eos>, read from the tokenizer (stop=None)
        key = Path(out["keyFile"]).read_text().strip()
        log = tmp_path / "run"
        cb_env = {**os.environ, "TINKER_API_KEY": key, "TINKER_TELEMETRY": "0",
                  "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
        cb_env.pop("PYTHONPATH", None)
        started = time.monotonic()
        proc = subprocess.run(
            [str(COOKBOOK_PY), "-c", RECIPE, out["baseUrl"], str(pretrained), str(log),
             str(STEPS), str(LR), str(GROUP), str(GROUPS)],
            env=cb_env, capture_output=True, text=True, timeout=900,
        )
        took = time.monotonic() - started
        assert proc.returncode == 0, proc.stderr[-6000:]
        assert "this server has none" not in proc.stderr
        rows = [json.loads(x) for x in (log / "metrics.jsonl").read_text().splitlines() if x]
        steps = [r for r in rows if "env/all/reward/total" in r]
        assert len(steps) == STEPS, rows[:2]
        for r in steps:  # every rollout sampled and was scored
            assert r.get("env/all/total_episodes") in (None, GROUP * GROUPS)
            assert -1.0 <= r["env/all/reward/total"] <= 1.0
        rewards = [r["env/all/reward/total"] for r in steps]
        print(f"math_rl {STEPS} steps in {took:.0f} s; rewards {[round(x, 3) for x in rewards]}")
        first, last = sum(rewards[:2]) / 2, sum(rewards[-3:]) / 3
        assert first < -0.02, f"no signal to learn from: the first rewards {rewards[:2]}"
        assert last > first + 0.02, f"the reward did not rise: {rewards}"
    finally:
        serve.terminate()
        try:
            serve.wait(30)
        except subprocess.TimeoutExpired:
            serve.kill()
        subprocess.run([*cli, "down", "-f", str(path), *addr], cwd=REPO_ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
