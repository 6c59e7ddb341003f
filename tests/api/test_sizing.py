"""Sizes that cannot work are refused before anything starts, with the estimate.

- the parameter estimate (tgapi.sizing) equals what megatron-core builds (real GPTModel on
  CPU, gloo, in launched ranks) for several shapes, tensor-parallel 1 and 2;
- a model too big for the worker pods' memory (CPU workers) or their GPU (gpuMemory, or
  the nvidia.com/gpu.product node selector) is a SpecError naming the field, with the
  estimate, the limit and what to change; one that fits is accepted;
- the real ``tgctl up`` refuses such a file (and the numLayers that overflowed megatron)
  with exit 2 and one error line, before any Ray head is started.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

import tgapi
from tgapi import sizing

REPO = Path(__file__).resolve().parents[2]

SHAPES: list[dict[str, Any]] = [
    {"hiddenSize": 64, "numAttentionHeads": 4, "numLayers": 2, "vocabSize": 128,
     "ffnHiddenSize": 96, "maxSequenceLength": 32},
    {"hiddenSize": 64, "numAttentionHeads": 8, "numQueryGroups": 2, "numLayers": 3,
     "vocabSize": 96, "ffnHiddenSize": 128, "maxSequenceLength": 16, "activation": "gelu",
     "normalization": "LayerNorm"},
    {"hiddenSize": 48, "numAttentionHeads": 4, "numLayers": 1, "vocabSize": 64,
     "ffnHiddenSize": 64, "maxSequenceLength": 8, "positionEmbedding": "rope"},
    # Qwen2 (QKV bias) with tied embeddings; Qwen3 (q/k norms) with a head_dim of its own
    {"hiddenSize": 64, "numAttentionHeads": 4, "numQueryGroups": 2, "numLayers": 2,
     "vocabSize": 128, "ffnHiddenSize": 96, "maxSequenceLength": 16, "positionEmbedding": "rope",
     "architecture": "qwen2", "tieEmbeddings": True},
    {"hiddenSize": 64, "numAttentionHeads": 4, "numQueryGroups": 2, "numLayers": 2,
     "vocabSize": 128, "ffnHiddenSize": 96, "maxSequenceLength": 16, "positionEmbedding": "rope",
     "architecture": "qwen3", "headDim": 32},
]

def _count(specs: list[dict[str, Any]]) -> list[int]:
    """One rank: the parameters of real megatron GPTModels on this rank (CPU, gloo)."""
    import torch.distributed as dist

    from tgapi import parse_spec
    from tgruntime.trainer import distributed, model
    from tgruntime.trainer.settings import resolve_settings

    counts = []
    for raw in specs:
        spec = parse_spec(raw, local=True)
        settings = resolve_settings(spec, device="cpu")
        distributed.init_process_group(settings)
        p = spec.parallelism
        distributed.init_model_parallel(tp=p.tensor, pp=p.pipeline, cp=p.context)
        config = model.transformer_config(spec.model, spec.parallelism, settings)
        gpt = model.build_gpt_model(spec.model, config, settings)
        counts.append(model.count_parameters(gpt))
        dist.barrier()
    distributed.destroy_parallel(destroy_process_group=True)
    return counts


def _megatron_counts(specs: list[dict[str, Any]], world: int) -> list[int]:
    """Parameters on rank 0 of real megatron GPTModels (CPU, gloo, ``world`` processes)."""
    from tgruntime.trainer.launch import launch

    ranks = launch(_count, world_size=world, kwargs={"specs": specs},
                   env={"CUDA_VISIBLE_DEVICES": ""}, timeout_s=600)
    counts: list[int] = ranks[0]
    return counts


@pytest.mark.parametrize("tensor", [1, 2])
def test_estimate_counts_what_megatron_builds(tensor: int) -> None:
    raws = [{"model": shape, "parallelism": {"tensor": tensor},
             "workers": {"processesPerNode": [tensor], "useGpu": False},
             "training": {"sequenceLength": 8, "batchSize": 1}} for shape in SHAPES]
    estimates = [sizing.estimate(tgapi.parse_spec(r, local=True), on_gpu=False) for r in raws]
    assert _megatron_counts(raws, tensor) == [e.worker_parameters for e in estimates]
    if tensor == 1:
        assert all(e.parameters == e.worker_parameters for e in estimates)


def test_estimate_of_the_measured_5b_shape() -> None:
    """docs/gpu.md's 5.1 B-parameter shape (h4096 L24 V32000, bf16 on a GPU)."""
    spec = tgapi.parse_spec({"model": {"hiddenSize": 4096, "numLayers": 24, "vocabSize": 32000,
                                       "numAttentionHeads": 32, "ffnHiddenSize": 11008}},
                            local=True)
    est = sizing.estimate(spec, on_gpu=True)
    assert round(est.parameters / 1e9, 2) == 5.12
    assert est.bytes_per_parameter == 18  # bf16 weights, fp32 grads, fp32 main + 2 moments
    assert est.worker_bytes < 122.7 * 2**30  # below the measured peak (activations on top)
    two = tgapi.parse_spec({**tgapi.to_wire(spec), "parallelism": {"tensor": 2, "pipeline": 2},
                            "workers": {"processesPerNode": [4]}}, local=True)
    quarter = sizing.estimate(two, on_gpu=True).worker_parameters
    assert est.parameters / 4 < quarter < est.parameters / 3  # stage 0/last hold the vocab


def test_bytes_per_parameter_follow_the_trainer() -> None:
    assert sizing.bytes_per_parameter(on_gpu=True, dtype="bfloat16") == 18
    assert sizing.bytes_per_parameter(on_gpu=True, dtype="float16") == 18
    assert sizing.bytes_per_parameter(on_gpu=True, dtype="float32") == 16
    assert sizing.bytes_per_parameter(on_gpu=False, dtype="bfloat16") == 16  # fp32 on CPU


@pytest.mark.parametrize(("text", "value"), [
    ("32Gi", 32 * 2**30), ("500M", 500 * 10**6), ("1.5Gi", 3 * 2**29), ("128974848", 128974848),
    ("129e6", 129 * 10**6), ("0.5", 0.5), (".5Ki", 512), ("100m", 0.1),
])
def test_quantities(text: str, value: float) -> None:
    assert float(sizing.parse_quantity(text) or -1) == pytest.approx(value)


@pytest.mark.parametrize("text", ["", "-1Gi", "1.2.3", "Gi", "1GB", "1 Gi", "1e", "8Gi\n"])
def test_not_quantities(text: str) -> None:
    assert sizing.parse_quantity(text) is None


BIG = {"hiddenSize": 8192, "numAttentionHeads": 64, "numLayers": 80, "ffnHiddenSize": 28672,
       "vocabSize": 128256}  # an 80B shape (no GQA)


def _errors(spec: dict[str, Any]) -> list[tgapi.SpecError]:
    with pytest.raises(tgapi.SpecErrors) as info:
        tgapi.parse_spec(spec)
    return info.value.errors


def test_cpu_workers_that_cannot_fit_their_pod_are_refused() -> None:
    (err,) = _errors({"model": BIG, "workers": {"processesPerNode": [2]},
                      "rayCluster": {"workers": {"gpusPerWorker": 0, "memory": "64Gi"}},
                      "training": {"batchSize": 2}})
    assert err.field == "spec.rayCluster.workers.memory"
    assert "64Gi is too small for the model" in err.problem
    assert "80.0B parameters" in err.problem and "16 bytes per parameter" in err.problem
    assert "2 CPU worker process(es)" in err.problem
    assert "set rayCluster.workers.memory to at least 2383Gi" in err.fix
    assert "parallelism.tensor" in err.fix and "model.numLayers" in err.fix


def test_gpu_workers_that_cannot_fit_the_gpu_are_refused() -> None:
    spec: dict[str, Any] = {"model": BIG, "rayCluster": {"workers": {"nodeSelector": {
        sizing.GPU_PRODUCT_LABEL: "NVIDIA-H100-80GB-HBM3"}}}}
    (err,) = _errors(spec)
    assert err.field == f"spec.rayCluster.workers.nodeSelector.{sizing.GPU_PRODUCT_LABEL}"
    assert "does not fit one GPU" in err.problem and "18 bytes per parameter" in err.problem
    assert "NVIDIA-H100-80GB-HBM3 has 80 GB" in err.problem
    # the explicit figure wins over the product's
    spec["rayCluster"]["workers"]["gpuMemory"] = "64Gi"
    (err,) = _errors(spec)
    assert err.field == "spec.rayCluster.workers.gpuMemory" and "gpuMemory is 64Gi" in err.problem
    # tensor x pipeline 8 x 4 over 32 GPUs: 1/32 of the model per GPU fits an H100
    spec["rayCluster"]["workers"].update(gpuMemory="", gpusPerWorker=8, replicas=4)
    spec.update(parallelism={"tensor": 8, "pipeline": 4},
                workers={"processesPerNode": [8, 8, 8, 8]})
    tgapi.parse_spec(spec)


def test_unknown_limits_are_not_guessed() -> None:
    # GPU workers on an unnamed GPU, a referenced cluster, tgctl's local mode: no limit here
    tgapi.parse_spec({"model": BIG, "rayCluster": {}})
    tgapi.parse_spec({"model": BIG, "rayClusterRef": {"name": "shared"}})
    tgapi.parse_spec({"model": BIG, "rayCluster": {"workers": {"gpusPerWorker": 0}}},
                     local=True)


def test_the_default_and_the_examples_fit() -> None:
    for path in [REPO / "manifests/examples/trainergroup.yaml",
                 *sorted((REPO / "examples/local").glob("*.yaml"))]:
        tgapi.load_file(path, local="local" in path.parts)
    tgapi.parse_spec({"rayCluster": {"workers": {"gpusPerWorker": 0}}})  # 1.2B on 32Gi


def test_overflowing_sizes_are_bounds() -> None:
    (err,) = _errors({"model": {"numLayers": 100000000000000000000},
                      "rayClusterRef": {"name": "x"}})
    assert str(err) == (
        "spec.model.numLayers: 100000000000000000000 is too large. Fix: use a value <= 65536"
    )
    (err,) = _errors({"model": {"seed": 2**32}, "rayClusterRef": {"name": "x"}})
    assert err.field == "spec.model.seed" and "<= 2147483647" in err.fix


def test_host_memory_check() -> None:
    spec = tgapi.parse_spec({"model": BIG, "workers": {"processesPerNode": [2]},
                             "training": {"batchSize": 2}}, local=True)
    (err,) = sizing.host_errors(spec, memory_bytes=24 * 2**30)
    assert err.field == "spec.model"
    assert "does not fit this machine" in err.problem and "24.0 GiB of memory" in err.problem
    assert "times 2 CPU worker process(es)" in err.problem
    assert not sizing.host_errors(tgapi.parse_spec({}, local=True), memory_bytes=24 * 2**30)


# -- the real CLI: refused before Ray ---------------------------------------------------
def _tgctl_up(tmp_path: Path, text: str, *extra: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "tg.yaml"
    path.write_text(text)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "TG_RAY_ADDRESS")}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")  # a fresh tgctl state: no known head
    return subprocess.run(
        [sys.executable, "-m", "tgruntime.entrypoints.cli", "up", "-f", str(path), *extra],
        env=env, capture_output=True, text=True, timeout=120, cwd=REPO)


def _manifest(spec: dict[str, Any]) -> str:
    return yaml.safe_dump({"apiVersion": f"{tgapi.API_GROUP}/{tgapi.API_VERSION}",
                           "kind": tgapi.KIND, "metadata": {"name": "big"}, "spec": spec})


@pytest.mark.parametrize(("spec", "field", "words"), [
    ({"model": {"numLayers": 100000000000000000000}}, "spec.model.numLayers", "too large"),
    ({"model": BIG, "workers": {"useGpu": False}}, "spec.model", "does not fit this machine"),
])
def test_tgctl_up_refuses_before_starting_ray(tmp_path: Path, spec: dict[str, Any], field: str,
                                              words: str) -> None:
    proc = _tgctl_up(tmp_path, _manifest(spec), "--num-gpus", "0")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert f"  - {field}: " in proc.stderr and words in proc.stderr and "Fix: " in proc.stderr
    assert "head:" not in proc.stderr  # never looked for (or started) a Ray head
    assert not (tmp_path / "cache" / "trainergroup" / "local-ray.json").exists()
