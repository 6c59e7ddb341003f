"""The cross-field rule records (tgapi.rules): every rule has CEL in the CRD or in the
admission policy, and the CEL text agrees with the Python evaluator on many specs
(evaluated with cel-python, a pure-Python CEL interpreter; the real API server tests are
tests/k8s/test_admission.py)."""

from __future__ import annotations

import contextlib
import functools
import random
import re
import string
from typing import Any

import pytest
import yaml

import tgapi
from tgapi import crd, rules, sizing
from tgapi.wire import from_wire


def _random_spec(rnd: random.Random) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "workers": {
            "processesPerNode": [
                rnd.choice([1, 2, 3, 4, 8]) for _ in range(rnd.choice([0, 1, 2, 3]))
            ],
            "useGpu": rnd.choice([True, False, "auto"]),
        },
        "parallelism": {
            k: rnd.choice([1, 1, 2, 3, 4]) for k in ("tensor", "pipeline", "context", "expert")
        },
        "model": {
            "numAttentionHeads": rnd.choice([1, 2, 3, 4, 8, 16]),
            "hiddenSize": rnd.choice([48, 63, 64, 128]),
            "vocabSize": rnd.choice([96, 255, 256]),
            "ffnHiddenSize": rnd.choice([63, 64, 96, 5504]),
            "numQueryGroups": rnd.choice([0, 0, 1, 2, 3, 4]),
            "numLayers": rnd.choice([1, 2, 3, 4]),
            "maxSequenceLength": rnd.choice([64, 1024]),
        },
        "training": {
            "batchSize": rnd.choice([1, 2, 3, 4, 6, 16]),
            "sequenceLength": rnd.choice([62, 64, 96, 1024, 2048]),
        },
    }
    choice = rnd.random()
    if choice < 0.6:
        spec["rayCluster"] = {
            "workers": {
                "replicas": rnd.choice([1, 2, 3]),
                "gpusPerWorker": rnd.choice([0, 1, 2, 4]),
            }
        }
    if choice > 0.4:
        spec["rayClusterRef"] = {"name": "x"}
    # drawn last, so the draws above (and the specs they give) stay as they were
    spec["training"]["checkpointDir"] = rnd.choice(
        ["", "/ckpt", "/ckpt/run1", "/ckpt-other", "/ckpt/../etc", "/elsewhere"]
    )
    if "rayCluster" in spec and rnd.random() < 0.5:
        spec["rayCluster"]["storage"] = {"claimName": "ckpt", "mountPath": "/ckpt"}
    if rnd.random() < 0.4:  # drawn last too: a Llama checkpoint, with Llama or other layers
        spec["model"]["pretrained"] = "/ckpt/llama"
        spec["model"]["positionEmbedding"] = rnd.choice(["auto", "rope", "learned_absolute"])
        spec["model"]["normalization"] = rnd.choice(["RMSNorm", "LayerNorm"])
        spec["model"]["activation"] = rnd.choice(["swiglu", "gelu"])
    if rnd.random() < 0.3:  # drawn last too: a Kueue queue, with rayCluster or rayClusterRef
        spec["queue"] = {"name": "team-a"}
    if rnd.random() < 0.4:  # drawn last too: Qwen (with Llama's other fields or not), headDim
        model = spec["model"]
        model["architecture"] = rnd.choice(["llama", "qwen2", "qwen3"])
        model["headDim"] = rnd.choice([0, 0, 32])
        if "pretrained" not in model:
            model["positionEmbedding"] = rnd.choice(["auto", "rope", "rope", "learned_absolute"])
            model["normalization"] = rnd.choice(["RMSNorm", "RMSNorm", "LayerNorm"])
            model["activation"] = rnd.choice(["swiglu", "swiglu", "gelu"])
    if "rayCluster" in spec and rnd.random() < 0.3:  # drawn last too: extra volumes, devices
        spec["rayCluster"]["workers"]["volumes"] = [
            {"name": rnd.choice(["ib", "dshm", "checkpoints"]), "mountPath": "/dev/infiniband",
             "source": {"hostPath": {"path": "/dev/infiniband"}}}
        ]
        spec["rayCluster"]["workers"]["extendedResources"] = [
            {"name": rnd.choice(["rdma/ib", "vpc.amazonaws.com/efa", "nvidia.com/gpu"])}
        ]
    return spec


def _wire(spec: dict[str, Any]) -> dict[str, Any]:
    parsed, errors = from_wire(tgapi.TrainerGroupSpec, spec, path="spec")
    assert parsed is not None and not errors
    wire: dict[str, Any] = tgapi.to_wire(parsed)
    return wire


SPECS = [_wire(_random_spec(random.Random(seed))) for seed in range(150)]


def test_every_rule_is_in_the_crd_or_the_policy() -> None:
    doc = yaml.safe_load(crd.render())
    crd_rules = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "x-kubernetes-validations"
    ]
    policy = next(yaml.safe_load_all(crd.render_policy()))
    assert [v["rule"] for v in crd_rules] == [r.cel_rule() for r in rules.crd_rules()]
    assert [v["expression"] for v in policy["spec"]["validations"]] == [
        r.cel_rule("object.spec") for r in crd.policy_validations()
    ]
    assert len(crd_rules) + len(policy["spec"]["validations"]) == len(rules.RULES) + len(
        sizing.SIZING_RULES
    )
    names = [r.name for r in rules.RULES]
    assert len(set(names)) == len(names)
    for r in rules.crd_rules():  # the CRD can't see untyped fields
        assert "useGpu" not in r.cel_rule() + r.cel_message_expression()
    assert {r.name for r in rules.policy_rules()} == {
        "gpu-choice",
        "gpu-pods-have-gpus",
        "gpu-nodes-fit-replicas",
        "gpu-processes-fit-pods",
        "tensor-groups-in-node",
    }


def test_messages_are_tgapi_errors() -> None:
    spec = _wire(
        {
            "model": {"ffnHiddenSize": 127},
            "parallelism": {"tensor": 2},
            "workers": {"processesPerNode": [2]},
            "rayClusterRef": {"name": "x"},
        }
    )
    with pytest.raises(tgapi.SpecErrors) as info:
        tgapi.parse_spec(spec)
    (err,) = info.value.errors
    assert str(err) == (
        "spec.model.ffnHiddenSize: 127 is not divisible by tensor parallel size 2. "
        "Fix: use an FFN size that is a multiple of parallelism.tensor"
    )
    (rule,) = rules.broken(spec)
    assert rule.message(spec) == f"{err.problem}. Fix: {err.fix}"


def test_every_rule_is_broken_by_some_spec() -> None:
    broken = {r.name for s in SPECS for r in rules.broken(s)}
    assert broken == {r.name for r in rules.RULES if not r.type_guard}
    # a type guard never breaks on a parsed spec: the parser refused the value first
    guards = [r for r in rules.RULES if r.type_guard]
    assert guards and not [r for s in SPECS for r in guards if r.broken_by(s)]


def test_local_mode_skips_the_cluster_rules() -> None:
    assert {r.name for r in rules.RULES} - {r.name for r in rules.rules(local=True)} == {
        "cluster-choice",
        "gpu-pods-have-gpus",
        "gpu-nodes-fit-replicas",
        "gpu-processes-fit-pods",
        "checkpoint-on-storage",
        "checkpoint-needs-storage",
        "tensor-groups-in-node",
    }


# -- CEL, evaluated ------------------------------------------------------------------------
import celpy  # noqa: E402
from celpy import celtypes  # noqa: E402
from celpy.adapter import json_to_cel  # noqa: E402
from celpy.evaluation import CELFunction  # noqa: E402


def _k8s_sum(items: Any) -> Any:  # the Kubernetes CEL list library's l.sum()
    return celtypes.IntType(sum(int(i) for i in items))


def _k8s_max(items: Any) -> Any:  # the list library's l.max() (an error on an empty list)
    if not items:
        raise ValueError("max() of an empty list")
    return celtypes.IntType(max(int(i) for i in items))


_VERB = re.compile(r"%%|%d|%s|%\.(\d+)f")


def _k8s_format(text: Any, args: Any) -> Any:
    """The strings library's "...".format([...]) for the verbs tgapi writes: %d (an int),
    %s (a string), %.<n>f (a double), %%."""
    values = iter(args)

    def one(m: re.Match[str]) -> str:
        if m.group() == "%%":
            return "%"
        value = next(values)
        if m.group() == "%d":
            assert isinstance(value, celtypes.IntType), value
            return str(int(value))
        if m.group() == "%s":
            assert isinstance(value, celtypes.StringType), value
            return str(value)
        assert isinstance(value, celtypes.DoubleType), value
        return f"{float(value):.{int(m.group(1))}f}"

    return celtypes.StringType(_VERB.sub(one, str(text)))


def _k8s_quantity(text: Any) -> Any:
    """A stand-in for the quantity library's quantity(s): the value as a double (tgapi's
    parser; the real library is exercised by tests/k8s/test_admission.py)."""
    value = sizing.parse_quantity(str(text))
    if value is None:
        raise ValueError(f"not a quantity: {text}")
    return celtypes.DoubleType(float(value) if value < 2**1000 else float("inf"))


def _k8s_is_quantity(text: Any) -> Any:
    return celtypes.BoolType(sizing.parse_quantity(str(text)) is not None)


def _k8s_as_approximate_float(q: Any) -> Any:
    return q


def _k8s_lower_ascii(text: Any) -> Any:
    return celtypes.StringType(str(text).translate(str.maketrans(string.ascii_uppercase,
                                                                 string.ascii_lowercase)))


_ENV = celpy.Environment()
_FUNCTIONS: dict[str, CELFunction] = {
    "sum": _k8s_sum,
    "max": _k8s_max,
    "format": _k8s_format,
    "quantity": _k8s_quantity,
    "isQuantity": _k8s_is_quantity,
    "asApproximateFloat": _k8s_as_approximate_float,
    "lowerAscii": _k8s_lower_ascii,
}


@functools.cache
def _program(expr: str) -> Any:
    return _ENV.program(_ENV.compile(expr), functions=_FUNCTIONS)


def _run(expr: str, activation: dict[str, Any]) -> Any:
    return _program(expr).evaluate({k: json_to_cel(v) for k, v in activation.items()})


_POLICY = next(yaml.safe_load_all(crd.render_policy()))


def policy_activation(spec: dict[str, Any]) -> dict[str, Any]:
    """``object`` and ``variables`` as the admission policy sees them: each of the generated
    policy's variables evaluated in order (one that fails is left out, so reading it is an
    error, as the API server's lazy variables are)."""
    obj = json_to_cel({"spec": spec})
    values: dict[str, Any] = {}
    for var in _POLICY["spec"].get("variables", []):
        activation = {"object": obj, "variables": celtypes.MapType(values)}
        with contextlib.suppress(celpy.evaluation.CELEvalError):
            values[celtypes.StringType(var["name"])] = _program(var["expression"]).evaluate(
                activation
            )
    return {"object": obj, "variables": celtypes.MapType(values)}


def run_policy(expr: str, activation: dict[str, Any]) -> Any:
    """A policy expression over :func:`policy_activation`'s values (an error is returned by
    cel-python as a CELEvalError value or raised)."""
    result = _program(expr).evaluate(activation)
    if isinstance(result, celpy.evaluation.CELEvalError):
        raise result
    return result


@pytest.mark.parametrize("rule", rules.RULES, ids=[r.name for r in rules.RULES])
def test_cel_agrees_with_python(rule: rules.Rule) -> None:
    """CRD CEL over `self` (the spec) and policy CEL over `object.spec`: the same verdict
    as Python on every spec, and the same sentence whenever the rule is broken."""
    for spec in SPECS:
        crd_verdict = _run(rule.cel_rule(), {"self": spec})
        policy_verdict = _run(rule.cel_rule("object.spec"), {"object": {"spec": spec}})
        broken = rule.broken_by(spec)
        assert bool(crd_verdict) is (not broken) and bool(policy_verdict) is (not broken), spec
        if broken:
            assert str(_run(rule.cel_message_expression(), {"self": spec})) == rule.message(spec)
            policy_message = _run(
                rule.cel_message_expression("object.spec", f"spec.{rule.field}: "),
                {"object": {"spec": spec}},
            )
            assert str(policy_message) == f"spec.{rule.field}: {rule.message(spec)}"


@pytest.mark.parametrize("value", [1, 0, "yes", "Auto", "true", [True], {"a": 1}])
def test_the_policy_refuses_what_the_parser_refuses_in_useGpu(value: Any) -> None:
    """useGpu is untyped in the CRD: the policy's type guard refuses what tgapi's parser does,
    with tgapi's fix (the parser names the value too)."""
    (guard,) = [r for r in rules.RULES if r.type_guard]
    spec = {**SPECS[0], "workers": {**SPECS[0]["workers"], "useGpu": value}}
    # The API server's CEL compares across types (false); cel-python raises on int == bool,
    # which the policy (failurePolicy: Fail) counts as a refusal too.
    try:
        verdict = bool(_run(guard.cel_rule("object.spec"), {"object": {"spec": spec}}))
    except celpy.evaluation.CELEvalError:
        verdict = False
    assert not verdict
    assert guard.broken_by(spec)
    with pytest.raises(tgapi.SpecErrors) as info:
        tgapi.parse_spec(spec)
    (err,) = [e for e in info.value.errors if e.field == "spec.workers.useGpu"]
    assert err.fix == guard.fix.render(spec)
    for ok in (True, False, "auto"):
        spec["workers"]["useGpu"] = ok
        assert _run(guard.cel_rule("object.spec"), {"object": {"spec": spec}})
