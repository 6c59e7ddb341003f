"""tinker-cookbook 0.5.8's ``math_rl`` recipe (env arithmetic, its default importance_sampling
loss, the role_colon renderer), unmodified, through ``tgctl up`` + ``tgctl serve`` on a local
group whose ``spec.model.pretrained`` directory holds a tiny Llama and its tokenizer, exactly
as issue 38 reported it: every sample carries the renderer's stop string, and every one was
refused with 400 "stop strings need the base model's tokenizer, and this server has none"
(the first rollouts sample concurrently, and all but the first arrived while the first was
loading the tokenizer). Only ``base_url``, ``model_name`` and the size knobs are set.

A random tiny model does not learn arithmetic in a CPU minute (its rewards stay at -0.1: no
answer right, no stop string), so this asserts the run: every step's rollouts are sampled with
the stop string and scored, no sample is refused. Learning through the same SDK calls is
asserted by test_cookbook.py (supervised) and the SDK flow tests. Skipped where the cookbook
venv is not built (hack/cookbook-venv.sh; math_rl needs its pylatexenc)."""

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

STEPS = int(os.environ.get("TG_MATH_RL_STEPS", "3"))
RECIPE = textwrap.dedent(
    """
    import asyncio, sys
    from tinker_cookbook.recipes.math_rl.train import CLIConfig, cli_main
    url, model, log, steps = sys.argv[1:5]
    cfg = CLIConfig(
        model_name=model, base_url=url, log_path=log, renderer_name="role_colon",
        env="arithmetic", lora_rank=4, group_size=4, groups_per_batch=4, max_tokens=5,
        learning_rate=1e-3, max_steps=int(steps), eval_every=0, save_every=0,
        behavior_if_log_dir_exists="delete",
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


def test_math_rl_unmodified_through_tgctl_serve(ray_cluster: RayCluster, tmp_path: Path) -> None:
    if not COOKBOOK_PY.exists():
        pytest.skip(f"no cookbook venv at {COOKBOOK_PY}: build it with hack/cookbook-venv.sh")
    shape = {"vocabSize": 128, "hiddenSize": 64, "numLayers": 2, "numAttentionHeads": 4,
             "ffnHiddenSize": 128, "maxSequenceLength": 128, "positionEmbedding": "rope"}
    pretrained = tiny_llama(tmp_path / "tiny-llama", shape)
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
             str(STEPS)],
            env=cb_env, capture_output=True, text=True, timeout=900,
        )
        took = time.monotonic() - started
        assert proc.returncode == 0, proc.stderr[-6000:]
        assert "this server has none" not in proc.stderr
        rows = [json.loads(x) for x in (log / "metrics.jsonl").read_text().splitlines() if x]
        steps = [r for r in rows if "env/all/reward/total" in r]
        assert len(steps) == STEPS, rows[:2]
        for r in steps:  # every rollout sampled (16 a step) and was scored
            assert r.get("env/all/total_episodes") in (None, 16)
            assert -1.0 <= r["env/all/reward/total"] <= 1.0
        print(f"math_rl {STEPS} steps in {took:.0f} s; rewards "
              f"{[round(r['env/all/reward/total'], 3) for r in steps]}")
    finally:
        serve.terminate()
        try:
            serve.wait(30)
        except subprocess.TimeoutExpired:
            serve.kill()
        subprocess.run([*cli, "down", "-f", str(path), *addr], cwd=REPO_ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
