"""``tgctl status``'s training progress: the record's ``training`` and its text (pure)."""

from __future__ import annotations

import json
from typing import Any

from tgapi.progress import TrainingProgress
from tgruntime.controller.registry import GroupRecord
from tgruntime.entrypoints import cli

PROGRESS = TrainingProgress(
    step=2, loss=4.81234, grad_norm=1.5, tokens_per_s=1234.4, last_step_at=1000.0
)


def _record(**changes: Any) -> GroupRecord:
    return GroupRecord(
        group_name="tiny",
        ray_namespace="tg-default-tiny",
        worker_names=("a", "b"),
        world_size=2,
        mesh={"tp": 1},
        worker_class="m.W",
        generation=1,
        created_at=1.0,
        **changes,
    )


def test_record_carries_training_and_old_records_still_load() -> None:
    record = _record(training=PROGRESS)
    data = json.loads(record.to_json())
    assert data["training"] == PROGRESS.to_wire()  # camelCase inside the snake_case record
    assert GroupRecord.from_json(record.to_json()) == record
    old = json.loads(_record().to_json())
    del old["training"]  # written before the field existed
    assert GroupRecord.from_json(json.dumps(old)).training is None
    assert json.loads(_record().to_json())["training"] is None


def test_training_status_and_its_text() -> None:
    st = cli.training_status(PROGRESS, now=1012.25)
    assert st is not None
    assert st["step"] == 2 and st["tokensPerSecond"] == 1234.4
    assert st["lastStepAgeSeconds"] == 12.25
    assert cli.describe_training(st) == (
        "step 2, loss 4.8123, 1,234 tokens/s, last step 12 s ago"
    )
    assert cli.training_status(None, now=0.0) is None
    assert cli.describe_training(None) == "no optimizer step recorded yet"
    nan = cli.training_status(TrainingProgress(step=1, loss=float("nan"), runs=3), now=0.0)
    assert cli.describe_training(nan) == (
        "step 1, loss n/a, tokens/s n/a, last step 0 s ago, 3 runs"
    )


def test_render_status_shows_training_line() -> None:
    st: dict[str, Any] = {
        "groupName": "tiny",
        "rayNamespace": "tg-default-tiny",
        "rayAddress": "127.0.0.1:6379",
        "phase": "Ready",
        "generation": 1,
        "alive": 2,
        "worldSize": 2,
        "useGpu": False,
        "device": {"device": "cpu", "backend": "gloo"},
        "training": cli.training_status(PROGRESS, now=1003.0),
        "workers": [{"rank": 0, "name": "a", "state": "ALIVE", "pid": 42, "cause": ""}],
        "dashboardUrl": "",
    }
    lines = cli.render_status(st, file="tg.yaml")
    assert lines[0].startswith("phase: Ready  (2/2 workers alive")
    assert "training: step 2, loss 4.8123, 1,234 tokens/s, last step 3 s ago" in lines
    assert lines[-1].startswith("0     ALIVE        42")
    gone = cli.render_status({**st, "phase": "NotFound"}, file="tg.yaml")
    assert gone[-1] == "Run `tgctl up -f tg.yaml` to create it."


def test_watch_option() -> None:
    parse = cli.build_parser().parse_args
    assert parse(["status", "-f", "x.yaml"]).watch is None
    assert parse(["status", "-f", "x.yaml", "--watch"]).watch == 2.0
    assert parse(["status", "-f", "x.yaml", "--watch", "0.5"]).watch == 0.5


def test_watch_reprints_when_not_a_tty_and_ctrl_c_exits_0(
    monkeypatch: Any, capsys: Any, tmp_path: Any
) -> None:
    import tgruntime.controller.gcs_view as gcs_view

    path = tmp_path / "tg.yaml"
    path.write_text("apiVersion: trainergroup.dev/v1alpha1\n")
    st = {"groupName": "tiny", "rayNamespace": "ns", "rayAddress": "h:1", "phase": "NotFound"}
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(gcs_view, "GcsView", lambda address: None)
    monkeypatch.setattr(cli, "group_status", lambda *a, **k: st)
    monkeypatch.setattr("tgruntime.entrypoints.cli.time.sleep", sleep)
    args = cli.build_parser().parse_args(["status", "-f", str(path), "--watch", "0.01"])
    assert cli._watch_status(args, None, "h:1", args.watch) == 0  # type: ignore[arg-type]
    out = capsys.readouterr().out
    assert out.count("phase: NotFound") == 2 and "\x1b[" not in out
    assert sleeps == [cli.WATCH_MIN_S] * 2  # the interval is bounded
