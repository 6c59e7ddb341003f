"""``TrainerClient``: drive a running trainer group from Python, one future per call.

    from tgruntime import TrainerClient

    client = TrainerClient.connect(trainergroup="tiny", k8s_namespace="default")  # Kubernetes
    client = TrainerClient.connect_local(group_name="tiny", ray_namespace="tg-default-tiny")

    lp = client.compute_log_prob({"input_ids": ids}).result()       # batch["log_probs"] [B, S-1]
    fb = client.forward_backward(batch, loss="ppo", loss_config={"clip_eps": 0.2})
    step = client.optim_step(lr=1e-5)                               # queued behind fb
    print(fb.result().meta_info["loss"], step.result()["grad_norm"])

Every method submits its call at once and returns a :class:`TrainerFuture`. Calls from one
client run on the workers in the order they were made (Ray keeps a caller's actor calls in
order), so a loop can submit the next batch's ``forward_backward`` before the current
``optim_step`` finishes: the next batch's transfer then overlaps the current step.
Attaching imports neither megatron nor the worker class.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import ray

from tgruntime.controller import DataProto, DataProtoFuture, WorkerGroup
from tgruntime.controller.calls import CallContext, resolve

if TYPE_CHECKING:
    from tgapi.kube_view import AttachTarget

__all__ = ["TRAIN_MESH", "TrainerClient", "TrainerFuture"]

T = TypeVar("T")
TRAIN_MESH = "train"  # the mesh MegatronTrainer registers (trainer/worker.py)
_PRIMITIVES = (
    "compute_log_prob",
    "forward_backward",
    "optim_step",
    "zero_grad",
    "train_model",
    "save_state",
    "load_state",
    "export_hf",
    "import_hf",
    "get_mesh",
    "save_sampler_weights",
    "sample",
    "sample_step",
    "sampler_pool",
    "sample_batch",
    "drop_sampler_weights",
    "sampler_weights_info",
    # many LoRA runs (docs/lora.md)
    "create_run",
    "use_run",
    "drop_run",
    "park_run",
    "list_runs",
    "save_run",
    "load_run",
)


class TrainerFuture(Generic[T]):
    """The pending result of one group call; ``result(timeout=)`` waits (and caches)."""

    def __init__(self, refs: list[Any], fetch: Callable[[float | None], T]) -> None:
        self._refs = refs
        self._fetch = fetch
        self._done = False
        self._value: T | None = None

    def done(self) -> bool:
        """Whether every worker has finished (never blocks)."""
        if self._done:
            return True
        ready, _ = ray.wait(self._refs, num_returns=len(self._refs), timeout=0)
        return len(ready) == len(self._refs)

    def result(self, timeout: float | None = None) -> T:
        """The call's value; raises the worker's error (WorkerMethodError, WorkerDiedError) or
        CallTimeoutError after ``timeout`` seconds (None: wait as long as it takes)."""
        if not self._done:
            self._value = self._fetch(timeout)
            self._done = True
        return self._value  # type: ignore[return-value]


def _k8s_target(
    *,
    trainergroup: str,
    k8s_namespace: str | None,
    kubeconfig: str | None,
    wait_s: float | None,
    address: str | None,
) -> AttachTarget:
    """Where to attach, from the TrainerGroup's Kubernetes status once it is Ready.

    The one place this module reads Kubernetes (the same reader and the same
    ``tgapi.kube_view.attach_target`` rule the client Job uses).
    """
    from tgapi.kube_view import attach_target, wait_for_ready

    status, _spec = wait_for_ready(
        name=trainergroup, k8s_namespace=k8s_namespace, kubeconfig=kubeconfig, timeout_s=wait_s
    )
    return attach_target(status, name=trainergroup, address=address)


def _as_proto(data: DataProto | Mapping[str, Any], meta: Mapping[str, Any]) -> DataProto:
    if isinstance(data, DataProto):
        if not meta:
            return data
        return DataProto(
            batch=data.batch,
            non_tensor_batch=data.non_tensor_batch,
            meta_info={**data.meta_info, **meta},
        )
    if isinstance(data, Mapping):
        return DataProto.from_dict(tensors=dict(data), meta_info=dict(meta))
    raise TypeError(f"data must be a DataProto or a dict of tensors, got {type(data).__name__}")


def sampling_params(
    *,
    max_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int | None,
    stop: list[list[int]] | None,
    num_samples: int,
    prompt_logprobs: bool,
    logprob_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The keyword arguments of the workers' ``sample`` and ``sample_batch`` (plain lists);
    ``logprob_options``: the SDK-named logprob fields (``trainer/logprob_options.py``)."""
    extra = {} if logprob_options is None else {"logprob_options": dict(logprob_options)}
    return {
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_k": top_k,
        "top_p": top_p,
        "seed": seed,
        "stop": None if stop is None else [list(s) for s in stop],
        "num_samples": num_samples,
        "prompt_logprobs": prompt_logprobs,
        **extra,
    }


class TrainerClient:
    """A client of one trainer group (``MegatronTrainer`` workers, or compatible)."""

    def __init__(self, group: WorkerGroup) -> None:
        self.group = group
        methods = {}
        for name in _PRIMITIVES:
            bound = getattr(group, name, None) if name in group.method_names else None
            if bound is not None:
                methods[name] = dataclasses.replace(bound.spec, blocking=False)
        # The same actors, every primitive non-blocking: calls return references at once.
        self._async = WorkerGroup(
            group_name=group.group_name,
            ray_namespace=group.ray_namespace,
            worker_names=group.worker_names,
            handles=group.workers,
            methods=methods,
            generation=group.generation,
            record=group.record,
            call_timeout_s=group.call_timeout_s,
        )
        self._dp_size: int | None = None
        self._vocab_size: int | None = None

    # -- connecting -------------------------------------------------------------------
    @classmethod
    def connect(
        cls,
        *,
        trainergroup: str,
        k8s_namespace: str | None = None,
        kubeconfig: str | None = None,
        address: str | None = None,
        wait_s: float | None = None,
        attach_timeout_s: float = 30.0,
    ) -> TrainerClient:
        """Attach to the group of a Kubernetes TrainerGroup (waits until it is Ready).

        ``k8s_namespace``: default the pod's own, else the kubeconfig context's; ``address``
        overrides ``status.rayAddress``; ``wait_s`` default: the TrainerGroup's Ready deadline.
        """
        where = _k8s_target(
            trainergroup=trainergroup,
            k8s_namespace=k8s_namespace,
            kubeconfig=kubeconfig,
            wait_s=wait_s,
            address=address,
        )
        return cls.connect_local(
            group_name=where.group_name,
            ray_namespace=where.ray_namespace,
            address=where.ray_address,
            attach_timeout_s=attach_timeout_s,
        )

    @classmethod
    def connect_local(
        cls,
        *,
        group_name: str,
        ray_namespace: str,
        address: str | None = None,
        attach_timeout_s: float = 30.0,
    ) -> TrainerClient:
        """Attach by group name in a Ray namespace (``tgctl up`` prints both)."""
        from tgruntime.controller.connect import connect
        from tgruntime.controller.gcs_view import use_light_handles

        connect(address=address, ray_namespace=ray_namespace)
        use_light_handles()
        group = WorkerGroup.attach(
            group_name=group_name, ray_namespace=ray_namespace, timeout_s=attach_timeout_s
        )
        return cls(group)

    # -- plumbing ---------------------------------------------------------------------
    def _method(self, name: str) -> None:
        if name not in self._async.method_names:
            raise AttributeError(
                f"the workers of group {self.group.group_name!r} have no method {name!r} "
                f"(registered: {self.group.method_names}); the trainer image may be older "
                "than this client"
            )

    def _proto_call(self, name: str, *args: Any, **kwargs: Any) -> TrainerFuture[DataProto]:
        self._method(name)
        future = self._async.call(name, *args, **kwargs)
        assert isinstance(future, DataProtoFuture)
        return TrainerFuture(list(future.refs), lambda timeout: future.get(timeout_s=timeout))

    def _all_call(self, name: str, *args: Any, **kwargs: Any) -> TrainerFuture[Any]:
        """A ONE_TO_ALL call; the future's value is rank 0's (every rank returns the same)."""
        self._method(name)
        refs = list(self._async.call(name, *args, **kwargs))
        handles = self.group.workers
        ctx = CallContext(
            self.group.group_name,
            name,
            tuple(range(len(refs))),
            tuple(self.group.worker_names),
            tuple(getattr(getattr(h, "_actor_id", None), "hex", lambda: "")() for h in handles),
        )
        return TrainerFuture(refs, lambda timeout: resolve(refs, ctx, timeout_s=timeout)[0])

    def dp_size(self) -> int:
        """Data-parallel size of the group's ``train`` mesh (queried once)."""
        if self._dp_size is None:
            self._dp_size = max(self.group.mesh_dispatch_info(TRAIN_MESH)) + 1
        return self._dp_size

    def _check_divisible(self, data: DataProto, method: str) -> None:
        dp = self.dp_size()
        if len(data) % dp:
            raise ValueError(
                f"{method}: the batch has {len(data)} samples, not a multiple of the group's "
                f"data-parallel size {dp}; padding rows would be trained on: send a multiple"
            )

    # -- the primitives ---------------------------------------------------------------
    def vocab_size(self) -> int | None:
        """The model's vocabulary size (queried once; None from workers that do not say)."""
        if self._vocab_size is None and "get_mesh" in self._async.method_names:
            mesh = self._all_call("get_mesh").result()
            value = mesh.get("vocab_size") if isinstance(mesh, dict) else None
            self._vocab_size = int(value) if value is not None else None
        return self._vocab_size

    def _check_targets(self, data: DataProto) -> None:
        """``target_ids`` (when sent) matches ``input_ids`` and lies in the vocabulary."""
        if data.batch is None or "target_ids" not in data.batch.keys():  # noqa: SIM118
            return
        from tgruntime.trainer.token_batch import check_target_ids

        ids = data.batch["input_ids"] if "input_ids" in data.batch.keys() else None  # noqa: SIM118
        target = data.batch["target_ids"]
        b, s = (int(x) for x in (ids.shape if ids is not None else target.shape))
        vocab = self.vocab_size()
        check_target_ids(target, b=b, s=s, vocab_size=vocab if vocab is not None else 2**62)

    def compute_log_prob(
        self, data: DataProto | Mapping[str, Any], *, entropy: bool = False
    ) -> TrainerFuture[DataProto]:
        """``batch["log_probs"]`` float32 ``[B, S-1]`` (column j: token j+1), or ``[B, S]``
        with ``target_ids`` (column j: ``target_ids[:, j]``); ``entropy``."""
        proto = _as_proto(data, {"entropy": entropy})
        self._check_targets(proto)
        return self._proto_call("compute_log_prob", proto)

    def forward_backward(
        self,
        data: DataProto | Mapping[str, Any],
        *,
        loss: str | Callable[..., Any] = "cross_entropy",
        loss_config: Mapping[str, Any] | None = None,
        reduction: str = "mean",
    ) -> TrainerFuture[DataProto]:
        """Accumulate the gradient of ``loss``: ``batch["loss"]`` per sample,
        ``batch["log_probs"]`` per token, metrics in ``meta_info`` (``loss``, ``tokens``,
        ``accumulated_tokens``, ``metrics/<name>``). ``reduction="sum"``: Tinker's plain sum
        over tokens (losses reported as sums); ``"mean"``: the token mean."""
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
        proto = _as_proto(data, {})
        self._check_divisible(proto, "forward_backward")
        self._precheck(loss, proto)
        self._check_targets(proto)
        return self._proto_call(
            "forward_backward",
            proto,
            loss=loss,
            loss_config=dict(loss_config or {}),
            reduction=reduction,
        )

    @staticmethod
    def _precheck(loss: str | Callable[..., Any], data: DataProto) -> None:
        """Fail here, before sending, when a built-in loss's tensors are missing."""
        from tgruntime.trainer.loss_catalog import registered_losses, resolve_loss

        if isinstance(loss, str) and loss in registered_losses() and data.batch is not None:
            keys = [str(k) for k in data.batch.keys()]  # noqa: SIM118 (TensorDict)
            resolve_loss(loss).check([*keys, "loss_mask"])

    def optim_step(
        self,
        *,
        lr: float | None = None,
        grad_clip: float | None = None,
        weight_decay: float | None = None,
        betas: tuple[float, float] | None = None,
        eps: float | None = None,
    ) -> TrainerFuture[dict[str, Any]]:
        """Apply the accumulated gradient: ``{step, grad_norm, lr, skipped, tokens}``.

        Each argument holds for this step only; None = the spec's value; ``grad_clip=0``
        turns clipping off (Tinker's ``AdamParams``: learning_rate, beta1/beta2, eps,
        weight_decay, grad_clip_norm)."""
        kwargs: dict[str, Any] = {"lr": lr, "grad_clip": grad_clip, "weight_decay": weight_decay}
        if betas is not None:  # only sent when given: older workers lack these parameters
            kwargs["betas"] = (float(betas[0]), float(betas[1]))
        if eps is not None:
            kwargs["eps"] = eps
        return self._all_call("optim_step", **kwargs)

    def zero_grad(self) -> TrainerFuture[bool]:
        return self._all_call("zero_grad")

    def train_step(self, data: DataProto | Mapping[str, Any]) -> TrainerFuture[DataProto]:
        """``train_model``: zero_grad -> forward_backward(cross_entropy) -> optim_step."""
        proto = _as_proto(data, {})
        self._check_divisible(proto, "train_step")
        return self._proto_call("train_model", proto)

    def save_state(self, path: str) -> TrainerFuture[str]:
        """Model, optimizer and step, sharded by (tp, pp), into ``path`` (shared storage)."""
        return self._all_call("save_state", path)

    def load_state(self, path: str, *, optimizer: bool = True) -> TrainerFuture[int]:
        """Restore ``save_state``'s files (same tp and pp); the value is the restored step.

        ``optimizer=False``: weights only, the optimizer starts fresh (Tinker's
        ``load_weights``; ``True`` is ``load_weights_with_optimizer``)."""
        if optimizer:
            return self._all_call("load_state", path)
        return self._all_call("load_state", path, optimizer=False)

    def export_hf(self, path: str, **kwargs: Any) -> TrainerFuture[Any]:
        """Hugging Face Llama safetensors + config into ``path`` (the workers' export_hf)."""
        return self._all_call("export_hf", path, **kwargs)

    def import_hf(self, path: str, **kwargs: Any) -> TrainerFuture[Any]:
        """Load Hugging Face Llama weights from ``path`` (the workers' import_hf)."""
        return self._all_call("import_hf", path, **kwargs)

    def sample_batch(
        self,
        prompts: list[list[int]],
        weights: list[str | None],
        *,
        max_tokens: int,
        temperature: float = 1.0,
        top_k: int = -1,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: list[list[int]] | None = None,
        num_samples: int = 1,
        prompt_logprobs: bool = False,
        logprob_options: Mapping[str, Any] | None = None,
    ) -> TrainerFuture[list[dict[str, Any]]]:
        """A LoRA group: one batch, one adapter snapshot per prompt (``weights[i]``, None for
        the base), in one forward pass (docs/lora.md); the value is ``sample``'s."""
        params = sampling_params(
            max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
            seed=seed, stop=stop, num_samples=num_samples, prompt_logprobs=prompt_logprobs,
            logprob_options=logprob_options,
        )
        return self._all_call("sample_batch", [list(p) for p in prompts], list(weights), **params)

    def sampler_pool(
        self,
        *,
        slots: int | None = None,
        length: int | None = None,
        kv_bytes: int | None = None,
        allocate: bool = True,
    ) -> TrainerFuture[dict[str, Any]]:
        """Size the continuous-batching KV pool (``slots`` rows of ``length`` positions
        within ``kv_bytes``; None: ``TG_SAMPLER_*`` on the workers, else the defaults) and
        allocate it; refused while rows decode (docs/sampling.md)."""
        return self._all_call(
            "sampler_pool", slots=slots, length=length, kv_bytes=kv_bytes, allocate=allocate
        )

    def sample_step(
        self,
        admit: list[dict[str, Any]],
        *,
        max_steps: int,
        weights: str | None = None,
        reset: bool = False,
    ) -> TrainerFuture[dict[str, Any]]:
        """One chunk of continuous batching (docs/sampling.md): queue ``admit`` (dicts of
        ``id``, ``prompt`` and ``sample``'s parameters), run up to ``max_steps`` decode steps,
        and get ``{"finished": {id: result}, "failed": {id: message}, ...pool info}``."""
        return self._all_call(
            "sample_step", list(admit), max_steps=max_steps, weights=weights, reset=reset
        )

    # -- many LoRA runs on a LoRA group (docs/lora.md) -------------------------------------
    def create_run(self, run_id: str, lora: Mapping[str, Any]) -> TrainerFuture[dict[str, Any]]:
        """A new LoRA run (``LoraSettings`` fields: rank, alpha, seed, train_attn, train_mlp,
        train_unembed) on the group's frozen base; it becomes the active run. The group must
        have ``spec.lora``. The value: ``{id, rank, steps, lastActive, created, active,
        parked}``."""
        return self._all_call("create_run", run_id, json.dumps(dict(lora)))

    def use_run(self, run_id: str) -> TrainerFuture[dict[str, Any]]:
        """Make ``run_id`` the run the next calls train, sample and save (calls reach the
        workers in the order they are made, so ``use_run`` then ``forward_backward`` is safe
        from one client; two clients switching runs of one group must take turns)."""
        return self._all_call("use_run", run_id)

    def drop_run(self, run_id: str) -> TrainerFuture[bool]:
        return self._all_call("drop_run", run_id)

    def park_run(self, run_id: str, path: str) -> TrainerFuture[dict[str, Any]]:
        """Write a run's whole state into ``path`` (shared storage) and free its memory; the
        next ``use_run`` brings it back."""
        return self._all_call("park_run", run_id, path)

    def list_runs(self) -> TrainerFuture[list[dict[str, Any]]]:
        return self._all_call("list_runs")

    def save_run(self, path: str) -> TrainerFuture[str]:
        """The active run's adapters, optimizer state and step (no base weights)."""
        return self._all_call("save_run", path)

    def load_run(self, path: str, *, optimizer: bool = True) -> TrainerFuture[int]:
        """Restore a ``save_run`` directory into the active run; the value is its step."""
        return self._all_call("load_run", path, optimizer=optimizer)

    # -- sampling (docs/sampling.md) ---------------------------------------------------
    def save_sampler_weights(
        self, name: str, path: str | None = None
    ) -> TrainerFuture[dict[str, Any]]:
        """Keep the current weights under ``name`` for ``sample`` (and write them to ``path``):
        ``{name, path, parameters, bytes, seconds, rank}``."""
        return self._all_call("save_sampler_weights", name, path)

    def drop_sampler_weights(self, name: str) -> TrainerFuture[bool]:
        """Free the in-memory sampler weights ``name`` on every rank (files stay): False
        when the group held none of that name."""
        return self._all_call("drop_sampler_weights", name)

    def sampler_weights_info(self) -> TrainerFuture[dict[str, Any]]:
        """What rank 0 holds in memory for sampling: ``{names, loaded, bytes, rank}``."""
        return self._all_call("sampler_weights_info")

    def sample(
        self,
        prompts: list[list[int]],
        *,
        max_tokens: int,
        temperature: float = 1.0,
        top_k: int = -1,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: list[list[int]] | None = None,
        num_samples: int = 1,
        prompt_logprobs: bool = False,
        weights: str | None = None,
        logprob_options: Mapping[str, Any] | None = None,
    ) -> TrainerFuture[list[dict[str, Any]]]:
        """Generate from the group's model: one dict per prompt, ``{"sequences": [{"tokens",
        "logprobs", "stop_reason"}] * num_samples, "prompt_logprobs"}`` (docs/sampling.md);
        ``logprob_options`` (top-k, target ids, alternative draws, last_n) add their keys
        (docs/tinker.md, "Logprob options")."""
        params = sampling_params(
            max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
            seed=seed, stop=stop, num_samples=num_samples, prompt_logprobs=prompt_logprobs,
            logprob_options=logprob_options,
        )
        return self._all_call("sample", [list(p) for p in prompts], weights=weights, **params)
