"""verl's ``verl.single_controller.base``: Worker, WorkerGroup, ResourcePool, ClassWithInitArgs."""

from tgruntime.controller.class_with_init import ClassWithInitArgs
from tgruntime.controller.resource_pool import ResourcePool
from tgruntime.controller.worker import Worker
from tgruntime.controller.worker_group import WorkerGroup

__all__ = ["ClassWithInitArgs", "ResourcePool", "Worker", "WorkerGroup"]
