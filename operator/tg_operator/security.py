"""The objects that secure a group's own RayCluster, made before the cluster itself:
the Ray token Secret (``ray_token``) and the NetworkPolicy (``networkpolicy``)."""

from __future__ import annotations

from tg_operator import events, networkpolicy, ray_token
from tg_operator.context import Context
from tg_operator.events import EventSink
from tgapi import TrainerGroup


async def ensure_group_objects(ctx: Context, tg: TrainerGroup, *, sink: EventSink) -> None:
    """Create what is missing (idempotent: an existing object is left as it is)."""
    if ray_token.uses_token(tg):
        await ctx.group_token(tg)  # creates the Secret when absent
    if networkpolicy.wanted(tg):
        body = networkpolicy.build_networkpolicy(
            tg,
            operator_namespace=ctx.config.operator_namespace,
            operator_labels=ctx.config.operator_pod_labels,
        )
        if await ctx.kube.create_networkpolicy(body):
            events.info(
                sink,
                reason="NetworkPolicyCreated",
                message=f"created NetworkPolicy {networkpolicy.policy_name(tg)}",
            )
