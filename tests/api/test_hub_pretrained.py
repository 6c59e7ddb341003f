"""``spec.model.pretrained`` as a hub id (``org/model``): downloaded by ``huggingface_hub`` where
the spec is parsed with its files (``tgapi.hub``), from a stand-in hub (``tests/fixtures_hub``:
the hub itself cannot be reached here) named by ``HF_ENDPOINT``.

``huggingface_hub`` reads ``HF_ENDPOINT`` and ``HF_HOME`` when it is imported, as every pod's
process does at start, so each case runs in a fresh interpreter with its own environment
(tgapi and huggingface_hub only: no torch). The group's workers loading the downloaded weights:
tests/trainer/test_hf_group.py::test_pp2_group_starts_from_spec_model_pretrained."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import tgapi
from tests.api.test_pretrained import _checkpoint

pytest.importorskip("huggingface_hub")
pytest.importorskip("aiohttp")

from tests.fixtures_hub import DirectoryHub, serve_hub

REPO = "org/tiny-llama"
SCRIPT = """
import json, os, sys
import tgapi
from tgapi.hub import local_dir
spec = {"model": {"pretrained": sys.argv[1], "positionEmbedding": "rope"},
        "training": {"batchSize": 2, "sequenceLength": 64}}
try:
    m = tgapi.parse_spec(spec, local=True).model
except tgapi.SpecErrors as exc:
    print(json.dumps({"errors": [str(e) for e in exc.errors]}))
    sys.exit(0)
parsed = sorted(os.listdir(local_dir(m.pretrained)))  # what the parse downloaded
files = sorted(os.listdir(local_dir(m.pretrained, weights=True)))
print(json.dumps({"pretrained": m.pretrained, "hidden": m.hidden_size,
                  "layers": m.num_layers, "parsed": parsed, "files": files}))
"""


def _parse(url: str, home: Path, *, token: str | None = None) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=url, HF_HOME=str(home), HF_HUB_DISABLE_TELEMETRY="1",
               HF_HUB_ETAG_TIMEOUT="10", HF_HUB_DOWNLOAD_TIMEOUT="10")
    if token:
        env["HF_TOKEN"] = token
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root / "api"), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", SCRIPT, REPO], env=env, capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_the_operator_takes_a_hub_id_and_refuses_a_bare_name() -> None:
    spec: dict[str, Any] = {"model": {"pretrained": REPO, "positionEmbedding": "rope"},
                            "training": {"batchSize": 2, "sequenceLength": 64},
                            "rayClusterRef": {"name": "rc"}}
    assert tgapi.parse_spec(spec).model.pretrained == REPO  # no download without local=True
    spec["model"]["pretrained"] = "tiny-llama"
    with pytest.raises(tgapi.SpecErrors, match=r"spec\.model\.pretrained"):
        tgapi.parse_spec(spec)


def test_a_hub_id_is_downloaded_where_the_spec_is_parsed_and_a_token_opens_a_gated_one(
    tmp_path: Path,
) -> None:
    root = Path(_checkpoint(tmp_path))
    (root / "model.safetensors").write_bytes(b"weights")  # only fetched with weights=True
    (root / "README.md").write_text("not a model file")  # never fetched
    hub = DirectoryHub(REPO, root)
    with serve_hub(hub) as url:
        got = _parse(url, tmp_path / "home-open")
        assert got["pretrained"] == REPO  # the spec keeps the id: it is the served name
        assert (got["hidden"], got["layers"]) == (64, 2)  # config.json's, downloaded
        assert got["parsed"] == ["config.json", "tokenizer.json"]  # no weights for the parse
        assert got["files"] == ["config.json", "model.safetensors", "tokenizer.json"]
        # a gated model: without the token the parse fails naming the fix, with it it works
        hub.token = "hf_s3cret"
        (err,) = _parse(url, tmp_path / "home-gated")["errors"]
        assert err.startswith("spec.model.pretrained: ") and "hubTokenSecret" in err
        got = _parse(url, tmp_path / "home-token", token="hf_s3cret")
        assert got["files"] == ["config.json", "model.safetensors", "tokenizer.json"]
    # no hub at all (the server is gone): the error says to copy the checkpoint to a volume
    (err,) = _parse(url, tmp_path / "home-none")["errors"]
    assert "could not be downloaded" in err and "HF_ENDPOINT" in err, err
