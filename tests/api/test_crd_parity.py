"""The CRD admits nothing that tgapi rejects (property-based).

For random specs (tests/api/strategies.py) this plays the API server's part in-process:
prune unknown fields and nulls, apply the schema's defaults, validate against the
generated openAPIV3Schema (jsonschema, draft 4 as the CRD's boolean exclusiveMinimum
is), then run the CRD's CEL rules and the ValidatingAdmissionPolicy's, its variables and
the size estimate included (cel-python, as tests/api/test_rules.py does). Whenever all of
that accepts, tgapi must accept the stored object too: no check is left to the operator.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings

import tgapi
from tests.api.strategies import near_valid_specs, spec_dicts
from tests.api.test_rules import _run, policy_activation, run_policy
from tgapi import crd, rules

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema (dev dependency) is missing")
celpy = pytest.importorskip("celpy", reason="cel-python (dev dependency) is not installed")

CRD = yaml.safe_load(crd.render())
SPEC_SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
VALIDATOR = jsonschema.Draft4Validator(SPEC_SCHEMA)


def _preserves(schema: dict[str, Any]) -> bool:
    return bool(schema.get("x-kubernetes-preserve-unknown-fields"))


def prune_and_default(value: Any, schema: dict[str, Any]) -> Any:
    """What the API server stores: unknown fields and nulls dropped, defaults applied."""
    if _preserves(schema) and "properties" not in schema:
        return value
    if schema.get("type") == "object" and isinstance(value, dict):
        props = schema.get("properties")
        if props is None:  # a map (additionalProperties)
            return {k: v for k, v in value.items() if v is not None}
        out = {}
        for key, sub in props.items():
            if value.get(key) is not None:
                out[key] = prune_and_default(value[key], sub)
            elif "default" in sub:
                out[key] = prune_and_default(copy.deepcopy(sub["default"]), sub)
        return out
    if schema.get("type") == "array" and isinstance(value, list):
        return [prune_and_default(v, schema["items"]) for v in value]
    return value


def api_server_accepts(spec: Any) -> tuple[bool, Any]:
    stored = prune_and_default(spec, SPEC_SCHEMA)
    if not VALIDATOR.is_valid(stored):
        return False, stored
    for rule in rules.crd_rules():
        if not _cel_holds(rule.cel_rule(), {"self": stored}):
            return False, stored
    policy = policy_activation(stored)
    for rule in crd.policy_validations():
        if not _cel_holds(rule.cel_rule("object.spec"), policy, run=run_policy):
            return False, stored
    return True, stored


def _cel_holds(expr: str, activation: dict[str, Any], *, run: Any = _run) -> bool:
    """A rule holds when CEL says true; an evaluation error refuses, as in the API server
    (the CRD reports it, the policy's failurePolicy is Fail)."""
    try:
        result = run(expr, activation)
    except (celpy.evaluation.CELEvalError, OverflowError, ValueError):
        return False  # ValueError: celpy's int64 overflow (2**63), which the server refuses too
    return type(result).__name__ == "BoolType" and bool(result)


@settings(max_examples=250, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(spec=near_valid_specs() | spec_dicts())
@example(spec={"workers": {"useGpu": 1}, "rayClusterRef": {"name": "x"}})
@example(spec={"workers": {"useGpu": "yes"}, "rayClusterRef": {"name": "x"}})
@example(spec={"rayClusterRef": {"name": "x"}, "rayCluster": None})
def test_what_the_crd_admits_tgapi_accepts(spec: dict[str, Any]) -> None:
    accepted, stored = api_server_accepts(spec)
    if not accepted:
        return
    tgapi.parse_spec(stored)


def test_the_size_estimate_is_refused_at_admission() -> None:
    """A model too big for its pods, which the CRD's own rules admit, is the policy's to
    refuse (it was the operator's until the estimate moved into the policy)."""
    spec = {"model": {"hiddenSize": 8192, "numAttentionHeads": 64, "numLayers": 80},
            "rayCluster": {"workers": {"gpusPerWorker": 0, "memory": "8Gi"}}}
    stored = prune_and_default(spec, SPEC_SCHEMA)
    assert all(_cel_holds(r.cel_rule(), {"self": stored}) for r in rules.crd_rules())
    accepted, _ = api_server_accepts(spec)
    assert not accepted
    with pytest.raises(tgapi.SpecErrors) as info:
        tgapi.parse_spec(stored)
    assert [e.field for e in info.value.errors] == ["spec.rayCluster.workers.memory"]
