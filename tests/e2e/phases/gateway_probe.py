"""The client pod of tests/e2e/phases/gateway.sh: one unmodified SDK ServiceClient at the
namespace's Tinker gateway trains GW_STUDENT (by its base model name) and samples GW_TEACHER
through the same session. Retries until the key added to both groups' Secrets is accepted
(the kubelet syncs the mounted volumes). Prints one JSON line: PROBE {...}."""

from __future__ import annotations

import json
import os
import time


def main() -> None:
    import numpy as np
    import tinker

    e = os.environ
    t = tinker.types
    out: dict[str, object] = {}
    deadline = time.monotonic() + float(e.get("GW_SECONDS", "300"))
    while True:
        try:
            with tinker.ServiceClient(base_url=e["GW_URL"], api_key=e["GW_KEY"]) as sc:
                caps = sc.get_server_capabilities()
                out["models"] = sorted(str(m.model_name) for m in caps.supported_models)
                tc = sc.create_lora_training_client(base_model=e["GW_STUDENT"], rank=8).result()
                teacher = sc.create_sampling_client(base_model=e["GW_TEACHER"]).result()
                got = teacher.sample(
                    t.ModelInput.from_ints([5, 6, 7]), num_samples=1,
                    sampling_params=t.SamplingParams(max_tokens=4, stop=[], seed=1),
                ).result()
                tokens = [5, 6, 7, *got.sequences[0].tokens]
                datum = t.Datum(
                    model_input=t.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": t.TensorData.from_numpy(np.asarray(tokens[1:], np.int64))
                    },
                )
                losses = []
                for _ in range(3):
                    fb = tc.forward_backward([datum], "cross_entropy").result()
                    tc.optim_step(t.AdamParams(learning_rate=2e-2)).result()
                    losses.append(float(fb.metrics["loss:sum"]))
                out.update(sampled=len(got.sequences[0].tokens), losses=losses, ok=True)
            break
        except tinker.AuthenticationError as exc:  # the added key not synced yet
            out["last_error"] = f"401: {exc}"[:300]
        except Exception as exc:  # reported, not raised
            out["last_error"] = f"{type(exc).__name__}: {exc}"[:300]
        if time.monotonic() > deadline:
            out["ok"] = False
            break
        time.sleep(5)
    print("PROBE " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
