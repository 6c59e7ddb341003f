"""Admission: the real API server rejects every class of cross-field mistake at apply time,
with tgapi's own sentence at tgapi's field, and creates nothing.

The CRD's ``x-kubernetes-validations`` are generated from ``tgapi.rules`` (one record per
rule); here each mistake is sent to the API server of the local control plane, both with
``kubectl apply`` (what a user runs) and with the kubernetes client (to compare the
server's structured causes with tgapi's errors one for one).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import yaml

import tgapi
from tests.fixtures_k8s import KubePlane, wait_until
from tgapi import rules

pytestmark = pytest.mark.k8s

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "manifests" / "crd" / "trainergroups.yaml"
POLICY = REPO / "manifests" / "crd" / "admission-policy.yaml"
CRD_NAME = f"{tgapi.PLURAL}.{tgapi.API_GROUP}"
CLUSTER = {"rayCluster": {"workers": {"replicas": 2, "gpusPerWorker": 2}}}
SMALL_MODEL = {"numAttentionHeads": 4, "hiddenSize": 64, "vocabSize": 64, "ffnHiddenSize": 128,
               "numLayers": 4, "maxSequenceLength": 128}
GOOD: dict[str, Any] = {
    **CLUSTER,
    "workers": {"processesPerNode": [2, 2]},
    "parallelism": {"tensor": 2},
    "model": SMALL_MODEL,
    "training": {"batchSize": 4, "sequenceLength": 128},
}


def spec_with(**changes: dict[str, Any] | None) -> dict[str, Any]:
    """GOOD with some sections merged (a None section is removed)."""
    spec: dict[str, Any] = json.loads(json.dumps(GOOD))
    for key, value in changes.items():
        if value is None:
            spec.pop(key, None)
        elif isinstance(spec.get(key), dict):
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    return spec


# One spec per class of mistake: (the rule it breaks, the spec). Together they break every
# rule in tgapi.rules (test_every_rule_has_a_case checks that).
MISTAKES: list[tuple[str, dict[str, Any]]] = [
    ("processes-listed", spec_with(workers={"processesPerNode": []})),
    ("model-parallel-divides-world", spec_with(workers={"processesPerNode": [2, 1]})),
    ("heads-by-tensor", spec_with(model={"numAttentionHeads": 3, "hiddenSize": 63})),
    ("vocab-by-tensor", spec_with(model={"vocabSize": 65})),
    ("hidden-by-heads", spec_with(model={"hiddenSize": 66})),
    ("ffn-by-tensor", spec_with(model={"ffnHiddenSize": 127})),
    ("query-groups", spec_with(model={"numQueryGroups": 3})),
    ("query-groups", spec_with(model={"numQueryGroups": 1})),
    ("layers-by-pipeline", spec_with(model={"numLayers": 3}, parallelism={"pipeline": 2})),
    ("no-expert-parallel", spec_with(parallelism={"expert": 2})),
    (
        "sequence-by-context",
        spec_with(parallelism={"context": 2}, training={"sequenceLength": 126}),
    ),
    ("sequence-fits-model", spec_with(training={"sequenceLength": 256})),
    ("batch-by-data-parallel", spec_with(training={"batchSize": 3})),
    ("cluster-choice", spec_with(rayCluster=None)),
    ("cluster-choice", spec_with(rayClusterRef={"name": "shared"})),
    ("queue-needs-cluster", spec_with(rayCluster=None, rayClusterRef={"name": "shared"},
                                      queue={"name": "team-a"})),
    ("gpu-pods-have-gpus", spec_with(workers={"useGpu": True},
                                     rayCluster={"workers": {"replicas": 2, "gpusPerWorker": 0}})),
    (
        "gpu-nodes-fit-replicas",
        spec_with(workers={"processesPerNode": [1, 1, 2], "useGpu": "auto"}),
    ),
    (
        "gpu-processes-fit-pods",
        spec_with(workers={"processesPerNode": [4]}, training={"batchSize": 2}),
    ),
    # several at once: every one is reported, in tgapi's words
    ("ffn-by-tensor", spec_with(model={"ffnHiddenSize": 127, "numQueryGroups": 3},
                                parallelism={"expert": 4}, training={"batchSize": 5})),
    ("gpu-processes-fit-pods", spec_with(workers={"processesPerNode": [4, 4, 4, 4]},
                                         training={"batchSize": 8})),
    # the checkpoint directory must be on the checkpoint volume (rayCluster.storage)
    ("checkpoint-on-storage", spec_with(rayCluster={"storage": {"claimName": "ckpt",
                                                                 "mountPath": "/ckpt"}},
                                        training={"checkpointDir": "/ckpt-old/run"})),
    ("checkpoint-on-storage", spec_with(rayCluster={"storage": {"claimName": "ckpt"}},
                                        training={"checkpointDir": "/checkpoints/../etc"})),
    # issue 36: checkpoints of a multi-node group on a shared claim; tensor groups inside a
    # node; the workers' extra volumes and devices
    ("checkpoint-needs-storage", spec_with(training={"checkpointDir": "/ckpt/run"})),
    ("tensor-groups-in-node", spec_with(parallelism={"tensor": 4})),
    ("worker-volume-names", spec_with(rayCluster={"workers": {
        "replicas": 2, "gpusPerWorker": 2,
        "volumes": [{"name": "dshm", "mountPath": "/x", "source": {"emptyDir": {}}}]}})),
    ("extended-resources-not-gpus", spec_with(rayCluster={"workers": {
        "replicas": 2, "gpusPerWorker": 2,
        "extendedResources": [{"name": "nvidia.com/gpu", "count": 2}]}})),
    # a Llama checkpoint (model.pretrained) fixes the position embedding, norm and MLP
    ("pretrained-rope", spec_with(model={"pretrained": "/ckpt/llama",
                                         "positionEmbedding": "learned_absolute"})),
    ("pretrained-rmsnorm", spec_with(model={"pretrained": "/ckpt/llama",
                                            "positionEmbedding": "rope",
                                            "normalization": "LayerNorm"})),
    ("pretrained-swiglu", spec_with(model={"pretrained": "/ckpt/llama",
                                           "positionEmbedding": "rope", "activation": "gelu"})),
    # Qwen2 / Qwen3 (model.architecture) are Llama with QKV biases or q/k norms
    ("architecture-rope", spec_with(model={"architecture": "qwen2"})),
    ("architecture-rmsnorm", spec_with(model={"architecture": "qwen3",
                                              "positionEmbedding": "rope",
                                              "normalization": "LayerNorm"})),
    ("architecture-swiglu", spec_with(model={"architecture": "qwen3",
                                             "positionEmbedding": "rope", "activation": "gelu"})),
]

# Accepted: useGpu in each of its three forms (the schema leaves it untyped), and the
# GPU rules off when useGpu is false or "auto" finds no GPUs.
ACCEPTED: list[dict[str, Any]] = [
    GOOD,
    spec_with(workers={"useGpu": True}),
    spec_with(workers={"useGpu": False, "processesPerNode": [4, 4, 4, 4]},
              rayCluster={"workers": {"replicas": 1, "gpusPerWorker": 0}},
              training={"batchSize": 8}),
    spec_with(workers={"useGpu": "auto", "processesPerNode": [4]},
              rayCluster={"workers": {"replicas": 1, "gpusPerWorker": 0}}),
    spec_with(rayCluster=None, rayClusterRef={"name": "shared"},
              workers={"processesPerNode": [8, 8]}, training={"batchSize": 8}),
    # every platform field of rayCluster, the checkpoint directory on the claim's mount
    spec_with(rayCluster={"storage": {"claimName": "ckpt", "mountPath": "/ckpt"},
                          "serviceAccountName": "trainer", "imagePullSecrets": ["regcred"],
                          "priorityClassName": "high", "labels": {"team": "llm"},
                          "annotations": {"a": "b"}, "podLabels": {"c": "d"},
                          "podAnnotations": {"e": "f"},
                          "head": {"cpu": "500m", "nodeSelector": {"pool": "cpu"},
                                   "tolerations": [{"key": "k", "operator": "Exists"}]}},
              training={"checkpointDir": "/ckpt/run1"}),
    # issue 36's pod fields: runtime class, user, RDMA devices, capabilities, host network,
    # volumes; a GPU group's tensor groups inside its nodes
    spec_with(rayCluster={"runtimeClassName": "nvidia",
                          "podSecurity": {"runAsUser": 1000, "fsGroup": 100},
                          "workers": {"replicas": 2, "gpusPerWorker": 2, "cpuLimit": "16",
                                      "shmSize": "8Gi", "capabilities": ["IPC_LOCK"],
                                      "extendedResources": [{"name": "rdma/ib", "count": 1}],
                                      "hostNetwork": True,
                                      "volumes": [{"name": "ib", "mountPath": "/dev/infiniband",
                                                   "source": {"hostPath": {
                                                       "path": "/dev/infiniband"}}}]}}),
]

# Models that cannot fit the worker pods (tgapi.sizing, in the admission policy): the field
# tgapi names and the spec. A 6.7B shape (tensor 2: 3.4B per worker) on 4Gi CPU pods, on
# GPUs of 16Gi (gpuMemory) and on T4s (16 GB, named by the node selector).
BIG_MODEL = {"numAttentionHeads": 32, "hiddenSize": 4096, "vocabSize": 32000,
             "ffnHiddenSize": 11008, "numLayers": 32, "maxSequenceLength": 128}
GPU_NODES = {"replicas": 2, "gpusPerWorker": 2}
SIZE_MISTAKES: list[tuple[str, dict[str, Any]]] = [
    ("spec.rayCluster.workers.memory",
     spec_with(model=BIG_MODEL, rayCluster={"workers": {"replicas": 2, "gpusPerWorker": 0,
                                                        "memory": "4Gi"}})),
    ("spec.rayCluster.workers.gpuMemory",
     spec_with(model=BIG_MODEL, rayCluster={"workers": {**GPU_NODES, "gpuMemory": "16Gi"}})),
    ("spec.rayCluster.workers.nodeSelector.nvidia.com/gpu.product",
     spec_with(model=BIG_MODEL, rayCluster={"workers": {
         **GPU_NODES, "nodeSelector": {"nvidia.com/gpu.product": "Tesla-T4"}}})),
]
# ... and the same model where it fits: 1.5Ti pods, 80Gi GPUs, H200s, an unnamed GPU.
ACCEPTED += [
    spec_with(model=BIG_MODEL, rayCluster={"workers": {"replicas": 2, "gpusPerWorker": 0,
                                                       "memory": "1.5Ti"}}),
    spec_with(model=BIG_MODEL, rayCluster={"workers": {**GPU_NODES, "gpuMemory": "80Gi"}}),
    spec_with(model=BIG_MODEL, rayCluster={"workers": {
        **GPU_NODES, "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200"}}}),
    spec_with(model=BIG_MODEL, rayCluster={"workers": GPU_NODES}),
]

# Per-field schema mistakes in the platform fields: refused at the field, by the schema.
FIELD_MISTAKES: list[tuple[str, dict[str, Any]]] = [
    ("spec.rayCluster.storage.claimName", {"storage": {"mountPath": "/ckpt"}}),
    ("spec.rayCluster.storage.mountPath", {"storage": {"claimName": "c", "mountPath": "/ckpt/"}}),
    ("spec.rayCluster.imagePullSecrets[0]", {"imagePullSecrets": ["Not_A_Name"]}),
    ("spec.rayCluster.serviceAccountName", {"serviceAccountName": "UPPER"}),
    ("spec.rayCluster.runtimeClassName", {"runtimeClassName": "Not_A_Name"}),
    ("spec.rayCluster.podSecurity.runAsUser", {"podSecurity": {"runAsUser": 0}}),
    ("spec.rayCluster.workers.capabilities[0]",
     {"workers": {"replicas": 2, "gpusPerWorker": 2, "capabilities": ["SYS_ADMIN"]}}),
    ("spec.rayCluster.workers.extendedResources[0].name",
     {"workers": {"replicas": 2, "gpusPerWorker": 2, "extendedResources": [{"name": "efa"}]}}),
]


RULE_FIELD = {r.name: r.field for r in rules.RULES}


def manifest(name: str, namespace: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": f"{tgapi.API_GROUP}/{tgapi.API_VERSION}", "kind": tgapi.KIND,
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}


def tgapi_errors(spec: dict[str, Any]) -> list[tgapi.SpecError]:
    with pytest.raises(tgapi.SpecErrors) as info:
        tgapi.parse_spec(spec, local=False)
    return info.value.errors


def expected_rejections(spec: dict[str, Any]) -> tuple[list[tgapi.SpecError], bool]:
    """tgapi's errors that the API server reports for ``spec``, and whether they come from
    the CRD (else from the ValidatingAdmissionPolicy). The CRD's rules run first: when one
    of them fails, the request never reaches the policy, so its errors show up on the next
    apply, once the CRD's are fixed; the policy reports the first of its own."""
    errors = tgapi_errors(spec)
    broken = rules.broken(tgapi.to_wire(_parse_unchecked(spec)))
    assert [f"spec.{r.field}" for r in broken] == [e.field for e in errors]
    in_crd = [e for e, r in zip(errors, broken, strict=True) if r.in_crd]
    if in_crd:
        return in_crd, True
    return errors[:1], False  # the policy stops at its first failing validation


@pytest.fixture(scope="module")
def crd_plane(k8s_plane: KubePlane) -> Iterator[KubePlane]:
    """The plane with the CRD and the admission policy applied (as `kubectl apply -f
    manifests/crd/` does), and the policy in force; the policy is removed afterwards (the
    plane is the session's: tests/operator checks the operator's own refusal of a model
    too big for its pods, which the policy would deny at apply)."""
    k8s_plane.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD),
                      "-f", str(POLICY))
    k8s_plane.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s")
    # A new binding takes a moment to reach the admission plugin: wait for a denial.
    probe = spec_with(workers={"processesPerNode": [4]}, training={"batchSize": 2})
    wait_until(lambda: _denied_by_policy(k8s_plane, probe), timeout=60,
               what="the ValidatingAdmissionPolicy to take effect")
    yield k8s_plane
    k8s_plane.kubectl("delete", "-f", str(POLICY), "--ignore-not-found")
    wait_until(lambda: not _denied_by_policy(k8s_plane, probe), timeout=60,
               what="the ValidatingAdmissionPolicy to be gone")


def _denied_by_policy(plane: KubePlane, spec: dict[str, Any]) -> bool:
    proc = plane.kubectl("create", "--dry-run=server", "-f", "-", check=False,
                         input=yaml.safe_dump(manifest("probe", "default", spec)))
    if proc.returncode == 0:
        plane.kubectl("delete", "trainergroup", "probe", "-n", "default", "--ignore-not-found",
                      check=False)
        return False
    return "denied request" in proc.stderr


@pytest.fixture(scope="module")
def custom_objects(crd_plane: KubePlane) -> Iterator[Any]:
    import kubernetes

    api = kubernetes.config.new_client_from_config(  # type: ignore[no-untyped-call]  # untyped
        config_file=str(crd_plane.kubeconfig)
    )
    try:
        yield kubernetes.client.CustomObjectsApi(api)
    finally:
        api.close()


def test_every_rule_has_a_case() -> None:
    # type guards never break on a parsed spec: test_policy_refuses_a_wrongly_typed_use_gpu
    assert {name for name, _ in MISTAKES} == {r.name for r in rules.RULES if not r.type_guard}
    for name, spec in MISTAKES:
        broken = {r.name for r in rules.broken(tgapi.to_wire(_parse_unchecked(spec)))}
        assert name in broken, (name, broken)


def _parse_unchecked(spec: dict[str, Any]) -> tgapi.TrainerGroupSpec:
    from tgapi.wire import _Parser

    parser = _Parser()
    parsed = parser.parse_dataclass(tgapi.TrainerGroupSpec, spec, "spec")
    assert parsed is not None and not parser.errors, parser.errors
    return parsed


@pytest.fixture(scope="module")
def refusal_ns(k8s_plane: KubePlane) -> Iterator[str]:
    """One namespace for the module's refusal tests. Nothing is ever stored in it: each test
    asserts that its object was refused (and, where it lists, that the namespace holds none),
    so they need no namespace each (79 namespaces fewer: a kubectl create, a wait for the
    default ServiceAccount and a delete each, and the namespace controller's cleanup). The
    valid specs, which are stored, get a fresh namespace per test (``k8s_namespace``)."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    k8s_plane.kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        k8s_plane.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.mark.parametrize(("rule", "spec"), MISTAKES,
                         ids=[f"{i}-{name}" for i, (name, _) in enumerate(MISTAKES)])
def test_kubectl_apply_rejects_with_tgapi_message(crd_plane: KubePlane, refusal_ns: str,
                                                   rule: str, spec: dict[str, Any]) -> None:
    assert f"spec.{RULE_FIELD[rule]}" in {e.field for e in tgapi_errors(spec)}
    expected, by_crd = expected_rejections(spec)
    name = f"bad-{uuid.uuid4().hex[:8]}"
    proc = crd_plane.kubectl("apply", "-f", "-", input=yaml.safe_dump(
        manifest(name, refusal_ns, spec)), check=False)
    assert proc.returncode != 0, f"the API server accepted a spec tgapi rejects:\n{expected}"
    for err in expected:
        if by_crd:  # '<field>: Invalid value: "object": <problem>. Fix: <fix>'
            assert f"{err.field}: Invalid value" in proc.stderr, (err.field, proc.stderr)
            assert f"{err.problem}. Fix: {err.fix}" in proc.stderr, (str(err), proc.stderr)
        else:  # 'ValidatingAdmissionPolicy ... denied request: <tgapi's error>'
            assert "denied request" in proc.stderr, proc.stderr
            assert str(err) in proc.stderr, (str(err), proc.stderr)
    got = crd_plane.kubectl("get", "trainergroup", name, "-n", refusal_ns, check=False)
    assert got.returncode != 0 and "NotFound" in got.stderr, got.stdout
    listed = crd_plane.kubectl_json("get", "trainergroups", "-n", refusal_ns)
    assert listed["items"] == []


@pytest.mark.parametrize(("rule", "spec"), MISTAKES,
                         ids=[f"{i}-{name}" for i, (name, _) in enumerate(MISTAKES)])
def test_server_causes_match_tgapi_errors(custom_objects: Any, refusal_ns: str, rule: str,
                                           spec: dict[str, Any]) -> None:
    from kubernetes.client.exceptions import ApiException

    errors, by_crd = expected_rejections(spec)
    with pytest.raises(ApiException) as info:
        custom_objects.create_namespaced_custom_object(
            tgapi.API_GROUP, tgapi.API_VERSION, refusal_ns, tgapi.PLURAL,
            manifest(f"bad-{uuid.uuid4().hex[:8]}", refusal_ns, spec))
    assert info.value.status == 422, info.value.body
    status = json.loads(cast(str, info.value.body))  # the 422 carries a Status body
    if by_crd:
        expected = sorted((e.field, f"{e.problem}. Fix: {e.fix}") for e in errors)
        causes = sorted((c["field"], _detail(c["message"])) for c in status["details"]["causes"])
        assert causes == expected
    else:
        # the policy stops at the first failing validation, in the declared order
        assert status["message"].endswith(str(errors[0])), status["message"]


def _detail(message: str) -> str:
    # The server writes 'Invalid value: "object": <detail>' (the value CEL validated).
    return message.split('": ', 1)[1] if message.startswith("Invalid value: ") else message


@pytest.mark.parametrize("spec", ACCEPTED, ids=[f"ok-{i}" for i in range(len(ACCEPTED))])
def test_valid_specs_are_accepted(crd_plane: KubePlane, k8s_namespace: str,
                                  spec: dict[str, Any]) -> None:
    tgapi.parse_spec(spec, local=False)  # tgapi agrees
    name = f"ok-{uuid.uuid4().hex[:8]}"
    crd_plane.kubectl("apply", "-f", "-", input=yaml.safe_dump(manifest(name, k8s_namespace, spec)))
    stored = crd_plane.kubectl_json("get", "trainergroup", name, "-n", k8s_namespace)
    assert stored["spec"]["workers"]["useGpu"] == spec["workers"].get("useGpu", "auto")


@pytest.mark.parametrize(("field", "cluster"), FIELD_MISTAKES,
                         ids=[f for f, _ in FIELD_MISTAKES])
def test_platform_field_mistakes_are_refused_at_the_field(
        crd_plane: KubePlane, refusal_ns: str, field: str, cluster: dict[str, Any]) -> None:
    spec = spec_with(rayCluster=cluster)
    assert field in {e.field for e in tgapi_errors(spec)}  # tgapi names the same field
    name = f"bad-{uuid.uuid4().hex[:8]}"
    proc = crd_plane.kubectl("apply", "-f", "-", input=yaml.safe_dump(
        manifest(name, refusal_ns, spec)), check=False)
    assert proc.returncode != 0 and field in proc.stderr, proc.stderr
    assert crd_plane.kubectl_json("get", "trainergroups", "-n", refusal_ns)["items"] == []


@pytest.mark.parametrize("value", [1, "yes"])
def test_policy_refuses_a_wrongly_typed_use_gpu(crd_plane: KubePlane, refusal_ns: str,
                                                 value: Any) -> None:
    """useGpu is untyped in the CRD; the policy's type guard (rules.py, gpu-choice) refuses
    what tgapi's parser refuses, at the same field with the same fix."""
    spec = spec_with(workers={"useGpu": value})
    (err,) = [e for e in tgapi_errors(spec) if e.field == "spec.workers.useGpu"]
    name = f"bad-{uuid.uuid4().hex[:8]}"
    proc = crd_plane.kubectl("apply", "-f", "-", input=yaml.safe_dump(
        manifest(name, refusal_ns, spec)), check=False)
    assert proc.returncode != 0 and "denied request" in proc.stderr, proc.stderr
    assert "spec.workers.useGpu: " in proc.stderr and err.fix in proc.stderr, proc.stderr
    got = crd_plane.kubectl("get", "trainergroup", name, "-n", refusal_ns, check=False)
    assert got.returncode != 0


@pytest.mark.parametrize(("field", "spec"), SIZE_MISTAKES, ids=[f for f, _ in SIZE_MISTAKES])
def test_models_that_cannot_fit_are_refused_at_apply(
        crd_plane: KubePlane, custom_objects: Any, refusal_ns: str, field: str,
        spec: dict[str, Any]) -> None:
    """The size estimate is the policy's: kubectl apply is denied with tgapi's whole error
    (the estimate, the limit and the fix) and nothing is created."""
    from kubernetes.client.exceptions import ApiException

    (err,) = tgapi_errors(spec)
    assert err.field == field
    name = f"big-{uuid.uuid4().hex[:8]}"
    proc = crd_plane.kubectl("apply", "-f", "-", input=yaml.safe_dump(
        manifest(name, refusal_ns, spec)), check=False)
    assert proc.returncode != 0 and "denied request" in proc.stderr, proc.stderr
    assert str(err) in proc.stderr, (str(err), proc.stderr)
    got = crd_plane.kubectl("get", "trainergroup", name, "-n", refusal_ns, check=False)
    assert got.returncode != 0 and "NotFound" in got.stderr, got.stdout
    assert crd_plane.kubectl_json("get", "trainergroups", "-n", refusal_ns)["items"] == []
    with pytest.raises(ApiException) as info:
        custom_objects.create_namespaced_custom_object(
            tgapi.API_GROUP, tgapi.API_VERSION, refusal_ns, tgapi.PLURAL,
            manifest(name, refusal_ns, spec))
    assert info.value.status == 422, info.value.body
    assert json.loads(cast(str, info.value.body))["message"].endswith(str(err)), info.value.body


def test_the_api_server_type_checks_the_policy_clean(crd_plane: KubePlane) -> None:
    """kube-controller-manager type-checks every policy expression (variables, the size
    estimate's doubles and quantities, the message formats) against the CRD's schema. The
    one thing it can't type is workers.useGpu (untyped in the schema: "undefined field",
    while at admission the policy reads it from the object); nothing else is reported."""
    name = f"{tgapi.PLURAL}.{tgapi.API_GROUP}"

    def checked() -> dict[str, Any] | None:
        policy = crd_plane.kubectl_json("get", "validatingadmissionpolicy", name)
        status = policy.get("status") or {}
        done = status.get("observedGeneration") == policy["metadata"]["generation"]
        return status if done and "typeChecking" in status else None

    def last() -> str:
        return json.dumps(crd_plane.kubectl_json("get", "validatingadmissionpolicy", name)
                          .get("status"))

    status = wait_until(checked, timeout=120, what="the policy's type check", on_timeout=last)
    errors = [line for w in status["typeChecking"].get("expressionWarnings", [])
              for line in w["warning"].splitlines() if "ERROR:" in line]
    other = [e for e in errors if not e.endswith("undefined field 'useGpu'")]
    assert other == [], "\n".join(other)
