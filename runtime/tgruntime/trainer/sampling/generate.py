"""``Sampler``: batched autoregressive generation over a :class:`CachedDecoder`.

One call: every prompt is repeated ``num_samples`` times (a row each); the prompts are
right-padded and prefilled together, each once (its keys and values are then copied to its
samples' rows; under per-row adapters every row is prefilled), then decoded one token per
step for all rows at once.
A step is ``decode -> next_token -> write`` on device tensors only (:func:`advance`); on a
GPU with tensor parallel size 1 it is captured once in a CUDA graph per batch shape and
replayed (``TG_SAMPLER_CUDA_GRAPHS``: ``0`` off, ``tp`` at tensor size > 1 too;
:func:`graphs_allowed`). A graph replays the kernels it
captured, forward hooks included, so one captured with one LoRA hook set (the active run's, a
snapshot's, a multi-adapter batch's) must never serve another: the caller names the hook set
attached for the call (``hooks``), graphs are keyed by it and keep it alive (its tensors are
then never freed under a graph that reads them; updates in place, such as the active run's
optimizer steps, are seen by the replay). Stop sequences are checked on the
host every ``check_every`` steps; rows that have stopped keep computing until every row has
(their extra tokens are dropped), so the device never waits on the host inside a stretch.

Tensor-parallel ranks compute the same full-vocabulary logits and the same noise; the
chosen tokens are still broadcast from the first tensor rank each step so the ranks can
never drift apart.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from tgruntime.trainer.sampling.decoder import CachedDecoder, KVCache
from tgruntime.trainer.sampling.device_span import DeviceSpan
from tgruntime.trainer.sampling.params import SamplingParams, row_keys
from tgruntime.trainer.sampling.prompt_scores import score_prompt
from tgruntime.trainer.sampling.select import next_token
from tgruntime.trainer.sampling.stops import first_stop

__all__ = ["DecodeState", "RowScope", "Sampler", "advance"]

RowScope = Callable[[int, int], AbstractContextManager[None]]
"""``scope(start, stop)``: a context inside which a forward over batch rows ``start:stop``
only is run (per-row LoRA adapters narrow their row map to those rows)."""


def _whole_batch(start: int, stop: int) -> AbstractContextManager[None]:
    return contextlib.nullcontext()


@dataclasses.dataclass
class DecodeState:
    """The device tensors one decode step reads and writes (fixed addresses)."""

    tokens: torch.Tensor  # [R] int64: the token to feed (the last one chosen)
    pos: torch.Tensor  # [R] int64: its position
    step: torch.Tensor  # [] int64: index of the token this step chooses
    keys: torch.Tensor  # [R] int64: noise keys
    out_tokens: torch.Tensor  # [R, T] int64
    out_logprobs: torch.Tensor  # [R, T] float32
    cache: KVCache
    out_topk_ids: torch.Tensor | None = None  # [R, T, k] int64 (topk_sample_logprobs k)
    out_topk_lps: torch.Tensor | None = None  # [R, T, k] float32

    @classmethod
    def allocate(
        cls, decoder: CachedDecoder, rows: int, length: int, max_tokens: int, topk: int = 0
    ) -> DecodeState:
        dev = decoder.device

        def ints(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=dev)

        return cls(
            tokens=ints(rows),
            pos=ints(rows),
            step=ints(),
            keys=ints(rows),
            out_tokens=ints(rows, max_tokens),
            out_logprobs=torch.zeros(rows, max_tokens, dtype=torch.float32, device=dev),
            cache=decoder.allocate(rows, length),
            out_topk_ids=ints(rows, max_tokens, topk) if topk else None,
            out_topk_lps=(
                torch.zeros(rows, max_tokens, topk, dtype=torch.float32, device=dev)
                if topk
                else None
            ),
        )


def graphs_allowed(decoder: CachedDecoder, setting: str | None = None) -> bool:
    """Whether a sampler over ``decoder`` replays CUDA graphs, by ``TG_SAMPLER_CUDA_GRAPHS``
    (``setting`` instead when given): ``0`` never; ``1``, the default, on a GPU at tensor and
    pipeline size 1; ``tp`` at tensor size > 1 too, the tensor-parallel all-reduces and the
    tokens' broadcast captured in the graphs as NCCL kernels (opt-in: not yet run on two GPUs,
    docs/sampling.md). Pipeline stages never: their send/receive is host-driven."""
    if setting is None:
        setting = os.environ.get("TG_SAMPLER_CUDA_GRAPHS", "1")
    if setting not in ("0", "1", "tp"):
        raise ValueError(
            f"TG_SAMPLER_CUDA_GRAPHS must be 0, 1 or tp, not {setting!r} (unset: 1, one GPU "
            "per model copy)"
        )
    if setting == "0" or decoder.device.type != "cuda" or decoder.pp_size != 1:
        return False
    return decoder.tp_size == 1 or setting == "tp"


def _agree(token: torch.Tensor, tp_size: int) -> torch.Tensor:
    if tp_size > 1:
        dist.broadcast(
            token,
            src=parallel_state.get_tensor_model_parallel_src_rank(),
            group=parallel_state.get_tensor_model_parallel_group(),
        )
    return token


def advance(decoder: CachedDecoder, state: DecodeState, params: SamplingParams) -> None:
    """One decode step for every row: feed ``tokens`` at ``pos``, choose and record the next."""
    logits = decoder.decode(state.tokens, state.pos, state.cache)
    column = state.step.view(1)  # [1]: the prefill's shape too, so the draw compiles once
    token, logprob = next_token(logits, state.keys, column, params)
    token = _agree(token, decoder.tp_size)
    state.out_tokens.index_copy_(1, column, token.view(-1, 1))
    state.out_logprobs.index_copy_(1, column, logprob.view(-1, 1))
    if state.out_topk_ids is not None and state.out_topk_lps is not None:
        values, ids = torch.topk(torch.log_softmax(logits, dim=-1), state.out_topk_ids.shape[-1])
        state.out_topk_ids.index_copy_(1, column, ids.unsqueeze(1))
        state.out_topk_lps.index_copy_(1, column, values.unsqueeze(1))
    state.tokens.copy_(token)
    state.pos.add_(1)
    state.step.add_(1)


class _GraphedStep:
    """``advance`` captured in a CUDA graph over one persistent :class:`DecodeState`."""

    def __init__(
        self,
        decoder: CachedDecoder,
        state: DecodeState,
        params: SamplingParams,
        hooks: object | None = None,
    ):
        self.decoder = decoder
        self.state = state
        self.params = params
        self.hooks = hooks  # the hook set the graph was captured with: kept alive with it
        self.graph: torch.cuda.CUDAGraph | None = None

    def _capture(self) -> None:
        s = self.state
        saved = [t.clone() for t in (s.tokens, s.pos, s.step)]
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (allocations, lazy buffers) off the graph
            for _ in range(2):
                advance(self.decoder, s, self.params)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            advance(self.decoder, s, self.params)
        for live, old in zip((s.tokens, s.pos, s.step), saved, strict=True):
            live.copy_(old)
        # The warm-up wrote keys/values at pos and pos + 1 and outputs at step and step + 1:
        # each is rewritten by the step that owns it before anything reads it.
        self.graph = graph

    def __call__(self) -> None:
        if self.graph is None:
            self._capture()
        assert self.graph is not None
        self.graph.replay()


class Sampler:
    """Generation over one rank's model shard; all ranks of a TP group call it together."""

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        check_every: int = 16,
        cuda_graphs: bool | None = None,
        max_graphs: int = 2,
    ) -> None:
        self.decoder = CachedDecoder(module)
        self.check_every = check_every
        # None: TG_SAMPLER_CUDA_GRAPHS; True: where the default allows them; False: never
        self.cuda_graphs = graphs_allowed(
            self.decoder, None if cuda_graphs is None else "1" if cuda_graphs else "0"
        )
        self.max_graphs = max_graphs
        self._graphs: collections.OrderedDict[tuple[Any, ...], _GraphedStep] = (
            collections.OrderedDict()
        )
        # the last call's split, as the engine's ``info`` gives its own: device seconds of
        # the prefill (with the first draw) and of the decode steps, and the steps run
        self.last: dict[str, Any] = {}

    def clear(self) -> None:
        """Drop the cached CUDA graphs and their KV caches."""
        self._graphs.clear()

    def _state(
        self, rows: int, length: int, params: SamplingParams, hooks: object | None
    ) -> tuple[DecodeState, _GraphedStep | None]:
        topk = params.logprobs.topk_sample
        if not self.cuda_graphs:
            state = DecodeState.allocate(self.decoder, rows, length, params.max_tokens, topk)
            return state, None
        key = (
            rows,
            length,
            params.max_tokens,
            params.temperature,
            params.top_k,
            params.top_p,
            topk,
            None if hooks is None else id(hooks),  # unique: the entry keeps ``hooks`` alive
        )
        step = self._graphs.pop(key, None)
        if step is None:
            while len(self._graphs) >= self.max_graphs:
                self._graphs.popitem(last=False)
            state = DecodeState.allocate(self.decoder, rows, length, params.max_tokens, topk)
            step = _GraphedStep(self.decoder, state, params, hooks)
        self._graphs[key] = step
        return step.state, step

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        *,
        scope: RowScope | None = None,
        hooks: object | None = None,
    ) -> list[dict[str, Any]]:
        """One dict per prompt (docs/sampling.md): sequences, and prompt log-probs on request.

        Rows are prompt-major (prompt ``i``'s samples are rows ``i * n .. i * n + n - 1``);
        ``scope`` is entered around a forward over a slice of the rows (see :data:`RowScope`).
        ``hooks``: the forward-hook set attached to the model for this call (None: none);
        a CUDA graph is only replayed under the hook set it was captured with.
        """
        d = self.decoder
        n = params.num_samples
        rows = [p for p in prompts for _ in range(n)]
        r_count = len(rows)
        lens = [len(p) for p in rows]
        width = max(lens)
        t_max = params.max_tokens
        state, graphed = self._state(r_count, width + t_max - 1, params, hooks)
        prefill = DeviceSpan(d.device)

        lengths = torch.tensor(lens, dtype=torch.int64, device=d.device)
        keys = row_keys(prompts, seed=params.seed, num_samples=n)
        state.keys.copy_(torch.tensor(keys, dtype=torch.int64))

        # Each prompt is prefilled once, into its first row, and its keys/values copied to
        # its other samples' rows, as the engine does (an RL group of 8 samples was 8
        # prefills of one prompt). Per-row adapters (``scope``) need each row's own prefill.
        shared = n > 1 and scope is None
        every = n if shared else 1  # the prefill's rows: 0, n, 2n, ... (or all)
        hidden, logits = d.prefill_prompts(prompts if shared else rows, state.cache.strided(every))
        if shared:
            logits = logits.repeat_interleave(n, dim=0)
            source = torch.arange(r_count, device=d.device).div(n, rounding_mode="floor") * n
            state.cache.copy_rows(source, width=width)
        token, logprob = next_token(logits, state.keys, state.step.new_zeros(1), params)
        token = _agree(token, d.tp_size)
        state.out_tokens[:, 0] = token
        state.out_logprobs[:, 0] = logprob
        if state.out_topk_ids is not None and state.out_topk_lps is not None:
            k = params.logprobs.topk_sample
            values, ids = torch.topk(torch.log_softmax(logits, dim=-1), k)
            state.out_topk_ids[:, 0] = ids
            state.out_topk_lps[:, 0] = values
        state.tokens.copy_(token)
        state.pos.copy_(lengths)
        state.step.fill_(1)
        scores: list[dict[str, Any]] = [{} for _ in prompts]
        if params.prompt_logprobs or params.logprobs.scores_prompt:
            stride = 1 if shared else n  # the prefill's column of prompt i: i * stride
            scores = self._prompt_scores(hidden, prompts, params, scope or _whole_batch, stride)
        del hidden, logits

        prefill.stop()
        decode = DeviceSpan(d.device)
        ends: list[int | None] = [None] * r_count
        scanned = 0
        for step in range(1, t_max):
            if graphed is not None:
                graphed()
            else:
                advance(d, state, params)
            done = step + 1
            if params.stop and (done % self.check_every == 0 or done == t_max):
                scanned = self._scan(state, params, ends, scanned, done)
                if all(e is not None for e in ends):
                    break
        decode.stop()
        produced = int(state.step.item())
        self.last = {
            "rows": r_count,
            "steps": produced - 1,
            "prefill_device_s": round(prefill.seconds(), 4),
            "decode_device_s": round(decode.seconds(), 4),
        }
        if params.stop:
            self._scan(state, params, ends, scanned, produced)
        out_tokens = state.out_tokens[:, :produced].cpu().tolist()
        out_lps = state.out_logprobs[:, :produced].cpu().tolist()
        out_topk: list[list[list[list[float]]]] | None = None
        if state.out_topk_ids is not None and state.out_topk_lps is not None:
            ids = state.out_topk_ids[:, :produced].double()
            pairs = torch.stack((ids, state.out_topk_lps[:, :produced].double()), dim=-1)
            out_topk = [  # [R][produced][k] of [id, logprob]
                [[[int(i), float(v)] for i, v in pos] for pos in row]
                for row in pairs.cpu().tolist()
            ]

        results: list[dict[str, Any]] = []
        for i in range(len(prompts)):
            sequences = []
            for j in range(n):
                r = i * n + j
                end = ends[r]
                stop = end is not None
                keep = end if end is not None else t_max
                seq: dict[str, Any] = {
                    "tokens": out_tokens[r][:keep],
                    "logprobs": out_lps[r][:keep],
                    "stop_reason": "stop" if stop else "length",
                }
                if out_topk is not None:
                    seq["topk_logprobs"] = out_topk[r][:keep]
                sequences.append(seq)
            results.append({"sequences": sequences, "prompt_logprobs": None, **scores[i]})
        return results

    @staticmethod
    def _scan(
        state: DecodeState, params: SamplingParams, ends: list[int | None], scanned: int, upto: int
    ) -> int:
        """Record in ``ends`` the rows whose tokens ``[:upto]`` complete a stop sequence."""
        longest = max(len(s) for s in params.stop)
        start = max(0, scanned - longest + 1)
        window = state.out_tokens[:, start:upto].cpu().tolist()
        for r, tail in enumerate(window):
            if ends[r] is None:
                hit = first_stop(tail, params.stop, start=max(0, scanned - start))
                if hit is not None:
                    ends[r] = start + hit
        return upto

    def _prompt_scores(
        self,
        hidden: torch.Tensor,
        prompts: list[list[int]],
        params: SamplingParams,
        scope: RowScope,
        stride: int,
    ) -> list[dict[str, Any]]:
        """Per prompt, the scores ``params`` asks for (``prompt_scores.score_prompt``), from
        the prefill's hidden states of the prompt's first row (one prompt at a time): prompt
        ``i`` is the prefill's column ``i * stride`` and the batch's row ``i * num_samples``."""
        n = params.num_samples
        out: list[dict[str, Any]] = []
        for i, prompt in enumerate(prompts):
            r, c = i * n, i * stride

            def logits_of(a: int, b: int, r: int = r, c: int = c) -> torch.Tensor:
                with scope(r, r + 1):
                    return self.decoder.logits(hidden[a:b, c : c + 1])[:, 0]

            out.append(score_prompt(logits_of, prompt, params, seed=params.seed))
        return out
