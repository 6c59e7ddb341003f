"""The size estimate in the admission policy (tgapi.sizing.SIZING_RULES as CEL) agrees with
tgapi's parse: on many specs, of models that fit and models that don't, the generated
policy's variables and expressions (cel-python, with stand-ins for Kubernetes' quantity,
list and strings functions: tests/api/test_rules.py) give the same verdict as Python and,
when refused, tgapi's message to the character. The real API server's CEL is
tests/k8s/test_admission.py."""

from __future__ import annotations

import random
from typing import Any

import pytest

import tgapi
from tests.api.test_rules import _wire, policy_activation, run_policy
from tgapi import crd, sizing
from tgapi.wire import from_wire

celpy = pytest.importorskip("celpy", reason="cel-python (dev dependency) is not installed")


def _random_spec(rnd: random.Random) -> dict[str, Any]:
    heads = rnd.choice([1, 4, 16, 64])
    tensor = rnd.choice([1, 1, 2, 4])
    pipeline = rnd.choice([1, 1, 2, 4])
    groups = rnd.choice([0, heads, tensor])
    layers = pipeline * rnd.choice([1, 3, 16, 80, 4096])
    nodes = rnd.choice([1, 2, 4])
    per_node = tensor * pipeline * rnd.choice([1, 2])
    gpus = rnd.choice([0, 0, per_node, 8])
    cluster: dict[str, Any] = {
        "replicas": nodes,
        "gpusPerWorker": gpus,
        # "": the default, 32Gi + 32Gi per GPU
        "memory": rnd.choice(["32Gi", "4Gi", "500M", "1.5Ti", "64e9", "2048Mi", "1e15", ""]),
    }
    if rnd.random() < 0.4:
        cluster["gpuMemory"] = rnd.choice(["80Gi", "24G", "141e9", "16Gi", "1.5Ti"])
    if rnd.random() < 0.6:
        cluster["nodeSelector"] = {
            sizing.GPU_PRODUCT_LABEL: rnd.choice(
                ["NVIDIA-H200", "NVIDIA-H100-80GB-HBM3", "NVIDIA-A100-SXM4-40GB", "Tesla-T4",
                 "NVIDIA-L40S", "NVIDIA-A10G", "some-new-gpu"]
            ),
            "pool": "gpu",
        }
    return {
        "workers": {
            "processesPerNode": [per_node] * nodes,
            "useGpu": rnd.choice([True, False, "auto", "auto"]),
        },
        "parallelism": {"tensor": tensor, "pipeline": pipeline},
        "model": {
            "numAttentionHeads": heads * tensor,
            "numQueryGroups": groups,
            "hiddenSize": heads * tensor * rnd.choice([16, 64, 128]),
            "ffnHiddenSize": tensor * rnd.choice([64, 5504, 28672]),
            "vocabSize": tensor * rnd.choice([256, 32000, 128256]),
            "numLayers": layers,
            "maxSequenceLength": rnd.choice([128, 4096]),
            "activation": rnd.choice(["swiglu", "gelu"]),
            "normalization": rnd.choice(["RMSNorm", "LayerNorm"]),
            "positionEmbedding": rnd.choice(["auto", "rope", "learned_absolute"]),
            "dtype": rnd.choice(["bfloat16", "float32"]),
        },
        "training": {"batchSize": nodes * 2, "sequenceLength": 128},
        "rayCluster": {"workers": cluster},
    }


SPECS = [_wire(_random_spec(random.Random(seed))) for seed in range(300)]


def _policy_errors(spec: dict[str, Any]) -> list[str]:
    """The sizing validations' messages for ``spec``, from the generated policy's CEL."""
    activation = policy_activation(spec)
    messages = []
    for rule in sizing.SIZING_RULES:
        validation = rule.policy_validation()
        if not run_policy(validation["expression"], activation):
            messages.append(str(run_policy(validation["messageExpression"], activation)))
    return messages


def test_the_specs_cover_every_outcome() -> None:
    broken = [[r.name for r in sizing.SIZING_RULES if r.broken_by(s)] for s in SPECS]
    assert {name for names in broken for name in names} == {r.name for r in sizing.SIZING_RULES}
    assert sum(1 for names in broken if not names) > 50  # and many that fit


@pytest.mark.parametrize("index", range(0, len(SPECS), 25))
def test_cel_and_python_give_the_same_verdict_and_message(index: int) -> None:
    for spec in SPECS[index : index + 25]:
        python = [str(e) for e in _python_errors(spec)]
        assert _policy_errors(spec) == python, spec


def _python_errors(spec: dict[str, Any]) -> list[tgapi.SpecError]:
    parsed, errors = from_wire(tgapi.TrainerGroupSpec, spec, path="spec")
    assert parsed is not None and not errors
    return sizing.sizing_errors(parsed)


def test_the_policy_holds_the_sizing_rules_after_the_others() -> None:
    names = [r.name for r in crd.policy_validations()]
    assert names[-len(sizing.SIZING_RULES) :] == [r.name for r in sizing.SIZING_RULES]
