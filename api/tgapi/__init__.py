"""tgapi: the one model of the TrainerGroup resource (parse, defaults, validation, CRD).

Dependency-light on purpose (standard library + PyYAML): the operator, the Ray
runtime and ``tgctl`` all import it.
"""

from tgapi.errors import SpecError, SpecErrors
from tgapi.model import (
    API_GROUP,
    API_VERSION,
    DEFAULT_WORKER_CLASS,
    KIND,
    PLURAL,
    USE_GPU_AUTO,
    ModelSpec,
    OptimizerSpec,
    ParallelismSpec,
    RayClusterRef,
    RayClusterSpec,
    TimeoutsSpec,
    TrainerGroup,
    TrainerGroupSpec,
    TrainingSpec,
    WorkersSpec,
)
from tgapi.parse import load_file, parse_resource, parse_spec
from tgapi.status import (
    PHASES,
    Condition,
    MeshStatus,
    RunStatus,
    TrainerGroupStatus,
    TrainingStatus,
    WorkerStatus,
    parse_status,
)
from tgapi.wire import to_wire

__all__ = [
    "API_GROUP",
    "API_VERSION",
    "DEFAULT_WORKER_CLASS",
    "KIND",
    "PHASES",
    "PLURAL",
    "USE_GPU_AUTO",
    "Condition",
    "MeshStatus",
    "ModelSpec",
    "OptimizerSpec",
    "ParallelismSpec",
    "RayClusterRef",
    "RayClusterSpec",
    "RunStatus",
    "SpecError",
    "SpecErrors",
    "TimeoutsSpec",
    "TrainerGroup",
    "TrainerGroupSpec",
    "TrainerGroupStatus",
    "TrainingSpec",
    "TrainingStatus",
    "WorkerStatus",
    "WorkersSpec",
    "load_file",
    "parse_resource",
    "parse_spec",
    "parse_status",
    "to_wire",
]
