"""Cross-field rules of a TrainerGroup spec (what a per-field schema cannot say).

The rules themselves are declared once, in ``rules.py``: this module evaluates them in
Python, and ``crd.py`` writes the same records as CEL ``x-kubernetes-validations`` in
the CRD. Both give the same sentence at the same field, so a user reads the same
thing from ``kubectl apply`` and from ``tgctl``.

Every rule is checked (none hides another), so one pass reports every mistake.
"""

from __future__ import annotations

from tgapi.errors import SpecError
from tgapi.model import TrainerGroupSpec
from tgapi.rules import MSG_CLUSTER_CHOICE, broken
from tgapi.wire import to_wire

__all__ = ["MSG_CLUSTER_CHOICE", "cross_field_errors"]


def cross_field_errors(
    spec: TrainerGroupSpec, *, path: str = "spec", local: bool = False
) -> list[SpecError]:
    """The spec's cross-field errors; ``local`` (tgctl, no Kubernetes) skips the cluster rules."""
    wire = to_wire(spec)
    errors: list[SpecError] = []
    for rule in broken(wire, local=local):
        problem, fix = rule.sentences(wire)
        errors.append(SpecError(field=f"{path}.{rule.field}", problem=problem, fix=fix))
    return errors
