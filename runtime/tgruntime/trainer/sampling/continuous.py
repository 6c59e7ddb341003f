"""``SlotEngine``: continuous batching over a KV pool of fixed slots (docs/sampling.md).

The pool (``slots`` rows x ``length`` positions, every layer's keys and values of this
rank) is allocated once. A request becomes ``num_samples`` rows; rows are admitted into free
slots when there is room (the prompts of the newly admitted rows only are prefilled, into
their slots), then every decode step advances all active rows, each at its own position and
step, each with its own temperature / top-k / top-p / noise key (``rows.py``). Steps run in
windows of up to ``window`` steps with no host sync inside: each step writes its chosen
tokens into a ``[slots, window]`` buffer at a device cursor, and a row stops advancing on the
device once it has its ``max_tokens`` (so it never writes past its slot). After a window the
tokens come to the host in one copy, which checks each row's stop sequences token by token
(a row that met a stop sequence inside a window computed the window's remaining steps for
nothing; its tokens after the stop are dropped). Finished rows leave then (the last active
row moves into a free slot, so the active rows are always slots ``[0, n)`` and a step
computes exactly them; on a GPU, the graph bucket just above ``n``). Admission happens
between windows, and a request submitted while others decode joins them at the next one. A
window is never longer than the call's steps left nor the most tokens an active row still
needs, so a row that ends by ``max_tokens`` costs nothing after it. (One host sync per step,
as before, cost the GPU idle time of the host's per-row work at every step.)

Every decision (admission order, slots, when a row finishes) is a function of the calls'
arguments and of the chosen tokens, which the tensor-parallel ranks agree on (broadcast from
the first tensor rank each step), so the ranks can never diverge.

CUDA graphs (GPU, tensor parallel 1, as the one-shot path; at tensor size > 1 with
``TG_SAMPLER_CUDA_GRAPHS=tp``, every rank capturing the same buckets at the same calls, as
every decision here is the same on every rank): one graph per (batch bucket,
filters in use), captured the first time that bucket runs and replayed from then on; the
buckets are a fixed list, so in steady state no request shape captures anything. Capture
runs its warm-up steps on a scratch column (the last position of every slot, which no row
ever reads or writes: a row's last token is never fed), so it can happen while rows decode.

LoRA groups (``RowAdapters``): every request names its adapter (a snapshot's sampling-only
``LoraAdapters``, or None for the base model), and the rows of different adapters decode in
one batch through ``lora.multi.MultiLora`` (per-row deltas from forward hooks). The pool
keeps a row -> adapter map of ``slots`` rows (``MultiLora.set_rows`` over the whole pool,
free slots 0 = the base), rewritten in place when rows are admitted or move, so its address
never changes: a step over slots ``[0, b)`` reads rows ``[0, b)`` of it
(``MultiLora.narrowed``), and a CUDA graph captured over the hooks stays valid while rows come
and go. A prefill runs the new rows' slots ``[start, end)`` of the same map.

The stack (the adapters the ``MultiLora`` holds) changes between windows, never by waiting:
when an admission brings an adapter the stack lacks, the stack is made to hold exactly the
adapters of the rows still decoding and of the rows being admitted (the union; adapters no row
uses any more are dropped then). Where the union fits the stack's slots and fills at least half
of them (an RL loop's new snapshot each step takes the old one's slot), it is written into the
stack's buffers in place (``MultiLora.refill``): every address stays, so the captured graphs
stay valid and nothing is captured again. Otherwise a new stack is built, the map is rewritten
for it, the old hooks are swapped for the new ones and the captured graphs are dropped (they
replay the old stack's hooks): the next step captures again, once per bucket in use. Either
way the row map is rewritten (the masks carry the slots' scalings). A row's adapter is the
snapshot's adapter set itself (keyed by identity), so a snapshot saved again under the same
name is a new adapter; rows already decoding keep the copy the stack made of the old one.
Requests for the base only need no stack (no hooks: the lean decode path).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from tgruntime.trainer.logprob_options import MAX_WIDTH
from tgruntime.trainer.lora.inject import LoraAdapters
from tgruntime.trainer.lora.multi import MultiLora
from tgruntime.trainer.sampling.decoder import CachedDecoder, KVCache
from tgruntime.trainer.sampling.device_span import DeviceSpan
from tgruntime.trainer.sampling.generate import _agree
from tgruntime.trainer.sampling.params import SamplingParams, row_keys
from tgruntime.trainer.sampling.pool import PoolSize
from tgruntime.trainer.sampling.prompt_scores import score_prompt, topk_rows
from tgruntime.trainer.sampling.rows import RowSettings, next_token_rows

__all__ = ["BUCKETS", "RowAdapters", "SlotEngine", "bucket", "topk_width"]

BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
"""Graph batch sizes; above 512, multiples of 128."""


def topk_width(widths: list[int], vocab: int) -> int:
    """The top-k width a step computes for rows asking ``widths`` (``topk_sample_logprobs``,
    each at most ``min(MAX_WIDTH, vocab)``; 0: none asks): the next power of two within that
    bound, so few graphs serve every width."""
    k = max(widths, default=0)
    return 0 if k == 0 else min(MAX_WIDTH, vocab, 1 << (k - 1).bit_length())


def bucket(rows: int, slots: int) -> int:
    """The graph batch size that serves ``rows`` active rows in a pool of ``slots``."""
    b = next((x for x in BUCKETS if x >= rows), -(-rows // 128) * 128)
    return min(b, slots)


@dataclasses.dataclass
class _Request:
    rid: str
    prompt: list[int]
    params: SamplingParams
    keys: list[int]
    sequences: list[dict[str, Any] | None]
    left: int
    submitted_step: int
    adapter: LoraAdapters | None = None  # a LoRA group's adapter set (None: the base model)
    admitted_step: int = -1
    finished_step: int = -1
    reported: bool = False
    scores: dict[str, Any] = dataclasses.field(default_factory=dict)  # prompt_scores' keys


@dataclasses.dataclass
class _Row:
    request: _Request
    index: int  # sample index within the request
    pos: int  # position of the token fed next (host copy)
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    topk: list[list[list[float]]] = dataclasses.field(default_factory=list)

    def add(self, token: int, logprob: float, topk: list[list[float]] | None = None) -> bool:
        """Record a chosen token (and its position's top-k pairs when the request asks for
        them); True when the row is finished (stop or max_tokens)."""
        self.tokens.append(token)
        self.logprobs.append(logprob)
        k = self.request.params.logprobs.topk_sample
        if k and topk is not None:  # (id, log-prob) pairs; the ids come as floats
            self.topk.append([[int(i), float(v)] for i, v in topk[:k]])
        self.pos += 1
        for stop in self.request.params.stop:
            if len(stop) <= len(self.tokens) and tuple(self.tokens[-len(stop) :]) == stop:
                self._finish("stop")
                return True
        if len(self.tokens) >= self.request.params.max_tokens:
            self._finish("length")
            return True
        return False

    def _finish(self, reason: str) -> None:
        seq: dict[str, Any] = {
            "tokens": self.tokens,
            "logprobs": self.logprobs,
            "stop_reason": reason,
        }
        if self.request.params.logprobs.topk_sample:
            seq["topk_logprobs"] = self.topk
        self.request.sequences[self.index] = seq
        self.request.left -= 1


class RowAdapters:
    """The per-row LoRA adapters of a LoRA group's pool (module docstring): the stack
    (``multi``, slot ``i + 1`` = ``stack[i]``) and the pool's row -> adapter map in it."""

    def __init__(self, module: torch.nn.Module, slots: int) -> None:
        self.module = module  # the GPT model the adapters were made for (``unwrap_gpt``)
        self.slots = slots
        self.stack: list[LoraAdapters] = []
        self.multi: MultiLora | None = None
        self.on = False  # the stack's hooks are attached (inside ``attached()``)
        self.rebuilds = 0
        self.refills = 0
        self._written: list[int] | None = None  # the map last written into ``multi``

    def holds(self, adapter: LoraAdapters) -> bool:
        return any(a is adapter for a in self.stack)

    def cover(self, needed: Iterable[LoraAdapters | None]) -> str:
        """Make the stack hold every adapter in ``needed`` (the live rows' and the admitted
        rows'): ``"kept"`` when it already did; ``"refilled"`` when exactly those were written
        into the stack's buffers in place (the captured graphs stay valid; the row map must be
        written again); ``"rebuilt"`` when a new stack of exactly those was made (the old
        graphs are stale)."""
        want: list[LoraAdapters] = []
        for adapter in needed:
            if adapter is not None and not any(a is adapter for a in want):
                want.append(adapter)
        if all(self.holds(a) for a in want):
            return "kept"
        # at least half the stack's slots in use: reuse it (an RL loop's new snapshot each
        # step takes the old one's slot, and no graph is captured again); "0": always rebuild
        if (
            self.multi is not None
            and 2 * len(want) >= self.multi.slots - 1
            and os.environ.get("TG_SAMPLER_REFILL", "1") != "0"
            and self.multi.refill(want) is None
        ):
            self.stack, self._written = want, None
            self.refills += 1
            return "refilled"
        old, self.multi = self.multi, None
        if old is not None:
            old.detach()
        del old  # free the old copies before the new ones are made
        self.stack, self._written = [], None  # a failed build leaves no stack (the caller
        # resets the engine)
        self.multi = MultiLora(self.module, want)
        self.stack = want
        if self.on:
            self.multi.attach()
        self.rebuilds += 1
        return "rebuilt"

    def write(self, adapters: Sequence[LoraAdapters | None]) -> None:
        """The adapter of every pool slot (None: the base, or a free slot), written in
        place into the stack's row map of ``slots`` rows."""
        if self.multi is None:
            return
        index = {id(a): i + 1 for i, a in enumerate(self.stack)}
        slots = [0 if a is None else index[id(a)] for a in adapters]
        if slots != self._written:  # most retirements move rows of one adapter: no copy
            self.multi.set_rows(slots)
            self._written = slots

    def scope(self, start: int, stop: int) -> contextlib.AbstractContextManager[None]:
        """A forward over pool slots ``start:stop`` only, each with its row's adapter."""
        if self.multi is None:
            return contextlib.nullcontext()
        return self.multi.narrowed(start, stop)

    @contextlib.contextmanager
    def attached(self) -> Iterator[None]:
        """The stack's hooks on inside the block (a rebuild inside swaps them), off after;
        the caller has taken every other adapter set's hooks off."""
        self.on = True
        if self.multi is not None:
            self.multi.attach()
        try:
            yield
        finally:
            self.on = False
            if self.multi is not None:
                self.multi.detach()

    def info(self) -> dict[str, Any]:
        return {
            "adapters": len(self.stack),
            "adapter_rebuilds": self.rebuilds,
            "adapter_refills": self.refills,
        }


def _whole(start: int, stop: int) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


class SlotEngine:
    """Continuous batching on one rank; every rank of the group runs the same calls."""

    def __init__(
        self,
        decoder: CachedDecoder,
        size: PoolSize,
        *,
        cuda_graphs: bool,
        lora: RowAdapters | None = None,
        window: int = 16,
    ) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1 decode step, not {window}")
        self.window = window
        self.decoder = decoder
        self.lora = lora  # a LoRA group's per-row adapters (None: a full-weight group)
        self.size = size
        slots, dev = size.slots, decoder.device
        self.cache: KVCache = decoder.allocate(slots, size.length)

        def ints() -> torch.Tensor:
            return torch.zeros(slots, dtype=torch.int64, device=dev)

        def floats() -> torch.Tensor:
            return torch.zeros(slots, dtype=torch.float32, device=dev)

        self.tokens, self.pos, self.live, self.limit = ints(), ints(), ints(), ints()
        self.settings = RowSettings(
            temperature=floats(), top_k=ints(), top_p=floats(), keys=ints(), step=ints()
        )
        # a window's chosen tokens (and top-k pairs), column ``cursor`` for its current step
        self.cursor = torch.zeros(1, dtype=torch.int64, device=dev)
        self.out_token = torch.zeros(slots, window, dtype=torch.int64, device=dev)
        self.out_logprob = torch.zeros(slots, window, dtype=torch.float32, device=dev)
        width = min(MAX_WIDTH, decoder.vocab_size)  # topk_sample_logprobs of each step
        self.out_topk_ids = torch.zeros(slots, window, width, dtype=torch.int64, device=dev)
        self.out_topk_lps = torch.zeros(slots, window, width, dtype=torch.float32, device=dev)
        self._slot_tensors = (
            self.tokens,
            self.pos,
            self.live,
            self.limit,
            self.settings.temperature,
            self.settings.top_k,
            self.settings.top_p,
            self.settings.keys,
            self.settings.step,
        )
        self.rows: list[_Row | None] = [None] * slots
        self.n = 0  # active rows: slots [0, n)
        self.waiting: collections.deque[_Request] = collections.deque()
        self.steps = 0  # decode steps run since the pool was made
        self.calls = 0
        self.admitted_rows = 0
        self.prefilled = 0  # prompts prefilled (one a request, whatever its num_samples)
        self.prefills = 0  # prefill forwards (one an admission, however many prompts)
        self.prefill_tokens = 0  # the prefills' padded prompt tokens
        self.decode_path = ""  # lean, lean+lora or modules (the decoder is shared)
        self.prefill_device_s = 0.0  # the prefill forwards' GPU time (CUDA events; 0 elsewhere)
        self.decode_device_s = 0.0  # the decode windows' GPU time, from the first step queued
        # seconds inside ``run`` since the pool was made; of them, in prefills and in the
        # host's reading of windows' tokens (the GPU idles then; docs/sampling.md)
        self.run_s = self.prefill_s = self.host_s = 0.0
        self.weights: str | None = None  # the weights the active rows decode with
        self.cuda_graphs = cuda_graphs
        self._graphs: dict[tuple[int, bool, bool, int], torch.cuda.CUDAGraph] = {}
        self._graph_pool: Any = None

    # -- requests ----------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return self.n > 0 or bool(self.waiting)

    def request_ids(self) -> set[str]:
        ids = {r.rid for r in self.waiting}
        ids.update(row.request.rid for row in self.rows[: self.n] if row is not None)
        return ids

    def submit(
        self,
        rid: str,
        prompt: list[int],
        params: SamplingParams,
        adapter: LoraAdapters | None = None,
    ) -> None:
        """Queue a checked request (``check_prompts`` / ``SamplingParams.build`` done) for
        admission; refuses what the pool can never hold, naming the limit. ``adapter``: the
        request's adapter set on a LoRA group (None: the base model)."""
        if adapter is not None and self.lora is None:
            raise ValueError("a request's adapter needs a LoRA group's engine (RowAdapters)")
        n, slots, length = params.num_samples, self.size.slots, self.size.length
        if n > slots:
            raise ValueError(
                f"num_samples {n} is over the sampler's row limit: its KV pool has {slots} "
                f"slots (sampler_pool(slots=...), TG_SAMPLER_SLOTS, within the KV budget)"
            )
        if len(prompt) + params.max_tokens > length:
            raise ValueError(
                f"{len(prompt)} prompt tokens + max_tokens {params.max_tokens} = "
                f"{len(prompt) + params.max_tokens} exceeds the sampler's slot length of "
                f"{length} positions (sampler_pool(length=...), TG_SAMPLER_SLOT_LENGTH)"
            )
        if rid in self.request_ids():
            raise ValueError(f"request id {rid!r} is already in the sampler")
        keys = row_keys([prompt], seed=params.seed, num_samples=n)
        self.waiting.append(
            _Request(
                rid=rid,
                prompt=prompt,
                params=params,
                keys=keys,
                sequences=[None] * n,
                left=n,
                submitted_step=self.steps,
                adapter=adapter,
            )
        )

    def reset(self) -> None:
        """Drop every row and queued request (after a failed step)."""
        self.waiting.clear()
        self.rows = [None] * self.size.slots
        self.n = 0
        self.live.zero_()
        self.pos.zero_()
        self.weights = None
        self._write_adapters()

    def info(self) -> dict[str, Any]:
        return {
            "slots": self.size.slots,
            "length": self.size.length,
            "kv_bytes": self.cache.nbytes(),
            "budget": self.size.budget,
            "active_rows": self.n,
            "waiting_requests": len(self.waiting),
            "steps": self.steps,
            "calls": self.calls,
            "admitted_rows": self.admitted_rows,
            "prefilled_prompts": self.prefilled,
            "prefills": self.prefills,
            "prefill_tokens": self.prefill_tokens,
            "prefill_device_s": round(self.prefill_device_s, 4),
            "decode_device_s": round(self.decode_device_s, 4),
            "graphs": len(self._graphs),
            "run_s": round(self.run_s, 4),
            "prefill_s": round(self.prefill_s, 4),
            "host_s": round(self.host_s, 4),
            "decode_path": self.decode_path,  # this engine's last traced step's layers
            **(self.lora.info() if self.lora is not None else {}),
        }

    # -- LoRA rows -----------------------------------------------------------------------
    def _scope(self, start: int, stop: int) -> contextlib.AbstractContextManager[None]:
        return _whole(start, stop) if self.lora is None else self.lora.scope(start, stop)

    def _write_adapters(self, admitted: Sequence[_Request] = (), *, each: bool = True) -> None:
        """Rewrite the pool's row -> adapter map: the active rows', then the rows of
        ``admitted`` (prompt-major, as ``_prefill`` places them; ``each=False``: one slot a
        request, as its prefill runs), then free slots (base)."""
        if self.lora is None:
            return
        adapters = [row.request.adapter if row else None for row in self.rows[: self.n]]
        adapters += [
            req.adapter for req in admitted for _ in range(req.params.num_samples if each else 1)
        ]
        adapters += [None] * (self.size.slots - len(adapters))
        self.lora.write(adapters)

    def _cover(self, batch: Sequence[_Request]) -> None:
        """Make the stack hold every adapter the active rows and ``batch`` use; a rebuilt
        stack drops the graphs captured over the old one's hooks."""
        if self.lora is None:
            return
        live = [row.request.adapter for row in self.rows[: self.n] if row is not None]
        done = self.lora.cover([*live, *(req.adapter for req in batch)])
        if done == "rebuilt":
            # a new memory pool too: capturing into the old one once its graphs are gone
            # fails in PyTorch's allocator ("use_count > 0" assert, seen on an H100) while
            # tensors made during those captures are still alive
            self._graphs.clear()
            self._graph_pool = None
        if done != "kept":
            self._write_adapters()

    # -- the loop ------------------------------------------------------------------------
    @torch.no_grad()
    def run(self, max_steps: int) -> list[tuple[str, dict[str, Any]]]:
        """Admit what fits, then up to ``max_steps`` decode steps (admitting between steps);
        the requests whose rows have all finished, in the order they finished."""
        self.calls += 1
        began = time.perf_counter()
        finished: list[tuple[str, dict[str, Any]]] = []
        try:
            self._admit(finished)
            left = max_steps
            while left > 0 and self.n > 0:
                left -= self._window(left, finished)
                self._admit(finished)
        finally:
            self.run_s += time.perf_counter() - began
        return finished

    def _admit(self, finished: list[tuple[str, dict[str, Any]]]) -> None:
        batch: list[_Request] = []
        room = self.size.slots - self.n
        while self.waiting and self.waiting[0].params.num_samples <= room:
            req = self.waiting.popleft()
            room -= req.params.num_samples
            batch.append(req)
        if batch:
            began = time.perf_counter()
            self._cover(batch)
            self._prefill(batch, finished)
            self.prefill_s += time.perf_counter() - began

    def _prefill(self, batch: list[_Request], finished: list[tuple[str, dict[str, Any]]]) -> None:
        """Prefill each admitted request's prompt once, into the first free slots (one slot a
        request), then copy its keys/values to the slots of all its samples: a request of
        ``num_samples`` G costs one prompt's prefill, not G (an RL group's 8 samples of a
        prompt were 8 prefills of the same tokens). Each row then draws its first token
        from the request's logits with its own noise key."""
        d = self.decoder
        rows = [(req, j) for req in batch for j in range(req.params.num_samples)]
        m, start = len(rows), self.n
        end = start + m
        q = len(batch)  # prefill rows: slots [start, start + q), request i in slot start + i
        width = max(len(req.prompt) for req in batch)
        lens = [len(req.prompt) for req, _ in rows]
        of_row = [i for i, req in enumerate(batch) for _ in range(req.params.num_samples)]
        source = torch.tensor(of_row, dtype=torch.int64, device=d.device)
        lengths = torch.tensor([len(req.prompt) for req in batch], dtype=torch.int64)
        lengths = lengths.to(d.device)
        s = self.settings
        vocab = d.vocab_size

        def column(values: list[Any], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(d.device)

        params = [req.params for req, _ in rows]
        s.temperature[start:end] = column([p.temperature for p in params], torch.float32)
        s.top_k[start:end] = column(
            [vocab if p.top_k == -1 else min(p.top_k, vocab) for p in params], torch.int64
        )
        s.top_p[start:end] = column([p.top_p for p in params], torch.float32)
        s.keys[start:end] = column([req.keys[j] for req, j in rows], torch.int64)
        s.step[start:end] = 0
        view = KVCache(
            keys=[k[start : start + q] for k in self.cache.keys],
            values=[v[start : start + q] for v in self.cache.values],
        )
        self._write_adapters(batch, each=False)  # slot start + i: request i's adapter
        span = DeviceSpan(d.device)
        with self._scope(start, start + q):
            hidden, logits = d.prefill_prompts([req.prompt for req in batch], view)
        span.stop()
        for i, req in enumerate(batch):  # the map still has request i in slot start + i
            if req.params.prompt_logprobs or req.params.logprobs.scores_prompt:
                req.scores = self._prompt_scores(hidden, i, req, start)
        self.cache.copy_rows(source + start, start=start, width=width)  # each sample's copy
        self._write_adapters(batch)  # each row's adapter in its own slot
        logits = logits.index_select(0, source)
        sub = RowSettings(
            *(t[start:end] for t in (s.temperature, s.top_k, s.top_p, s.keys, s.step))
        )
        token, logprob = next_token_rows(logits, sub, **self._filters(params))
        token = _agree(token, d.tp_size)
        self.tokens[start:end] = token
        self.pos[start:end] = lengths.index_select(0, source)
        s.step[start:end] = 1
        self.limit[start:end] = column([p.max_tokens for p in params], torch.int64)
        self.live[start:end] = (self.limit[start:end] > 1).long()
        for req in batch:
            req.admitted_step = self.steps
        kw = topk_width([p.logprobs.topk_sample for p in params], vocab)
        topk = topk_rows(torch.log_softmax(logits, dim=-1), kw) if kw else None
        del hidden, logits
        host = torch.stack((token.double(), logprob.double())).cpu().tolist()
        done: list[int] = []
        for i, (req, j) in enumerate(rows):
            row = _Row(request=req, index=j, pos=lens[i])
            self.rows[start + i] = row
            if row.add(int(host[0][i]), float(host[1][i]), None if topk is None else topk[i]):
                done.append(start + i)
        self.n = end
        self.admitted_rows += m
        self.prefilled += q
        self.prefills += 1
        self.prefill_tokens += q * width
        self.prefill_device_s += span.seconds()  # the host read above waited for it
        self._retire(done, finished)

    def _prompt_scores(
        self, hidden: torch.Tensor, r: int, req: _Request, start: int = 0
    ) -> dict[str, Any]:
        """The request's prompt scores (``prompt_scores.score_prompt``) from the prefill's
        hidden states of its first row ``r`` (pool slot ``start + r``)."""

        def logits_of(a: int, b: int) -> torch.Tensor:
            with self._scope(start + r, start + r + 1):
                return self.decoder.logits(hidden[a:b, r : r + 1])[:, 0]

        return score_prompt(logits_of, req.prompt, req.params, seed=req.params.seed)

    def _filters(self, params: list[SamplingParams]) -> dict[str, bool]:
        vocab = self.decoder.vocab_size
        return {
            "top_k": any(0 < p.top_k < vocab for p in params),
            "top_p": any(p.top_p < 1.0 for p in params),
        }

    def _advance(self, b: int, cache: KVCache, top_k: bool, top_p: bool, kw: int = 0) -> None:
        """One decode step over slots ``[0, b)`` (device work only: capturable); ``kw``: the
        top-k width to record (0: none)."""
        with self._scope(0, b):
            logits = self.decoder.decode(self.tokens[:b], self.pos[:b], cache)
        self.decode_path = self.decoder.last_path  # at capture or an eager step
        token, logprob = next_token_rows(logits, self.settings.narrow(b), top_k=top_k, top_p=top_p)
        token = _agree(token, self.decoder.tp_size)
        at = self.cursor
        self.out_token[:b].index_copy_(1, at, token.unsqueeze(1))
        self.out_logprob[:b].index_copy_(1, at, logprob.unsqueeze(1))
        if kw:
            values, ids = torch.topk(torch.log_softmax(logits, dim=-1), kw, dim=-1)
            self.out_topk_ids[:b, :, :kw].index_copy_(1, at, ids.unsqueeze(1))
            self.out_topk_lps[:b, :, :kw].index_copy_(1, at, values.unsqueeze(1))
        self.cursor.add_(1)
        self.tokens[:b].copy_(token)
        live = self.live[:b]
        self.pos[:b].add_(live)
        step = self.settings.step[:b]
        step.add_(live)
        live.mul_((step < self.limit[:b]).long())  # max_tokens reached: stop advancing

    def _window(self, left: int, finished: list[tuple[str, dict[str, Any]]]) -> int:
        """Up to ``min(window, left)`` decode steps with no host sync between them, then the
        host's reading of their tokens (module docstring); the steps run."""
        n = self.n
        active = [row for row in self.rows[:n] if row is not None]
        need = max(row.request.params.max_tokens - len(row.tokens) for row in active)
        w = max(1, min(self.window, left, need))
        flags = self._filters([row.request.params for row in active])
        kw = topk_width(
            [row.request.params.logprobs.topk_sample for row in active], self.decoder.vocab_size
        )
        if self.cuda_graphs:
            graph = self._graph(bucket(n, self.size.slots), flags["top_k"], flags["top_p"], kw)
            self.cursor.zero_()
            timer = DeviceSpan(self.decoder.device)  # after a capture: the steps only
            for _ in range(w):
                graph.replay()
        else:  # attend only the live prefix of the cache
            span = min(self.size.length, max(row.pos for row in active) + w)
            view = KVCache(
                keys=[k[:n, :, :span] for k in self.cache.keys],
                values=[v[:n, :, :span] for v in self.cache.values],
            )
            self.cursor.zero_()
            timer = DeviceSpan(self.decoder.device)
            for _ in range(w):
                self._advance(n, view, flags["top_k"], flags["top_p"], kw)
        timer.stop()
        host = torch.stack((self.out_token[:n, :w].double(), self.out_logprob[:n, :w].double()))
        tokens, logprobs = host.cpu().tolist()
        self.decode_device_s += timer.seconds()  # the read above waited for the steps
        began = time.perf_counter()
        topk: list[list[list[list[float]]]] | None = None
        if kw:
            pairs = torch.stack(
                (
                    self.out_topk_ids[:n, :w, :kw].double(),
                    self.out_topk_lps[:n, :w, :kw].double(),
                ),
                -1,
            )
            topk = pairs.cpu().tolist()
        first = self.steps
        self.steps += w
        done: list[int] = []
        ends: dict[int, int] = {}
        for r, row in enumerate(active):
            for j in range(w):
                step_topk = None if topk is None else topk[r][j]
                if row.add(int(tokens[r][j]), logprobs[r][j], step_topk):
                    done.append(r)
                    ends[r] = first + j + 1
                    break
        self._retire(done, finished, ends)
        self.host_s += time.perf_counter() - began
        return w

    def _retire(
        self,
        slots: list[int],
        finished: list[tuple[str, dict[str, Any]]],
        ends: dict[int, int] | None = None,
    ) -> None:
        """Free finished rows' slots; keep the active rows in ``[0, n)``. ``ends``: the step
        at which each slot's row finished (default: now)."""
        if not slots:
            return
        ends = ends or {}
        reported: list[_Request] = []
        for s in slots:
            row = self.rows[s]
            assert row is not None
            req = row.request
            req.finished_step = max(req.finished_step, ends.get(s, self.steps))
            if req.left == 0 and not req.reported:  # two of its rows may end in one step
                req.reported = True
                reported.append(req)
        reported.sort(key=lambda req: req.finished_step)  # in the order they finished
        finished.extend((req.rid, self._result(req)) for req in reported)
        n, gone = self.n, set(slots)
        n_new = n - len(gone)
        holes = sorted(s for s in gone if s < n_new)
        movers = [s for s in range(n_new, n) if s not in gone]
        if holes:
            dst = torch.tensor(holes, dtype=torch.int64, device=self.decoder.device)
            src = torch.tensor(movers, dtype=torch.int64, device=self.decoder.device)
            for t in (*self.cache.keys, *self.cache.values, *self._slot_tensors):
                t.index_copy_(0, dst, t.index_select(0, src))
            for h, m in zip(holes, movers, strict=True):
                self.rows[h] = self.rows[m]
        for s in range(n_new, n):
            self.rows[s] = None
        self.live[n_new:n] = 0
        self.pos[n_new:n] = 0
        self.n = n_new
        self._write_adapters()
        if self.n == 0 and not self.waiting:
            self.weights = None

    def _result(self, req: _Request) -> dict[str, Any]:
        return {
            "sequences": list(req.sequences),
            "prompt_logprobs": None,
            **req.scores,
            "engine": {
                "submitted_step": req.submitted_step,
                "admitted_step": req.admitted_step,
                "finished_step": req.finished_step,
            },
        }

    # -- CUDA graphs ---------------------------------------------------------------------
    @torch.no_grad()  # as ``run``: Dynamo's graphs for the draw are per grad mode
    def capture_buckets(self, adapter: LoraAdapters | None = None) -> int:
        """Capture now, on an idle pool, the graph of every batch bucket up to the pool's
        slots for the filters an RL loop's sampling uses (no top-k, no top-p, no top-k
        record), so the first requests capture nothing (the group's warm-up, ``warm_up.py``);
        the graphs captured (0 without CUDA graphs). Other filters still capture at their
        first use. On a LoRA group ``adapter`` (the active run's adapters: the linears and
        rank of its snapshots) becomes the stack's one set, and the first snapshot takes its
        slot in place (``RowAdapters.cover``'s refill), so these graphs serve it; call it
        inside ``lora.attached()``."""
        if not self.cuda_graphs:
            return 0
        if self.busy:
            raise ValueError("capture_buckets: the pool has rows decoding; capture when idle")
        if self.lora is not None:
            if adapter is None:
                raise ValueError("capture_buckets: a LoRA group's engine needs an adapter set")
            if self.lora.cover([adapter]) == "rebuilt":
                self._graphs.clear()
                self._graph_pool = None
            self._write_adapters()
        before = len(self._graphs)
        slots = self.size.slots
        for b in sorted({bucket(n, slots) for n in range(1, slots + 1)}):
            self._graph(b, False, False, 0)
        # a prefill's draw runs eagerly (compiled on CUDA, draw.py): compile it now, at two
        # batch sizes (the second compiles the dynamic-shape graph every later size reuses)
        vocab = self.decoder.vocab_size
        for rows in (2, 3):
            if rows <= slots:
                logits = torch.zeros(rows, vocab, dtype=torch.float32, device=self.decoder.device)
                next_token_rows(logits, self.settings.narrow(rows), top_k=False, top_p=False)
        return len(self._graphs) - before

    def _graph(self, b: int, top_k: bool, top_p: bool, kw: int = 0) -> torch.cuda.CUDAGraph:
        key = (b, top_k, top_p, kw)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._capture(b, top_k, top_p, kw)
            self._graphs[key] = graph
        return graph

    def _capture(self, b: int, top_k: bool, top_p: bool, kw: int = 0) -> torch.cuda.CUDAGraph:
        """Capture ``_advance`` over slots ``[0, b)`` and the whole slot length. The warm-up
        and the capture write keys/values at the scratch column (``length - 1``) only, with
        ``live`` 0, and the row state is put back afterwards."""
        saved = [t.clone() for t in self._slot_tensors]
        self.pos[:b] = self.size.length - 1
        self.live[:b] = 0
        view = KVCache(
            keys=[k[:b] for k in self.cache.keys], values=[v[:b] for v in self.cache.values]
        )
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.cursor.zero_()  # the window's buffers have ``window`` >= 1 columns
                self._advance(b, view, top_k, top_p, kw)
            self.cursor.zero_()
        torch.cuda.current_stream().wait_stream(side)
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            self._advance(b, view, top_k, top_p, kw)
        for live, old in zip(self._slot_tensors, saved, strict=True):
            live.copy_(old)
        return graph
