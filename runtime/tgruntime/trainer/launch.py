"""A torchrun-style local launcher: run a function on N new processes, collect results.

Each process gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT`` (a free loopback port) before the function runs, exactly as torchrun or
the worker group would set them, so :meth:`TrainEngine.create` initialises from the
environment as usual. Used by the tests and by the direct half of the step benchmark.
The function must be importable (module level) and its arguments and result picklable.

Ranks start from a fork server that has imported torch and megatron-core once (about 10 CPU
seconds per process on the CI machine), not from a fresh interpreter each: a test module that
launches five times pays that import once. Each rank still gets the caller's environment as it
is at the call, as a spawned process would (the fork server's own is from its start).

On a machine with NVIDIA devices, ranks are spawned instead: importing megatron-core queries
CUDA, and a process forked after CUDA is initialised fails its first CUDA call with
"CUDA error: initialization error" (how the GPU tests failed on the H200). ``TG_LAUNCH_START``
(``spawn`` or ``forkserver``) overrides the choice.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Mapping
from multiprocessing.context import ForkServerContext, SpawnContext
from typing import Any

import torch.multiprocessing as mp

from tgapi.errors import PicklableError
from tgruntime.trainer.gpu_check import nvidia_device_nodes

__all__ = ["LaunchError", "free_port", "launch", "start_method"]


class LaunchError(PicklableError, RuntimeError):
    """A rank failed, died or timed out; the message holds its traceback."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


# Imported once by the fork server; each rank is forked from it with these already loaded
# (tgruntime.trainer before megatron: its hook defers megatron's torch.compile decoration).
PRELOAD = ("torch", "tgruntime.trainer", "megatron.core", "tgruntime.trainer.engine")


def start_method() -> str:
    """``forkserver`` with the preload on CPU-only machines, ``spawn`` where NVIDIA devices
    are (see the module's docstring); ``TG_LAUNCH_START`` overrides."""
    chosen = os.environ.get("TG_LAUNCH_START", "")
    if chosen:
        if chosen not in ("spawn", "forkserver"):
            raise ValueError(f"TG_LAUNCH_START must be spawn or forkserver, not {chosen!r}")
        return chosen
    return "spawn" if nvidia_device_nodes(_dev_names()) else "forkserver"


def _dev_names() -> list[str]:
    try:
        return os.listdir("/dev")
    except OSError:
        return []


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    kwargs: Mapping[str, Any],
    env: Mapping[str, str],
    results: Any,
) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        results.put((rank, True, fn(**kwargs)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        raise SystemExit(1) from None


def launch(
    fn: Callable[..., Any],
    *,
    world_size: int,
    kwargs: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 600.0,
) -> list[Any]:
    """Run ``fn(**kwargs)`` on ``world_size`` new ranks (forked from the fork server); return
    results by rank."""
    ctx: SpawnContext | ForkServerContext
    if start_method() == "forkserver":
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(PRELOAD))
    else:
        ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_entry,
            args=(fn, rank, world_size, port, dict(kwargs or {}),
                  {**os.environ, **(env or {})}, results),
            daemon=False,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    collected: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(collected) < world_size:
            try:
                rank, ok, value = results.get(timeout=0.5)
            except queue.Empty:
                dead = [
                    i
                    for i, p in enumerate(procs)
                    if p.exitcode not in (None, 0) and i not in collected
                ]
                if dead:
                    raise LaunchError(
                        f"rank {dead[0]} exited with code {procs[dead[0]].exitcode}"
                    ) from None
                if time.monotonic() > deadline:
                    raise LaunchError(
                        f"timed out after {timeout_s:.0f}s waiting for ranks"
                    ) from None
                continue
            if not ok:
                raise LaunchError(f"rank {rank} failed:\n{value}")
            collected[rank] = value
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
    return [collected[r] for r in range(world_size)]
