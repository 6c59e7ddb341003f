"""One TP=2 group (CPU, gloo, on the session's Ray head) and one Tinker server for all of
tests/service.

Session-scoped: one group start-up for the whole directory; every test finishes its SDK
sessions (``with ServiceClient``), so the next one may start its own training run."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures_ray import RayCluster, init_private_ray

os.environ.setdefault("TINKER_TELEMETRY", "0")

KEY = "tml-" + uuid.uuid4().hex
# the gateway's two principals (a key each, valid on both of its servers)
KA, KB = ("tml-" + uuid.uuid4().hex for _ in range(2))
MODEL = {"positionEmbedding": "rope", "numQueryGroups": 2, "maxSequenceLength": 128}
# the sampler-weights budget of the package's group: 11 copies of its weights per rank, so that
# a test of named saves sees the cache evict (test_sampler_memory.py)
WEIGHTS_MEMORY = "2Mi"


# package scope: torn down after tests/service, so its 2 CPUs are free for later groups
@pytest.fixture(scope="package")
def service_driver(ray_cluster: RayCluster) -> Iterator[RayCluster]:
    """This process as a driver of the session's Ray head for the whole package (as
    ``ray_driver`` does per module), instead of a private local Ray: one Ray start less."""
    ray = pytest.importorskip("ray")
    from tgruntime.controller.connect import connect

    connect(ray_cluster.gcs_address, ray_namespace="tgtests")
    try:
        yield ray_cluster
    finally:
        if ray.is_initialized():
            ray.shutdown()


@pytest.fixture(scope="package")
def served(
    service_driver: RayCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    from tests.trainer.scenarios import tiny_spec

    root = tmp_path_factory.mktemp("tinker")
    spec = tiny_spec(
        tp=2,
        checkpoint_dir=str(root / "ckpt"),
        training={"samplerWeightsMemory": WEIGHTS_MEMORY},
        **MODEL,  # type: ignore[arg-type]
    )
    with serving(spec, root, prefix="svc") as s:
        yield s


@pytest.fixture(scope="package")
def gateway(
    served: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """Two Tinker servers over the package's group serving ``org/student`` and ``org/teacher``
    (own registries and checkpoint dirs, both starting from the group's base weights;
    principals alice (KA) and bob (KB)) behind one gateway:
    the routing is what tests exercise, and a second group would double their CPU. Shared by
    the package's gateway tests (test_gateway_sdk, test_cookbook_distillation); a test that
    restarts the gateway puts the new one in ``["gw"]``."""
    from tgruntime.service.__main__ import build_service
    from tgruntime.service.auth import KeyStore

    root = tmp_path_factory.mktemp("gateway")
    keys = root / "keys"
    keys.write_text(f"alice {KA}\nbob {KB}\n")

    # the package server's copy of the group's base weights: a server's start-up saves the
    # group's weights as they are, and earlier tests' runs leave theirs in the shared group
    base = Path(served["service"].base_state).parent

    def make(name: str) -> Any:
        info = dataclasses.replace(
            served["info"], base_model=f"org/{name}", aliases=(),
            checkpoint_dir=str(root / name),
        )
        shutil.copytree(base, root / name / "tinker" / base.name)
        return build_service(served["client"], info, KeyStore(keys_file=str(keys)))

    with gateway_over(make, ("student", "teacher")) as state:
        yield state


@contextlib.contextmanager
def gateway_over(
    make: Callable[[str], Any], names: Iterable[str], *, extra: Iterable[str] = (),
    **gateway_kw: Any,
) -> Iterator[dict[str, Any]]:
    """A Tinker server on a free port for each name (its service from ``make(name)``) and a
    gateway over them (and the ``extra`` ``name=url`` groups). Yields ``{"gw", "start",
    "servers"}``: ``start(port)`` starts another gateway over the same groups (a restart on the
    same port); whichever is in ``["gw"]`` at the end is stopped, then the servers."""
    from tgruntime.gateway.__main__ import Running as GatewayRunning
    from tgruntime.gateway.app import Gateway
    from tgruntime.gateway.groups import GroupSource, from_flags
    from tgruntime.service.__main__ import Running

    servers: dict[str, Any] = {}
    try:
        for name in names:
            servers[name] = Running(make(name), "127.0.0.1", 0).start(60)
        flags = [f"{n}={r.url}" for n, r in servers.items()] + list(extra)
        source = GroupSource(fixed=from_flags(flags))

        def start(port: int = 0) -> Any:
            return GatewayRunning(Gateway(source=source, **gateway_kw), host="127.0.0.1",
                                  port=port).start()

        state = {"gw": start(), "start": start, "servers": servers}
        try:
            yield state
        finally:
            state["gw"].stop()
    finally:
        for r in servers.values():
            r.stop()


@contextlib.contextmanager
def serving(spec: Any, root: Path, *, prefix: str) -> Iterator[dict[str, Any]]:
    """A TP=2 group of ``spec`` (CPU, gloo; on the Ray this process is connected to, else a
    private local one) and a Tinker server over it on a free port."""
    ray = pytest.importorskip("ray")
    pytest.importorskip("megatron.core")
    pytest.importorskip("tinker")
    from tests.trainer.groups import trainer_group
    from tgruntime import TrainerClient
    from tgruntime.service.__main__ import group_info, serve
    from tgruntime.service.auth import KeyStore

    started = not ray.is_initialized()
    if started:
        init_private_ray(namespace=f"tg-svc-{uuid.uuid4().hex[:8]}")
    wg = trainer_group(spec, prefix=prefix)
    running = None
    try:
        wg.init_model()
        client = TrainerClient.connect_local(
            group_name=wg.group_name, ray_namespace=wg.ray_namespace
        )
        keys_file = root / "keys"
        keys_file.write_text(KEY + "\n")
        tok = build_tokenizer(root / "tokenizer")
        info = group_info("tiny", spec, base_model=str(tok), tokenizer=str(tok), eos_token_ids=(1,))
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
            "running": running,
            "base": info.base_model,
        }
    finally:
        if running is not None:
            running.stop()
        wg.teardown()
        if started:
            ray.shutdown()


def build_tokenizer(path: Path, vocab: int = 128) -> Path:
    """A word-level tokenizer of ``vocab`` ids, trained on the cookbook's example conversations
    when present (else on a few words), saved with PreTrainedTokenizerFast.save_pretrained."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(
        vocab_size=vocab, special_tokens=["<unk>", "<eos>", "<bos>", "<pad>"]
    )
    text = ["User: Assistant: System: the a of is and to in"]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    pattern = "trainergroup/cookbook-venv/lib/python*/site-packages/tinker_cookbook/example_data"
    for d in cache.glob(pattern):
        text += (d / "conversations.jsonl").read_text().splitlines()
    tk.train_from_iterator(text, trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tk, unk_token="<unk>", eos_token="<eos>", bos_token="<bos>",
        pad_token="<pad>",
    )
    fast.save_pretrained(str(path))
    return path
