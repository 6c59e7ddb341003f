"""The one tiny TrainerGroup spec the tests and the local plane build on.

A Llama-shaped model small enough for 2 CPU cores (gloo), and the Kubernetes-side sections
(image, Ray version, RayCluster sizes) the operator tests need. :func:`tiny_spec` returns a
fresh deep copy with the given sections merged over the defaults (one level deep: a section
given replaces the keys it names and keeps the others).
"""

from __future__ import annotations

import copy
from typing import Any

RUNTIME_IMAGE = "ghcr.io/trainergroup/runtime:0.1.0"

TINY_MODEL: dict[str, Any] = {
    "vocabSize": 128,
    "hiddenSize": 64,
    "numLayers": 2,
    "numAttentionHeads": 4,
    "ffnHiddenSize": 128,
    "maxSequenceLength": 64,
    "dtype": "float32",
}

_LOCAL: dict[str, Any] = {
    "workers": {"processesPerNode": [2], "useGpu": False},
    "parallelism": {"tensor": 1},
    "model": TINY_MODEL,
    "training": {"batchSize": 4, "sequenceLength": 32},
}

_K8S: dict[str, Any] = {
    "image": RUNTIME_IMAGE,
    "rayVersion": "2.60.0",
    "rayCluster": {
        "head": {"cpu": "1", "memory": "2Gi"},
        # GPU pods (they land on the fake GPU node) whose workers may still run on CPU.
        "workers": {"replicas": 1, "gpusPerWorker": 2, "cpu": "2", "memory": "4Gi"},
    },
    "restartPolicy": "OnFailure",
}


def tiny_spec(*, k8s: bool = True, **sections: Any) -> dict[str, Any]:
    """The tiny spec (with the Kubernetes sections unless ``k8s=False``), ``sections`` merged."""
    spec = copy.deepcopy({**_LOCAL, **(_K8S if k8s else {})})
    for key, value in copy.deepcopy(sections).items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key].update(value)
        else:
            spec[key] = value
    return spec
