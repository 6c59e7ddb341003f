"""verl's ``verl.single_controller.ray``: RayResourcePool, RayClassWithInitArgs, RayWorkerGroup."""

from tgruntime.compat.verl.single_controller.ray.base import (
    PROTECTED_ENV,
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
)

__all__ = ["PROTECTED_ENV", "RayClassWithInitArgs", "RayResourcePool", "RayWorkerGroup"]
