"""Generate the TrainerGroup CustomResourceDefinition from the spec model.

This is the single source of truth for the CRD: ``python -m tgapi.crd`` writes it
to ``manifests/crd/`` and the Helm chart's ``crds/``; a test fails when a committed
copy differs from what this module generates.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from tgapi.expr import variables
from tgapi.fields import default_value, field_meta, has_default
from tgapi.model import (
    API_GROUP,
    API_VERSION,
    KIND,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    TrainerGroupSpec,
)
from tgapi.rules import Rule, crd_rules, policy_rules
from tgapi.sizing import SIZING_RULES
from tgapi.status import TrainerGroupStatus

MAX_LIST = 256

# CEL rules on .spec, one per cross-field rule in rules.py (defaults are applied before
# they run): the same condition, sentence and field as tgapi's own validation. The rules
# that read an untyped field (workers.useGpu), which CEL in a CRD cannot see, go to the
# ValidatingAdmissionPolicy below instead.
SPEC_RULES: list[dict[str, str]] = [rule.validation() for rule in crd_rules()]

PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {
        "name": "Ready",
        "type": "integer",
        "jsonPath": ".status.readyWorkers",
        "description": "Workers alive",
    },
    {
        "name": "Desired",
        "type": "integer",
        "jsonPath": ".status.worldSize",
        "description": "Workers wanted",
    },
    {
        "name": "Step",
        "type": "integer",
        "jsonPath": ".status.training.step",
        "description": "Optimizer steps taken",
    },
    {
        "name": "Loss",
        "type": "number",
        "jsonPath": ".status.training.loss",
        "description": "Loss of the last step",
    },
    {"name": "RayCluster", "type": "string", "jsonPath": ".status.rayClusterName"},
    {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts", "priority": 1},
    {
        "name": "Device",
        "type": "string",
        "jsonPath": ".status.device",
        "description": "What the workers run on (cuda or cpu)",
        "priority": 1,
    },
    {
        "name": "API",
        "type": "string",
        "jsonPath": ".status.apiURL",
        "description": "The Tinker API's base URL (TINKER_BASE_URL)",
        "priority": 1,
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def _schema_for(
    tp: Any, field: dataclasses.Field[Any] | None, *, with_defaults: bool
) -> dict[str, Any]:
    if field is not None and field_meta(field).bool_or_auto:
        # true, false or "auto": a structural schema can't say "boolean or string", so the
        # node is left untyped (preserved as written) and tgapi's parser, which the operator
        # runs on every spec, rejects anything else with a message naming the field.
        return {"x-kubernetes-preserve-unknown-fields": True}
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return _schema_for(inner[0], field, with_defaults=with_defaults)
    meta = field_meta(field) if field is not None else None
    if dataclasses.is_dataclass(tp):
        return object_schema(tp, with_defaults=with_defaults)  # type: ignore[arg-type]
    if origin is list:
        item_tp = args[0]
        if meta is not None and meta.free_form:
            items: dict[str, Any] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        else:
            items = _schema_for(item_tp, None, with_defaults=with_defaults)
            if meta is not None and item_tp in (int, float):
                if meta.minimum is not None:
                    items["minimum"] = meta.minimum
                if meta.maximum is not None:
                    items["maximum"] = meta.maximum
            if meta is not None and item_tp is str:  # the parser checks each item the same way
                if meta.pattern is not None:
                    items["pattern"] = meta.pattern
                if meta.max_length is not None:
                    items["maxLength"] = meta.max_length
        return {"type": "array", "items": items, "maxItems": MAX_LIST}
    if origin is dict:
        if meta is not None and meta.free_form:
            return {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        return {"type": "object", "additionalProperties": {"type": "string"}}
    schema: dict[str, Any] = {
        bool: {"type": "boolean"},
        int: {"type": "integer"},
        float: {"type": "number"},
        str: {"type": "string"},
    }[tp].copy()
    if meta is not None:
        if meta.enum is not None:
            schema["enum"] = list(meta.enum)
        if meta.minimum is not None:
            schema["minimum"] = meta.minimum if tp is float else int(meta.minimum)
            if meta.exclusive_minimum:
                schema["exclusiveMinimum"] = True
        if meta.maximum is not None:
            schema["maximum"] = meta.maximum if tp is float else int(meta.maximum)
        if meta.pattern is not None:
            schema["pattern"] = meta.pattern
        if meta.max_length is not None:
            schema["maxLength"] = meta.max_length
    return schema


def object_schema(cls: type[Any], *, with_defaults: bool) -> dict[str, Any]:
    """OpenAPI v3 schema of a model dataclass (camelCase properties)."""
    hints = typing.get_type_hints(cls)
    props: dict[str, Any] = {}
    required: list[str] = []
    for f in dataclasses.fields(cls):
        meta = field_meta(f)
        s = _schema_for(hints[f.name], f, with_defaults=with_defaults)
        s["description"] = meta.description
        if with_defaults and has_default(f):
            dv = default_value(f)
            if dataclasses.is_dataclass(dv):
                s["default"] = {}
            elif dv is not None:
                s["default"] = dv
        elif not has_default(f):
            required.append(meta.name)
        props[meta.name] = s
    schema: dict[str, Any] = {"type": "object", "properties": props}
    if required:
        schema["required"] = required
    return schema


def crd_manifest() -> dict[str, Any]:
    spec_schema = object_schema(TrainerGroupSpec, with_defaults=True)
    spec_schema["x-kubernetes-validations"] = SPEC_RULES
    status_schema = object_schema(TrainerGroupStatus, with_defaults=False)
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{API_GROUP}"},
        "spec": {
            "group": API_GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": list(SHORT_NAMES),
                "listKind": f"{KIND}List",
                "categories": ["all"],
            },
            "versions": [
                {
                    "name": API_VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": (
                                "A long-lived group of detached Megatron training workers"
                                " on a Ray cluster."
                            ),
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec_schema,
                                "status": status_schema,
                            },
                            "required": ["spec"],
                        }
                    },
                }
            ],
        },
    }


POLICY_NAME = f"{PLURAL}.{API_GROUP}"


def policy_validations() -> list[Rule]:
    """The admission policy's rules, in order: the cross-field rules CEL in the CRD can't
    state, then the size estimate (tgapi.sizing: it reads workers.useGpu and the policy's
    variables, neither of which CEL in a CRD has)."""
    return [*policy_rules(), *SIZING_RULES]


def _policy_variables() -> list[dict[str, str]]:
    rules = policy_validations()
    found = variables(*(r.holds for r in rules), *(t for r in rules for t in (r.problem, r.fix)))
    return [{"name": v.name, "expression": v.expr.cel("object.spec")} for v in found]


def policy_manifests(name: str = POLICY_NAME) -> list[dict[str, Any]]:
    """A ValidatingAdmissionPolicy (and its binding) with the rules CEL in the CRD can't state."""
    labels = {"app.kubernetes.io/part-of": "trainergroup"}
    return [
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicy",
            "metadata": {"name": name, "labels": labels},
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {
                    "resourceRules": [
                        {
                            "apiGroups": [API_GROUP],
                            "apiVersions": [API_VERSION],
                            "operations": ["CREATE", "UPDATE"],
                            "resources": [PLURAL],
                        }
                    ]
                },
                # An update that leaves the spec alone (finalizers, labels) is never refused:
                # a group stored before the policy existed can still be cleaned up.
                "matchConditions": [
                    {
                        "name": "spec-written",
                        "expression": "request.operation == 'CREATE' || "
                        "object.spec != oldObject.spec",
                    }
                ],
                "variables": _policy_variables(),
                "validations": [rule.policy_validation() for rule in policy_validations()],
            },
        },
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicyBinding",
            "metadata": {"name": name, "labels": labels},
            "spec": {"policyName": name, "validationActions": ["Deny"]},
        },
    ]


HEADER = (
    "# GENERATED by `python -m tgapi.crd` from api/tgapi (the single source). Do not edit.\n"
)
TARGETS = ("manifests/crd/trainergroups.yaml", "charts/trainergroup/crds/trainergroups.yaml")
POLICY_TARGET = "manifests/crd/admission-policy.yaml"
CHART_POLICY_TARGET = "charts/trainergroup/templates/admission-policy.yaml"
# In the chart the policy is the release's (cluster-scoped objects of two releases must not
# share a name) and optional (`admissionPolicy.enabled`, for clusters without
# admissionregistration.k8s.io/v1 ValidatingAdmissionPolicy, Kubernetes < 1.30).
_CHART_NAME = "tg-chart-policy-name"
_CHART_NAME_TEMPLATE = '{{ include "trainergroup.fullname" . }}-' + POLICY_NAME


def render() -> str:
    return HEADER + yaml.safe_dump(crd_manifest(), sort_keys=False, width=120)


def render_policy(name: str = POLICY_NAME) -> str:
    text = HEADER + yaml.safe_dump_all(policy_manifests(name), sort_keys=False, width=120)
    if "{{" in text:  # the chart copy is a Helm template: it must hold no template actions
        raise ValueError("the admission policy contains '{{'")
    return text


def render_chart_policy() -> str:
    """The chart's copy: release-named, behind ``admissionPolicy.enabled``."""
    body = render_policy(_CHART_NAME).removeprefix(HEADER)
    body = body.replace(_CHART_NAME, _CHART_NAME_TEMPLATE)
    return HEADER + "{{- if .Values.admissionPolicy.enabled }}\n" + body + "{{- end }}\n"


def outputs() -> dict[str, str]:
    """Every generated file (path under the repository root) and its content."""
    crd_text = render()
    return {
        **{t: crd_text for t in TARGETS},
        POLICY_TARGET: render_policy(),
        CHART_POLICY_TARGET: render_chart_policy(),
    }


def main(argv: list[str] | None = None) -> int:
    """Write the CRD and the admission policy to every target under the repository root.

    The root defaults to '.'; ``--check`` only compares.
    """
    args = sys.argv[1:] if argv is None else argv
    check = "--check" in args
    args = [a for a in args if a != "--check"]
    root = Path(args[0] if args else ".")
    files = outputs()
    if check:
        stale = [
            t
            for t, text in files.items()
            if not (root / t).exists() or (root / t).read_text() != text
        ]
        for t in stale:
            print(
                f"{t} is stale: run `python -m tgapi.crd .` and commit the result",
                file=sys.stderr,
            )
        return 1 if stale else 0
    for target, text in files.items():
        path = root / target
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
