"""Groups on a real two-node Ray cluster on this machine (two raylets, one GCS).

``ray.cluster_utils.Cluster`` starts a head raylet and a second raylet, each with 2 CPUs
and its own custom resource (``tg_node_a`` / ``tg_node_b``), so a placement group can be
pinned to a node with ``ResourcePool(node_resources=...)``. Both raylets share this
machine's IP, so the node *id* (not the IP) tells them apart.

For ``processesPerNode`` [1,1], [2,1], [1,2] (entry i pinned to node a, b):
ranks in order; each rank on the node its bundle names; verl's names
(``{prefix}{ClassName}_{pg_index}:{local_rank}``); DP_COMPUTE across the nodes (one group
per layout for all of these); a DataProto's N-D mesh dispatch across the nodes in [1,2]
(see DATAPROTO_LAYOUTS for why one layout is enough).
The IP-sort bug (placement groups re-sorted by node IP were paired with the per-node counts
in spec order) is checked in the [2,1] layout: its group is made with node b reported at the
lower IP. TP=2 across the two nodes (gloo) trains the tiny Megatron model with falling loss.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import ray
from ray.util.placement_group import placement_group_table

from tests.runtime.light_workers import MeshProbe
from tgruntime.controller import ClassWithInitArgs, ResourcePool, WorkerGroup

pytestmark = pytest.mark.ray

NODE_KEYS = ("tg_node_a", "tg_node_b")
TIMEOUTS = {"pg_timeout_s": 180.0, "actor_timeout_s": 300.0}


@dataclass(frozen=True)
class TwoNodes:
    address: str
    node_ids: dict[str, str]  # custom resource -> node id


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[TwoNodes]:
    from ray.cluster_utils import Cluster

    from tests.fixtures_ray import _refresh_ray_config, with_startup_tries

    if ray.is_initialized():
        ray.shutdown()
    auth_was = os.environ.get("RAY_AUTH_MODE")
    if auth_was is None:
        os.environ["RAY_AUTH_MODE"] = "disabled"
        _refresh_ray_config()
    store = 200 << 20
    made: list[Any] = []

    def start() -> Any:  # Ray's raylets get a fixed 30 s to register: tried again under load
        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 2, "resources": {NODE_KEYS[0]: 100}, "object_store_memory": store,
                "gcs_server_port": _free_port(), "include_dashboard": False,
            },
        )
        made.append(cluster)
        cluster.add_node(num_cpus=2, resources={NODE_KEYS[1]: 100}, object_store_memory=store)
        cluster.wait_for_nodes(timeout=180)
        ray.init(address=cluster.address, namespace="tgtests-multinode", log_to_driver=False)
        return cluster

    def undo() -> None:
        if ray.is_initialized():
            ray.shutdown()
        while made:
            with contextlib.suppress(Exception):
                made.pop().shutdown()

    try:
        cluster = with_startup_tries(start, undo, what="two_nodes")
    except BaseException:
        undo()
        raise
    try:
        ids = {}
        for node in ray.nodes():  # type: ignore[no-untyped-call]  # ray leaves it unannotated
            if node.get("Alive"):
                for key in NODE_KEYS:
                    if key in (node.get("Resources") or {}):
                        ids[key] = node["NodeID"]
        assert set(ids) == set(NODE_KEYS), ray.nodes()  # type: ignore[no-untyped-call]  # ray leaves it unannotated
        yield TwoNodes(address=cluster.address, node_ids=ids)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
        if auth_was is None:
            os.environ.pop("RAY_AUTH_MODE", None)
            _refresh_ray_config()


def pinned_pool(counts: list[int], **kw: Any) -> ResourcePool:
    """Entry i of ``counts`` pinned to node NODE_KEYS[i]."""
    return ResourcePool(
        process_on_nodes=counts,
        node_resources=[{NODE_KEYS[i]: 0.01} for i in range(len(counts))],
        **kw,
    )


def expected_names(prefix: str, cls_name: str, counts: list[int]) -> list[str]:
    return [f"{prefix}{cls_name}_{pg}:{local}" for pg, c in enumerate(counts) for local in range(c)]


CASES = [[1, 1], [2, 1], [1, 2]]


# dp rank per rank: a tp pair spanning the two nodes in every case
MESHES = {"1x1": [0, 0], "2x1": [0, 1, 1], "1x2": [0, 0, 1]}
# Layouts whose workers also get a DataProto (each such worker imports torch and tensordict,
# ~12 CPU-s). 1x2's mesh [0, 0, 1] has a tp pair across the nodes (collected on node a), a dp
# rank wholly on node b (collected there: collectors on both nodes, one not rank 0) and
# uneven dp ranks. 1x1's mesh is 1x2's dp rank 0; 2x1's [0, 1, 1] has a one-rank dp rank on
# node a and a pair across the nodes, both collected on node a: nothing 1x2 lacks, node-wise
# (its DataProto step, 3 torch imports, was dropped on 2026-12-06). The dispatch itself, any
# mesh, on one node: tests/runtime/test_controller_groups.py::test_nd_mesh_dispatch.
DATAPROTO_LAYOUTS = {"1x2"}
# The layout whose group is made with the IPs swapped (the IP-sort bug below).
SWAPPED_IP_LAYOUT = "2x1"


def swap_ips(monkeypatch: pytest.MonkeyPatch) -> None:
    """Report node b (which holds entry 1) at a lower IP than node a (entry 0).

    The bug: placement groups were re-sorted by node IP, the counts were not. Both raylets
    here share one IP, so the old sort was a no-op on this machine; this reproduces a cluster
    whose IPs do not follow the spec. Before the fix, in [2, 1], ranks 0 and 1 went to the
    one-bundle placement group (bundle index 1 does not exist there) and creation failed; now
    ranks, names and nodes follow the spec.
    """
    real_nodes = ray.nodes

    def nodes_with_swapped_ips() -> list[dict[str, Any]]:
        out = []
        for n in real_nodes():  # type: ignore[no-untyped-call]  # ray leaves it unannotated
            ip = "10.0.0.1" if NODE_KEYS[1] in (n.get("Resources") or {}) else "10.0.0.2"
            out.append({**n, "NodeManagerAddress": ip})
        return out

    monkeypatch.setattr(ray, "nodes", nodes_with_swapped_ips)


@pytest.mark.parametrize("counts", CASES, ids=lambda c: "x".join(map(str, c)))
def test_placement_ranks_names_and_mesh_dispatch(
    two_nodes: TwoNodes, counts: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One group per layout serves both checks (a group start is most of each test's time);
    the DataProto mesh dispatch runs in DATAPROTO_LAYOUTS, and SWAPPED_IP_LAYOUT's group is
    made with the IPs swapped (the IP-sort bug; until 2026-12-06 a group of its own)."""
    import torch

    from tgruntime.controller import DataProto

    key = "x".join(map(str, counts))
    dp_ranks = MESHES[key]
    if key == SWAPPED_IP_LAYOUT:
        swap_ips(monkeypatch)
    prefix = f"p{uuid.uuid4().hex[:6]}"
    wg = WorkerGroup.create(
        group_name=f"mn-{prefix}", ray_namespace=f"t-{prefix}", name_prefix=prefix,
        resource_pool=pinned_pool(counts, cpus_per_process=0.2),
        cls=ClassWithInitArgs(MeshProbe, dp_ranks), detached=False, **TIMEOUTS,  # type: ignore[arg-type]
    )
    try:
        names = expected_names(prefix, "MeshProbe", counts)
        assert wg.worker_names == names
        infos = wg.whoami()
        assert [i["rank"] for i in infos] == list(range(sum(counts)))
        assert [i["name"] for i in infos] == names
        assert {i["world_size"] for i in infos} == {sum(counts)}
        pgs = wg.placement_groups
        assert [pg.bundle_count for pg in pgs] == counts
        rank = 0
        for pg_index, (pg, count) in enumerate(zip(pgs, counts, strict=True)):
            bundle_nodes = placement_group_table(pg)["bundles_to_node_id"]
            for local in range(count):
                info = infos[rank]
                assert info["local_rank"] == local
                # on the node its bundle names, and that is the node the spec entry pinned
                assert info["node_id"] == bundle_nodes[local], (rank, info, bundle_nodes)
                assert info["node_id"] == two_nodes.node_ids[NODE_KEYS[pg_index]], (rank, info)
                rank += 1
        # the ranks really are on two raylets, and share one master (rank 0's)
        assert len({i["node_id"] for i in infos}) == 2
        assert len({tuple(i["master"]) for i in infos}) == 1
        # DP_COMPUTE across nodes: rank r gets element r
        assert wg.scaled(list(range(10, 10 + sum(counts)))) == [
            (10 + r) * (r + 1) for r in range(sum(counts))
        ]
        if key not in DATAPROTO_LAYOUTS:
            return
        # N-D mesh dispatch across the nodes: each dp rank's rows reach its tp peers, and the
        # collecting rank of each dp rank returns them
        dp_size = max(dp_ranks) + 1
        rows = 2 * dp_size
        out = wg.step(DataProto.from_dict(tensors={"x": torch.arange(rows)}))
        assert out.batch["x"].tolist() == list(range(rows))
        collectors = [dp_ranks.index(d) for d in range(dp_size)]
        assert out.batch["rank"].tolist() == [r for r in collectors for _ in range(2)]
        seen = wg.seen()
        for r, d in enumerate(dp_ranks):
            assert seen[r] == [2 * d, 2 * d + 1], (r, seen)
    finally:
        wg.teardown()


def test_node_resources_must_match_entries() -> None:
    with pytest.raises(ValueError, match="node_resources"):
        ResourcePool(process_on_nodes=[1, 1], node_resources=[{"x": 1.0}])
    pool = ResourcePool(
        process_on_nodes=[2, 1], cpus_per_process=0.5, node_resources=[{"a": 0.01}, {"b": 0.01}]
    )
    assert pool.bundles() == [[{"CPU": 0.5, "a": 0.01}] * 2, [{"CPU": 0.5, "b": 0.01}]]


@pytest.mark.megatron
def test_megatron_tp2_across_nodes(two_nodes: TwoNodes, tmp_path: Path) -> None:
    import tgapi
    from tests.trainer.scenarios import fixed_batch, tiny_spec
    from tgruntime.controller import DataProto
    from tgruntime.trainer.worker import MegatronTrainer

    wire = json.dumps(tgapi.to_wire(tiny_spec(tp=2, checkpoint_dir=str(tmp_path / "ckpt"))))
    prefix = f"t{uuid.uuid4().hex[:6]}"
    wg = WorkerGroup.create(
        group_name=f"mn-{prefix}", ray_namespace=f"t-{prefix}", name_prefix=prefix,
        resource_pool=pinned_pool([1, 1], cpus_per_process=1.0),
        cls=ClassWithInitArgs(MegatronTrainer, wire), detached=False, **TIMEOUTS,  # type: ignore[arg-type]
    )
    try:
        assert wg.worker_names == expected_names(prefix, "MegatronTrainer", [1, 1])
        meshes: list[dict[str, Any]] = wg.init_model()
        assert [m["tp_rank"] for m in meshes] == [0, 1]
        assert [m["is_collect"] for m in meshes] == [True, False]
        bundle_nodes = [
            placement_group_table(pg)["bundles_to_node_id"][0] for pg in wg.placement_groups
        ]
        assert bundle_nodes == [two_nodes.node_ids[k] for k in NODE_KEYS]
        data = DataProto.from_dict(tensors={"input_ids": fixed_batch()})
        losses = [float(wg.train_model(data).meta_info["loss"]) for _ in range(3)]
        assert losses[-1] < losses[0] - 0.05, losses
        last = wg.last_step()
        assert [s["rank"] for s in last] == [0, 1]
        assert last[0]["loss"] == pytest.approx(last[1]["loss"], rel=1e-5)  # TP peers agree
    finally:
        wg.teardown()
