"""verl's ``verl.single_controller.base.decorator``: register, Dispatch, Execute and the N-D
dispatch helper."""

from tgruntime.controller.decorator import (
    Dispatch,
    Execute,
    make_nd_compute_dataproto_dispatch_fn,
    register,
)

__all__ = ["Dispatch", "Execute", "make_nd_compute_dataproto_dispatch_fn", "register"]
