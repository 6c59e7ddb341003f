"""Unit tests of the one spec model: parsing, defaults, error messages, CRD generation."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import tgapi
from tgapi import crd

ROOT = Path(__file__).resolve().parents[2]


def _errors(spec: dict[str, object], *, local: bool = True) -> list[tgapi.SpecError]:
    with pytest.raises(tgapi.SpecErrors) as info:
        tgapi.parse_spec(spec, local=local)
    return info.value.errors


def _fields(spec: dict[str, object], *, local: bool = True) -> list[str]:
    return [e.field for e in _errors(spec, local=local)]


def test_defaults_fill_everything() -> None:
    spec = tgapi.parse_spec({}, local=True)
    assert spec.world_size == 1
    assert spec.parallelism.tensor == 1
    assert spec.model.dtype == "bfloat16"
    assert spec.workers.worker_class == tgapi.DEFAULT_WORKER_CLASS
    assert spec.restart_policy == "OnFailure"


def test_wire_round_trip() -> None:
    tg = tgapi.load_file(ROOT / "examples/local/seed-gpu.yaml", local=True)
    again = tgapi.parse_spec(tgapi.to_wire(tg.spec), local=True)
    assert again == tg.spec
    assert tg.ray_namespace == "tg-default-seed"
    assert tg.name_prefix == "seed"


@pytest.mark.parametrize("path", sorted((ROOT / "examples/local").glob("*.yaml")))
def test_local_examples_parse(path: Path) -> None:
    tg = tgapi.load_file(path, local=True)
    assert tg.spec.world_size % tg.spec.parallelism.tensor == 0


def test_unknown_field_suggests_the_right_name() -> None:
    (err,) = _errors({"parallelizm": {"tensor": 2}})
    assert err.field == "spec.parallelizm"
    assert "parallelism" in err.fix


def test_bad_enum_and_type_are_all_reported() -> None:
    errs = _errors({"model": {"dtype": "bf16", "numLayers": "four"}, "restartPolicy": "Always"})
    text = "\n".join(str(e) for e in errs)
    assert "spec.model.dtype" in text and "bfloat16" in text
    assert "spec.model.numLayers" in text and "integer" in text
    assert "spec.restartPolicy" in text and "OnFailure" in text


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (
            {
                "workers": {"processesPerNode": [3]},
                "parallelism": {"tensor": 2},
                "model": {
                    "numAttentionHeads": 4,
                    "hiddenSize": 64,
                    "vocabSize": 64,
                    "ffnHiddenSize": 64,
                },
            },
            "spec.parallelism",
        ),
        (
            {
                "workers": {"processesPerNode": [2]},
                "parallelism": {"tensor": 2},
                "model": {"numAttentionHeads": 3, "hiddenSize": 63},
            },
            "spec.model.numAttentionHeads",
        ),
        (
            {
                "workers": {"processesPerNode": [2]},
                "parallelism": {"tensor": 2},
                "model": {"vocabSize": 255},
            },
            "spec.model.vocabSize",
        ),
        (
            {
                "model": {"numLayers": 3},
                "parallelism": {"pipeline": 2},
                "workers": {"processesPerNode": [2]},
            },
            "spec.model.numLayers",
        ),
        ({"training": {"sequenceLength": 4096}}, "spec.training.sequenceLength"),
        (
            {"workers": {"processesPerNode": [2]}, "training": {"batchSize": 3}},
            "spec.training.batchSize",
        ),
    ],
)
def test_cross_field_rules_name_the_field(spec: dict[str, object], field: str) -> None:
    errs = _errors(spec)
    assert field in [e.field for e in errs], errs
    assert all(e.fix for e in errs)


def test_cluster_choice_required_in_kubernetes_mode() -> None:
    assert "spec.rayCluster" in _fields({}, local=False)
    assert "spec.rayCluster" in _fields(
        {"rayCluster": {}, "rayClusterRef": {"name": "x"}}, local=False
    )
    tgapi.parse_spec({"rayClusterRef": {"name": "shared"}}, local=False)


def test_gpu_processes_must_fit_the_pods() -> None:
    spec = {
        "rayCluster": {"workers": {"replicas": 1, "gpusPerWorker": 1}},
        "workers": {"processesPerNode": [2]},
    }
    assert "spec.workers.processesPerNode" in _fields(spec, local=False)


def test_resource_errors_cover_metadata_and_kind() -> None:
    with pytest.raises(tgapi.SpecErrors) as info:
        tgapi.parse_resource(
            {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "Bad_Name"}, "spec": {}},
            local=True,
        )
    fields = [e.field for e in info.value.errors]
    assert fields[:3] == ["apiVersion", "kind", "metadata.name"]


def test_bad_yaml_file_says_where(tmp_path: Path) -> None:
    p = tmp_path / "tg.yaml"
    p.write_text(
        "apiVersion: trainergroup.io/v1alpha1\nkind: TrainerGroup\nspec:\n  model: [unclosed\n"
    )
    with pytest.raises(tgapi.SpecErrors) as info:
        tgapi.load_file(p, local=True)
    assert "line" in str(info.value)
    with pytest.raises(tgapi.SpecErrors, match="cannot read"):
        tgapi.load_file(tmp_path / "missing.yaml")


def test_committed_crd_matches_the_generator() -> None:
    text = crd.render()
    for target in crd.TARGETS:
        path = ROOT / target
        assert path.exists(), f"{target} missing: run `python -m tgapi.crd .`"
        assert path.read_text() == text, f"{target} is stale: run `python -m tgapi.crd .`"


def test_crd_schema_covers_status_contract() -> None:
    doc = yaml.safe_load(crd.render())
    version = doc["spec"]["versions"][0]
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    for key in (
        "phase",
        "conditions",
        "workerNames",
        "rayNamespace",
        "rayAddress",
        "dashboardURL",
        "workers",
        "observedGeneration",
        "worldSize",
        "mesh",
        "restarts",
        "groupGeneration",
    ):
        assert key in status
    assert version["subresources"] == {"status": {}}
    assert [c["name"] for c in version["additionalPrinterColumns"]][:6] == [
        "Phase",
        "Ready",
        "Desired",
        "Step",
        "Loss",
        "RayCluster",
    ]
    assert "training" in status and "stallSeconds" in str(version["schema"])


def test_example_validates_against_crd_schema() -> None:
    import jsonschema

    schema = yaml.safe_load(crd.render())["spec"]["versions"][0]["schema"]["openAPIV3Schema"][
        "properties"
    ]["spec"]
    doc = yaml.safe_load((ROOT / "examples/local/seed-gpu.yaml").read_text())
    jsonschema.validate(doc["spec"], _strip_k8s(schema))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"model": {"dtype": "bf16"}}, _strip_k8s(schema))


def _strip_k8s(schema: object) -> object:
    """Drop Kubernetes-only keywords so plain JSON Schema can check the rest."""
    if isinstance(schema, dict):
        out = {k: _strip_k8s(v) for k, v in schema.items() if not k.startswith("x-kubernetes")}
        if out.get("exclusiveMinimum") is True:
            out["exclusiveMinimum"] = out.pop("minimum")
        return out
    if isinstance(schema, list):
        return [_strip_k8s(v) for v in schema]
    return schema


def test_lora_defaults_bounds_and_round_trip() -> None:
    """spec.lora: absent -> full weights; present -> the SDK's LoraConfig defaults (rank 32,
    every switch on) plus alpha; rank < 1 and alpha <= 0 name their field."""
    assert tgapi.parse_spec({}, local=True).lora is None
    spec = tgapi.parse_spec({"lora": {}}, local=True)
    assert spec.lora is not None
    assert spec.lora.settings() == {
        "rank": 32, "alpha": 32.0, "train_attn": True, "train_mlp": True, "train_unembed": True
    }
    spec = tgapi.parse_spec({"lora": {"rank": 8, "trainUnembed": False}}, local=True)
    assert tgapi.parse_spec(tgapi.to_wire(spec), local=True) == spec
    assert tgapi.to_wire(spec)["lora"]["trainUnembed"] is False
    bad = sorted(_fields({"lora": {"rank": 0, "alpha": 0}}))
    assert bad == ["spec.lora.alpha", "spec.lora.rank"]
    assert _fields({"lora": {"rnak": 8}}) == ["spec.lora.rnak"]
