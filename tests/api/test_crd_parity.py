"""The CRD admits nothing that tgapi rejects (property-based).

For random specs (tests/api/strategies.py) this plays the API server's part in-process:
prune unknown fields and nulls, apply the schema's defaults, validate against the
generated openAPIV3Schema (jsonschema, draft 4 as the CRD's boolean exclusiveMinimum
is), then run the CRD's CEL rules and the ValidatingAdmissionPolicy's (cel-python, as
tests/api/test_rules.py does). Whenever all of that accepts, tgapi must accept the stored
object too, except for the one documented check neither can state: the size estimate
(tgapi.sizing: products of big integers and quantities), which the operator's parse
enforces before any RayCluster exists; those errors must then be exactly the estimate's.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings

import tgapi
from tests.api.strategies import near_valid_specs, spec_dicts
from tests.api.test_rules import _run
from tgapi import crd, rules, sizing

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
    for rule in rules.policy_rules():
        if not _cel_holds(rule.cel_rule("object.spec"), {"object": {"spec": stored}}):
            return False, stored
    return True, stored


def _cel_holds(expr: str, activation: dict[str, Any]) -> bool:
    """A rule holds when CEL says true; an evaluation error refuses, as in the API server
    (the CRD reports it, the policy's failurePolicy is Fail)."""
    try:
        result = _run(expr, activation)
    except celpy.evaluation.CELEvalError:
        return False
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
    try:
        tgapi.parse_spec(stored)
    except tgapi.SpecErrors as exc:
        parsed = _parse_fields_only(stored)
        assert parsed is not None, f"the CRD admits what tgapi's field checks refuse:\n{exc}"
        estimate = [str(e) for e in sizing.sizing_errors(parsed)]
        assert [str(e) for e in exc.errors] == estimate, exc


def _parse_fields_only(stored: dict[str, Any]) -> tgapi.TrainerGroupSpec | None:
    from tgapi.parse import _Parser

    parser = _Parser()
    parsed = parser.parse_dataclass(tgapi.TrainerGroupSpec, stored, "spec")
    return parsed if not parser.errors else None


def test_the_estimate_is_the_only_exception() -> None:
    """A spec the CRD admits and the estimate refuses exists (so the exception is real)."""
    spec = {"model": {"hiddenSize": 8192, "numAttentionHeads": 64, "numLayers": 80},
            "rayCluster": {"workers": {"gpusPerWorker": 0, "memory": "8Gi"}}}
    accepted, stored = api_server_accepts(spec)
    assert accepted
    with pytest.raises(tgapi.SpecErrors) as info:
        tgapi.parse_spec(stored)
    assert [e.field for e in info.value.errors] == ["spec.rayCluster.workers.memory"]
