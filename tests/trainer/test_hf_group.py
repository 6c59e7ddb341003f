"""export_hf / import_hf on real MegatronTrainer groups (local Ray, CPU, gloo) against transformers.

Two groups of two workers, one after the other, on the same tiny Llama (RoPE, GQA with 2
key/value groups):

* TP=2: train 2 steps, ``export_hf`` -> ``LlamaForCausalLM.from_pretrained`` gives the same
  log-probs as ``compute_log_prob``; ``import_hf`` of a Llama that transformers created
  gives transformers' log-probs, and exporting it again gives its tensors bit for bit.
* PP=2 (a fresh group, started from ``spec.model.pretrained`` given as a hub id, which its
  workers download from a stand-in hub, ``tests/fixtures_hub.py``): ``import_hf`` of the TP=2
  group's export, then ``export_hf`` in
  small shards, is bit-identical to that export; its log-probs equal transformers'; the same
  for the transformers-created Llama.

Tolerance of log-probs against transformers (fp32 on CPU): 2e-5 absolute; the sums are the
same but tensor parallelism reduces them in another order (measured: ~1e-6).
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

import tgapi

ray = pytest.importorskip("ray")
pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from tests.fixtures_hub import DirectoryHub, serve_hub  # noqa: E402
from tests.fixtures_ray import RayCluster  # noqa: E402
from tests.trainer.scenarios import fixed_batch, tiny_spec, write_tokenizer  # noqa: E402
from tgruntime.controller import (  # noqa: E402
    ClassWithInitArgs,
    DataProto,
    ResourcePool,
    WorkerGroup,
)
from tgruntime.trainer.hf_weights import LlamaShape  # noqa: E402
from tgruntime.trainer.worker import MegatronTrainer  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.megatron]

ATOL = 2e-5
HUB_REPO = "org/theirs-llama"
MODEL = {"positionEmbedding": "rope", "numQueryGroups": 2}


def _spec(*, pretrained: Path | None = None, **parallel: int) -> tgapi.TrainerGroupSpec:
    extra = {"pretrained": str(pretrained)} if pretrained else {}
    return tiny_spec(**parallel, **MODEL, **extra)  # type: ignore[arg-type]


def _group(spec: tgapi.TrainerGroupSpec, env: dict[str, str] | None = None) -> WorkerGroup:
    wg = WorkerGroup.create(
        group_name=f"hf-{uuid.uuid4().hex[:8]}",
        ray_namespace=ray.get_runtime_context().namespace,
        resource_pool=ResourcePool(process_on_nodes=[2], use_gpu=False, strategy="PACK"),
        cls=ClassWithInitArgs(MegatronTrainer, json.dumps(tgapi.to_wire(spec))),
        detached=False,
        env=env,
        pg_timeout_s=120,
        actor_timeout_s=180,
    )
    try:
        wg.init_model()
    except BaseException:
        wg.teardown()
        raise
    return wg


def _ids() -> torch.Tensor:
    return fixed_batch(seed=7)


def _group_log_probs(wg: WorkerGroup) -> torch.Tensor:
    out = wg.compute_log_prob(DataProto.from_dict(tensors={"input_ids": _ids()}))
    log_probs: torch.Tensor = out.batch["log_probs"].clone()
    return log_probs


def _hf_log_probs(path: Path) -> torch.Tensor:
    model = transformers.LlamaForCausalLM.from_pretrained(path).eval()
    ids = _ids()
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    return torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(safetensors_torch.load_file(file))
    return out


def _transformers_llama(path: Path) -> dict[str, torch.Tensor]:
    """A tiny Llama initialised by transformers itself (nothing downloaded), saved to path."""
    spec = _spec()
    shape = LlamaShape.from_model_spec(spec.model, position_embedding="rope")
    config = transformers.LlamaConfig.from_dict(shape.hf_config(dtype=torch.float32))
    torch.manual_seed(11)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(path)
    write_tokenizer(path, shape.vocab_size)  # as spec.model.pretrained requires
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


@pytest.fixture(scope="module")
def tp_run(ray_driver: RayCluster, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("hf-tp")
    trained, theirs, again = root / "trained", root / "theirs", root / "theirs-again"
    wg = _group(_spec(tp=2))
    try:
        data = DataProto.from_dict(tensors={"input_ids": fixed_batch()})
        for _ in range(2):
            wg.train_model(data)  # weights no longer the initial ones
        out: dict[str, Any] = {"trained": trained, "theirs": theirs}
        out["export"] = wg.export_hf(str(trained))
        out["log_probs"] = _group_log_probs(wg)
        out["theirs_tensors"] = _transformers_llama(theirs)
        out["import"] = wg.import_hf(str(theirs))
        out["theirs_log_probs"] = _group_log_probs(wg)
        wg.export_hf(str(again))
        out["again_tensors"] = _tensors(again)
        return out
    finally:
        wg.teardown()


@pytest.fixture(scope="module")
def pp_run(tp_run: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("hf-pp")
    # spec.model.pretrained: init_model loads the transformers-created Llama (shape from its
    # config.json), before any import_hf; named by its hub id, which each worker downloads
    # (tgapi.hub) from a stand-in hub (HF_ENDPOINT is read when huggingface_hub is imported:
    # the workers get it at start; this process parses the spec from the directory)
    spec = _spec(pp=2, pretrained=tp_run["theirs"])
    spec = dataclasses.replace(spec, model=dataclasses.replace(spec.model, pretrained=HUB_REPO))
    hub = DirectoryHub(HUB_REPO, tp_run["theirs"])
    with serve_hub(hub) as url:
        wg = _group(spec, env={"HF_ENDPOINT": url, "HF_HOME": str(root / "hf-home")})
    assert any("model.safetensors" in r for r in hub.requests), hub.requests
    try:
        out: dict[str, Any] = {"pretrained_log_probs": _group_log_probs(wg)}
        out["import"] = wg.import_hf(str(tp_run["trained"]))
        out["log_probs"] = _group_log_probs(wg)
        out["export"] = wg.export_hf(str(root / "sharded"), max_shard_bytes=64 * 1024)
        out["sharded"] = root / "sharded"
        wg.import_hf(str(tp_run["theirs"]))
        out["theirs_log_probs"] = _group_log_probs(wg)
        return out
    finally:
        wg.teardown()


def test_tp2_export_loads_in_transformers_with_the_same_log_probs(tp_run: dict[str, Any]) -> None:
    exports = tp_run["export"]
    assert [e["rank"] for e in exports] == [0, 1]
    first = exports[0]
    assert first["files"] == ["model.safetensors"] and first["dtype"] == "float32"
    assert first["bytes"] > 0 and first["seconds"] > 0
    assert (tp_run["trained"] / "config.json").is_file()
    ours, ref = tp_run["log_probs"], _hf_log_probs(tp_run["trained"])
    assert ours.shape == ref.shape == (4, 31)
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)


def test_tp2_import_of_a_transformers_llama(tp_run: dict[str, Any]) -> None:
    assert [i["rank"] for i in tp_run["import"]] == [0, 1]
    ref = _hf_log_probs(tp_run["theirs"])
    torch.testing.assert_close(tp_run["theirs_log_probs"], ref, atol=ATOL, rtol=0)
    theirs, again = tp_run["theirs_tensors"], tp_run["again_tensors"]
    assert set(again) == set(theirs)
    for name, tensor in theirs.items():  # HF -> megatron TP=2 shards -> HF: bit for bit
        assert torch.equal(again[name], tensor), name


def test_pp2_fresh_group_round_trip_is_bit_identical(
    tp_run: dict[str, Any], pp_run: dict[str, Any]
) -> None:
    sharded = pp_run["sharded"]
    files = pp_run["export"][0]["files"]
    assert len(files) > 1 and (sharded / "model.safetensors.index.json").is_file()
    original, exported = _tensors(tp_run["trained"]), _tensors(sharded)
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    model = transformers.LlamaForCausalLM.from_pretrained(sharded)
    assert all(torch.equal(t, original[n]) for n, t in model.state_dict().items())


def test_pp2_log_probs_equal_transformers(tp_run: dict[str, Any], pp_run: dict[str, Any]) -> None:
    torch.testing.assert_close(
        pp_run["log_probs"], _hf_log_probs(tp_run["trained"]), atol=ATOL, rtol=0
    )
    torch.testing.assert_close(
        pp_run["theirs_log_probs"], _hf_log_probs(tp_run["theirs"]), atol=ATOL, rtol=0
    )


def test_pp2_group_starts_from_spec_model_pretrained(
    tp_run: dict[str, Any], pp_run: dict[str, Any]
) -> None:
    ref = _hf_log_probs(tp_run["theirs"])
    torch.testing.assert_close(pp_run["pretrained_log_probs"], ref, atol=ATOL, rtol=0)
