"""Worker: the base class of every group member (a Ray actor).

Before the subclass's ``__init__`` runs (in ``__new__``, so subclasses that never call
``super().__init__()`` are covered too) a worker created by a WorkerGroup has RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT in its
environment (and verl's WG_PREFIX, WG_BACKEND, RAY_LOCAL_WORLD_SIZE, RAY_LOCAL_RANK), so
``torch.distributed.init_process_group(init_method="env://")`` works.

Master port without the bind-then-close race: rank 0 binds a socket to a free port with
SO_REUSEADDR and *keeps it bound* (not listening) for its whole life. While it is held,
the kernel never hands that port to anyone else (neither ``bind(0)`` nor an outgoing
connection), yet torch's TCPStore (which sets SO_REUSEADDR too, in both its libuv and
its classic backend) can still bind and listen on it. Rank 0 publishes addr:port in the
group's key-value entry; the other ranks wait for it (bounded by TG_MASTER_TIMEOUT_S)
before their ``__init__``. ``release_master_port()`` closes the reservation early.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from tgruntime.controller.decorator import Dispatch, register

ENV_GROUP = "TG_GROUP_NAME"
ENV_NAMESPACE = "TG_NAMESPACE"
ENV_GENERATION = "TG_GENERATION"
ENV_WORKER_NAME = "TG_WORKER_NAME"
ENV_MASTER_TIMEOUT = "TG_MASTER_TIMEOUT_S"

_process_master: dict[str, Any] = {}  # one actor per process: the reservation lives here


def _reserve_port() -> tuple[socket.socket, int]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("", 0))
    return sock, int(sock.getsockname()[1])


def _node_ip() -> str:
    import ray

    return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]


def _setup_master_from_group() -> None:
    """Rank 0 reserves and publishes the master port; other ranks wait for it."""
    if "addr" in _process_master:
        os.environ["MASTER_ADDR"] = _process_master["addr"]
        os.environ["MASTER_PORT"] = str(_process_master["port"])
        return
    from tgruntime.controller import registry

    group = os.environ[ENV_GROUP]
    ray_namespace = os.environ[ENV_NAMESPACE]
    generation = int(os.environ.get(ENV_GENERATION, "0"))
    rank = int(os.environ["RANK"])
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    elif rank == 0:
        sock, port = _reserve_port()
        addr = _node_ip()
        _process_master["socket"] = sock
        registry.publish_master(
            group_name=group,
            ray_namespace=ray_namespace,
            generation=generation,
            addr=addr,
            port=port,
        )
    else:
        timeout = float(os.environ.get(ENV_MASTER_TIMEOUT, "120"))
        deadline = time.monotonic() + timeout
        found = None
        delay = 0.02
        while found is None:
            found = registry.load_master(
                group_name=group, ray_namespace=ray_namespace, generation=generation
            )
            if found is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"rank {rank} of group {group!r}: rank 0 did not publish MASTER_ADDR/PORT "
                        f"within {timeout:g}s (is rank 0 starting?)"
                    )
                time.sleep(delay)
                delay = min(delay * 1.5, 0.5)
        addr, port = found
    _process_master["addr"] = addr
    _process_master["port"] = port
    os.environ["MASTER_ADDR"] = addr
    os.environ["MASTER_PORT"] = str(port)


def _set_verl_env() -> None:
    """verl's names for the local rank and size (verl's workers read RAY_LOCAL_*)."""
    env = os.environ
    if "LOCAL_WORLD_SIZE" in env:
        env.setdefault("RAY_LOCAL_WORLD_SIZE", env["LOCAL_WORLD_SIZE"])
    if "LOCAL_RANK" in env:
        env.setdefault("RAY_LOCAL_RANK", env["LOCAL_RANK"])


class Worker:
    """Base class for group members: rank/world info, master address, mesh registration."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Worker:
        instance = super().__new__(cls)
        if ENV_GROUP in os.environ and "RANK" in os.environ:
            _setup_master_from_group()
            _set_verl_env()
        instance._tg_read_env()
        return instance

    def __init__(self, cuda_visible_devices: str | None = None) -> None:
        self._tg_read_env()
        if cuda_visible_devices is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = str(cuda_visible_devices)

    def _tg_read_env(self) -> None:
        env = os.environ
        self._rank = int(env.get("RANK", "0"))
        self._world_size = int(env.get("WORLD_SIZE", "1"))
        self._local_rank = int(env.get("LOCAL_RANK", "0"))
        self._local_world_size = int(env.get("LOCAL_WORLD_SIZE", "1"))
        self._master_addr = env.get("MASTER_ADDR")
        self._master_port = env.get("MASTER_PORT")
        if not hasattr(self, "_tg_dispatch_dp_rank"):
            self._tg_dispatch_dp_rank: dict[str, int] = {}
            self._tg_collect: dict[str, bool] = {}

    # ------------------------------------------------------------------ identity
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def local_rank(self) -> int:
        return self._local_rank

    @property
    def local_world_size(self) -> int:
        return self._local_world_size

    def get_master_addr_port(self) -> tuple[str | None, str | None]:
        return self._master_addr, self._master_port

    def release_master_port(self) -> None:
        """Close rank 0's port reservation (safe once torch.distributed is initialised)."""
        sock = _process_master.pop("socket", None)
        if sock is not None:
            sock.close()

    def init_torch_distributed(self, *, backend: str | None = None, timeout_s: float = 600) -> None:
        """``torch.distributed.init_process_group`` from this worker's environment.

        backend None: NCCL when CUDA is available, else gloo.
        """
        import datetime

        import torch
        import torch.distributed as dist

        if dist.is_initialized():
            return
        chosen = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(
            backend=chosen,
            init_method="env://",
            rank=self._rank,
            world_size=self._world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )

    # ------------------------------------------------------------------ meshes
    def _register_dispatch_collect_info(
        self, mesh_name: str, dp_rank: int, is_collect: bool
    ) -> None:
        """Declare this worker's dp rank in ``mesh_name`` and whether its output is collected."""
        if not hasattr(self, "_tg_dispatch_dp_rank"):
            self._tg_read_env()
        old = (self._tg_dispatch_dp_rank.get(mesh_name), self._tg_collect.get(mesh_name))
        new = (int(dp_rank), bool(is_collect))
        if old != (None, None) and old != new:
            raise ValueError(
                f"mesh {mesh_name!r} already registered as dp_rank={old[0]}, is_collect={old[1]}"
            )
        self._tg_dispatch_dp_rank[mesh_name] = new[0]
        self._tg_collect[mesh_name] = new[1]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def _query_dispatch_info(self, mesh_name: str) -> int:
        if mesh_name not in self._tg_dispatch_dp_rank:
            raise KeyError(
                f"rank {self._rank} has no mesh {mesh_name!r}; call "
                f"self._register_dispatch_collect_info(mesh_name={mesh_name!r}, ...) in the worker"
            )
        return self._tg_dispatch_dp_rank[mesh_name]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def _query_collect_info(self, mesh_name: str) -> bool:
        if mesh_name not in self._tg_collect:
            raise KeyError(f"rank {self._rank} has no mesh {mesh_name!r}")
        return self._tg_collect[mesh_name]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def _tg_mesh_info(self) -> dict[str, tuple[int, bool]]:
        """Every mesh this worker registered: name -> (dp rank, is_collect)."""
        return {
            m: (self._tg_dispatch_dp_rank[m], self._tg_collect[m])
            for m in self._tg_dispatch_dp_rank
        }

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def _tg_worker_info(self) -> dict[str, Any]:
        """Identity of this worker process (rank, pid, node, name, master address)."""
        import ray

        return {
            "rank": self._rank,
            "world_size": self._world_size,
            "local_rank": self._local_rank,
            "local_world_size": self._local_world_size,
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "name": os.environ.get(ENV_WORKER_NAME, ""),
            "master_addr": self._master_addr,
            "master_port": self._master_port,
        }
