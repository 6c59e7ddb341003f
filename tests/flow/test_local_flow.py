"""The seed's flow on a real local Ray with real megatron-core on CPU (gloo).

`tgctl up` (a server process creates the detached TP=2 group and exits) -> a different client
process attaches by group name and trains -> teardown leaves nothing in the Ray namespace. Plus
checkpoint resume across group generations, and clear errors for bad inputs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.fixtures_ray import REPO_ROOT, RayCluster

pytestmark = [pytest.mark.ray, pytest.mark.megatron]

TINY = REPO_ROOT / "examples/local/tiny-cpu.yaml"
SERVER = "tgruntime.entrypoints.server"
TEARDOWN = "tgruntime.entrypoints.teardown"


def write_spec(
    tmp_path: Path, *, name: str | None = None, **overrides: Any
) -> tuple[Path, dict[str, Any]]:
    """The tiny CPU example with a unique name and Ray namespace, plus spec overrides."""
    doc = yaml.safe_load(TINY.read_text())
    doc["metadata"]["name"] = name or f"t{uuid.uuid4().hex[:8]}"
    spec = doc["spec"]
    spec["workers"]["rayNamespace"] = f"ns-{doc['metadata']['name']}"
    for dotted, value in overrides.items():
        node = spec
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    path = tmp_path / f"{doc['metadata']['name']}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path, doc


def run(
    cluster: RayCluster, *args: str, timeout: float = 600, check: bool = True
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=REPO_ROOT,
        env=cluster.env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{args} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return proc


def tagged(tag: str, text: str) -> list[Any]:
    """The JSON after each "TAG " line (an object for most tags; LAST's is a list per rank)."""
    return [
        json.loads(line[len(tag) + 1 :]) for line in text.splitlines() if line.startswith(tag + " ")
    ]


def leftovers(cluster: RayCluster, namespace: str) -> dict[str, Any]:
    """Live actors and non-removed placement groups of a namespace, read from another process."""
    out = cluster.run_python(f"""
        import json, ray
        from ray.util.state import list_actors, list_placement_groups
        from tgruntime.controller.connect import connect
        connect(ray_namespace="probe")
        mine = [("ray_namespace", "=", {namespace!r})]
        actors = [a.name for a in list_actors(filters=mine, limit=1000) if a.state != "DEAD"]
        pgs = [p.name for p in list_placement_groups(limit=1000)
               if p.state != "REMOVED" and {namespace!r} in (p.name or "")]
        print("LEFT " + json.dumps({{"actors": actors, "pgs": pgs}}))
    """)
    left: dict[str, Any] = tagged("LEFT", out)[-1]
    return left


def last_steps(cluster: RayCluster, group: str, namespace: str) -> list[dict[str, Any]]:
    out = cluster.run_python(f"""
        import json
        from tgruntime.controller import WorkerGroup
        from tgruntime.controller.connect import connect
        connect(ray_namespace={namespace!r})
        wg = WorkerGroup.attach(group_name={group!r}, ray_namespace={namespace!r})
        print("LAST " + json.dumps(wg.last_step()))
    """)
    ranks: list[dict[str, Any]] = tagged("LAST", out)[-1]
    return ranks


@pytest.mark.flow
def test_up_attach_train_checkpoint_resume_in_a_new_generation_and_tear_down(
    ray_cluster: RayCluster, tmp_path: Path
) -> None:
    """`tgctl up` (its server process creates the detached TP=2 group and exits) -> status ->
    a different OS process, knowing only the group's name and namespace, attaches and trains
    -> `tgctl train` -> a checkpoint -> teardown's report -> generation 1 (new workers, new
    names) resumes from the checkpoint -> `tgctl down` -> nothing left; a second teardown finds
    nothing. One group generation pair for what were two flows (up/attach/train/down and
    checkpoint resume across generations): each started its own group, and a group is two
    Megatron processes (~14 CPU s of imports each) plus the client and server processes.
    """
    ckpt = tmp_path / "ckpt"
    path, doc = write_spec(tmp_path, **{"training.checkpointDir": str(ckpt)})
    name, ns = doc["metadata"]["name"], doc["spec"]["workers"]["rayNamespace"]
    addr = ["--address", ray_cluster.gcs_address]
    names = [f"{name}MegatronTrainer_0:0", f"{name}MegatronTrainer_0:1"]

    up = run(ray_cluster, "-m", "tgruntime.entrypoints.cli", "up", "-f", str(path), *addr)
    assert "rank 1:" in up.stdout
    assert "device: cpu (gloo, float32); workers.useGpu resolved to false" in up.stdout
    cli = ["-m", "tgruntime.entrypoints.cli"]
    status = run(ray_cluster, *cli, "status", "-f", str(path), *addr)
    assert "phase: Ready" in status.stdout and "2/2 workers alive" in status.stdout
    assert "device: cpu (gloo, float32)" in status.stdout
    st = json.loads(run(ray_cluster, *cli, "status", "-f", str(path), "--json", *addr).stdout)
    assert [w["name"] for w in st["workers"]] == names
    assert st["mesh"] == {"tp": 2, "pp": 1, "cp": 1, "dp": 1} and st["rayNamespace"] == ns

    # The spec's batch shape and seed, given as flags: this client knows no spec file.
    client = run(
        ray_cluster,
        "-m",
        "tgruntime.entrypoints.client_job",
        "--group",
        name,
        "--ray-namespace",
        ns,
        "--vocab-size",
        "128",
        "--batch-size",
        "8",
        "--seq-len",
        "32",
        "--steps",
        "5",
        "--no-progress",
    )
    before = [s["loss"] for s in tagged("TG_STEP", client.stdout)]
    assert len(before) == 5
    assert before[-1] < before[0], before

    ranks = last_steps(ray_cluster, name, ns)
    assert [r["tp_rank"] for r in ranks] == [0, 1]
    assert ranks[0]["loss"] == pytest.approx(ranks[1]["loss"], rel=1e-6), ranks
    assert ranks[0]["loss"] == pytest.approx(before[-1], rel=1e-5)

    train = run(ray_cluster, *cli, "train", "-f", str(path), "--steps", "2", "--json", *addr)
    assert len(tagged("TG_STEP", train.stdout)) == 2

    ray_cluster.run_python(f"""
        from tgruntime.controller import WorkerGroup
        from tgruntime.controller.connect import connect
        connect(ray_namespace={ns!r})
        print(WorkerGroup.attach(group_name={name!r}, ray_namespace={ns!r}).save_checkpoint())
    """)
    one_step = ["-m", "tgruntime.entrypoints.client_job", "-f", str(path), "--no-progress"]
    (continued,) = [
        s["loss"] for s in tagged("TG_STEP", run(ray_cluster, *one_step, "--steps", "1").stdout)
    ]

    down = run(ray_cluster, "-m", TEARDOWN, "--group", name, "--ray-namespace", ns)
    (report,) = tagged("TG_TEARDOWN", down.stdout)
    assert sorted(report["actorsKilled"]) == sorted(names)
    assert leftovers(ray_cluster, ns) == {"actors": [], "pgs": []}

    # Generation 1: new workers, new names; init_model loads the newest checkpoint.
    server = run(ray_cluster, "-m", SERVER, "-f", str(path), "--generation", "1")
    (ready,) = tagged("TG_GROUP_READY", server.stdout)
    assert ready["generation"] == 1
    g1 = [f"{name}-g1-MegatronTrainer_0:0", f"{name}-g1-MegatronTrainer_0:1"]
    assert ready["workerNames"] == g1
    (resumed,) = [
        s["loss"] for s in tagged("TG_STEP", run(ray_cluster, *one_step, "--steps", "1").stdout)
    ]

    gone = json.loads(run(ray_cluster, *cli, "down", "-f", str(path), "--json", *addr).stdout)
    assert sorted(gone["teardown"]["actorsKilled"]) == sorted(g1), gone
    assert leftovers(ray_cluster, ns) == {"actors": [], "pgs": []}
    # Idempotent: a second teardown finds nothing and still succeeds.
    again = run(ray_cluster, "-m", TEARDOWN, "--group", name, "--ray-namespace", ns)
    (report,) = tagged("TG_TEARDOWN", again.stdout)
    assert report["actorsKilled"] == [], report

    assert before[-1] > continued  # still learning the memorised batch
    # The re-created group's next step is the step the old group took after the checkpoint,
    # not a step from a fresh initialisation (which would repeat before[0]).
    assert resumed == pytest.approx(continued, rel=1e-4), (before, continued, resumed)
    assert abs(resumed - before[0]) > 1e-3


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"workers.processesPerNode": [3]}, "spec.parallelism"),
        ({"model.numAttentionHeads": 3, "model.hiddenSize": 63}, "spec.model.numAttentionHeads"),
        ({"model.vocabSize": 127}, "spec.model.vocabSize"),
        ({"model.dtype": "bf16"}, "spec.model.dtype"),
    ],
)
def test_bad_specs_fail_clearly_and_create_nothing(
    ray_cluster: RayCluster, tmp_path: Path, overrides: dict[str, Any], field: str
) -> None:
    path, doc = write_spec(tmp_path, **overrides)
    proc = run(
        ray_cluster,
        "-m",
        "tgruntime.entrypoints.cli",
        "up",
        "-f",
        str(path),
        "--address",
        ray_cluster.gcs_address,
        check=False,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert field in proc.stderr and "Fix:" in proc.stderr
    assert leftovers(ray_cluster, doc["spec"]["workers"]["rayNamespace"]) == {
        "actors": [],
        "pgs": [],
    }


def test_bad_yaml_names_the_line(ray_cluster: RayCluster, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "apiVersion: trainergroup.io/v1alpha1\nkind: TrainerGroup\nspec:\n  model: {vocabSize: 1\n"
    )
    proc = run(
        ray_cluster,
        "-m",
        "tgruntime.entrypoints.cli",
        "up",
        "-f",
        str(bad),
        "--address",
        ray_cluster.gcs_address,
        check=False,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "not valid YAML at line" in proc.stderr


def test_unsatisfiable_placement_fails_at_once_and_cleans_up(
    ray_cluster: RayCluster, tmp_path: Path
) -> None:
    # GPU workers on a cluster without GPUs: refused before any wait (the spec's 600 s).
    path, doc = write_spec(
        tmp_path, **dict[str, Any]({"workers.useGpu": True, "timeouts.workersReadySeconds": 600})
    )
    proc = run(ray_cluster, "-m", SERVER, "-f", str(path), check=False, timeout=180)
    assert proc.returncode == 1
    (failed,) = tagged("TG_GROUP_FAILED", proc.stdout)
    assert failed["kind"] == "PlacementInfeasibleError", failed
    assert "asked 2 bundles of {CPU=0.5, GPU=1}" in failed["error"], failed
    assert "GPU=0}" in failed["error"] and "workers.useGpu: false" in failed["error"]
    assert leftovers(ray_cluster, doc["spec"]["workers"]["rayNamespace"]) == {
        "actors": [],
        "pgs": [],
    }


def test_missing_group_is_a_clear_error(ray_cluster: RayCluster, tmp_path: Path) -> None:
    proc = run(
        ray_cluster,
        "-m",
        "tgruntime.entrypoints.client_job",
        "--group",
        "nope",
        "--ray-namespace",
        "ns-nope",
        "--vocab-size",
        "8",
        "--batch-size",
        "2",
        "--seq-len",
        "4",
        "--attach-timeout",
        "2",
        check=False,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "nope" in proc.stderr and "ns-nope" in proc.stderr
    path, _ = write_spec(tmp_path, name="absent")
    status = run(
        ray_cluster,
        "-m",
        "tgruntime.entrypoints.cli",
        "status",
        "-f",
        str(path),
        "--address",
        ray_cluster.gcs_address,
        check=False,
        timeout=120,
    )
    assert status.returncode == 1
    assert "NotFound" in status.stdout and "tgctl up" in status.stdout
