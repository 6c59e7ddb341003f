"""tinker-cookbook 0.5.8's DPO (``tinker_cookbook.preference.train_dpo.main``, what its
``recipes/preference/dpo`` CLI calls), unmodified, against the server; then the cookbook's
``weights.download`` of the run's final sampler checkpoint through an archive link.

Run in the cookbook venv (``hack/cookbook-venv.sh``, built by tools/install.sh in
.venv/cookbook); skipped, with the reason, where it is not built. What differs from the recipe:
``base_url``, ``model_name`` (the local word-level tokenizer the server serves), the size knobs
(batch 4, 4 epochs, LoRA rank 8), ``learning_rate`` 3e-3 (the recipe's 1e-5 is for a pretrained
8B model; this one is random and tiny) and the data: the recipe's HHH/HelpSteer3/UltraFeedback
come from the Hugging Face Hub, so a ``ComparisonDatasetBuilder`` of eight local pairs stands in
(the cookbook's own ``DPODatasetBuilderFromComparisons`` renders them). Learning: the DPO loss
starts at ln 2 (the policy is its reference) and falls; the chosen answer ends up preferred.

SDK 0.38 dropped ``RestClient.get_checkpoint_archive_url_from_tinker_path``, which this
cookbook's ``weights.download`` calls for ``sampler_weights`` paths: the script puts tinker
0.34's call back (the same GET of ``.../archive``) and runs ``weights.download`` unmodified; the
unpacked files equal the server's checkpoint files byte for byte. Then SDK 0.38's own ways, all
unmodified: ``create_training_client_from_state`` of the final state, ``save_weights_external``
and ``weights.download`` of its ``external_weights`` path; and ``weights.download`` of the
``weights`` (state) path, which exports encrypted to an age key it generates
(``age_encryption_recipients``), fetches, decrypts with pyrage and deletes the export: both give
the Hugging Face files the group exported, byte for byte."""

from __future__ import annotations

import json
import math
import os
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.service.test_cookbook import COOKBOOK_PY, finish_lingering

pytestmark = [pytest.mark.ray, pytest.mark.megatron, pytest.mark.flow]

SCRIPT = textwrap.dedent(
    """
    import concurrent.futures, datetime, json, os, sys, types, urllib.request
    from pathlib import Path
    import chz, datasets
    from tinker_cookbook.preference import train_dpo
    from tinker_cookbook.preference.dpo_datasets import DPODatasetBuilderFromComparisons
    from tinker_cookbook.preference.preference_datasets import ComparisonDatasetBuilder
    from tinker_cookbook.preference.types import Comparison, LabeledComparison
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    url, tok, log, out = sys.argv[1:5]
    PROMPTS = ["the a", "a of", "is the", "of is", "the is", "a a", "to the", "in a"]

    @chz.chz
    class LocalPairs(ComparisonDatasetBuilder):
        def get_train_and_test_datasets(self):
            rows = [{"q": q, "good": "the of the of", "bad": "in and in and"} for q in PROMPTS]
            return datasets.Dataset.from_list(rows), None

        def example_to_labeled_comparison(self, ex):
            return LabeledComparison(
                comparison=Comparison(
                    prompt_conversation=[{"role": "user", "content": ex["q"]}],
                    completion_A=[{"role": "assistant", "content": ex["good"]}],
                    completion_B=[{"role": "assistant", "content": ex["bad"]}],
                ),
                label="A",
            )

    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=tok, renderer_name="role_colon", max_length=64, batch_size=4
    )
    cfg = train_dpo.Config(
        log_path=log, model_name=tok, recipe_name="tg-test-dpo", renderer_name="role_colon",
        dataset_builder=DPODatasetBuilderFromComparisons(
            common_config=common, comparison_builder=LocalPairs()
        ),
        learning_rate=3e-3, num_epochs=4, lora_rank=8, base_url=url, save_every=0,
        eval_every=0, infrequent_eval_every=0,
    )
    train_dpo.main(cfg)

    # tinker 0.34's get_checkpoint_archive_url_from_tinker_path (0.38 dropped it): GET .../archive
    from tinker.lib.public_interfaces.rest_client import RestClient

    def archive_url(self, tinker_path):
        run, cp = tinker_path.removeprefix("tinker://").split("/", 1)
        req = urllib.request.Request(
            f"{url}/api/v1/training_runs/{run}/checkpoints/{cp}/archive",
            headers={"X-API-Key": os.environ["TINKER_API_KEY"], "accept": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            body = json.loads(r.read())
        fut = concurrent.futures.Future()
        fut.set_result(types.SimpleNamespace(
            url=body["url"], expires=datetime.datetime.fromisoformat(body["expires"])
        ))
        return fut

    RestClient.get_checkpoint_archive_url_from_tinker_path = archive_url
    from tinker_cookbook import weights

    recs = [json.loads(x) for x in (Path(log) / "checkpoints.jsonl").read_text().splitlines() if x]
    final = recs[-1]["sampler_path"]
    weights.download(tinker_path=final, output_dir=out, base_url=url)
    print("FINAL=" + final)
    """
)


# SDK 0.38 and the cookbook unmodified: the run's final state into a new training client,
# save_weights_external (the group's export_hf), weights.download of that external path; then
# weights.download of the state path itself (the cookbook exports it encrypted to a key it makes,
# downloads, decrypts with pyrage and deletes the export)
EXTERNAL = textwrap.dedent(
    """
    import sys
    import tinker
    from tinker_cookbook import weights

    url, state, out = sys.argv[1:4]
    sc = tinker.ServiceClient(base_url=url)
    tc = sc.create_training_client_from_state(state)
    ext = tc.save_weights_external("hf", ttl_seconds=3600).result().path
    sc.close("success").result()
    weights.download(tinker_path=ext, output_dir=out + "/plain", base_url=url)
    weights.download(tinker_path=state, output_dir=out + "/state", base_url=url)
    print("EXTERNAL=" + ext)
    """
)


def test_cookbook_dpo_loss_falls_and_download_unpacks(
    served: dict[str, Any], tmp_path: Path
) -> None:
    if not COOKBOOK_PY.exists():
        pytest.skip(f"no cookbook venv at {COOKBOOK_PY}: build it with hack/cookbook-venv.sh")
    log, out = tmp_path / "run", tmp_path / "download"
    env = {**os.environ, "TINKER_API_KEY": served["key"], "TINKER_TELEMETRY": "0",
           "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [str(COOKBOOK_PY), "-c", SCRIPT, served["url"], served["base"], str(log), str(out)],
        env=env, capture_output=True, text=True, timeout=900,
    )
    finish_lingering(served)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(x) for x in (log / "metrics.jsonl").read_text().splitlines() if x]
    steps = [r for r in rows if "dpo_loss" in r]
    assert len(steps) == 8, rows[:3]
    first, last = steps[0]["dpo_loss"], steps[-1]["dpo_loss"]
    assert abs(first - math.log(2)) < 0.01, first  # step 0: the policy is its reference
    assert last < first - 0.05, [s["dpo_loss"] for s in steps]
    assert steps[-1]["accuracy"] == 1.0, steps[-1]
    # weights.download: the unpacked archive is the final sampler checkpoint, file for file
    final = next(x for x in proc.stdout.splitlines() if x.startswith("FINAL="))[6:]
    run, kind, name = final.removeprefix("tinker://").split("/")
    d = served["root"] / "ckpt" / "tinker" / "principals" / "default" / run / kind / name
    want = {str(p.relative_to(d)): p.read_bytes() for p in d.rglob("*") if p.is_file()}
    got = {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert want and got == want, (sorted(got), sorted(want))
    # weights.download of save_weights_external's path, and of the state path (encrypted
    # export): both the Hugging Face files the group exported, byte for byte
    state = json.loads((log / "checkpoints.jsonl").read_text().splitlines()[-1])["state_path"]
    hf = tmp_path / "hf"
    proc = subprocess.run(
        [str(COOKBOOK_PY), "-c", EXTERNAL, served["url"], state, str(hf)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    finish_lingering(served)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ext = next(x for x in proc.stdout.splitlines() if x.startswith("EXTERNAL="))[9:]
    run, kind, name = ext.removeprefix("tinker://").split("/")
    d = served["root"] / "ckpt" / "tinker" / "principals" / "default" / run / kind / name
    want = {str(p.relative_to(d)): p.read_bytes() for p in d.rglob("*") if p.is_file()}
    assert "config.json" in want and any(k.endswith(".safetensors") for k in want), sorted(want)
    for sub in ("plain", "state"):
        got = {str(p.relative_to(hf / sub)): p.read_bytes()
               for p in (hf / sub).rglob("*") if p.is_file()}
        assert got == want, (sub, sorted(got), sorted(want))
    # the cookbook deleted its temporary encrypted export
    exports = served["root"] / "ckpt" / "tinker" / "principals" / "default"
    assert sorted(p.name for p in exports.glob("*/external_weights/*")) == [".hf.meta.json", "hf"]
