"""tinker-cookbook 0.6.1's on-policy distillation, as SDK calls, with the teacher on a second
group behind the gateway.

0.6.1 does not install here (it needs ``tml-renderers>=0.4.1``, which this index does not
serve), so this test makes the calls its ``distillation/train_on_policy.py`` ``main`` and
``do_sync_training`` make (with ``rl/train.py``'s ``train_step`` and
``save_checkpoint_and_get_sampling_client``, ``rl/data_processing.py``'s
``assemble_training_data`` and ``completers.py``'s ``TinkerTokenCompleter``), read from the
0.6.1 wheel, through one ``ServiceClient`` pointed at the gateway (the package's ``gateway``
fixture: ``org/student`` and ``org/teacher`` on two servers):

- the student from the recipe's ``load_checkpoint_path``:
  ``create_training_client_from_state(path, user_metadata)``; the teacher's
  ``create_sampling_client(base_model="org/teacher")`` (no teacher checkpoint);
- the first sampling client from ``save_weights_and_get_sampling_client()``; each batch, every
  prompt's group of rollouts, one ``sample(prompt, num_samples=1, SamplingParams(max_tokens,
  temperature=1.0, stop))`` each, all sent before any is read; the env's reward is 0, so the
  centred advantages are 0; datums as ``assemble_training_data`` makes them (the whole
  sequence shifted by one, sampled log-probs and ``mask`` on the sampled tokens, provenance
  spans from each sequence's ``sequence_id``);
- ``incorporate_kl_penalty``: the teacher's ``compute_logprobs`` of every datum's full
  sequence (all sent, then read), reverse KL ``(student logprob - teacher logprob[1:]) *
  mask``, advantages ``-= kl_penalty_coef * KL``; the mask dropped; ``forward_backward(...,
  "importance_sampling")`` and ``optim_step(AdamParams(lr, 0.9, 0.95, 1e-8))`` sent together;
  then ``save_weights_and_get_sampling_client()`` for the next batch; at the end
  ``save_state`` and ``save_weights_for_sampler`` (``save_final_async``, kind both).

The student's starting state (a setup step in its own session, not the recipe: a few
cross-entropy steps towards answering ``[10, 11]``, saved on the student's server) differs from
the teacher, the base model of the other server. Asserted: the recipe's ``teacher_kl`` (mean
reverse KL per sampled token, the student's samples scored by the teacher) falls below half its
first value (8 batches: 3.23, 1.93, then 0.03 to 0.28; other runs alike); the student's run
is on the student's server, the teacher's sampler on the teacher's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from tests.service.conftest import KA
from tests.service.test_sdk_flow import WAIT

pytestmark = [pytest.mark.ray, pytest.mark.megatron]

tinker = pytest.importorskip("tinker")
torch = pytest.importorskip("torch")
T = tinker.types

ANSWER, SETUP_STEPS, SETUP_LR = [10, 11], 4, 2e-2
GROUPS, GROUP_SIZE, MAX_TOKENS, LR, STEPS, KL_COEF = 2, 4, 2, 2e-2, 8, 1.0


def _student_checkpoint(url: str) -> str:
    """Setup, not the recipe: the student's ``load_checkpoint_path``, a state unlike the
    teacher (a few cross-entropy steps towards answering ``[10, 11]``), saved on the student's
    server in its own session (finished before the recipe's run takes the group)."""
    data = []
    for d in range(10):
        toks = [2, d, *ANSWER]
        data.append(T.Datum(
            model_input=T.ModelInput.from_ints(toks[:-1]),
            loss_fn_inputs={"target_tokens": np.asarray(toks[1:], np.int64),
                            "weights": np.asarray([0.0, 1.0, 1.0], np.float32)}))
    with tinker.ServiceClient(base_url=url, api_key=KA) as sc:
        tc = sc.create_lora_training_client(base_model="org/student", rank=4).result()
        for _ in range(SETUP_STEPS):
            tc.forward_backward(data, "cross_entropy").result(timeout=WAIT)
            tc.optim_step(T.AdamParams(learning_rate=SETUP_LR)).result(timeout=WAIT)
        return str(tc.save_state("sft").result(timeout=WAIT).path)


def _datum(prompt: list[int], seq: Any) -> Any:
    """``assemble_training_data``'s datum of one single-turn rollout (reward 0, advantage 0)."""
    from tinker.types.tensor_data import TensorData

    toks, sid, n = list(seq.tokens), seq.sequence_id, len(prompt)
    full = prompt + toks
    lp = [0.0] * (n - 1) + list(seq.logprobs)
    mask = [0.0] * (n - 1) + [1.0] * len(toks)
    datum = T.Datum(
        model_input=T.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={
            "target_tokens": TensorData.from_torch(torch.tensor(full[1:])),
            "logprobs": TensorData.from_torch(torch.tensor(lp)),
            "advantages": TensorData.from_torch(torch.zeros(len(full) - 1)),
            "mask": TensorData.from_torch(torch.tensor(mask)),
        },
    )
    return datum.with_provenance(
        model_input=[T.PromptProvenanceSpan(sequence_id=sid, length=n),
                     T.SampledProvenanceSpan(sequence_id=sid, length=len(toks) - 1)],
        loss_fn_inputs=[T.PromptProvenanceSpan(sequence_id=sid, offset=1, length=n - 1),
                        T.SampledProvenanceSpan(sequence_id=sid, length=len(toks))],
    )


def _incorporate_kl_penalty(data: list[Any], teacher: Any) -> float:
    """The recipe's ``incorporate_kl_penalty`` (one teacher, no discount): advantages -= coef *
    reverse KL per token, in place; returns its ``teacher_kl`` metric."""
    from tinker.types.tensor_data import TensorData

    full = [d.model_input.append_int(int(d.loss_fn_inputs["target_tokens"].data[-1]))
            for d in data]
    futures = [teacher.compute_logprobs(x) for x in full]
    teacher_lp = [f.result(timeout=WAIT) for f in futures]
    kl_sum = mask_sum = 0.0
    for datum, tlp in zip(data, teacher_lp, strict=True):
        mask = datum.loss_fn_inputs["mask"].to_torch().float()
        sampled = datum.loss_fn_inputs["logprobs"].to_torch()
        kl = (sampled - torch.tensor([x or 0.0 for x in tlp[1:]])) * mask
        datum.loss_fn_inputs["advantages"] = TensorData.from_torch(
            datum.loss_fn_inputs["advantages"].to_torch() - KL_COEF * mask * kl)
        kl_sum += float(kl.sum())
        mask_sum += float(mask.sum())
    return kl_sum / mask_sum


def test_on_policy_distillation_student_kl_to_teacher_falls(gateway: dict[str, Any]) -> None:
    url = gateway["gw"].url
    student_srv, teacher_srv = (gateway["servers"][n].service for n in ("student", "teacher"))
    start = _student_checkpoint(url)
    rng = np.random.default_rng(3)
    kls: list[float] = []
    with tinker.ServiceClient(base_url=url, api_key=KA,
                              user_metadata={"recipe": "on_policy_distillation"}) as sc:
        tc = sc.create_training_client_from_state(
            start, user_metadata={"renderer_name": "role_colon"}).result()
        teacher = sc.create_sampling_client(base_model="org/teacher").result()
        adam = T.AdamParams(learning_rate=LR, beta1=0.9, beta2=0.95, eps=1e-8)
        params = T.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, stop=[])
        sampler = tc.save_weights_and_get_sampling_client().result()
        for _ in range(STEPS):
            prompts = [[2, int(d)] for d in rng.integers(0, 10, size=GROUPS)]
            sent = [(p, sampler.sample(T.ModelInput.from_ints(p), num_samples=1,
                                       sampling_params=params))
                    for p in prompts for _ in range(GROUP_SIZE)]
            data = [_datum(p, f.result(timeout=WAIT).sequences[0]) for p, f in sent]
            kls.append(_incorporate_kl_penalty(data, teacher))
            data = [dataclasses.replace(d, loss_fn_inputs={
                k: v for k, v in d.loss_fn_inputs.items() if k != "mask"}) for d in data]
            fb = tc.forward_backward(data, loss_fn="importance_sampling")
            opt = tc.optim_step(adam)
            fb.result(timeout=WAIT)
            opt.result(timeout=WAIT)
            sampler = tc.save_weights_and_get_sampling_client().result()
        assert tc.save_state("final").result(timeout=WAIT).path
        assert tc.save_weights_for_sampler("final").result(timeout=WAIT).path

        sid = tc.model_id.split(":train:")[0]
        assert tc.model_id in student_srv.registry.models
        assert tc.model_id not in teacher_srv.registry.models
        assert len([s for s in teacher_srv.registry.samplers.values()
                    if s.session_id == sid]) == 1
    print(f"distillation teacher_kl {[round(x, 3) for x in kls]}")
    assert np.mean(kls[-2:]) < 0.5 * np.mean(kls[:2]), kls
