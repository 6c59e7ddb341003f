"""verl's single_controller names, with verl's meanings and keyword arguments.

A verl user ports detached-worker code by changing imports only::

    # from verl import DataProto
    # from verl.single_controller.base import Worker
    # from verl.single_controller.base.decorator import Dispatch, register, ...
    # from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from tgruntime.compat.verl import (
        DataProto, Dispatch, RayClassWithInitArgs, RayResourcePool, RayWorkerGroup, Worker,
        register,
    )

Differences, all on the safe side:

- verl's CPU bundles hold ``max_colocate_count`` (10) CPUs each, which no 2-core machine
  can ever place (verl then waits forever). Here a bundle holds
  ``min(max_colocate_count, CPUs of the largest node / processes on it)`` CPUs (fractional
  allowed; a warning says so when it is less), each actor asks for
  ``bundle / max_colocate_count`` of it (so up to ``max_colocate_count`` groups can share
  a pool, verl's colocation), and waiting for placement is bounded
  (``ray_wait_register_center_timeout``, 300 s as in verl) and fails with
  PlacementTimeoutError saying what was asked and what the cluster has.
- The master port is reserved without verl's bind-then-close race (see ``Worker``).
  ``RayWorkerGroup(master_port_range=[low, high])`` (verl >= 0.7.1, ``trainer.master_port_range``)
  puts the rendezvous on the first port of ``low`` .. ``high - 1`` that no socket holds on
  rank 0's node, chosen there before the workers start (verl's rule; an explicit
  ``master_addr``/``master_port`` wins, no free port is a RuntimeError naming the range, a
  malformed range a ValueError before anything is placed). Ports held by another group's
  rank 0 are skipped; two groups created at the same moment on one range may still pick
  the same port (as in verl): give each its own slice.
- ``from_detached`` keeps strong references to the actors (verl's weak-reference bug
  cannot happen), and works without ``ray_cls_with_init`` for groups created here (the
  published group record describes their methods).
- ``RayWorkerGroup(worker_env={...})`` adds variables to every worker's environment and,
  as in verl, refuses (ValueError) to override the ones the group sets (``PROTECTED_ENV``).
  Keyword arguments that verl does not know are a TypeError naming them (verl swallows
  them). Workers see verl's RANK, WORLD_SIZE, MASTER_ADDR/PORT, WG_PREFIX, WG_BACKEND,
  RAY_LOCAL_WORLD_SIZE and RAY_LOCAL_RANK (local to each node here; verl uses node 0's size).
- DP_COMPUTE_PROTO and N-D dispatch always pad a batch that does not divide by the DP
  size and drop the padding from the result, so ``DataProtoConfig.auto_padding`` (and
  ``VERL_AUTO_PADDING``, and ``from_dict(auto_padding=True)``) changes only what
  ``DataProto.is_padding_enabled()`` says and whether ``DataProto.chunk()`` accepts an
  uneven split: verl without it would fail the call. ``DataProto.padding()`` is verl's.
- TensorDict arguments of DP_COMPUTE_PROTO and N-D methods are split per rank like
  DataProtos (padded, not refused, when uneven), and TensorDict results are joined with
  ``concat_tensordict``, also through ``DataProtoFuture``.
- ``tensordict_utils``: verl's ``verl.utils.tensordict_utils`` helpers.

The modules below this package map verl's one to one: ``protocol`` (``verl.protocol``),
``single_controller.base`` and ``.base.decorator``, ``single_controller.ray``, and
``utils.tensordict_utils``, so ``from verl.X import Y`` becomes
``from tgruntime.compat.verl.X import Y``.
- Detached groups are published under ``name_prefix + ClassName`` and can be attached by
  that name (``WorkerGroup.attach``), checked (``health``) and removed (``teardown``).
"""

from __future__ import annotations

from typing import Any

from tgruntime.compat.verl.protocol import (
    DataProtoConfig,
    DataProtoFuture,
    pad_dataproto_to_divisor,
    unpad_dataproto,
)
from tgruntime.compat.verl.single_controller.base import ClassWithInitArgs, Worker
from tgruntime.compat.verl.single_controller.base.decorator import (
    Dispatch,
    Execute,
    make_nd_compute_dataproto_dispatch_fn,
    register,
)
from tgruntime.compat.verl.single_controller.ray import (
    PROTECTED_ENV,
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
)

__all__ = [
    "PROTECTED_ENV",
    "ClassWithInitArgs",
    "DataProto",
    "DataProtoConfig",
    "DataProtoFuture",
    "DataProtoItem",
    "Dispatch",
    "Execute",
    "RayClassWithInitArgs",
    "RayResourcePool",
    "RayWorkerGroup",
    "Worker",
    "make_nd_compute_dataproto_dispatch_fn",
    "pad_dataproto_to_divisor",
    "register",
    "tensordict_utils",
    "unpad_dataproto",
]


def __getattr__(name: str) -> Any:
    # DataProto and tensordict_utils need torch: imported on first use, so drivers that never
    # send one stay light.
    if name in ("DataProto", "DataProtoItem"):
        from tgruntime.compat.verl import protocol

        return getattr(protocol, name)
    if name == "tensordict_utils":
        from tgruntime.compat.verl.utils import tensordict_utils

        return tensordict_utils
    raise AttributeError(f"module 'tgruntime.compat.verl' has no attribute {name!r}")
