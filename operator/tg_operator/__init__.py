"""tg_operator: the kopf operator for TrainerGroup resources.

It turns a ``TrainerGroup`` into a KubeRay ``RayCluster`` plus a detached worker
group launched through the Ray Jobs API, keeps the group healthy, and publishes the
workers' names in the resource's status. It talks to Ray only over HTTP (the
dashboard's Jobs and State APIs) and never imports ray, torch or megatron.

The import name is ``tg_operator`` because a package named ``operator`` would shadow
the standard library.
"""

__all__ = ["__version__"]

__version__ = "0.1.0"
