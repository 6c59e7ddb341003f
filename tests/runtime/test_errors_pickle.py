"""Every public exception class of tgapi and tgruntime survives pickling (no Ray).

An error raised on a Ray worker is pickled there and unpickled by the caller; a class whose
copy cannot be rebuilt reaches the caller as Ray's ``UnserializableException``. The classes
are discovered from the source (every module-level class deriving from an exception), so a
new class without a case in ``CASES`` fails ``test_every_error_class_has_a_case``.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tgapi.errors import PicklableError, SpecError, SpecErrors
from tgapi.expr import CelError
from tgapi.hub import HubError
from tgapi.kube_view.ready import (
    TrainerGroupFailed,
    TrainerGroupForbidden,
    TrainerGroupNotFound,
    TrainerGroupNotReady,
)
from tgapi.status import TrainerGroupStatus
from tgruntime.controller import errors as ce
from tgruntime.gateway.groups import GroupsError
from tgruntime.gateway.routing import NotRouted
from tgruntime.service.limits import LimitError
from tgruntime.service.sampler_weights import FreedWeights
from tgruntime.service.sessions import ServiceError
from tgruntime.trainer import losses
from tgruntime.trainer.checkpoint import CheckpointUnreadableError
from tgruntime.trainer.gpu_check import GpuWorkersOnCpuError, NoCudaDeviceError
from tgruntime.trainer.launch import LaunchError
from tgruntime.trainer.losses import MissingTensorError
from tgruntime.trainer.sampling.weights_budget import SamplerWeightsBudgetError
from tgruntime.trainer.token_budget import TokenBudgetError

REPO = Path(__file__).resolve().parents[2]
PACKAGES = {"tgapi": REPO / "api" / "tgapi", "tgruntime": REPO / "runtime" / "tgruntime"}

_STATUS = TrainerGroupStatus(phase="Failed", message="worker died", group_name="g", restarts=2)


def _spec() -> SpecError:
    return SpecError(field="spec.parallelism.tensor", problem="must divide 8", fix="use 1, 2, 4")


# "module:Class" -> a representative instance (the arguments a real raise passes).
CASES: dict[str, Callable[[], BaseException]] = {
    "tgapi.errors:PicklableError": lambda: PicklableError("plain message"),
    "tgapi.errors:SpecError": _spec,
    "tgapi.errors:SpecErrors": lambda: SpecErrors(
        [_spec(), SpecError(field="spec.model", problem="missing", fix="set spec.model.path")]
    ),
    "tgapi.expr:CelError": lambda: CelError("no such key: foo"),
    "tgapi.hub:HubError": lambda: HubError(  # raised on workers (their base weights' download)
        problem="'org/m' is not on the hub, or is private",
        fix="check the id, or set spec.model.hubTokenSecret",
    ),
    "tgapi.kube_view.ready:TrainerGroupNotFound": lambda: TrainerGroupNotFound("no group 'g'"),
    "tgapi.kube_view.ready:TrainerGroupForbidden": lambda: TrainerGroupForbidden("403 on get"),
    "tgapi.kube_view.ready:TrainerGroupFailed": lambda: TrainerGroupFailed(
        "group g failed: worker died", status=_STATUS
    ),
    "tgapi.kube_view.ready:TrainerGroupNotReady": lambda: TrainerGroupNotReady(
        "not Ready within 30s", status=_STATUS
    ),
    "tgruntime.trainer.launch:LaunchError": lambda: LaunchError("rank 1 failed:\nTraceback ..."),
    "tgruntime.trainer.gpu_check:GpuWorkersOnCpuError": lambda: GpuWorkersOnCpuError(
        device="cpu", torch_cuda="13.0"
    ),
    "tgruntime.trainer.gpu_check:NoCudaDeviceError": lambda: NoCudaDeviceError(
        rank=0, driver="535.129.03", torch_cuda="13.0", min_driver="580.65.06",
        fix="run on nodes with NVIDIA driver >= 580.65.06",
    ),
    "tgruntime.trainer.checkpoint:CheckpointUnreadableError": lambda: CheckpointUnreadableError(
        path="/ckpt/g/step_00000007", step=7, node="worker-b", rank=1,
        reason="it has no meta.json (missing or incomplete on this node)", failed_ranks=[1, 3],
    ),
    "tgruntime.trainer.token_budget:TokenBudgetError": lambda: TokenBudgetError(
        "a row of 2048 tokens (the call's longest, padded) does not fit one micro-batch of 1024"
    ),
    "tgruntime.trainer.sampling.weights_budget:SamplerWeightsBudgetError": lambda: (
        SamplerWeightsBudgetError("sampler weights: keeping weights 'w' needs 2.3 GB on this rank")
    ),
    "tgruntime.service.sampler_weights:FreedWeights": lambda: FreedWeights(
        "the sampling client's weights (m/ephemeral/0) were freed"
    ),
    "tgruntime.trainer.losses:MissingTensorError": lambda: MissingTensorError(
        key="ref_log_probs", loss="ppo", present=["advantages", "loss_mask", "old_log_probs"]
    ),
    "tgruntime.service.limits:LimitError": lambda: LimitError(
        "principal 'team-a' has 1024 requests queued",
        limit="queued requests", value=1024, setting="--max-queued-requests", status=429,
        retry_after=1.0,
    ),
    "tgruntime.gateway.groups:GroupsError": lambda: GroupsError(
        "--group '127.0.0.1:8001': not a group's base URL"
    ),
    "tgruntime.gateway.routing:NotRouted": lambda: NotRouted("/api/v1/nope"),
    "tgruntime.service.sessions:ServiceError": lambda: ServiceError(
        "seq_id 3 is out of order", status=409, category="user"
    ),
    "tgruntime.controller.errors:TrainerGroupError": lambda: ce.TrainerGroupError("base"),
    "tgruntime.controller.errors:GroupNotFoundError": lambda: ce.GroupNotFoundError(
        group_name="g", ray_namespace="ns", existing=["h", "i"], detail="deleted"
    ),
    "tgruntime.controller.errors:NamespaceMismatchError": lambda: ce.NamespaceMismatchError(
        group_name="g", ray_namespace="ns", found_in=["other"], detail="worker gW_0:0"
    ),
    "tgruntime.controller.errors:WorkerDiedError": lambda: ce.WorkerDiedError(
        group_name="g", rank=1, worker_name="gW_0:1", cause="SIGKILL", method="train"
    ),
    "tgruntime.controller.errors:WorkerMethodError": lambda: ce.WorkerMethodError(
        group_name="g", rank=0, worker_name="gW_0:0", method="forward_backward",
        error_type="MissingTensorError", summary="loss 'ppo' needs batch['ref_log_probs']",
        remote_traceback="Traceback (most recent call last):\n  ...",
    ),
    "tgruntime.controller.errors:PlacementTimeoutError": lambda: ce.PlacementTimeoutError(
        group_name="g", timeout_s=3, bundles=[[{"CPU": 4.0}] * 2], strategy="STRICT_PACK",
        available={"CPU": 2.0}, total={"CPU": 2.0, "node:1.2.3.4": 1.0},
    ),
    "tgruntime.controller.errors:PlacementInfeasibleError": lambda: ce.PlacementInfeasibleError(
        group_name="g", bundles=[[{"GPU": 1.0}] * 4], strategy="STRICT_PACK",
        total={"CPU": 8.0, "GPU": 2.0}, reason="4 GPUs asked, 2 in the cluster",
        fix="ask for fewer workers",
    ),
    "tgruntime.controller.errors:ActorStartTimeoutError": lambda: ce.ActorStartTimeoutError(
        group_name="g", timeout_s=60, pending=["gW_0:1"]
    ),
    "tgruntime.controller.errors:WorkerStartError": lambda: ce.WorkerStartError(
        group_name="g", rank=0, worker_name="gW_0:0", cause="RuntimeError: boom"
    ),
    "tgruntime.controller.errors:GroupExistsError": lambda: ce.GroupExistsError(
        group_name="g", ray_namespace="ns", generation=3
    ),
    "tgruntime.controller.errors:CallTimeoutError": lambda: ce.CallTimeoutError(
        group_name="g", method="train", timeout_s=5, pending=["rank 1 (gW_0:1)"]
    ),
    "tgruntime.controller.errors:RayConnectError": lambda: ce.RayConnectError(
        "could not connect to 10.0.0.1:6379 (tried RAY_ADDRESS)"
    ),
}


def _exception_bases() -> set[str]:
    return {
        n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)
    }


def _base_name(node: ast.expr) -> str:
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Subscript):
        return _base_name(node.value)
    return ""


def discovered() -> dict[str, type[BaseException]]:
    """Every public module-level exception class in the packages' source, by "module:Class".

    Found syntactically (a base named like an exception, a builtin exception, or another
    class found so), then imported and checked with ``issubclass``: only the modules that
    define one are imported (importing the whole runtime takes ~20 s)."""
    classes: dict[str, tuple[str, list[str]]] = {}  # "module:Class" -> (class name, base names)
    for package, root in PACKAGES.items():
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            dotted = [package, *(parts[:-1] if parts[-1] == "__init__" else parts)]
            module = ".".join(dotted)
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in tree.body:
                if isinstance(node, ast.ClassDef):
                    bases = [_base_name(b) for b in node.bases]
                    classes[f"{module}:{node.name}"] = (node.name, bases)
    names = _exception_bases()
    while True:  # a class deriving from a project exception is one too
        more = {
            name for name, bases in classes.values()
            if name not in names
            and any(b in names or b.endswith(("Error", "Exception")) for b in bases)
        }
        if not more:
            break
        names |= more
    found: dict[str, type[BaseException]] = {}
    for key, (name, _bases) in classes.items():
        if name not in names or name.startswith("_"):
            continue
        module, _, attr = key.partition(":")
        cls = getattr(importlib.import_module(module), attr)
        if isinstance(cls, type) and issubclass(cls, BaseException):
            found[key] = cls
    return found


def same(a: Any, b: Any) -> bool:
    """Equal values; exceptions (which compare by identity) by type, args and attributes."""
    if isinstance(a, BaseException):
        return (
            type(a) is type(b) and str(a) == str(b) and same(a.args, b.args)
            and same(vars(a), vars(b))
        )
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


def test_every_error_class_has_a_case() -> None:
    found = discovered()
    assert "tgruntime.trainer.losses:MissingTensorError" in found  # discovery works
    assert len(found) >= 20
    missing = sorted(set(found) - set(CASES))
    stale = sorted(set(CASES) - set(found))
    assert not missing, f"add a case to CASES for each new error class: {missing}"
    assert not stale, f"CASES names classes that no longer exist: {stale}"


def _dumps(how: str, error: BaseException) -> bytes:
    if how == "cloudpickle":  # what Ray serializes a worker's exception with
        from ray import cloudpickle

        return bytes(cloudpickle.dumps(error))  # type: ignore[no-untyped-call]
    return pickle.dumps(error, protocol=pickle.HIGHEST_PROTOCOL if how == "pickle5" else 2)


@pytest.mark.parametrize("how", ["pickle2", "pickle5", "cloudpickle"])
@pytest.mark.parametrize("key", sorted(CASES))
def test_error_round_trips_with_type_message_and_attributes(key: str, how: str) -> None:
    module, _, attr = key.partition(":")
    cls = getattr(importlib.import_module(module), attr)
    error = CASES[key]()
    assert type(error) is cls
    try:  # raised and caught, as on a worker: the traceback is not part of the copy
        raise error
    except BaseException as caught:
        caught.add_note("while testing")
        back = pickle.loads(_dumps(how, caught))
    assert type(back) is cls
    assert str(back) == str(error) and repr(back) == repr(error)
    assert same(back, error), (vars(back), vars(error))
    assert back.__notes__ == ["while testing"]
    for name in ("group_name", "rank", "cause", "status", "field", "errors", "message"):
        if hasattr(error, name):
            assert same(getattr(back, name), getattr(error, name)), name


def test_the_ppo_kl_error_from_the_loss_itself_round_trips() -> None:
    """The issue's case: ppo with kl_coef > 0 and no ref_log_probs (a KeyError subclass with a
    keyword-only constructor, which BaseException's pickling could not rebuild)."""
    lp = torch.zeros(2, 3)
    batch = losses.TokenTensors(
        {"advantages": torch.ones(2, 3), "old_log_probs": lp, "loss_mask": torch.ones(2, 3)},
        loss="ppo",
    )
    with pytest.raises(MissingTensorError) as info:
        losses.ppo(lp, batch, {"kl_coef": 0.1})
    back = pickle.loads(pickle.dumps(info.value))
    assert type(back) is MissingTensorError and isinstance(back, KeyError)
    assert "ref_log_probs" in str(back) and str(back) == str(info.value)
    assert back.message == info.value.message
