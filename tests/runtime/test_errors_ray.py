"""Errors raised on real Ray workers reach the caller as the project's own errors.

One group of two light ``LossWorker`` ranks (0.2 CPU each) lives for the module. Through
the real ``TrainerClient`` / ``WorkerGroup`` paths, a worker raising ``MissingTensorError``
(the ``ppo`` loss with ``kl_coef > 0`` and no ``ref_log_probs``; a custom loss reading a
missing key) arrives as ``WorkerMethodError`` naming ``MissingTensorError`` and its message,
not as Ray's ``UnserializableException``; every error class of tests/runtime/test_errors_pickle
does the same. And when both ranks fail, the rank whose error is not the one delivered is
retrieved too, so Ray prints no "Unhandled error" block for it when its reference is dropped.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from tests.fixtures_ray import RayCluster
from tgruntime.controller import (
    ClassWithInitArgs,
    DataProto,
    Dispatch,
    ResourcePool,
    Worker,
    WorkerGroup,
    WorkerMethodError,
    make_nd_compute_dataproto_dispatch_fn,
    register,
)
from tgruntime.driver.trainer_client import TrainerClient
from tgruntime.trainer.loss_catalog import resolve_loss
from tgruntime.trainer.losses import MissingTensorError, TokenTensors

pytestmark = pytest.mark.ray

B, S = 4, 5


class LossWorker(Worker):
    """``forward_backward`` as the trainer calls a loss (log-probs zero), without a model."""

    def __init__(self) -> None:
        super().__init__()
        self._register_dispatch_collect_info(mesh_name="train", dp_rank=self.rank, is_collect=True)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="train"))
    def forward_backward(
        self,
        data: DataProto,
        *,
        loss: Any = "cross_entropy",
        loss_config: Mapping[str, Any] | None = None,
        reduction: str = "mean",
    ) -> DataProto:
        assert data.batch is not None
        config = dict(loss_config or {})
        # rank r fails r x delay_s later: the other rank's error arrives after the delivered one
        time.sleep(float(config.pop("test_rank_delay_s", 0.0)) * self.rank)
        spec = resolve_loss(loss)
        tensors = {str(k): data.batch[k] for k in data.batch.keys() if k != "input_ids"}  # noqa: SIM118
        spec.check([*tensors, "loss_mask"])
        log_probs = torch.zeros(len(data), S - 1)
        per_token, _metrics = spec.fn(
            log_probs, TokenTensors(tensors, loss=spec.name), config
        )
        return DataProto.from_dict(tensors={"loss": per_token.sum(-1)})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def ping(self) -> int:
        """Answers once this rank's earlier calls from the same caller have finished."""
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def raise_case(self, key: str) -> None:
        """Raise the representative instance of one error class (test_errors_pickle.CASES)."""
        from tests.runtime.test_errors_pickle import CASES

        raise CASES[key]()


def values_loss(
    log_probs: torch.Tensor, batch: TokenTensors, config: Mapping[str, Any]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A custom loss (passed as a function) reading a tensor the batch lacks."""
    return -log_probs * batch["values"], {}


@dataclass(frozen=True)
class Setup:
    group: WorkerGroup
    client: TrainerClient


@pytest.fixture(scope="module")
def setup(ray_driver: RayCluster) -> Iterator[Setup]:
    group = WorkerGroup.create(
        group_name="errs", ray_namespace="t-errors-ray",
        resource_pool=ResourcePool(process_on_nodes=[2], cpus_per_process=0.2),
        cls=ClassWithInitArgs(LossWorker), actor_timeout_s=240, pg_timeout_s=60,
    )
    try:
        client = TrainerClient(group)
        # The client's first mesh call also asks the workers which ranks are collected (a
        # query queued behind the call itself): warm that up, so later calls return at once.
        client.forward_backward(ppo_batch(), loss="cross_entropy").result()
        yield Setup(group=group, client=client)
    finally:
        group.teardown()


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def unhandled(capfd: pytest.CaptureFixture[str]) -> Iterator[Callable[[], list[str]]]:
    """The "Unhandled error" lines Ray logs (logger ray._private.worker) or prints on stderr
    from now on; call it after dropping every reference (it collects garbage first)."""
    handler = Records()
    logger = logging.getLogger("ray._private.worker")
    logger.addHandler(handler)

    def lines() -> list[str]:
        gc.collect()
        time.sleep(1.5)  # Ray reports an unretrieved error once its reference is freed
        gc.collect()
        err = capfd.readouterr().err
        return [ln for ln in [*handler.lines, *err.splitlines()] if "Unhandled error" in ln]

    try:
        yield lines
    finally:
        logger.removeHandler(handler)


def ppo_batch() -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.randint(0, 10, (B, S)),
        "advantages": torch.ones(B, S - 1),
        "old_log_probs": torch.zeros(B, S - 1),
        "loss_mask": torch.ones(B, S - 1),
    }


def _expect_missing(err: WorkerMethodError, key: str, loss: str) -> None:
    assert err.error_type == "MissingTensorError", str(err)
    assert err.method == "forward_backward" and err.group_name == "errs" and err.rank in (0, 1)
    assert f"loss {loss!r} needs batch[{key!r}]" in err.summary, err.summary
    assert "UnserializableException" not in str(err) and "MissingTensorError" in str(err)
    cause = getattr(err.__cause__, "cause", None)  # the RayTaskError's own copy of the error
    assert type(cause) is MissingTensorError and f"batch[{key!r}]" in str(cause)


def test_ppo_kl_without_ref_log_probs_through_the_client(
    setup: Setup, unhandled: Callable[[], list[str]]
) -> None:
    # The client's precheck passes (ref_log_probs is not required unless kl_coef > 0): the
    # error is raised by the loss on both workers, rank 1's a second after rank 0's.
    config = {"kl_coef": 0.1, "test_rank_delay_s": 1.0}
    future = setup.client.forward_backward(ppo_batch(), loss="ppo", loss_config=config)
    with pytest.raises(WorkerMethodError) as info:
        future.result()
    _expect_missing(info.value, "ref_log_probs", "ppo")
    assert info.value.rank == 0
    # Queued behind forward_backward on each actor: rank 1 has failed once it answers (not
    # future.done(): ray.wait on a finished error already counts as retrieving it).
    assert setup.group.ping() == [0, 1]
    del future, info
    assert unhandled() == []


def test_custom_loss_missing_key_through_a_blocking_group_call(
    setup: Setup, unhandled: Callable[[], list[str]]
) -> None:
    # A blocking call: the caller is waiting when rank 0 fails; rank 1 fails 0.5 s later,
    # after the call's references are gone from the caller.
    data = DataProto.from_dict(tensors=ppo_batch())
    with pytest.raises(WorkerMethodError) as info:
        setup.group.forward_backward(
            data, loss=values_loss, loss_config={"test_rank_delay_s": 0.5}
        )
    _expect_missing(info.value, "values", values_loss.__qualname__)
    assert info.value.rank == 0
    del info
    assert setup.group.ping() == [0, 1]  # queued behind the failed call: rank 1 has failed
    assert unhandled() == []


def test_every_error_class_arrives_as_itself(
    setup: Setup, unhandled: Callable[[], list[str]]
) -> None:
    from tests.runtime.test_errors_pickle import CASES, same

    for key, make in sorted(CASES.items()):
        expected = make()
        with pytest.raises(WorkerMethodError) as info:
            setup.group.raise_case(key)
        err = info.value
        assert err.error_type == type(expected).__name__, (key, str(err))
        assert err.method == "raise_case"
        first = str(expected).strip().splitlines()[0]
        assert err.summary == first, (key, err.summary)
        cause = getattr(err.__cause__, "cause", None)
        assert type(cause) is type(expected) and same(cause, expected), key
        del info, err, cause
    assert unhandled() == []
