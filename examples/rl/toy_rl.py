"""A tiny RL loop on a verifiable toy task, driving a local trainer group through TrainerClient.

Task ("successor"): the prompt is ``[BOS, d]`` with a digit ``d``; the policy answers one
token; the reward is 1 when the answer is the digit ``(d + 1) % 10``, else 0 (16 tokens, so
a random policy scores 1/16).

Each iteration:

1. sample: ``compute_log_prob`` scores every candidate answer after each prompt (the
   trainer's own forward: rows ``[BOS, d, c]`` for all 16 ``c``), the client samples
   ``--samples`` answers per prompt from that distribution and keeps their log-probs;
2. reward each answer; advantage = reward - the mean reward of its prompt's samples;
3. ``--epochs`` times: ``forward_backward(loss="ppo")`` (or ``importance_sampling``) with
   the answers, the sampler's log-probs and the advantages (only the answer token has loss
   weight), then ``optim_step``. The first update is on-policy (ratio 1: the surrogate loss
   is 0 by construction with a mean baseline); the plotted loss is the last update's, whose
   ratio has moved (negative: the update improved the surrogate).

At the end the policy is exported with ``export_hf`` and answered greedily by
``transformers``' ``LlamaForCausalLM`` on the CPU: the exported weights solve the task too.
Outputs (``--out``): ``metrics.json`` (per iteration and a summary) and ``reward.png``.
Exit status 1 when the reward did not rise (``--check``, on by default).

    .venv/bin/python examples/rl/toy_rl.py   # 50 iterations: ~30 s of loop, plus Ray start-up
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch

import tgapi
from tgruntime import TrainerClient
from tgruntime.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
from tgruntime.trainer.worker import MegatronTrainer

VOCAB, BOS, DIGITS = 16, 10, 10
HERE = Path(__file__).resolve().parent


def spec(*, tp: int, lr: float) -> tgapi.TrainerGroupSpec:
    return tgapi.parse_spec(
        {
            "workers": {"useGpu": False, "processesPerNode": [tp]},
            "parallelism": {"tensor": tp},
            "model": {
                "vocabSize": VOCAB,
                "hiddenSize": 32,
                "numLayers": 2,
                "numAttentionHeads": 4,
                "numQueryGroups": 2,
                "ffnHiddenSize": 64,
                "maxSequenceLength": 8,
                "positionEmbedding": "rope",  # a Hugging Face Llama uses RoPE
                "seed": 3,
            },
            "optimizer": {"lr": lr, "clipGrad": 1.0, "weightDecay": 0.0},
            "training": {"batchSize": 64, "sequenceLength": 3},
        },
        local=True,
    )


def reward(prompt_digit: torch.Tensor, answer: torch.Tensor) -> torch.Tensor:
    return (answer == (prompt_digit + 1) % DIGITS).float()


def answer_distribution(client: TrainerClient, digits: torch.Tensor) -> torch.Tensor:
    """``[P, VOCAB]`` probabilities of each answer token after each prompt ``[BOS, d]``."""
    p = digits.shape[0]
    rows = torch.stack(
        [
            torch.full((p, VOCAB), BOS),
            digits[:, None].expand(p, VOCAB),
            torch.arange(VOCAB).expand(p, VOCAB),
        ],
        dim=-1,
    ).reshape(p * VOCAB, 3)
    out = client.compute_log_prob({"input_ids": rows}).result(timeout=300)
    log_probs: torch.Tensor = out.batch["log_probs"][:, 1]  # column 1: token 2 (the answer)
    return log_probs.reshape(p, VOCAB).exp()


def iteration(
    client: TrainerClient,
    *,
    prompts: int,
    samples: int,
    epochs: int,
    loss: str,
    gen: torch.Generator,
) -> dict[str, float]:
    start = time.perf_counter()
    digits = torch.randint(0, DIGITS, (prompts,), generator=gen)
    probs = answer_distribution(client, digits)
    answers = torch.multinomial(probs, samples, replacement=True, generator=gen)  # [P, G]
    old_log_probs = probs.gather(1, answers).log()
    rewards = reward(digits[:, None], answers)  # [P, G]
    advantages = rewards - rewards.mean(dim=1, keepdim=True)  # group baseline
    n = prompts * samples
    input_ids = torch.stack(
        [torch.full((n,), BOS), digits.repeat_interleave(samples), answers.reshape(n)], dim=-1
    )
    per_token = torch.zeros((n, 2))  # [B, S-1]: column 1 is the answer token
    mask, adv, old = per_token.clone(), per_token.clone(), per_token.clone()
    mask[:, 1] = 1.0
    adv[:, 1] = advantages.reshape(n)
    old[:, 1] = old_log_probs.reshape(n)
    batch = {"input_ids": input_ids, "loss_mask": mask, "advantages": adv, "old_log_probs": old}
    losses = []
    for _ in range(epochs):  # epoch 1 is on-policy (surrogate 0); later ones are off-policy
        fb = client.forward_backward(batch, loss=loss, loss_config={"clip_eps": 0.2})
        step = client.optim_step()  # queued behind forward_backward
        losses.append(float(fb.result(timeout=300).meta_info["loss"]))
        stepped = step.result(timeout=300)
    entropy = -(probs * probs.clamp_min(1e-12).log()).sum(dim=1).mean()
    return {
        "reward": float(rewards.mean()),
        "loss": losses[-1],  # the last update's surrogate loss
        "entropy": float(entropy),
        "p_correct": float(probs.gather(1, ((digits + 1) % DIGITS)[:, None]).mean()),
        "grad_norm": float(stepped["grad_norm"]),
        "seconds": time.perf_counter() - start,
    }


def greedy_accuracy_in_transformers(path: Path) -> float:
    """Answer every digit greedily with the exported weights in LlamaForCausalLM (CPU)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path)
    model.eval()  # type: ignore[no-untyped-call]
    digits = torch.arange(DIGITS)
    prompts = torch.stack([torch.full((DIGITS,), BOS), digits], dim=-1)
    with torch.no_grad():
        answers = model(input_ids=prompts).logits[:, -1].argmax(dim=-1)
    return float(reward(digits, answers).mean())


def plot(history: list[dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(range(1, len(history) + 1))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6, 4.5), sharex=True, dpi=80)
    top.plot(steps, [h["reward"] for h in history], label="mean reward")
    top.plot(steps, [h["p_correct"] for h in history], "--", label="p(correct answer)")
    top.axhline(1 / VOCAB, color="grey", lw=0.8, ls=":", label="random policy")
    top.set_ylim(0, 1.05)
    top.set_ylabel("reward")
    top.legend(loc="lower right", fontsize=8)
    bottom.plot(steps, [h["loss"] for h in history], color="tab:red", label="loss")
    bottom.plot(steps, [h["entropy"] for h in history], color="tab:green", label="entropy (nats)")
    bottom.set_xlabel("iteration")
    bottom.legend(loc="upper right", fontsize=8)
    fig.suptitle(
        "toy RL (successor digit): TrainerClient, forward_backward + optim_step", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def start_private_ray(namespace: str, *, num_cpus: int) -> None:
    """A local Ray of this process's own, tried twice: Ray gives its raylet 30 s to register,
    and a loaded machine can miss it."""
    import ray

    for attempt in (1, 2):
        try:
            ray.init(
                address="local",
                num_cpus=num_cpus,
                include_dashboard=False,
                namespace=namespace,
                log_to_driver=False,
            )
            return
        except Exception:
            ray.shutdown()
            if attempt == 2:
                raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument("--prompts", type=int, default=64, help="prompts per iteration")
    parser.add_argument("--samples", type=int, default=8, help="answers sampled per prompt")
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--epochs", type=int, default=2, help="updates per sampled batch")
    parser.add_argument("--loss", choices=("ppo", "importance_sampling"), default="ppo")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel workers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--address",
        default=None,
        help="GCS host:port of a running Ray cluster to use (default: a private local one)",
    )
    parser.add_argument("--out", type=Path, default=HERE, help="where the outputs go")
    parser.add_argument(
        "--no-check",
        dest="check",
        action="store_false",
        help="do not fail when the reward did not rise",
    )
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    import ray

    namespace = f"tg-rl-{uuid.uuid4().hex[:8]}"
    if args.address:
        from tgruntime.controller.connect import connect

        connect(args.address, ray_namespace=namespace)
    else:
        start_private_ray(namespace, num_cpus=max(2, args.tp))
    wg = WorkerGroup.create(
        group_name=f"rl-{uuid.uuid4().hex[:8]}",
        ray_namespace=ray.get_runtime_context().namespace,
        resource_pool=ResourcePool(process_on_nodes=[args.tp], use_gpu=False, strategy="PACK"),
        cls=ClassWithInitArgs(
            MegatronTrainer, json.dumps(tgapi.to_wire(spec(tp=args.tp, lr=args.lr)))
        ),
        detached=False,
        pg_timeout_s=120,
        actor_timeout_s=180,
    )
    try:
        wg.init_model()
        client = TrainerClient(wg)
        gen = torch.Generator().manual_seed(args.seed)
        history: list[dict[str, float]] = []
        for i in range(args.iterations):
            history.append(
                iteration(
                    client,
                    prompts=args.prompts,
                    samples=args.samples,
                    epochs=args.epochs,
                    loss=args.loss,
                    gen=gen,
                )
            )
            h = history[-1]
            print(
                f"iter {i + 1:3d}  reward {h['reward']:.3f}  p_correct {h['p_correct']:.3f}  "
                f"loss {h['loss']:+.4f}  entropy {h['entropy']:.3f}"
            )
        with tempfile.TemporaryDirectory(prefix="tg-rl-hf-") as hf_dir:
            export = client.export_hf(hf_dir).result(timeout=300)
            accuracy = greedy_accuracy_in_transformers(Path(hf_dir))
    finally:
        wg.teardown()
        ray.shutdown()
    k = max(1, min(5, len(history) // 2))
    first = sum(h["reward"] for h in history[:k]) / k
    last = sum(h["reward"] for h in history[-k:]) / k
    rose = last > first + 0.3
    summary: dict[str, Any] = {
        "iterations": len(history),
        "prompts": args.prompts,
        "samples": args.samples,
        "lr": args.lr,
        "loss": args.loss,
        "epochs": args.epochs,
        "tp": args.tp,
        f"reward_first_{k}": first,
        f"reward_last_{k}": last,
        "reward_rose": rose,
        "transformers_greedy_accuracy": accuracy,
        "export_hf_seconds": export["seconds"],
        "loop_seconds": sum(h["seconds"] for h in history),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "metrics.json").write_text(
        json.dumps({"summary": summary, "history": history}, indent=1) + "\n"
    )
    plot(history, args.out / "reward.png")
    print(
        f"reward {first:.3f} (first {k}) -> {last:.3f} (last {k}); exported policy, greedy in "
        f"transformers: {accuracy:.0%} correct; export_hf {export['seconds'] * 1e3:.0f} ms; "
        f"wrote {args.out / 'metrics.json'} and {args.out / 'reward.png'}"
    )
    if args.check and not rose:
        print("the reward did not rise by 0.3", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
