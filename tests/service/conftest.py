"""One TP=2 group (CPU, gloo, private local Ray) and one Tinker server for the module."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("TINKER_TELEMETRY", "0")

KEY = "tml-" + uuid.uuid4().hex
MODEL = {"positionEmbedding": "rope", "numQueryGroups": 2}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    ray = pytest.importorskip("ray")
    pytest.importorskip("megatron.core")
    pytest.importorskip("tinker")
    import tgapi
    from tests.trainer.scenarios import tiny_spec
    from tgruntime import TrainerClient
    from tgruntime.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
    from tgruntime.service.__main__ import group_info, serve
    from tgruntime.service.auth import KeyStore
    from tgruntime.trainer.worker import MegatronTrainer

    root = tmp_path_factory.mktemp("tinker")
    spec = tiny_spec(tp=2, checkpoint_dir=str(root / "ckpt"), **MODEL)  # type: ignore[arg-type]
    started = not ray.is_initialized()
    if started:
        ray.init(
            address="local",
            num_cpus=4,
            include_dashboard=False,
            namespace=f"tg-svc-{uuid.uuid4().hex[:8]}",
        )
    wg = WorkerGroup.create(
        group_name=f"svc-{uuid.uuid4().hex[:8]}",
        ray_namespace=ray.get_runtime_context().namespace,
        resource_pool=ResourcePool(process_on_nodes=[2], use_gpu=False, strategy="PACK"),
        cls=ClassWithInitArgs(MegatronTrainer, json.dumps(tgapi.to_wire(spec))),
        detached=False,
        pg_timeout_s=120,
        actor_timeout_s=180,
    )
    running = None
    try:
        wg.init_model()
        client = TrainerClient.connect_local(
            group_name=wg.group_name, ray_namespace=wg.ray_namespace
        )
        keys_file = root / "keys"
        keys_file.write_text(KEY + "\n")
        info = group_info("tiny", spec, eos_token_ids=(1,))
        running = serve(
            client,
            info,
            KeyStore(keys_file=str(keys_file), recheck_s=0.0),
            host="127.0.0.1",
            port=0,
        )
        yield {
            "url": running.url,
            "key": KEY,
            "keys_file": keys_file,
            "client": client,
            "spec": spec,
            "info": info,
            "root": root,
            "service": running.service,
            "base": info.base_model,
        }
    finally:
        if running is not None:
            running.stop()
        wg.teardown()
        if started:
            ray.shutdown()


def hf_dir(root: Path) -> Path:
    return root / "hf"
