"""verl's own single-controller usage, ported by changing imports only.

The patterns follow verl's tests and workers: ``worker_env`` and the environment verl's
workers read, ``DataProtoConfig.auto_padding`` with uneven DP_COMPUTE_PROTO batches (as
args and as kwargs), the ``tensordict_utils`` helpers, and TensorDicts through a real
group's N-D and DP_COMPUTE_PROTO dispatch (issue 21; test_verl_compat_tensordict.py has the
rest). One group (``verl_group``) serves every test here that only calls a group.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import ray
import torch
from tensordict import TensorDict

from tests.fixtures_ray import RayCluster
from tests.runtime.test_verl_compat_tensordict import _rows, _td
from tgruntime.compat.verl import (
    PROTECTED_ENV,
    DataProto,
    DataProtoConfig,
    DataProtoFuture,
    Dispatch,
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    Worker,
    make_nd_compute_dataproto_dispatch_fn,
    pad_dataproto_to_divisor,
    register,
    unpad_dataproto,
)
from tgruntime.compat.verl import tensordict_utils as tu
from tgruntime.compat.verl.single_controller.ray.base import first_free_port
from tgruntime.controller import teardown_group

ENV_KEYS = (
    "RANK",
    "WORLD_SIZE",
    "WG_PREFIX",
    "WG_BACKEND",
    "RAY_LOCAL_WORLD_SIZE",
    "RAY_LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "MY_FLAG",
)


@ray.remote
class EnvActor(Worker):
    """verl's tests/single_controller TestActor: reads its environment."""

    def __init__(self) -> None:
        super().__init__()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def getenv(self, key: str) -> str:
        return os.getenv(key, f"{key} not set")


@ray.remote
class PadActor(Worker):
    """verl's test_auto_padding Actor, plus a worker that uses tensordict_utils, plus verl's
    TestActor's ``getenv``, plus methods that take and return TensorDicts on a 1-D mesh "dp"
    and with DP_COMPUTE_PROTO (``mark``, ``mark_async``, ``rows``; TDActor's in
    test_verl_compat_tensordict.py until 2026-12-06): one class, so that one group
    (``verl_group``, two workers that each import torch and tensordict, ~12 CPU s apiece)
    serves the worker_env, auto-padding, tensordict_utils and TensorDict-group tests."""

    def __init__(self) -> None:
        super().__init__()
        self._register_dispatch_collect_info(mesh_name="dp", dp_rank=self.rank, is_collect=True)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="dp"))
    def mark(self, td: TensorDict) -> TensorDict:
        import tgruntime.compat.verl.utils.tensordict_utils as tdu

        return tdu.get_tensordict(
            {"x": td["x"] * 10, "rank": torch.full((len(td),), self.rank)},
            {"experiment": tdu.get(td, "experiment")},
        )

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="dp"), blocking=False)
    def mark_async(self, td: TensorDict) -> TensorDict:
        return TensorDict({"x": td["x"] + 1, "rank": torch.full((len(td),), self.rank)},
                          batch_size=td.batch_size)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def rows(self, td: TensorDict) -> TensorDict:
        return TensorDict({"x": td["x"], "n": torch.full((len(td),), len(td))},
                          batch_size=td.batch_size)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def getenv(self, key: str) -> str:
        return os.getenv(key, f"{key} not set")

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def add(self, data: Any) -> Any:
        data.batch["a"] += self.rank
        return data

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def scale(self, data: Any) -> Any:
        td = tu.contiguous(data.batch)
        tu.assign_non_tensor(td, factor=data.meta_info["factor"])
        factor = tu.get(td, "factor", 1.0)
        out = tu.get_tensordict({"y": tu.pop(td, "x") * factor})
        return DataProto(batch=out)


def _prefix() -> str:
    return f"v{uuid.uuid4().hex[:6]}"


@pytest.fixture
def cleanup() -> Iterator[list[str]]:
    groups: list[str] = []
    yield groups
    namespace = ray.get_runtime_context().namespace
    for g in groups:
        teardown_group(group_name=g, ray_namespace=namespace, timeout_s=60)


@dataclasses.dataclass(frozen=True)
class VerlGroup:
    wg: RayWorkerGroup
    prefix: str


@pytest.fixture(scope="module")
def verl_group(ray_driver: RayCluster) -> Iterator[VerlGroup]:
    """One PadActor group with ``worker_env={"MY_FLAG": "on"}`` for the module's tests that
    only call it (none changes its state): the worker_env, auto-padding and tensordict_utils
    tests. The master_port_range test makes its own (its group's port range is the subject)."""
    prefix = _prefix()
    wg = RayWorkerGroup(
        # one CPU a bundle (verl's default, 10, is cut to half the head's CPUs each: the
        # whole head), so the master_port_range test's group fits beside this one
        resource_pool=RayResourcePool([2], use_gpu=False, max_colocate_count=1),
        ray_cls_with_init=RayClassWithInitArgs(cls=PadActor),
        name_prefix=prefix,
        worker_env={"MY_FLAG": "on"},
    )
    try:
        yield VerlGroup(wg=wg, prefix=prefix)
    finally:
        teardown_group(
            group_name=wg.group_name, ray_namespace=ray.get_runtime_context().namespace,
            timeout_s=60,
        )


# ---------------------------------------------------------------------------- worker_env
@pytest.mark.ray
def test_worker_env_and_verl_env_vars(verl_group: VerlGroup) -> None:
    wg, prefix = verl_group.wg, verl_group.prefix
    env = {key: wg.getenv(key) for key in ENV_KEYS}
    assert env["RANK"] == ["0", "1"] and env["WORLD_SIZE"] == ["2", "2"]
    assert env["WG_PREFIX"] == [prefix, prefix] and env["WG_BACKEND"] == ["ray", "ray"]
    assert env["RAY_LOCAL_WORLD_SIZE"] == ["2", "2"] and env["RAY_LOCAL_RANK"] == ["0", "1"]
    assert env["MY_FLAG"] == ["on", "on"]
    assert len(set(env["MASTER_ADDR"])) == 1 and len(set(env["MASTER_PORT"])) == 1
    assert int(env["MASTER_PORT"][0]) > 0
    assert wg.customized_worker_env == {"MY_FLAG": "on"}


@pytest.mark.ray
@pytest.mark.parametrize(
    "key",
    [
        "RANK",
        "WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "WG_PREFIX",
        "WG_BACKEND",
        "RAY_LOCAL_WORLD_SIZE",
        "TG_GROUP_NAME",
    ],
)
def test_worker_env_refuses_protected_variables(ray_driver: RayCluster, key: str) -> None:
    with pytest.raises(ValueError, match=f"Cannot override protected system env: {key}"):
        RayWorkerGroup(
            resource_pool=RayResourcePool([2], use_gpu=False),
            ray_cls_with_init=RayClassWithInitArgs(cls=EnvActor),
            name_prefix=_prefix(),
            worker_env={key: "x", "FINE": "1"},
        )


def test_protected_set_covers_verls() -> None:
    verl = {
        "WORLD_SIZE",
        "RANK",
        "WG_PREFIX",
        "WG_BACKEND",
        "RAY_LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    }
    assert verl <= PROTECTED_ENV


def test_unknown_kwargs_are_a_type_error() -> None:
    with pytest.raises(TypeError, match="'worker_evn'"):
        RayWorkerGroup(resource_pool=None, ray_cls_with_init=None, worker_evn={"A": "1"})
    with pytest.raises(TypeError, match="'bogus', 'other'"):
        RayWorkerGroup(other=1, bogus=2)


def test_use_gpu_must_match_the_pool() -> None:
    with pytest.raises(ValueError, match="use_gpu is True"):
        RayWorkerGroup(resource_pool=RayResourcePool([1], use_gpu=False),
                       ray_cls_with_init=RayClassWithInitArgs(cls=EnvActor), use_gpu=True)


def test_master_addr_needs_master_port() -> None:
    with pytest.raises(ValueError, match="master_port"):
        RayWorkerGroup(
            resource_pool=RayResourcePool([1], use_gpu=False),
            ray_cls_with_init=RayClassWithInitArgs(cls=EnvActor),
            master_addr="127.0.0.1",
        )


# ---------------------------------------------------------------------------- master_port_range
# verl >= 0.7.1 passes RayWorkerGroup(master_port_range=[low, high]) (trainer.master_port_range):
# the rendezvous port is the first free one of low .. high-1 on rank 0's node (None: any free
# port); an explicit master_addr/master_port wins; no free port is a RuntimeError.
@ray.remote
class RendezvousActor(Worker):
    """Joins torch.distributed (gloo, env://) on the master address it was given."""

    def __init__(self) -> None:
        super().__init__()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def master(self) -> tuple[str, str]:
        return os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def all_reduce(self) -> float:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method="env://")
        value = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(value)
        dist.destroy_process_group()
        return float(value.item())


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ([30000], "two port numbers"),
        ("30000-30010", "two port numbers"),
        ([30010, 30000], "low < high"),
        ([0, 10], "low < high"),
        ([65000, 70000], "<= 65536"),
    ],
)
def test_master_port_range_refusals(value: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):  # before anything is placed (no Ray needed)
        RayWorkerGroup(
            resource_pool=RayResourcePool([1], use_gpu=False),
            ray_cls_with_init=RayClassWithInitArgs(cls=EnvActor),
            master_port_range=value,
        )


def _held(port: int, *, listen: bool) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("", port))
    if listen:
        sock.listen()
    return sock


def _is_free(port: int) -> bool:
    try:
        return first_free_port(port, port + 1) == port
    except RuntimeError:  # taken by another process: look for another run
        return False


def _free_run(n: int) -> int:
    """A port p with p .. p+n-1 all free now."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("", 0))
            low = int(s.getsockname()[1])
        if low + n < 65536 and all(_is_free(p) for p in range(low, low + n)):
            return low
    raise AssertionError("no run of free ports")


def test_first_free_port_skips_held_ports_and_says_when_none_is_left() -> None:
    low = _free_run(3)
    assert first_free_port(low, low + 3) == low
    # a listening socket, and a bound-not-listening one like rank 0's reservation
    with _held(low, listen=True), _held(low + 1, listen=False):
        assert first_free_port(low, low + 3) == low + 2
        with pytest.raises(RuntimeError, match=rf"no free port in master_port_range \[{low}, "):
            first_free_port(low, low + 2)  # high is exclusive, as in verl


@pytest.mark.ray
def test_master_port_range_is_honoured(ray_driver: RayCluster, cleanup: list[str]) -> None:
    low = _free_run(20)
    with _held(low, listen=True):  # the first port of the range is taken: the next one is used
        wg = RayWorkerGroup(
            # one CPU a bundle: it runs beside the module's verl_group (see there)
            resource_pool=RayResourcePool([2], use_gpu=False, max_colocate_count=1),
            ray_cls_with_init=RayClassWithInitArgs(cls=RendezvousActor),
            name_prefix=_prefix(),
            master_port_range=[low, low + 20],
        )
        cleanup.append(wg.group_name)
        masters = wg.master()
    assert len(set(masters)) == 1, masters
    addr, port = masters[0]
    assert low < int(port) < low + 20
    assert addr == ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
    assert wg._ray_master_port_range == [low, low + 20]
    assert wg.all_reduce() == [3.0, 3.0]  # the rendezvous on that port works


# ---------------------------------------------------------------------------- auto padding
@pytest.mark.ray
def test_auto_padding_dp_compute_proto(verl_group: VerlGroup,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(type(DataProtoConfig), "_auto_padding", False)
    DataProtoConfig.auto_padding = True  # verl's switch (or VERL_AUTO_PADDING=1)
    assert DataProtoConfig.auto_padding
    wg = verl_group.wg  # RayResourcePool([2]): two ranks, as verl's test
    for size in (1, 3, 5, 8):
        names = np.array([str(i) for i in range(size)], dtype=object)
        for as_kwarg in (False, True):
            data = DataProto.from_dict({"a": torch.zeros(size)}, {"na": names})
            out = wg.add(data=data) if as_kwarg else wg.add(data)
            assert len(out) == size, (size, as_kwarg)
            assert list(out.non_tensor_batch["na"]) == list(names)
            first = (size + 1) // 2  # rank 0 gets the first ceil(size/2) rows
            assert out.batch["a"].tolist() == [0.0] * first + [1.0] * (size - first)
    DataProtoConfig.auto_padding = False
    out = wg.add(
        DataProto.from_single_dict({"a": torch.zeros(3), "na": np.array(["x"] * 3, dtype=object)})
    )
    assert len(out) == 3  # padding here does not depend on the switch


def test_auto_padding_env_and_type(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(type(DataProtoConfig), "_auto_padding", False)
    monkeypatch.setenv("VERL_AUTO_PADDING", "true")
    assert DataProtoConfig.auto_padding
    monkeypatch.setenv("VERL_AUTO_PADDING", "0")
    assert not DataProtoConfig.auto_padding
    with pytest.raises(TypeError):
        DataProtoConfig.auto_padding = 1
    assert DataProtoConfig.auto_padding_key == "_verl_auto_padding"


def test_pad_and_unpad_dataproto() -> None:
    data = DataProto.from_dict({"a": torch.arange(5)}, {"n": np.arange(5)})
    padded, pad = pad_dataproto_to_divisor(data, 4)
    assert pad == 3 and len(padded) == 8 and padded.batch["a"].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert unpad_dataproto(padded, pad).batch["a"].tolist() == [0, 1, 2, 3, 4]
    same, none = pad_dataproto_to_divisor(data, 5)
    assert none == 0 and same is data
    with pytest.raises(TypeError):
        pad_dataproto_to_divisor(TensorDict({"a": torch.zeros(2)}, [2]), 2)


@pytest.mark.ray
def test_worker_uses_tensordict_utils(verl_group: VerlGroup) -> None:
    wg = verl_group.wg
    x = torch.arange(6.0).reshape(3, 2).t()  # non-contiguous rows: (2, 3)
    td = tu.get_tensordict({"x": x})
    out = wg.scale(DataProto(batch=td, meta_info={"factor": 2.0}))
    assert out.batch["y"].tolist() == (x * 2).tolist()
    # WorkerGroup's alternate constructors, inherited, build a RayWorkerGroup (its parent's
    # contract): attach by name and by worker names, with verl's attributes set
    for again in (
        RayWorkerGroup.attach(group_name=wg.group_name, ray_namespace=wg.ray_namespace),
        RayWorkerGroup.from_worker_names(
            worker_names=wg.worker_names, ray_namespace=wg.ray_namespace
        ),
    ):
        assert type(again) is RayWorkerGroup and again.device_name == "cuda"
        assert again.use_gpu is False and again.fused_worker_used is False
        assert again.scale(DataProto(batch=td, meta_info={"factor": 3.0})).batch["y"].tolist() == (
            x * 3
        ).tolist()


def test_ray_worker_group_keeps_its_parents_signatures() -> None:
    """Every WorkerGroup method RayWorkerGroup overrides accepts the parent's arguments."""
    import inspect

    from tgruntime.controller import WorkerGroup

    overridden = [
        name
        for name, value in vars(RayWorkerGroup).items()
        if callable(value) and name in vars(WorkerGroup) and name != "__init__"
    ]
    for name in overridden:
        parent = inspect.signature(getattr(WorkerGroup, name)).parameters
        child = inspect.signature(getattr(RayWorkerGroup, name)).parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in child.values())
        for pname, param in parent.items():
            assert pname in child or takes_any, f"RayWorkerGroup.{name} drops {pname!r}"
            if pname in child and param.default is not param.empty:
                assert child[pname].default is not param.empty, f"{name}({pname}) lost its default"


# ---------------------------------------------------------------------------- tensordict_utils
def test_tensordict_utils_get_pop_contiguous() -> None:
    td = tu.get_tensordict(
        {"obs": torch.arange(6).reshape(2, 3).t(), "turn_scores": [[], [0.5, 0.8], [0.9]]},
        non_tensor_dict={"experiment": "run_001"},
    )
    assert td.batch_size == torch.Size([3])
    assert tu.get(td, "experiment") == "run_001"
    assert tu.get(td, "turn_scores") == [[], [0.5, 0.8], [0.9]]
    assert tu.get(td, "missing", "d") == "d" and tu.pop(td, "missing") is None
    assert not td["obs"].is_contiguous()
    c = tu.contiguous(td)
    assert c is not td and c["obs"].is_contiguous() and torch.equal(c["obs"], td["obs"])
    assert tu.get(c, "experiment") == "run_001" and tu.get(c, "turn_scores") == [
        [],
        [0.5, 0.8],
        [0.9],
    ]

    assert tu.pop(td, "experiment") == "run_001" and "experiment" not in list(td.keys())
    sub = tu.get_keys(td, ["obs"])
    assert list(sub.keys()) == ["obs"] and "turn_scores" in list(td.keys())
    popped = tu.pop_keys(td, ["turn_scores"])
    assert tu.get(popped, "turn_scores") == [[], [0.5, 0.8], [0.9]] and list(td.keys()) == ["obs"]
    with pytest.raises(KeyError):
        tu.get_keys(td, ["nope"])


def test_tensordict_utils_assign_pad_union() -> None:
    td = TensorDict({"a": torch.arange(3)}, batch_size=[3])
    tu.assign_non_tensor(td, config={"lr": 0.01}, per_row=[{"acc": 1.0}, {"acc": 0.0}, {}])
    assert tu.get(td, "config") == {"lr": 0.01} and tu.get_non_tensor_data(td, "config", None) == {
        "lr": 0.01
    }
    assert tu.get(td, "per_row") == [{"acc": 1.0}, {"acc": 0.0}, {}]
    padded, pad = tu.pad_to_divisor(TensorDict({"a": torch.arange(5)}, [5]), 4)
    assert pad == 3 and padded["a"].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert tu.unpad(padded, pad)["a"].tolist() == [0, 1, 2, 3, 4]
    merged = tu.union_tensor_dict(TensorDict({"a": torch.ones(2)}, [2]),
                                  TensorDict({"a": torch.ones(2), "b": torch.zeros(2)}, [2]))
    assert sorted(merged.keys()) == ["a", "b"]
    with pytest.raises(ValueError):
        tu.union_tensor_dict(
            TensorDict({"a": torch.ones(2)}, [2]), TensorDict({"a": torch.zeros(2)}, [2])
        )
    with pytest.raises(ValueError):
        tu.get_tensordict({"a": torch.zeros(2), "b": [1, 2, 3]})
    parts = tu.chunk_tensordict(TensorDict({"a": torch.arange(4)}, [4]), 2)
    assert [p["a"].tolist() for p in parts] == [[0, 1], [2, 3]]
    assert tu.concat_tensordict(parts)["a"].tolist() == [0, 1, 2, 3]
    assert tu.index_select_tensor_dict(parts[1], [1])["a"].tolist() == [3]


# ---------------------------------------------------------------- TensorDicts in a group
@pytest.mark.ray
def test_tensordict_through_a_real_group(verl_group: VerlGroup) -> None:
    """TensorDict arguments and results through N-D and DP_COMPUTE_PROTO dispatch on a real
    group (the helpers and the expected values: test_verl_compat_tensordict.py)."""
    wg = verl_group.wg
    out = wg.mark(_td(4))
    assert isinstance(out, TensorDict)
    assert _rows(out) == [0, 10, 20, 30] and out["rank"].tolist() == [0, 0, 1, 1]
    assert tu.get(out, "experiment") == "run_001"
    uneven = wg.mark(td=_td(3))  # padded to 2 + 2 on the way out, trimmed on the way back
    assert _rows(uneven) == [0, 10, 20] and uneven["rank"].tolist() == [0, 0, 1]
    # non-blocking: a DataProtoFuture over TensorDict parts, fetched here ...
    future = wg.mark_async(_td(5))
    assert isinstance(future, DataProtoFuture) and future.num_parts == 2
    got = future.get(timeout_s=60)
    assert _rows(got) == [1, 2, 3, 4, 5] and got["rank"].tolist() == [0, 0, 0, 1, 1]
    # ... or passed on: each part goes straight to the matching rank
    chained = wg.rows(wg.mark_async(_td(4)))
    assert _rows(chained) == [1, 2, 3, 4] and chained["n"].tolist() == [2, 2, 2, 2]
