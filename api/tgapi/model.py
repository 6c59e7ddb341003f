"""The TrainerGroup spec as typed, frozen dataclasses.

This module is the one model of the resource: the operator, the runtime's server
and ``tgctl`` all parse YAML into these classes (see ``parse.py``), and the CRD's
OpenAPI schema is generated from them (see ``crd.py``). It must import nothing
heavier than the standard library.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tgapi.fields import spec_field

API_GROUP = "trainergroup.io"
API_VERSION = "v1alpha1"
KIND = "TrainerGroup"
PLURAL = "trainergroups"
SINGULAR = "trainergroup"
SHORT_NAMES = ("tg",)

DEFAULT_WORKER_CLASS = "tgruntime.trainer.worker:MegatronTrainer"
DEFAULT_IMAGE = "ghcr.io/trainergroup/runtime:0.1.0"
DEFAULT_RAY_VERSION = "2.60.0"

# A Kubernetes quantity without a sign (the grammar of apimachinery's resource.Quantity):
# tgapi.sizing parses memory sizes with the same grammar.
_QUANTITY = (
    r"^([0-9]+(\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+))?$"
)
# Upper bounds: far beyond any real model or cluster, low enough that every product the
# cross-field rules and the size estimate form stays well inside int64 (CEL's integers) and
# every tensor dimension inside what torch and megatron index.
MAX_SIZE = 2**24
MAX_PARALLEL = 4096
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_NAME_PREFIX = r"^[A-Za-z0-9_.-]*$"
_IMPORT_PATH = r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*$"
_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
_DNS_SUBDOMAIN_OR_EMPTY = r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?)?$"
_ABSOLUTE_DIR = r"^(/[^/]+)+$"
HF_MODEL_ID = r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$"
"""An absolute directory, no trailing slash and no empty step: ``/checkpoints``."""

USE_GPU_AUTO = "auto"
PLACEMENT_AUTO = "auto"

ARCHITECTURE_LLAMA = "llama"
ARCHITECTURE_QWEN2 = "qwen2"
ARCHITECTURE_QWEN3 = "qwen3"
ARCHITECTURES = (ARCHITECTURE_LLAMA, ARCHITECTURE_QWEN2, ARCHITECTURE_QWEN3)
"""``model.architecture``: the decoder families the trainer builds (docs/models.md)."""
ROPE_THETA = 10000.0
NORM_EPSILON = 1e-5
"""``workers.useGpu: auto``: GPU workers when the Ray cluster has GPUs, else CPU workers."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EnvVar:
    name: str = spec_field(name="name", description="Environment variable name.")
    value: str = spec_field(name="value", description="Value.", default="")


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeadSpec:
    cpu: str = spec_field(
        name="cpu",
        description="CPU request of the head pod (no CPU limit: the GCS and the dashboard "
        "must not be throttled).",
        default="2",
        pattern=_QUANTITY,
    )
    memory: str = spec_field(
        name="memory",
        description="Memory request/limit of the head pod.",
        default="8Gi",
        pattern=_QUANTITY,
    )
    node_selector: dict[str, str] = spec_field(
        name="nodeSelector", description="Node selector for the head pod.", default_factory=dict
    )
    tolerations: list[dict[str, Any]] = spec_field(
        name="tolerations",
        description="Tolerations for the head pod (core/v1 Toleration).",
        default_factory=list,
        free_form=True,
    )


MEMORY_BASE_GI = 32
MEMORY_PER_GPU_GI = 32


def default_memory_gi(gpus: int) -> int:
    """A worker pod's memory when ``rayCluster.workers.memory`` is empty, in GiB."""
    return MEMORY_BASE_GI + MEMORY_PER_GPU_GI * gpus


RDMA_CAPABILITIES = ("IPC_LOCK", "SYS_RESOURCE", "SYS_PTRACE")
"""The capabilities ``rayCluster.workers.capabilities`` may add (NCCL over RDMA/EFA)."""
_EXTENDED_RESOURCE = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*)/"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
"""A domain-prefixed resource name (``rdma/ib``, ``vpc.amazonaws.com/efa``): the only kind a
device plugin can advertise."""
RESERVED_VOLUMES = ("dshm", "checkpoints")
"""Volume names the operator uses itself (``/dev/shm``, the checkpoint claim); the rule
worker-volume-names (tgapi.rules) refuses them."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExtendedResource:
    name: str = spec_field(
        name="name",
        description="Resource name with a domain prefix, e.g. rdma/ib or "
        "vpc.amazonaws.com/efa.",
        pattern=_EXTENDED_RESOURCE,
        max_length=253,
    )
    count: int = spec_field(
        name="count",
        description="How many per worker pod (requests = limits).",
        default=1,
        minimum=1,
        maximum=1024,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExtraVolume:
    name: str = spec_field(
        name="name",
        description="Volume name (a DNS label; not dshm or checkpoints, the operator's own).",
        pattern=_DNS_LABEL,
        max_length=63,
    )
    mount_path: str = spec_field(
        name="mountPath",
        description="Where the worker container mounts it.",
        pattern=_ABSOLUTE_DIR,
        max_length=1024,
    )
    read_only: bool = spec_field(
        name="readOnly", description="Mount read-only.", default=False
    )
    source: dict[str, Any] = spec_field(
        name="source",
        description="The volume's source as in a core/v1 Volume without its name, e.g. "
        "{hostPath: {path: /dev/infiniband}}, {configMap: {name: x}} or {emptyDir: {}}.",
        free_form=True,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class RayWorkerNodesSpec:
    replicas: int = spec_field(
        name="replicas",
        description="Number of Ray worker pods (nodes).",
        default=1,
        minimum=1,
        maximum=MAX_PARALLEL,
    )
    gpus_per_worker: int = spec_field(
        name="gpusPerWorker",
        description="nvidia.com/gpu per worker pod (0 for CPU-only).",
        default=1,
        minimum=0,
        maximum=64,
    )
    cpu: str = spec_field(
        name="cpu",
        description="CPU request per worker pod (no CPU limit unless cpuLimit is set: a limit "
        "throttles the raylet and NCCL's proxy threads).",
        default="8",
        pattern=_QUANTITY,
    )
    cpu_limit: str = spec_field(
        name="cpuLimit",
        description="CPU limit per worker pod; empty (the default): none.",
        default="",
        pattern=r"^$|" + _QUANTITY,
    )
    memory: str = spec_field(
        name="memory",
        description="Memory request/limit per worker pod. Empty (the default): 32Gi plus "
        "32Gi per GPU (gpusPerWorker).",
        default="",
        pattern=r"^$|" + _QUANTITY,
    )
    shm_size: str = spec_field(
        name="shmSize",
        description="sizeLimit of the memory-backed /dev/shm of a worker pod (Ray's object "
        "store and NCCL's shared-memory transport live there, and it counts against the pod's "
        "memory). Empty: 8Gi per GPU (2Gi for a pod without GPUs), at most half of memory.",
        default="",
        pattern=r"^$|" + _QUANTITY,
    )
    gpu_memory: str = spec_field(
        name="gpuMemory",
        description="Memory of one GPU of a worker pod (e.g. 80Gi): a model whose weights, "
        "gradients and optimizer state exceed it is refused before anything starts. Empty: "
        "the nominal memory of the GPU named by the nvidia.com/gpu.product node selector, "
        "if known, else unchecked.",
        default="",
        pattern=r"^$|" + _QUANTITY,
    )
    node_selector: dict[str, str] = spec_field(
        name="nodeSelector", description="Node selector for worker pods.", default_factory=dict
    )
    tolerations: list[dict[str, Any]] = spec_field(
        name="tolerations",
        description="Tolerations for worker pods (core/v1 Toleration). A toleration for "
        "nvidia.com/gpu is added automatically when gpusPerWorker > 0.",
        default_factory=list,
        free_form=True,
    )
    env: list[EnvVar] = spec_field(
        name="env",
        description="Extra environment for worker pods (wins over the operator's defaults: "
        "NCCL_DEBUG=WARN, TORCHINDUCTOR_COMPILE_THREADS, NCCL_SOCKET_IFNAME with hostNetwork).",
        default_factory=list,
    )
    capabilities: list[str] = spec_field(
        name="capabilities",
        description="Linux capabilities added to the worker container after dropping ALL, for "
        "NCCL over RDMA/EFA (IPC_LOCK pins memory; SYS_RESOURCE raises the memlock limit; "
        "SYS_PTRACE lets NCCL share CUDA memory between processes by file descriptor). Any of "
        "them takes the pods out of the restricted Pod Security Standard (baseline allows "
        "none of them either: the namespace needs the privileged level or an exemption).",
        default_factory=list,
        pattern=r"^(" + "|".join(RDMA_CAPABILITIES) + r")$",
    )
    extended_resources: list[ExtendedResource] = spec_field(
        name="extendedResources",
        description="Device-plugin resources per worker pod, in requests and limits, e.g. "
        "rdma/ib or vpc.amazonaws.com/efa (nvidia.com/gpu comes from gpusPerWorker).",
        default_factory=list,
    )
    host_network: bool = spec_field(
        name="hostNetwork",
        description="Run worker pods in the node's network namespace (some RDMA/TCPX set-ups "
        "need it; dnsPolicy becomes ClusterFirstWithHostNet, and NCCL_SOCKET_IFNAME defaults "
        "to ncclSocketIfname). Not allowed by the baseline or restricted Pod Security Standards.",
        default=False,
    )
    nccl_socket_ifname: str = spec_field(
        name="ncclSocketIfname",
        description="NCCL_SOCKET_IFNAME of worker pods with hostNetwork (NCCL's bootstrap and "
        "socket interfaces); ignored without hostNetwork (the pod has one interface).",
        default="^lo,docker,veth",
        pattern=r"^[A-Za-z0-9^=,._-]+$",
        max_length=256,
    )
    volumes: list[ExtraVolume] = spec_field(
        name="volumes",
        description="Extra volumes mounted in every worker container (e.g. the host's "
        "/dev/infiniband for RDMA, or a TCPX/EFA plugin's directory).",
        default_factory=list,
    )

    @property
    def memory_quantity(self) -> str:
        """``memory``, else the default for the pod's GPUs (:func:`default_memory_gi`)."""
        return self.memory or f"{default_memory_gi(self.gpus_per_worker)}Gi"


AUTH_TOKEN = "token"
AUTH_DISABLED = "disabled"


@dataclasses.dataclass(frozen=True, kw_only=True)
class GcsFaultToleranceSpec:
    redis_address: str = spec_field(
        name="redisAddress",
        description="host:port of an external Redis that keeps the GCS state, so the head pod "
        "can be replaced while the detached workers live on.",
        pattern=r"^[A-Za-z0-9.-]+:[0-9]{1,5}$",
    )
    redis_password_secret: str = spec_field(
        name="redisPasswordSecret",
        description="Secret (key: password) with the Redis password; empty: none.",
        default="",
        pattern=r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?)?$",
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointStorageSpec:
    """An existing PersistentVolumeClaim mounted on every worker pod, for checkpoints."""

    claim_name: str = spec_field(
        name="claimName",
        description="Name of a PersistentVolumeClaim in the group's namespace (the platform "
        "owns it; the operator never creates or deletes it). ReadWriteMany when workers run "
        "on several nodes.",
        pattern=_DNS_SUBDOMAIN,
        max_length=253,
    )
    mount_path: str = spec_field(
        name="mountPath",
        description="Where the claim is mounted in worker pods; training.checkpointDir must "
        "be this directory or one under it.",
        default="/checkpoints",
        pattern=_ABSOLUTE_DIR,
        max_length=1024,
    )


RUNTIME_UID = 1000
RUNTIME_GID = 100
"""The runtime image's user (``ray``, uid 1000) and group (``users``, gid 100)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PodSecuritySpec:
    run_as_user: int = spec_field(
        name="runAsUser",
        description="uid of every container (not 0: the pods run as non-root).",
        default=RUNTIME_UID,
        minimum=1,
        maximum=2**31 - 1,
    )
    run_as_group: int = spec_field(
        name="runAsGroup",
        description="Primary gid of every container.",
        default=RUNTIME_GID,
        minimum=0,
        maximum=2**31 - 1,
    )
    fs_group: int = spec_field(
        name="fsGroup",
        description="Group that owns the checkpoint claim's files (fsGroupChangePolicy "
        "OnRootMismatch: the kubelet re-owns a volume only when its root is not this group "
        "already), so a fresh volume is writable by the runtime's user.",
        default=RUNTIME_GID,
        minimum=0,
        maximum=2**31 - 1,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class RayClusterSpec:
    head: HeadSpec = spec_field(name="head", description="Head pod.", default_factory=HeadSpec)
    workers: RayWorkerNodesSpec = spec_field(
        name="workers", description="GPU worker pods.", default_factory=RayWorkerNodesSpec
    )
    # -- what a platform sets on every pod and on the RayCluster (see platform.py) ---------
    storage: CheckpointStorageSpec | None = spec_field(
        name="storage",
        description="Checkpoint volume: a PersistentVolumeClaim mounted on every worker, so "
        "that a re-created group resumes from what the old one wrote.",
        default=None,
    )
    service_account_name: str = spec_field(
        name="serviceAccountName",
        description="ServiceAccount of the head and worker pods; empty: the namespace default.",
        default="",
        pattern=_DNS_SUBDOMAIN_OR_EMPTY,
        max_length=253,
    )
    image_pull_secrets: list[str] = spec_field(
        name="imagePullSecrets",
        description="Names of Secrets (in the group's namespace) used to pull the image.",
        default_factory=list,
        pattern=_DNS_SUBDOMAIN,
        max_length=253,
    )
    priority_class_name: str = spec_field(
        name="priorityClassName",
        description="PriorityClass of the head and worker pods; empty: none.",
        default="",
        pattern=_DNS_SUBDOMAIN_OR_EMPTY,
        max_length=253,
    )
    labels: dict[str, str] = spec_field(
        name="labels",
        description="Labels of the RayCluster object (the operator's own labels win).",
        default_factory=dict,
    )
    annotations: dict[str, str] = spec_field(
        name="annotations",
        description="Annotations of the RayCluster object (the operator's own win).",
        default_factory=dict,
    )
    pod_labels: dict[str, str] = spec_field(
        name="podLabels",
        description="Labels of the head and worker pods (the operator's own labels win).",
        default_factory=dict,
    )
    pod_annotations: dict[str, str] = spec_field(
        name="podAnnotations",
        description="Annotations of the head and worker pods.",
        default_factory=dict,
    )
    auth: str = spec_field(
        name="auth",
        description='Ray token authentication: "token" (default; a per-group token in the '
        'Secret <name>-ray-token) or "disabled" (any pod that reaches the Ray ports may run code '
        "on the workers).",
        default=AUTH_TOKEN,
        enum=(AUTH_TOKEN, AUTH_DISABLED),
    )
    network_policy: bool = spec_field(
        name="networkPolicy",
        description="A NetworkPolicy admitting only the operator, the group's pods and pods "
        "labelled trainergroup.io/client=<name> to the Ray ports (default true).",
        default=True,
    )
    gcs_fault_tolerance: GcsFaultToleranceSpec | None = spec_field(
        name="gcsFaultTolerance",
        description="GCS fault tolerance with an external Redis (KubeRay "
        "gcsFaultToleranceOptions); absent: losing the head loses the group.",
        default=None,
    )
    runtime_class_name: str = spec_field(
        name="runtimeClassName",
        description="runtimeClassName of the head and worker pods (e.g. nvidia, which k3s and "
        "RKE2 GPU nodes need); empty: the cluster's default runtime.",
        default="",
        pattern=_DNS_SUBDOMAIN_OR_EMPTY,
        max_length=253,
    )
    pod_security: PodSecuritySpec = spec_field(
        name="podSecurity",
        description="The user and groups of the head and worker pods (their containers run "
        "with the restricted Pod Security Standard's settings: non-root, no privilege "
        "escalation, all capabilities dropped, seccomp RuntimeDefault).",
        default_factory=lambda: PodSecuritySpec(),
    )
    scheduler_name: str = spec_field(
        name="schedulerName",
        description="schedulerName of the head and worker pods (e.g. volcano or yunikorn for "
        "gang scheduling, with the label ray.io/gang-scheduling-enabled in labels); empty: the "
        "default scheduler.",
        default="",
        pattern=_DNS_SUBDOMAIN_OR_EMPTY,
        max_length=253,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class RayClusterRef:
    name: str = spec_field(
        name="name",
        description="Name of an existing RayCluster in the same namespace.",
        pattern=_DNS_LABEL,
        max_length=63,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkersSpec:
    processes_per_node: list[int] = spec_field(
        name="processesPerNode",
        description="Worker processes on each Ray node, like verl's process_on_nodes; the "
        "world size is their sum.",
        default_factory=lambda: [1],
        minimum=1,
        maximum=MAX_PARALLEL,
    )
    use_gpu: bool | str = spec_field(
        name="useGpu",
        description='One GPU per worker process: true, false (CPU workers, gloo) or "auto" '
        "(GPUs when the Ray cluster has any, else CPU; resolved when the group is created).",
        default=USE_GPU_AUTO,
        bool_or_auto=True,
    )
    cpus_per_process: float = spec_field(
        name="cpusPerProcess",
        description="Ray CPUs reserved per worker process.",
        default=1.0,
        minimum=0,
        exclusive_minimum=True,
        maximum=MAX_PARALLEL,
    )
    placement: str = spec_field(
        name="placementStrategy",
        description='Ray placement group strategy of each node\'s placement group. "auto" '
        "(the default): STRICT_PACK for GPU workers (a node's processes, and so its tensor-"
        "parallel groups, stay on one node), PACK for CPU workers.",
        default=PLACEMENT_AUTO,
        enum=(PLACEMENT_AUTO, "PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"),
    )
    name_prefix: str = spec_field(
        name="namePrefix",
        description="Worker name prefix; default: the resource name. Names are "
        "{prefix}{ClassName}_{pg_index}:{local_rank}.",
        default="",
        pattern=_NAME_PREFIX,
        max_length=63,
    )
    ray_namespace: str = spec_field(
        name="rayNamespace",
        description="Ray namespace of the group; default: tg-{namespace}-{name}.",
        default="",
        pattern=_NAME_PREFIX,
        max_length=128,
    )
    worker_class: str = spec_field(
        name="workerClass",
        description=(
            "module:Class import path of the worker; default: the built-in Megatron trainer."
        ),
        default=DEFAULT_WORKER_CLASS,
        pattern=_IMPORT_PATH,
    )

    @property
    def placement_strategy(self) -> str:
        """``placementStrategy`` as Ray takes it: "auto" is STRICT_PACK for GPU workers and
        PACK otherwise (``useGpu`` "auto" not yet resolved counts as CPU: resolve it first)."""
        if self.placement != PLACEMENT_AUTO:
            return self.placement
        return "STRICT_PACK" if self.use_gpu is True else "PACK"

    def gpu_for(self, cluster_gpus: float) -> bool:
        """``useGpu`` resolved against a cluster with ``cluster_gpus`` GPUs in total."""
        if self.use_gpu == USE_GPU_AUTO:
            return cluster_gpus > 0
        return bool(self.use_gpu)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelismSpec:
    tensor: int = spec_field(
        name="tensor", description="Tensor-parallel size.", default=1, minimum=1,
        maximum=MAX_PARALLEL,
    )
    pipeline: int = spec_field(
        name="pipeline", description="Pipeline-parallel size.", default=1, minimum=1,
        maximum=MAX_PARALLEL,
    )
    context: int = spec_field(
        name="context", description="Context-parallel size.", default=1, minimum=1,
        maximum=MAX_PARALLEL,
    )
    expert: int = spec_field(
        name="expert", description="Expert-parallel size (MoE models only).", default=1, minimum=1,
        maximum=MAX_PARALLEL,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    vocab_size: int = spec_field(
        name="vocabSize", description="Vocabulary size.", default=256, minimum=2,
        maximum=MAX_SIZE,
    )
    hidden_size: int = spec_field(
        name="hiddenSize", description="Hidden size.", default=2048, minimum=1,
        maximum=2**20,
    )
    num_layers: int = spec_field(
        name="numLayers", description="Transformer layers.", default=24, minimum=1,
        maximum=2**16,
    )
    num_attention_heads: int = spec_field(
        name="numAttentionHeads", description="Attention heads.", default=16, minimum=1,
        maximum=2**16,
    )
    num_query_groups: int = spec_field(
        name="numQueryGroups",
        description="Key/value heads for GQA; 0 means equal to heads.",
        default=0,
        minimum=0,
        maximum=2**16,
    )
    ffn_hidden_size: int = spec_field(
        name="ffnHiddenSize", description="Feed-forward hidden size.", default=5504, minimum=1,
        maximum=2**22,
    )
    max_sequence_length: int = spec_field(
        name="maxSequenceLength", description="Maximum sequence length.", default=1024, minimum=1,
        maximum=MAX_SIZE,
    )
    dtype: str = spec_field(
        name="dtype",
        description="Parameter/compute dtype; float32 is used on CPU.",
        default="bfloat16",
        enum=("bfloat16", "float16", "float32"),
    )
    position_embedding: str = spec_field(
        name="positionEmbedding",
        description="rope (GPU) or learned absolute positions (CPU-safe); auto picks by device.",
        default="auto",
        enum=("auto", "rope", "learned_absolute"),
    )
    normalization: str = spec_field(
        name="normalization",
        description="Layer norm type.",
        default="RMSNorm",
        enum=("RMSNorm", "LayerNorm"),
    )
    activation: str = spec_field(
        name="activation", description="MLP activation.", default="swiglu", enum=("swiglu", "gelu")
    )
    architecture: str = spec_field(
        name="architecture",
        description="The decoder family: llama (no biases), qwen2 (Llama plus a bias on the "
        "query, key and value projections) or qwen3 (Llama plus an RMSNorm over each query "
        "and key head). qwen2 and qwen3 need positionEmbedding rope, normalization RMSNorm and "
        "activation swiglu. With model.pretrained, config.json's model_type sets it.",
        default=ARCHITECTURE_LLAMA,
        enum=ARCHITECTURES,
    )
    head_dim: int = spec_field(
        name="headDim",
        description="Size of one attention head; 0 means hiddenSize / numAttentionHeads "
        "(Qwen3 checkpoints may set another).",
        default=0,
        minimum=0,
        maximum=2**16,
    )
    rope_theta: float = spec_field(
        name="ropeTheta",
        description="Base of the rotary position frequencies (positionEmbedding rope).",
        default=ROPE_THETA,
        minimum=0,
        exclusive_minimum=True,
        maximum=1e12,
    )
    norm_epsilon: float = spec_field(
        name="normEpsilon",
        description="Epsilon of every RMSNorm / LayerNorm (config.json's rms_norm_eps).",
        default=NORM_EPSILON,
        minimum=0,
        exclusive_minimum=True,
        maximum=1.0,
    )
    tie_embeddings: bool = spec_field(
        name="tieEmbeddings",
        description="The output layer uses the input embedding's weight (config.json's "
        "tie_word_embeddings).",
        default=False,
    )
    pretrained: str | None = spec_field(
        name="pretrained",
        description="Directory holding a Hugging Face LlamaForCausalLM, Qwen2ForCausalLM or "
        "Qwen3ForCausalLM checkpoint (config.json, safetensors) and its tokenizer, on the "
        "workers' filesystem (a volume such as rayCluster.storage), or such a checkpoint's hub "
        "id in org/model form (e.g. Qwen/Qwen3-0.6B), downloaded at start by every pod that "
        "reads it (HF_ENDPOINT, HF_HOME and, from hubTokenSecret, HF_TOKEN apply; the "
        "model's name defaults to it). Where the spec is parsed "
        "with the files at hand (the runtime, tgctl) the architecture and shape (architecture, "
        "vocabSize, hiddenSize, numLayers, numAttentionHeads, numQueryGroups, ffnHiddenSize, "
        "maxSequenceLength, headDim, ropeTheta, normEpsilon, tieEmbeddings) come from its "
        "config.json and such a field set in the spec must agree with it; the operator cannot "
        "read the volume, so it checks only the path and the Llama-only fields (rope, RMSNorm, "
        "swiglu), and sizes the model by the fields as written. Absent: random initialisation.",
        default=None,
        pattern=f"{_ABSOLUTE_DIR}|{HF_MODEL_ID}",
        max_length=1024,
    )
    hub_token_secret: str = spec_field(
        name="hubTokenSecret",
        description="A Secret in the group's namespace (key: token) with a Hugging Face token, "
        "given to every Ray pod and the Tinker server as HF_TOKEN: for a pretrained hub id of "
        "a gated or private model. Empty: none.",
        default="",
        pattern=r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?)?$",
    )
    name: str | None = spec_field(
        name="name",
        description="The base model's Hugging Face id in org/model form (e.g. Qwen/Qwen3-0.6B, "
        "meta-llama/Llama-3.2-1B): the Tinker API serves the group under this name "
        "(create_lora_training_client(base_model=...), get_info, get_server_capabilities), "
        "and clients choose the tokenizer and the cookbook's renderer from it. The group's "
        "own name and the pretrained directory stay aliases. Absent: the pretrained directory, "
        "else the TrainerGroup's name.",
        default=None,
        pattern=HF_MODEL_ID,
        max_length=200,
    )
    seed: int = spec_field(
        name="seed",
        description="Initialisation seed (numpy takes seeds below 2**32; each pipeline stage "
        "adds 100 x its rank).",
        default=1234,
        minimum=0,
        maximum=2**31 - 1,
    )

    @property
    def kv_channels(self) -> int:
        """The size of one attention head (``headDim``, else hidden size / heads)."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def qkv_bias(self) -> bool:
        """Whether the query, key and value projections have a bias (Qwen2)."""
        return self.architecture == ARCHITECTURE_QWEN2

    @property
    def qk_norm(self) -> bool:
        """Whether each query and key head is RMSNorm'd before RoPE (Qwen3)."""
        return self.architecture == ARCHITECTURE_QWEN3


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    lr: float = spec_field(name="lr", description="Learning rate.", default=1e-6, minimum=0)
    min_lr: float = spec_field(
        name="minLr", description="Minimum learning rate.", default=0.0, minimum=0
    )
    clip_grad: float = spec_field(
        name="clipGrad",
        description="Gradient clipping by global norm (0 disables).",
        default=1.0,
        minimum=0,
    )
    weight_decay: float = spec_field(
        name="weightDecay", description="AdamW weight decay.", default=0.01, minimum=0
    )
    adam_beta1: float = spec_field(
        name="adamBeta1", description="Adam beta1.", default=0.9, minimum=0, maximum=1
    )
    adam_beta2: float = spec_field(
        name="adamBeta2", description="Adam beta2.", default=0.95, minimum=0, maximum=1
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainingSpec:
    batch_size: int = spec_field(
        name="batchSize",
        description="Global batch size (sequences per step) the client sends.",
        default=16,
        minimum=1,
        maximum=MAX_SIZE,
    )
    sequence_length: int = spec_field(
        name="sequenceLength",
        description="Tokens per sequence; at most maxSequenceLength.",
        default=1024,
        minimum=2,
        maximum=MAX_SIZE,
    )
    checkpoint_dir: str = spec_field(
        name="checkpointDir",
        description="Directory for checkpoints, shared by all workers; empty disables. On "
        "Kubernetes put it on rayCluster.storage (this directory or one under its mountPath), "
        "else each worker pod writes its own ephemeral disk and a re-created group starts fresh.",
        default="",
        max_length=1024,
    )
    micro_batch_tokens: int = spec_field(
        name="microBatchTokens",
        description="Most tokens (rows x padded length) one micro-batch of a forward_backward "
        "or log-prob call holds: a larger call is split into micro-batches whose summed loss "
        "and gradient equal the whole call's. 0: chosen for each call from the GPU memory free "
        "then (no limit on CPU).",
        default=0,
        minimum=0,
        maximum=MAX_SIZE,
    )
    sampler_weights_memory: str = spec_field(
        name="samplerWeightsMemory",
        description="Most memory one worker keeps for sampler weights (a Kubernetes quantity, "
        "e.g. 8Gi): the copies of save_weights_for_sampler and "
        "save_weights_and_get_sampling_client (the full weights, or on a LoRA group the run's "
        "adapters). Copies also on disk (named saves, weights read from a path) are a cache "
        "inside it, least recently used out first and read again at their next use; a copy "
        "that still does not fit is refused with an error naming this field, never an out of "
        "memory. Empty: a quarter of the memory free when the worker's first copy is made "
        "(the GPU's; on the CPU the host's available memory, shared by the ranks), or room "
        "for two full-weight copies if that is more and fits 80% of the free memory.",
        default="",
        # a positive quantity of bytes: no zero, sign, exponent or milli
        pattern=r"^$|^([1-9][0-9]*(\.[0-9]*)?|0?\.[0-9]*[1-9][0-9]*)([KMGTPE]i|[kMGTPE])?$",
    )
    keep_checkpoints: int = spec_field(
        name="keepCheckpoints",
        description="Keep only the newest N complete step_* checkpoints under checkpointDir "
        "(those saved without an explicit path, e.g. tgctl train --save-checkpoint default or "
        "TrainerClient.save_checkpoint()): after each such save rank 0 removes the older ones "
        "and interrupted saves. 0 keeps all (the TG_KEEP_CHECKPOINTS environment variable "
        "then applies, if set). The Tinker API keeps the newest N named checkpoints of each "
        "training run, counting save_state and save_weights_for_sampler apart, after each "
        "save (docs/tinker.md, 'Checkpoint lifecycle').",
        default=0,
        minimum=0,
        maximum=1_000_000,
    )
    stall_seconds: int = spec_field(
        name="stallSeconds",
        description="The Training condition turns False (reason Stalled) once no optimizer "
        "step has ended for this long while the group is Ready; 0 never calls a run stalled.",
        default=900,
        minimum=0,
        maximum=7 * 86400,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class TimeoutsSpec:
    cluster_ready_seconds: int = spec_field(
        name="clusterReadySeconds",
        description="Wait this long for the RayCluster to be ready.",
        default=900,
        minimum=1,
        maximum=7 * 86400,
    )
    workers_ready_seconds: int = spec_field(
        name="workersReadySeconds",
        description="Wait this long for placement groups and worker actors.",
        default=600,
        minimum=1,
        maximum=7 * 86400,
    )

    @property
    def ready_seconds(self) -> int:
        """The one Ready deadline: how long a client waits for the group to be Ready.

        The operator gives up on a cluster after ``clusterReadySeconds`` and on the workers
        after ``workersReadySeconds``, so a client waiting their sum never gives up before
        the operator has (the client module, the client Job and tgctl all use this).
        """
        return self.cluster_ready_seconds + self.workers_ready_seconds


TINKER_PORT = 8000
"""The port of a group's Tinker API server (its Service ``<name>-tinker``)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TinkerServerSpec:
    """The Tinker API server of a group: one pod, a Deployment ``<name>-tinker``."""

    port: int = spec_field(
        name="port",
        description="Port of the server and of its Service <name>-tinker.",
        default=TINKER_PORT,
        minimum=1,
        maximum=65535,
    )
    replicas: int = spec_field(
        name="replicas",
        description="Server pods: exactly 1 (the server keeps the sessions and futures of "
        "its clients in memory; a second replica would split them).",
        default=1,
        minimum=1,
        maximum=1,
    )
    cpu: str = spec_field(
        name="cpu",
        description="CPU request of the server pod; no CPU limit (it mostly waits on the "
        "workers, but its start imports torch and Ray and runs a raylet, which a cap at a small "
        "request throttles for minutes).",
        default="1",
        pattern=_QUANTITY,
    )
    memory: str = spec_field(
        name="memory",
        description="Memory request/limit of the server pod (its Ray driver's object store "
        "is in a memory-backed /dev/shm and counts against it).",
        default="2Gi",
        pattern=_QUANTITY,
    )
    node_selector: dict[str, str] = spec_field(
        name="nodeSelector", description="Node selector of the server pod.", default_factory=dict
    )
    tolerations: list[dict[str, Any]] = spec_field(
        name="tolerations",
        description="Tolerations of the server pod (core/v1 Toleration).",
        default_factory=list,
        free_form=True,
    )
    pod_labels: dict[str, str] = spec_field(
        name="podLabels",
        description="Extra labels of the server pod (the operator's own labels win).",
        default_factory=dict,
    )
    pod_annotations: dict[str, str] = spec_field(
        name="podAnnotations",
        description="Annotations of the server pod.",
        default_factory=dict,
    )


_PEM_CERTS = (
    r"^(\s*-----BEGIN CERTIFICATE-----[A-Za-z0-9+/=\s]+-----END CERTIFICATE-----)+\s*$"
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ApiTlsSpec:
    """HTTPS for the Tinker API from a certificate Secret (docs/security.md)."""

    secret_name: str = spec_field(
        name="secretName",
        description="A Secret in the group's namespace with tls.crt and tls.key (the "
        "kubernetes.io/tls layout; e.g. a cert-manager Certificate's secretName) for the "
        "Service's DNS name <name>-tinker.<namespace>.svc. The server then speaks only HTTPS "
        "and status.apiURL starts with https://; a renewed certificate is picked up without a "
        "restart.",
        pattern=_DNS_SUBDOMAIN,
        max_length=253,
    )
    ca_bundle: str = spec_field(
        name="caBundle",
        description="The PEM certificates of the CA that signed the Secret's certificate, when it "
        "is a private one (public, as in a webhook's caBundle). The namespace's Tinker gateway "
        "verifies this group's server against these roots only; without them it uses the "
        "image's public roots. Clients outside the gateway pass the same CA (SSL_CERT_FILE).",
        default="",
        pattern=r"^$|" + _PEM_CERTS,
        max_length=65536,
    )


_PRINCIPAL = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ApiSpec:
    tinker: bool = spec_field(
        name="tinker",
        description="Serve the Tinker API for the group (default true): a Deployment and a "
        "Service <name>-tinker, API keys in the Secret <name>-tinker-keys, reachable only from "
        "pods labelled trainergroup.io/client=<name>; status.apiURL once it is available.",
        default=True,
    )
    server: TinkerServerSpec = spec_field(
        name="server",
        description="The Tinker API server's pod.",
        default_factory=TinkerServerSpec,
    )
    max_runs: int = spec_field(
        name="maxRuns",
        description="LoRA groups (spec.lora): how many training runs (Tinker create_model calls, "
        "each its own adapter and optimizer state on the shared base) the server holds at once; "
        "one more is refused with HTTP 429 until a run's session finishes.",
        default=8,
        minimum=1,
        maximum=1024,
    )
    idle_run_seconds: int = spec_field(
        name="idleRunSeconds",
        description="LoRA groups: a run with no call for this long is parked (its adapters and "
        "optimizer state written under training.checkpointDir, its memory freed) and comes back "
        "on its next call; 0 never parks.",
        default=600,
        minimum=0,
    )
    admin_principals: list[str] = spec_field(
        name="adminPrincipals",
        description="Principals (entry names of the keys Secret <name>-tinker-keys) that may "
        "list every principal's runs and checkpoints, read and delete any checkpoint and finish "
        "any session; each such act is in the audit log, marked admin. Empty: no admin.",
        default_factory=list,
        pattern=_PRINCIPAL,
        max_length=64,
    )
    tls: ApiTlsSpec | None = spec_field(
        name="tls",
        description="Serve the Tinker API over HTTPS with the certificate of a Secret; absent: "
        "plain HTTP (inside the NetworkPolicy).",
        default=None,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class QueueSpec:
    """The Kueue queue the group's RayCluster waits in (Kueue's RayCluster integration)."""

    name: str = spec_field(
        name="name",
        description="The LocalQueue (in the group's namespace): the RayCluster is created "
        "suspended with the label kueue.x-k8s.io/queue-name, and Kueue starts it once admitted.",
        pattern=_DNS_SUBDOMAIN,
        max_length=253,
    )
    priority_class: str = spec_field(
        name="priorityClass",
        description="A Kueue WorkloadPriorityClass (label kueue.x-k8s.io/priority-class); empty: "
        "the queue's default.",
        default="",
        pattern=_DNS_SUBDOMAIN_OR_EMPTY,
        max_length=253,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraSpec:
    """LoRA adapters on the frozen base (the Tinker SDK's ``LoraConfig`` fields, plus alpha)."""

    rank: int = spec_field(
        name="rank",
        description="Adapter rank (each adapted projection gets A [rank, in] and B [out, rank]).",
        default=32,
        minimum=1,
    )
    alpha: float = spec_field(
        name="alpha",
        description="Scaling numerator: a projection adds alpha / rank * B @ A @ x.",
        default=32.0,
        minimum=0,
        exclusive_minimum=True,
    )
    train_attn: bool = spec_field(
        name="trainAttn", description="Adapt q/k/v/o projections.", default=True
    )
    train_mlp: bool = spec_field(
        name="trainMlp", description="Adapt gate/up/down projections.", default=True
    )
    train_unembed: bool = spec_field(
        name="trainUnembed", description="Adapt the output layer (lm_head).", default=True
    )

    def settings(self) -> dict[str, Any]:
        """The runtime's ``LoraSettings`` fields (tgruntime.trainer.lora)."""
        return {
            "rank": self.rank,
            "alpha": self.alpha,
            "train_attn": self.train_attn,
            "train_mlp": self.train_mlp,
            "train_unembed": self.train_unembed,
        }


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainerGroupSpec:
    image: str = spec_field(
        name="image",
        description="Runtime image for Ray pods (Ray + torch + megatron-core + tgruntime).",
        default=DEFAULT_IMAGE,
    )
    ray_version: str = spec_field(
        name="rayVersion", description="Ray version in the image.", default=DEFAULT_RAY_VERSION
    )
    ray_cluster: RayClusterSpec | None = spec_field(
        name="rayCluster",
        description="RayCluster to create (exclusive with rayClusterRef).",
        default=None,
    )
    ray_cluster_ref: RayClusterRef | None = spec_field(
        name="rayClusterRef",
        description="Use an existing RayCluster (exclusive with rayCluster).",
        default=None,
    )
    workers: WorkersSpec = spec_field(
        name="workers", description="The worker group.", default_factory=WorkersSpec
    )
    parallelism: ParallelismSpec = spec_field(
        name="parallelism",
        description="Model parallelism; data parallel is derived.",
        default_factory=ParallelismSpec,
    )
    model: ModelSpec = spec_field(
        name="model", description="Model shape.", default_factory=ModelSpec
    )
    optimizer: OptimizerSpec = spec_field(
        name="optimizer", description="Optimizer.", default_factory=OptimizerSpec
    )
    training: TrainingSpec = spec_field(
        name="training", description="Batch shape and checkpoints.", default_factory=TrainingSpec
    )
    restart_policy: str = spec_field(
        name="restartPolicy",
        description="Re-create the group when a worker dies (OnFailure) or not.",
        default="OnFailure",
        enum=("Never", "OnFailure"),
    )
    max_restarts: int = spec_field(
        name="maxRestarts",
        description="Re-creations allowed with restartPolicy OnFailure (exponential back-off "
        "between them) before the phase is Failed.",
        default=10,
        minimum=0,
    )
    timeouts: TimeoutsSpec = spec_field(
        name="timeouts", description="Timeouts.", default_factory=TimeoutsSpec
    )
    api: ApiSpec = spec_field(
        name="api",
        description="The APIs the group serves besides Ray (the Tinker API).",
        default_factory=ApiSpec,
    )
    lora: LoraSpec | None = spec_field(
        name="lora",
        description="Train LoRA adapters on a frozen base (docs/lora.md); the optimizer holds "
        "adapter state only. Absent: full-weight training.",
        default=None,
    )
    queue: QueueSpec | None = spec_field(
        name="queue",
        description="Wait for admission by Kueue before the RayCluster starts (phase Queued); "
        "needs rayCluster. Absent: the RayCluster starts at once.",
        default=None,
    )

    # -- derived values -------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return sum(self.workers.processes_per_node)

    @property
    def data_parallel(self) -> int:
        p = self.parallelism
        return self.world_size // (p.tensor * p.pipeline * p.context)

    def with_gpu_resolved(self, cluster_gpus: float) -> TrainerGroupSpec:
        """This spec with ``workers.useGpu`` a plain bool (``auto`` resolved; see ``gpu_for``)."""
        use_gpu = self.workers.gpu_for(cluster_gpus)
        if self.workers.use_gpu is use_gpu:
            return self
        return dataclasses.replace(
            self, workers=dataclasses.replace(self.workers, use_gpu=use_gpu)
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainerGroup:
    """A whole resource: identity plus spec (status lives in ``status.py``)."""

    name: str
    namespace: str
    spec: TrainerGroupSpec
    uid: str = ""
    generation: int = 0
    labels: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def ray_namespace(self) -> str:
        return self.spec.workers.ray_namespace or f"tg-{self.namespace}-{self.name}"

    @property
    def name_prefix(self) -> str:
        return self.spec.workers.name_prefix or self.name

    @property
    def group_name(self) -> str:
        """The group's lookup name inside its Ray namespace."""
        return self.name
