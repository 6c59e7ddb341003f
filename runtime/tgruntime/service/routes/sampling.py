"""Routes of sampling: sampling sessions, samplers and asample."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from tgruntime.service.core import ServiceCore
from tgruntime.service.futures import Outcome
from tgruntime.service.logprob_codec import encode_sample_with_options, parse_logprob_request
from tgruntime.service.sampler_weights import FreedWeights
from tgruntime.service.sampling import SampleJob
from tgruntime.service.sessions import ServiceError
from tgruntime.service.stability import check_recordable, sampled_from
from tgruntime.service.stops import cut_sequences, token_stops


class SamplingRoutes(ServiceCore):
    def _weights_for(
        self, model_path: str | None, base_model: str | None, who: str
    ) -> str | None:
        if model_path:
            at = self._locate(str(model_path), who)
            if at.kind != "sampler_weights":
                raise ServiceError(
                    f"{model_path} is not sampler weights ({at.kind}); sample from a "
                    "tinker://.../sampler_weights/... path (save_weights_for_sampler)"
                )
            return str(at.dir)
        self._base(base_model)
        return self.base_sampler

    async def create_sampling_session(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        sid, who = str(body.get("session_id")), self._who(request)
        self.registry.session(sid, who)
        weights = self._weights_for(body.get("model_path"), body.get("base_model"), who)
        self.limits.check_sampling_sessions(who, self._live_samplers(who))
        ss = self._new_sampler(sid, weights, body.get("model_path"), who)
        return web.json_response(
            {"type": "create_sampling_session", "sampling_session_id": ss.sampling_session_id}
        )

    async def get_sampler(self, request: web.Request) -> web.Response:
        ss = self.registry.sampler(request.match_info["sampler_id"], self._who(request))
        return web.json_response(
            {
                "sampler_id": ss.sampling_session_id,
                "base_model": ss.base_model,
                "model_path": ss.model_path,
            }
        )

    async def _stop(self, stop: Any) -> tuple[tuple[tuple[int, ...], ...], tuple[str, ...]]:
        """(token stop sequences for the sampler, stop strings to cut at after decoding)."""
        if stop is None:
            return tuple((e,) for e in self.info.eos_token_ids), ()
        if isinstance(stop, str) or (
            isinstance(stop, list) and any(isinstance(s, str) for s in stop)
        ):
            strings = (stop,) if isinstance(stop, str) else tuple(stop)
            if not all(isinstance(s, str) and s for s in strings):
                raise ServiceError(
                    f"stop must be a string, a list of strings or a list of token ids, got "
                    f"{stop!r}"
                )
            tok = await self._tokenizer()
            if tok is None:
                raise ServiceError(
                    "stop strings need the base model's tokenizer, and this server has none "
                    f"({self._tok_error or 'spec.model.pretrained or --tokenizer'}): pass stop "
                    "token ids, e.g. the renderer's get_stop_sequences() as ints"
                )
            eos = tuple((e,) for e in self.info.eos_token_ids)
            return eos + token_stops(tok, strings), strings
        if not isinstance(stop, list) or not all(isinstance(s, int) for s in stop):
            raise ServiceError(f"stop must be a list of token ids, got {stop!r}")
        return tuple((int(s),) for s in stop), ()

    async def asample(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        who = self._who(request)
        session: str | None = None  # the sampling session's Tinker session
        if body.get("sampling_session_id"):
            ss = self.registry.sampler(str(body["sampling_session_id"]), who)
            session = ss.session_id
            if ss.model_path:  # its checkpoint deleted, or its grant revoked, since: 404
                self._locate(ss.model_path, who)
            weights = ss.weights
        else:
            weights = self._weights_for(body.get("model_path"), body.get("base_model"), who)
        tokens: list[int] = []
        for chunk in (body.get("prompt") or {}).get("chunks") or []:
            if chunk.get("type", "encoded_text") != "encoded_text":
                raise ServiceError(f"{chunk.get('type')} chunks are not supported (text only)")
            tokens += [int(t) for t in chunk.get("tokens") or []]
        if not tokens:
            raise ServiceError("the prompt is empty")
        vocab = self.info.vocab_size
        bad = [t for t in tokens if t < 0 or t >= vocab]
        if bad:
            raise ServiceError(
                f"prompt token id {bad[0]} is outside the vocabulary (vocab_size {vocab})"
            )
        p = dict(body.get("sampling_params") or {})
        limit = self.info.max_sequence_length
        max_tokens = p.get("max_tokens")
        if max_tokens is None:
            max_tokens = limit - len(tokens)
            if self.limits.max_tokens:
                max_tokens = min(max_tokens, self.limits.max_tokens)
        max_tokens = int(max_tokens)
        n = int(body.get("num_samples", 1))
        self.limits.check_sample(n, max_tokens)
        if max_tokens < 1 or len(tokens) + max_tokens > limit:
            raise ServiceError(
                f"max_tokens {max_tokens} with a {len(tokens)}-token prompt exceeds the group's "
                f"sequence limit (model.maxSequenceLength {limit}); at most "
                f"{limit - len(tokens)}"
            )
        if n < 1:
            raise ServiceError(f"num_samples must be >= 1, got {n}")
        scoring = parse_logprob_request(body, prompt_len=len(tokens), vocab_size=vocab)
        token_seqs, strings = await self._stop(p.get("stop"))
        recorded: str | None = None  # the session a stable_reinforce record belongs to
        if body.get("record_stability_info"):  # (service.stability)
            recorded = check_recordable(
                session_id=session, temperature=float(p.get("temperature", 1.0)),
                top_k=int(p.get("top_k", -1)), top_p=float(p.get("top_p", 1.0)), vocab=vocab,
            )
            self.stability.check_fits(prompt_tokens=len(tokens), num_samples=n,
                                      max_tokens=max_tokens)
        self._admit(who)  # the principal's quotas, last: nothing is created when they refuse
        self.rate.admit(who)
        job_key: tuple[Any, ...] = (
            weights,
            max_tokens,
            float(p.get("temperature", 1.0)),
            int(p.get("top_k", -1)),
            float(p.get("top_p", 1.0)),
            None if p.get("seed") is None else int(p["seed"]),
            token_seqs,
            n,
            bool(body.get("prompt_logprobs")),
            scoring.options,
        )
        try:
            self.ephemeral.begin(weights)  # ended in done(), whatever happens
        except FreedWeights as exc:
            raise ServiceError(str(exc), status=404) from None
        rid = self.futures.new(who)

        def done(result: dict[str, Any] | None, exc: BaseException | None) -> None:
            self._drop_weights(self.ephemeral.end(weights))
            if exc is not None:
                self.futures.resolve(rid, self._failure(exc))
                return
            assert result is not None
            seqs = result["sequences"]
            self.rate.charge(who, sum(len(s.get("tokens") or ()) for s in seqs))
            if strings:
                assert self._tok is not None
                try:
                    seqs = cut_sequences(self._tok, seqs, strings)
                except Exception as err:
                    self.futures.resolve(rid, self._failure(err))
                    return
            if recorded is not None:
                self.stability.record(rid, sampled_from(
                    owner=who, session_id=recorded, prompt=tokens, sequences=seqs))
            proto = encode_sample_with_options(seqs, result, scoring)
            self.futures.resolve(rid, Outcome(proto=proto))

        self.samples.put(SampleJob(job_key, tokens, done))
        return web.json_response(
            {"request_id": rid, "sample_sequence_ids": [f"{rid}:{i}" for i in range(n)]}
        )
