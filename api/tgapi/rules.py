"""The cross-field rules of a TrainerGroup spec, each declared once.

A rule is a small record (:class:`Rule`): the field it names, a condition that must
hold, and the problem and fix sentences. Conditions and sentences are built from the
expression language in ``tgapi.expr`` (:class:`~tgapi.expr.Expr`, :class:`~tgapi.expr.Text`),
which has two back ends:

* ``Expr.eval`` evaluates it in Python over the spec's wire form (camelCase, defaults
  filled in, as ``to_wire`` writes it); ``validation.py`` runs every rule this way for
  ``tgctl``, the runtime and the operator;
* ``Expr.cel`` writes it as CEL; ``crd.py`` turns every rule into an
  ``x-kubernetes-validations`` entry on ``.spec`` (``rule``, ``messageExpression``,
  ``fieldPath``), so ``kubectl apply`` rejects the same mistakes with the same
  sentence: ``<problem>. Fix: <fix>`` at the same field.

``tests/api/test_rules.py`` evaluates the generated CEL with cel-python on many specs and
checks it agrees with ``eval``; the real API server tests (``tests/k8s/test_admission.py``)
check the CRD itself.

Rules that read an untyped field (``workers.useGpu``) or a ``Var`` go to the
ValidatingAdmissionPolicy instead (``policy_validation``; its ``spec.variables`` hold the
Vars). ``tgapi.sizing`` builds the size estimate from the same language and the spec's
fields named here (:data:`TENSOR`, :data:`HIDDEN`, ...).

Only what a per-field OpenAPI schema cannot say lives here; types, bounds, enums and
patterns are in the schema generated from ``model.py``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

# CelError and Wire stay importable from here, where they were defined before tgapi.expr
# (tests import tgapi.rules.CelError); new code imports the language from tgapi.expr.
from tgapi.expr import CelError as CelError
from tgapi.expr import Cond, Expr, Field, Has, Str, Text, Var, truth, variables
from tgapi.expr import Wire as Wire

MSG_CLUSTER_CHOICE = "set exactly one of rayCluster and rayClusterRef"
USE_GPU_AUTO = "auto"  # = tgapi.model.USE_GPU_AUTO (rules.py imports nothing from the model)


@dataclasses.dataclass(frozen=True)
class Rule:
    """One cross-field rule: ``holds`` must be true, else ``field`` is wrong."""

    name: str
    """Stable id (tests and docs refer to it)."""
    field: str
    """Wire path under ``spec`` that the error names, e.g. ``model.ffnHiddenSize``."""
    holds: Expr
    problem: Text
    fix: Text
    cluster: bool = False
    """Only with Kubernetes: tgctl's local mode (no RayCluster) skips it."""
    type_guard: bool = False
    """States the type of an untyped field (what the CRD schema cannot say). tgapi's parser
    checks types first, so it never breaks on a parsed spec; the admission policy needs it."""

    def broken_by(self, spec: Wire) -> bool:
        """Whether ``spec`` breaks the rule (an evaluation error counts, as in CEL)."""
        try:
            return not truth(self.holds.eval(spec))
        except CelError:
            return True

    def sentences(self, spec: Wire) -> tuple[str, str]:
        """(problem, fix) for ``spec``; the CRD's static message where a hole can't be filled."""
        try:
            return self.problem.render(spec), self.fix.render(spec)
        except CelError:
            return self.problem.static(), self.fix.static()

    def message(self, spec: Wire) -> str:
        """The sentence the user reads: tgapi's ``SpecError`` without the field."""
        problem, fix = self.sentences(spec)
        return f"{problem}. Fix: {fix}"

    @property
    def in_crd(self) -> bool:
        """Whether the CRD's own CEL can state it: not when it reads an untyped field, which
        the API server leaves out of the object CEL sees in a CRD (then it is a policy rule)."""
        text = " ".join(
            [self.holds.cel(), *(a.cel() for a in (*self.problem.args, *self.fix.args))]
        )
        return "variables." not in text and not any(f"self.{f}" in text for f in UNTYPED_FIELDS)

    def cel_rule(self, root: str = "self") -> str:
        return self.holds.cel(root)

    def variables(self) -> list[Var]:
        """The policy variables the rule and its sentences read."""
        return variables(self.holds, self.problem, self.fix)

    def cel_message_expression(self, root: str = "self", prefix: str = "") -> str:
        # One format() call rather than "..." + string(x): the API server's cost estimator
        # takes string(int) as unbounded in size, so every concatenation with it blows the
        # CRD's cost budget; format()'s estimate is bounded.
        problem, problem_args = self.problem.cel_format(root)
        fix, fix_args = self.fix.cel_format(root)
        args = [*problem_args, *fix_args]
        text = json.dumps(f"{prefix}{problem}. Fix: {fix}")
        return f"{text}.format([{', '.join(args)}])" if args else text

    def cel_static_message(self) -> str:
        return f"{self.field}: {self.problem.static()}. Fix: {self.fix.static()}"

    def validation(self) -> dict[str, str]:
        """The CRD's ``x-kubernetes-validations`` entry (on ``.spec``)."""
        return {
            "rule": self.cel_rule(),
            "messageExpression": self.cel_message_expression(),
            "message": self.cel_static_message(),
            "fieldPath": f".{self.field}",
            "reason": "FieldValueInvalid",
        }

    def policy_validation(self) -> dict[str, str]:
        """The ValidatingAdmissionPolicy's entry: over ``object.spec``; no fieldPath there,
        so the message is tgapi's whole error, field first (``spec.x: problem. Fix: fix``)."""
        root = "object.spec"
        return {
            "expression": self.cel_rule(root),
            "messageExpression": self.cel_message_expression(root, prefix=f"spec.{self.field}: "),
            "message": f"spec.{self.cel_static_message()}",
            "reason": "Invalid",
        }


UNTYPED_FIELDS = ("workers.useGpu",)
"""Fields the CRD schema leaves untyped (x-kubernetes-preserve-unknown-fields): true, false
or "auto". CEL in a CRD does not see them; a ValidatingAdmissionPolicy sees the raw object."""


# -- the spec's fields -------------------------------------------------------------------
PPN = Field("workers.processesPerNode")
WORLD = PPN.sum()
TENSOR = Field("parallelism.tensor")
PIPELINE = Field("parallelism.pipeline")
CONTEXT = Field("parallelism.context")
EXPERT = Field("parallelism.expert")
MODEL_PARALLEL = TENSOR * PIPELINE * CONTEXT
DATA_PARALLEL = WORLD // MODEL_PARALLEL
HEADS = Field("model.numAttentionHeads")
QUERY_GROUPS_RAW = Field("model.numQueryGroups")
QUERY_GROUPS = Cond(QUERY_GROUPS_RAW.eq(0), HEADS, QUERY_GROUPS_RAW)
VOCAB = Field("model.vocabSize")
HIDDEN = Field("model.hiddenSize")
FFN = Field("model.ffnHiddenSize")
LAYERS = Field("model.numLayers")
MAX_SEQ = Field("model.maxSequenceLength")
SEQ = Field("training.sequenceLength")
BATCH = Field("training.batchSize")
USE_GPU = Field("workers.useGpu")
"""true, false or "auto": untyped in the CRD schema, so compared with == only."""
GPUS_PER_WORKER = Field("rayCluster.workers.gpusPerWorker")
REPLICAS = Field("rayCluster.workers.replicas")
HAS_CLUSTER = Has("rayCluster")
# useGpu "auto" resolves against the cluster: GPU workers when its pods have GPUs.
GPU = HAS_CLUSTER & (USE_GPU.eq(True) | (USE_GPU.eq("auto") & (GPUS_PER_WORKER > 0)))
CHECKPOINT_DIR = Field("training.checkpointDir")
HAS_STORAGE = HAS_CLUSTER & Has("rayCluster.storage")
MOUNT_PATH = Field("rayCluster.storage.mountPath")
# A GPU group for the rules that hold whatever runs the pods (rayClusterRef too): useGpu true,
# or "auto" on a RayCluster the spec creates with GPUs.
GPU_GROUP = USE_GPU.eq(True) | GPU
TENSOR_CONTEXT = TENSOR * CONTEXT
WORKER_VOLUMES = Field("rayCluster.workers.volumes")
EXTENDED_RESOURCES = Field("rayCluster.workers.extendedResources")
RESERVED_VOLUMES = ("dshm", "checkpoints")  # = tgapi.model.RESERVED_VOLUMES
GPU_RESOURCE = ("nvidia.com/gpu",)
PRETRAINED = Has("model.pretrained")
HEAD_DIM = Field("model.headDim")
ARCHITECTURE = Field("model.architecture")
LLAMA = ARCHITECTURE.eq("llama")


RULES: tuple[Rule, ...] = (
    Rule(
        name="processes-listed",
        field="workers.processesPerNode",
        holds=PPN.size() > 0,
        problem=Text("is empty"),
        fix=Text("list the worker processes per node, e.g. [2]"),
    ),
    Rule(
        name="model-parallel-divides-world",
        field="parallelism",
        holds=(WORLD % MODEL_PARALLEL).eq(0),
        problem=Text(
            "tensor x pipeline x context = {} x {} x {} = {} does not divide the world size {} "
            "(sum of workers.processesPerNode)",
            TENSOR,
            PIPELINE,
            CONTEXT,
            MODEL_PARALLEL,
            WORLD,
        ),
        fix=Text(
            "make the world size a multiple of {} or lower the parallel sizes", MODEL_PARALLEL
        ),
    ),
    Rule(
        name="heads-by-tensor",
        field="model.numAttentionHeads",
        holds=(HEADS % TENSOR).eq(0),
        problem=Text("{} heads are not divisible by tensor parallel size {}", HEADS, TENSOR),
        fix=Text("use a head count that is a multiple of parallelism.tensor"),
    ),
    Rule(
        name="vocab-by-tensor",
        field="model.vocabSize",
        holds=(VOCAB % TENSOR).eq(0),
        problem=Text("{} is not divisible by tensor parallel size {}", VOCAB, TENSOR),
        fix=Text("use a vocabulary size that is a multiple of parallelism.tensor"),
    ),
    Rule(
        name="hidden-by-heads",
        field="model.hiddenSize",
        holds=(HEAD_DIM > 0) | (HIDDEN % HEADS).eq(0),
        problem=Text("{} is not divisible by numAttentionHeads {}", HIDDEN, HEADS),
        fix=Text(
            "use a hidden size that is a multiple of the head count, or set model.headDim"
        ),
    ),
    Rule(
        name="ffn-by-tensor",
        field="model.ffnHiddenSize",
        holds=(FFN % TENSOR).eq(0),
        problem=Text("{} is not divisible by tensor parallel size {}", FFN, TENSOR),
        fix=Text("use an FFN size that is a multiple of parallelism.tensor"),
    ),
    Rule(
        name="query-groups",
        field="model.numQueryGroups",
        holds=(HEADS % QUERY_GROUPS).eq(0) & (QUERY_GROUPS % TENSOR).eq(0),
        problem=Text(
            "{} query groups must divide {} heads and be divisible by tensor parallel size {}",
            QUERY_GROUPS,
            HEADS,
            TENSOR,
        ),
        fix=Text("pick a compatible numQueryGroups (0 = heads)"),
    ),
    Rule(
        name="layers-by-pipeline",
        field="model.numLayers",
        holds=(LAYERS % PIPELINE).eq(0),
        problem=Text("{} layers are not divisible by pipeline parallel size {}", LAYERS, PIPELINE),
        fix=Text("use a layer count that is a multiple of parallelism.pipeline"),
    ),
    Rule(
        name="no-expert-parallel",
        field="parallelism.expert",
        holds=EXPERT <= 1,
        problem=Text(
            "expert parallelism needs a mixture-of-experts model, which the built-in trainer "
            "does not build"
        ),
        fix=Text("set parallelism.expert to 1"),
    ),
    Rule(
        name="sequence-by-context",
        field="training.sequenceLength",
        holds=(CONTEXT <= 1) | (SEQ % (2 * CONTEXT)).eq(0),
        problem=Text("{} is not divisible by 2 x context parallel size {}", SEQ, CONTEXT),
        fix=Text("use a sequence length that is a multiple of 2 x parallelism.context"),
    ),
    Rule(
        name="sequence-fits-model",
        field="training.sequenceLength",
        holds=SEQ <= MAX_SEQ,
        problem=Text("{} exceeds model.maxSequenceLength {}", SEQ, MAX_SEQ),
        fix=Text("lower training.sequenceLength or raise model.maxSequenceLength"),
    ),
    Rule(
        name="batch-by-data-parallel",
        field="training.batchSize",
        # Only when the data-parallel size is known (the world divides) and not 0.
        holds=(WORLD % MODEL_PARALLEL).ne(0) | DATA_PARALLEL.eq(0) | (BATCH % DATA_PARALLEL).eq(0),
        problem=Text("{} is not divisible by the data-parallel size {}", BATCH, DATA_PARALLEL),
        fix=Text("use a batch size that is a multiple of {}", DATA_PARALLEL),
    ),
    Rule(
        name="gpu-choice",
        field="workers.useGpu",
        holds=USE_GPU.eq(True) | USE_GPU.eq(False) | USE_GPU.eq(USE_GPU_AUTO),
        problem=Text('must be true, false or "auto"'),
        fix=Text('use true, false or "auto" (GPUs when the Ray cluster has them)'),
        type_guard=True,
    ),
    Rule(
        name="cluster-choice",
        field="rayCluster",
        holds=HAS_CLUSTER.ne(Has("rayClusterRef")),
        problem=Text("exactly one of rayCluster and rayClusterRef must be set"),
        fix=Text(MSG_CLUSTER_CHOICE),
        cluster=True,
    ),
    Rule(
        name="queue-needs-cluster",
        field="queue",
        holds=~Has("queue") | HAS_CLUSTER,
        problem=Text("is set with rayClusterRef: Kueue queues a RayCluster the operator creates"),
        fix=Text("use rayCluster (the operator creates it suspended for Kueue) or remove queue"),
    ),
    Rule(
        name="gpu-pods-have-gpus",
        field="rayCluster.workers.gpusPerWorker",
        holds=~GPU | (GPUS_PER_WORKER >= 1),
        problem=Text("is 0 but workers.useGpu is true"),
        fix=Text("give worker pods GPUs or set workers.useGpu: false"),
        cluster=True,
    ),
    Rule(
        name="gpu-nodes-fit-replicas",
        field="workers.processesPerNode",
        holds=~GPU | (PPN.size() <= REPLICAS),
        problem=Text(
            "lists {} nodes but the RayCluster has {} worker replicas", PPN.size(), REPLICAS
        ),
        fix=Text("raise rayCluster.workers.replicas or list fewer nodes"),
        cluster=True,
    ),
    Rule(
        name="gpu-processes-fit-pods",
        field="workers.processesPerNode",
        holds=~GPU | ~PPN.exists_above(GPUS_PER_WORKER),
        problem=Text(
            "{} GPU processes on one node exceed gpusPerWorker {}",
            PPN.first_above(GPUS_PER_WORKER),
            GPUS_PER_WORKER,
        ),
        fix=Text("lower processesPerNode or raise rayCluster.workers.gpusPerWorker"),
        cluster=True,
    ),
    Rule(
        name="checkpoint-on-storage",
        field="training.checkpointDir",
        holds=~HAS_STORAGE | CHECKPOINT_DIR.eq("") | CHECKPOINT_DIR.within(MOUNT_PATH),
        problem=Text(
            "is not rayCluster.storage.mountPath or a directory under it (with no '..' step), "
            "so workers would write checkpoints beside the checkpoint volume and a re-created "
            "group could not resume from them"
        ),
        fix=Text(
            "set training.checkpointDir to rayCluster.storage.mountPath or a directory under "
            "it, e.g. /checkpoints/my-group when mountPath is /checkpoints"
        ),
        cluster=True,
    ),
    Rule(
        name="checkpoint-needs-storage",
        field="training.checkpointDir",
        holds=~HAS_CLUSTER | CHECKPOINT_DIR.eq("") | HAS_STORAGE | (PPN.size() <= 1),
        problem=Text(
            "is set without rayCluster.storage for a group on {} nodes: each node would write "
            "its own ephemeral disk, and ranks on different nodes would resume from different "
            "steps",
            PPN.size(),
        ),
        fix=Text(
            "add rayCluster.storage (a ReadWriteMany PersistentVolumeClaim mounted on every "
            "worker) and put training.checkpointDir under its mountPath, or set "
            'training.checkpointDir: "" (no checkpoints)'
        ),
        cluster=True,
    ),
    Rule(
        name="worker-volume-names",
        field="rayCluster.workers.volumes",
        holds=~HAS_CLUSTER | ~WORKER_VOLUMES.exists_key_in("name", RESERVED_VOLUMES),
        problem=Text(
            "names a volume {}, which the operator mounts itself (dshm is /dev/shm, "
            "checkpoints the rayCluster.storage claim)",
            Str(WORKER_VOLUMES.first_key_in("name", RESERVED_VOLUMES)),
        ),
        fix=Text("give the volume another name"),
    ),
    Rule(
        name="extended-resources-not-gpus",
        field="rayCluster.workers.extendedResources",
        holds=~HAS_CLUSTER | ~EXTENDED_RESOURCES.exists_key_in("name", GPU_RESOURCE),
        problem=Text("lists nvidia.com/gpu, which rayCluster.workers.gpusPerWorker sets"),
        fix=Text("remove it and set rayCluster.workers.gpusPerWorker"),
    ),
    Rule(
        name="tensor-groups-in-node",
        field="parallelism.tensor",
        holds=~GPU_GROUP | ~PPN.exists_not_multiple_of(TENSOR_CONTEXT),
        problem=Text(
            "tensor x context = {} x {} = {} does not divide the {} GPU processes of a node "
            "(workers.processesPerNode), so a tensor-parallel group would span nodes and "
            "run its all-reduces over the network",
            TENSOR,
            CONTEXT,
            TENSOR_CONTEXT,
            PPN.first_not_multiple_of(TENSOR_CONTEXT),
        ),
        fix=Text(
            "make every workers.processesPerNode entry a multiple of {} (e.g. [{}] per node), "
            "or lower parallelism.tensor or parallelism.context",
            TENSOR_CONTEXT,
            TENSOR_CONTEXT,
        ),
        cluster=True,
    ),
)


PRETRAINED_RULES: tuple[Rule, ...] = (
    Rule(
        name="pretrained-rope",
        field="model.positionEmbedding",
        holds=~PRETRAINED | Field("model.positionEmbedding").eq("rope"),
        problem=Text(
            "is {} but model.pretrained is a Llama checkpoint, which uses rotary positions "
            "(auto picks learned positions on a CPU)",
            Str(Field("model.positionEmbedding")),
        ),
        fix=Text("set model.positionEmbedding: rope, or remove model.pretrained"),
    ),
    Rule(
        name="pretrained-rmsnorm",
        field="model.normalization",
        holds=~PRETRAINED | Field("model.normalization").eq("RMSNorm"),
        problem=Text(
            "is {} but model.pretrained is a Llama checkpoint, which uses RMSNorm",
            Str(Field("model.normalization")),
        ),
        fix=Text("set model.normalization: RMSNorm, or remove model.pretrained"),
    ),
    Rule(
        name="pretrained-swiglu",
        field="model.activation",
        holds=~PRETRAINED | Field("model.activation").eq("swiglu"),
        problem=Text(
            "is {} but model.pretrained is a Llama checkpoint, whose MLP is SwiGLU",
            Str(Field("model.activation")),
        ),
        fix=Text("set model.activation: swiglu, or remove model.pretrained"),
    ),
)

# qwen2 and qwen3 are Llama with QKV biases or q/k norms: the rest of the Llama shape holds
# (with model.pretrained the rules above say so already).
ARCHITECTURE_RULES: tuple[Rule, ...] = (
    Rule(
        name="architecture-rope",
        field="model.positionEmbedding",
        holds=LLAMA | PRETRAINED | Field("model.positionEmbedding").eq("rope"),
        problem=Text(
            "is {} but model.architecture {} uses rotary positions "
            "(auto picks learned positions on a CPU)",
            Str(Field("model.positionEmbedding")),
            Str(ARCHITECTURE),
        ),
        fix=Text("set model.positionEmbedding: rope, or model.architecture: llama"),
    ),
    Rule(
        name="architecture-rmsnorm",
        field="model.normalization",
        holds=LLAMA | PRETRAINED | Field("model.normalization").eq("RMSNorm"),
        problem=Text(
            "is {} but model.architecture {} uses RMSNorm",
            Str(Field("model.normalization")),
            Str(ARCHITECTURE),
        ),
        fix=Text("set model.normalization: RMSNorm, or model.architecture: llama"),
    ),
    Rule(
        name="architecture-swiglu",
        field="model.activation",
        holds=LLAMA | PRETRAINED | Field("model.activation").eq("swiglu"),
        problem=Text(
            "is {} but model.architecture {} has a SwiGLU MLP",
            Str(Field("model.activation")),
            Str(ARCHITECTURE),
        ),
        fix=Text("set model.activation: swiglu, or model.architecture: llama"),
    ),
)
RULES = RULES + PRETRAINED_RULES + ARCHITECTURE_RULES


def crd_rules() -> list[Rule]:
    return [r for r in RULES if r.in_crd]


def policy_rules() -> list[Rule]:
    return [r for r in RULES if not r.in_crd]


def rules(*, local: bool = False) -> Sequence[Rule]:
    """The rules that apply: all of them on Kubernetes, those without ``cluster`` locally."""
    return [r for r in RULES if not (local and r.cluster)]


def broken(spec: Wire, *, local: bool = False) -> list[Rule]:
    """The rules a wire-form spec breaks, in declaration order."""
    return [r for r in rules(local=local) if r.broken_by(spec)]
