"""``tg-client`` at a fixed rate: optimizer steps at ``--rate`` per second for ``--duration`` s.

    .venv/bin/python bench/throttled_client.py --trainergroup NAME --k8s-namespace NS \
        --kubeconfig PATH --rate 3 --duration 120

The options are tg-client's (``tgruntime.entrypoints.client_job``; ``--steps`` is ignored)
plus ``--rate`` and ``--duration``. It attaches as tg-client does, then sends one batch per
step through ``train_model``, sleeping so that step k starts at ``start + k / rate`` (a step
slower than ``1 / rate`` is not made up for). Prints ``TG_BENCH_START {json}`` before the
first step and ``TG_BENCH_DONE {json}`` (steps, achieved rate, step times, losses) at the
end; bench/bench_operator.py ``--status-writes`` reads both.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

from tgruntime.controller.connect import connect
from tgruntime.controller.gcs_view import use_light_handles
from tgruntime.entrypoints import client_job


def main(argv: list[str] | None = None) -> int:
    p = client_job.build_parser()
    p.add_argument("--rate", type=float, default=3.0, help="optimizer steps per second")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of training")
    args = p.parse_args(argv)
    target = client_job.resolve_target(args)
    connect(address=target.address, ray_namespace=target.ray_namespace)
    use_light_handles()
    wg = client_job.attach(target, timeout_s=args.attach_timeout)
    stream = client_job.batch_stream(args, target.spec)
    period = 1.0 / args.rate
    walls: list[float] = []
    losses: list[float] = []
    start_wall, start = time.time(), time.monotonic()
    print("TG_BENCH_START " + json.dumps({"time": start_wall}), flush=True)
    step = 0
    while time.monotonic() - start < args.duration:
        step += 1
        report = client_job.train_step(wg, next(stream), step=step)
        walls.append(report.step_time_s)
        losses.append(report.loss)
        delay = start + step * period - time.monotonic()
        if delay > 0:
            time.sleep(delay)
    elapsed = time.monotonic() - start
    done = {
        "time": time.time(),
        "steps": step,
        "seconds": round(elapsed, 2),
        "steps_per_s": round(step / elapsed, 3),
        "step_wall_s_mean": round(statistics.fmean(walls), 4),
        "step_wall_s_max": round(max(walls), 4),
        "loss_first": round(losses[0], 4),
        "loss_last": round(losses[-1], 4),
    }
    print("TG_BENCH_DONE " + json.dumps(done), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
