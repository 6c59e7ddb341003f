"""launch.plan as a table: spec + cluster resources -> pool, env, mesh, prefix, init payload.

Pure (no Ray): the plan is what ``server.run`` acts on, computed once.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

import tgapi
from tests.specs import tiny_spec
from tgruntime.launch.plan import ClusterResources, GroupPlan, plan

NOSET = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}


def _tg(**sections: Any) -> tgapi.TrainerGroup:
    body = {
        "apiVersion": "trainergroup.io/v1alpha1",
        "kind": "TrainerGroup",
        "metadata": {"name": "tiny", "namespace": "team-a"},
        "spec": tiny_spec(k8s=False, **sections),
    }
    return tgapi.parse_resource(body, local=True)


def _cluster(gpus: float = 0, cpus: float = 8) -> ClusterResources:
    node = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    return ClusterResources(nodes=(node,))


CASES: list[tuple[str, dict[str, Any], ClusterResources, int, dict[str, Any]]] = [
    (
        "auto-without-gpus-is-cpu",
        {"workers": {"useGpu": "auto"}},
        _cluster(gpus=0),
        0,
        {"use_gpu": False, "gpu_auto": True, "env": {}, "name_prefix": "tiny"},
    ),
    (
        "auto-with-gpus-is-gpu",
        {"workers": {"useGpu": "auto"}},
        _cluster(gpus=2),
        0,
        {"use_gpu": True, "gpu_auto": True, "env": NOSET},
    ),
    (
        "explicit-cpu",
        {},
        _cluster(gpus=2),
        0,
        {"use_gpu": False, "gpu_auto": False, "env": {}},
    ),
    (
        "later-generation-gets-a-suffix",
        {},
        _cluster(),
        3,
        {"name_prefix": "tiny-g3-", "generation": 3},
    ),
    (
        "mesh-from-parallelism",
        {"parallelism": {"tensor": 2}},
        _cluster(),
        0,
        {"mesh": {"tp": 2, "pp": 1, "cp": 1, "dp": 1}},
    ),
    (
        "data-parallel-fills-the-rest",
        {"workers": {"processesPerNode": [4]}, "parallelism": {"tensor": 2}},
        _cluster(),
        0,
        {"mesh": {"tp": 2, "pp": 1, "cp": 1, "dp": 2}},
    ),
]


@pytest.mark.parametrize(
    ("case", "sections", "cluster", "generation", "expected"), CASES, ids=[c[0] for c in CASES]
)
def test_plan_table(
    case: str,
    sections: dict[str, Any],
    cluster: ClusterResources,
    generation: int,
    expected: dict[str, Any],
) -> None:
    p = plan(_tg(**sections), generation=generation, cluster=cluster)
    for field, value in expected.items():
        got = getattr(p, field)
        assert (dict(got) if field in ("env", "mesh") else got) == value, (case, field)


def test_the_plan_carries_the_resolved_spec_everywhere() -> None:
    p: GroupPlan = plan(_tg(workers={"useGpu": "auto"}), generation=0, cluster=_cluster(gpus=2))
    assert p.tg.spec.workers.use_gpu is True
    assert p.pool.use_gpu is True and tuple(p.pool.process_on_nodes) == (2,)
    payload = json.loads(p.init_payload)
    assert payload["workers"]["useGpu"] is True  # the workers never see "auto"
    assert p.tg.group_name == "tiny"


def test_infeasible_fix_names_the_field_to_change() -> None:
    p = plan(_tg(workers={"useGpu": True}), generation=0, cluster=_cluster(gpus=0))
    assert "workers.useGpu" in p.infeasible_fix
    p = plan(_tg(workers={"cpusPerProcess": 4.0}), generation=0, cluster=_cluster(cpus=2))
    assert "workers.cpusPerProcess" in p.infeasible_fix


def test_a_negative_generation_is_refused() -> None:
    with pytest.raises(ValueError, match="generation"):
        plan(_tg(), generation=-1, cluster=_cluster())
