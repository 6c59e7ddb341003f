"""tinker-cookbook 0.5.8's supervised training, unmodified, against the server.

It runs in the cookbook venv (``hack/cookbook-venv.sh``; its transformers/tokenizers pins stay
out of .venv): ``tinker_cookbook.supervised.train`` on the shipped
``example_data/conversations.jsonl``, renderer ``role_colon``, the local word-level tokenizer the
server names as its base model. Skipped, with the reason, where that venv is not built."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.megatron, pytest.mark.flow]

# tools/install.sh builds it in .venv/cookbook (next to the venv it is layered over)
COOKBOOK_PY = Path(
    os.environ.get("TG_COOKBOOK_PYTHON")
    or Path(__file__).resolve().parents[2] / ".venv" / "cookbook" / "bin" / "python"
)

SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys
    from pathlib import Path
    import tinker_cookbook
    from tinker_cookbook.supervised import train
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    url, tok, log = sys.argv[1:4]
    data = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"
    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=tok, renderer_name="role_colon", max_length=96, batch_size=16
    )
    builder = FromConversationFileBuilder(file_path=str(data), common_config=common)
    cfg = train.Config(
        log_path=log, model_name=tok, recipe_name="tg-test", renderer_name="role_colon",
        dataset_builder=builder,
        learning_rate=3e-3, num_epochs=3, lora_rank=8, base_url=url, save_every=0,
        eval_every=0,
    )
    asyncio.run(train.main(cfg))
    """
)


def finish_lingering(served: dict[str, Any]) -> None:
    """The cookbook's ``train.main`` (and ``train_dpo.main``) exit without
    ``sessions/{id}/finish``; their heartbeat would hold the group's one training run for the
    session TTL (120 s): finish each such session the way the SDK's ``with`` would."""
    registry = served["service"].registry
    for sid, sess in list(registry.sessions.items()):
        if not sess.finished and any(m.session_id == sid for m in registry.models.values()):
            req = urllib.request.Request(
                f"{served['url']}/api/v1/sessions/{sid}/finish",
                data=b"{}",
                headers={"X-API-Key": served["key"], "Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=30) as resp:
                assert resp.status == 200


def test_cookbook_supervised_train_loss_falls(served: dict[str, Any], tmp_path: Path) -> None:
    if not COOKBOOK_PY.exists():
        pytest.skip(f"no cookbook venv at {COOKBOOK_PY}: build it with hack/cookbook-venv.sh")
    log = tmp_path / "run"
    env = {**os.environ, "TINKER_API_KEY": served["key"], "TINKER_TELEMETRY": "0",
           "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [str(COOKBOOK_PY), "-c", SCRIPT, served["url"], served["base"], str(log)],
        env=env, capture_output=True, text=True, timeout=900,
    )
    finish_lingering(served)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(x) for x in (log / "metrics.jsonl").read_text().splitlines() if x]
    nll = [r["train_mean_nll"] for r in rows if "train_mean_nll" in r]
    assert len(nll) >= 6, rows[:3]
    first, last = sum(nll[:3]) / 3, sum(nll[-3:]) / 3
    assert last < first * 0.9, nll
