"""What every pod the operator builds gets for a platform team to accept it (pure functions).

* :func:`container_security` / :func:`pod_security`: the ``restricted`` Pod Security
  Standard's settings (non-root, no privilege escalation, every capability dropped, seccomp
  ``RuntimeDefault``); a pod that mounts the checkpoint claim also gets ``fsGroup`` with
  ``fsGroupChangePolicy: OnRootMismatch``, so a fresh volume is writable by the runtime's
  user and a large one is not re-owned at every start. Worker pods may add the capabilities
  NCCL over RDMA needs (``rayCluster.workers.capabilities``, validated by the spec's schema).
* :func:`worker_env`: NCCL and torch defaults (the user's ``env`` wins).
* :func:`shm_size`: the ``sizeLimit`` of a worker pod's memory-backed ``/dev/shm``.
* :func:`worker_resources`: requests and limits: no CPU limit unless ``cpuLimit``; GPUs and
  the extended resources (RDMA, EFA) in both.
"""

from __future__ import annotations

import decimal
from collections.abc import Sequence
from typing import Any

from tgapi import TrainerGroup
from tgapi.model import PodSecuritySpec, RayWorkerNodesSpec
from tgapi.sizing import parse_quantity

GPU_RESOURCE = "nvidia.com/gpu"
NCCL_DEBUG = "WARN"
MAX_COMPILE_THREADS = 8
"""torch.compile's worker processes per training process at most (inductor's default is the
node's CPU count, not the pod's share, and every rank of a pod starts that many)."""
GI = 2**30
SHM_PER_GPU = 8 * GI
SHM_WITHOUT_GPU = 2 * GI


def container_security(*, add: Sequence[str] = ()) -> dict[str, Any]:
    """A container's ``securityContext``: restricted, plus the ``add`` capabilities."""
    capabilities: dict[str, Any] = {"drop": ["ALL"]}
    if add:
        capabilities["add"] = list(add)
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": capabilities,
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def pod_security(security: PodSecuritySpec | None, *, mounts_claim: bool) -> dict[str, Any]:
    """A pod's ``securityContext``: its user and group (the spec's, else the image's), and
    ``fsGroup`` where the pod mounts the checkpoint claim."""
    security = security or PodSecuritySpec()
    out: dict[str, Any] = {
        "runAsNonRoot": True,
        "runAsUser": security.run_as_user,
        "runAsGroup": security.run_as_group,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    if mounts_claim:
        out["fsGroup"] = security.fs_group
        out["fsGroupChangePolicy"] = "OnRootMismatch"
    return out


def _bytes(quantity: str) -> decimal.Decimal | None:
    return parse_quantity(quantity) if quantity else None


def _gi(n: decimal.Decimal | int) -> str:
    """Bytes as a quantity: whole GiB where exact, else whole MiB (rounded down)."""
    n = int(n)
    if n % GI == 0:
        return f"{n // GI}Gi"
    return f"{n // 2**20}Mi"


def half(memory: str) -> str:
    """Half of a memory quantity (a /dev/shm limit that leaves the processes the rest)."""
    n = _bytes(memory)
    if n is None or n <= 0:
        return memory
    return _gi((n / 2).to_integral_value(rounding=decimal.ROUND_FLOOR))


def shm_size(workers: RayWorkerNodesSpec) -> str:
    """``shmSize``, else 8Gi per GPU (2Gi without GPUs), at most half the pod's memory."""
    if workers.shm_size:
        return workers.shm_size
    size = decimal.Decimal(
        SHM_PER_GPU * workers.gpus_per_worker if workers.gpus_per_worker else SHM_WITHOUT_GPU
    )
    memory = _bytes(workers.memory_quantity)
    if memory is not None and memory > 0:
        size = min(size, (memory / 2).to_integral_value(rounding=decimal.ROUND_FLOOR))
    return _gi(size)


def worker_resources(workers: RayWorkerNodesSpec) -> dict[str, dict[str, str]]:
    """Requests and limits of the worker container: CPU requested only (a limit throttles
    the raylet and NCCL's proxy threads) unless ``cpuLimit`` is set; memory, GPUs and the
    extended resources in both (the scheduler needs them equal for devices)."""
    memory = workers.memory_quantity
    requests: dict[str, str] = {"cpu": workers.cpu, "memory": memory}
    limits: dict[str, str] = {"memory": memory}
    if workers.cpu_limit:
        limits["cpu"] = workers.cpu_limit
    devices: dict[str, str] = {}
    if workers.gpus_per_worker > 0:
        devices[GPU_RESOURCE] = str(workers.gpus_per_worker)
    for extra in workers.extended_resources:
        devices[extra.name] = str(extra.count)
    return {"limits": {**limits, **devices}, "requests": {**requests, **devices}}


def ray_cpus(workers: RayWorkerNodesSpec) -> str:
    """The worker's ``num-cpus`` for ``ray start``: its CPU request, rounded up. Set explicitly
    because without a CPU limit KubeRay may not infer it from the container, and Ray would
    count every CPU of the node."""
    cpus = _bytes(workers.cpu)
    if cpus is None:
        return workers.cpu
    return str(max(1, int(cpus.to_integral_value(rounding=decimal.ROUND_CEILING))))


def head_resources(*, cpu: str, memory: str) -> dict[str, dict[str, str]]:
    """The head container: CPU requested only (the GCS and dashboard must not be throttled)."""
    return {"limits": {"memory": memory}, "requests": {"cpu": cpu, "memory": memory}}


def compile_threads(tg: TrainerGroup) -> int:
    """``TORCHINDUCTOR_COMPILE_THREADS``: the pod's CPU request shared by the training
    processes of its node, between 1 and :data:`MAX_COMPILE_THREADS`."""
    rc = tg.spec.ray_cluster
    cpus = _bytes(rc.workers.cpu) if rc is not None else None
    processes = max(tg.spec.workers.processes_per_node or [1])
    if cpus is None:
        return 1
    share = int(cpus // max(processes, 1))
    return max(1, min(MAX_COMPILE_THREADS, share))


def hub_token_env(tg: TrainerGroup) -> list[dict[str, Any]]:
    """``HF_TOKEN`` from ``spec.model.hubTokenSecret`` (key ``token``), for a pretrained hub id
    of a gated or private model (tgapi.hub); nothing when unset."""
    secret = tg.spec.model.hub_token_secret
    if not secret:
        return []
    return [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": secret, "key": "token"}}}]


def worker_env(tg: TrainerGroup) -> list[dict[str, Any]]:
    """The worker container's environment: the operator's defaults, then the user's ``env``
    (a name the user sets replaces the default)."""
    rc = tg.spec.ray_cluster
    user = [{"name": e.name, "value": e.value} for e in rc.workers.env] if rc else []
    defaults = [
        {"name": "NCCL_DEBUG", "value": NCCL_DEBUG},
        {"name": "TORCHINDUCTOR_COMPILE_THREADS", "value": str(compile_threads(tg))},
    ]
    if rc is not None and rc.workers.host_network:
        defaults.append({"name": "NCCL_SOCKET_IFNAME", "value": rc.workers.nccl_socket_ifname})
    mine = {e["name"] for e in user}
    return [d for d in defaults if d["name"] not in mine] + user
