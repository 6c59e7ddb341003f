"""Ray's namespace is ``ray_namespace`` everywhere in ``tgruntime.controller`` (issue 21).

The old keyword ``namespace=`` (deprecated for one release) is gone: every function that took
it raises TypeError before touching Ray, so these tests need no cluster.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Callable
from typing import Any

import pytest

import tgruntime.controller as controller
from tgruntime.controller import registry
from tgruntime.controller.connect import connect
from tgruntime.controller.resource_pool import ResourcePool
from tgruntime.controller.teardown import teardown_group
from tgruntime.controller.worker_group import WorkerGroup

# Any: the removed keyword is passed on purpose, past what the signatures allow.
OLD: dict[str, Any] = {"namespace": "ns"}

CALLS: dict[str, Callable[[], Any]] = {
    "WorkerGroup.create": lambda: WorkerGroup.create(
        group_name="g", resource_pool=ResourcePool(process_on_nodes=[1]), cls=object, **OLD
    ),
    "WorkerGroup.attach": lambda: WorkerGroup.attach(group_name="g", **OLD),
    "WorkerGroup.from_worker_names": lambda: WorkerGroup.from_worker_names(
        worker_names=["w"], **OLD
    ),
    "WorkerGroup.from_handles": lambda: WorkerGroup.from_handles(handles=[], **OLD),
    "teardown_group": lambda: teardown_group(group_name="g", **OLD),
    "load_record": lambda: registry.load_record(group_name="g", **OLD),
    "list_groups": lambda: registry.list_groups(**OLD),
    "connect": lambda: connect("127.0.0.1:1", ray_namespace="ns", **OLD),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_the_old_namespace_keyword_is_a_type_error(name: str) -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'namespace'"):
        CALLS[name]()


def test_worker_group_has_no_namespace_property() -> None:
    assert isinstance(inspect.getattr_static(WorkerGroup, "ray_namespace"), property)
    with pytest.raises(AttributeError):
        inspect.getattr_static(WorkerGroup, "namespace")


def test_the_ray_namespace_is_required_where_it_was() -> None:
    # The missing ray_namespace is the point; mypy rightly refuses each call.
    for call in (
        lambda: WorkerGroup.attach(group_name="g"),  # type: ignore[call-arg]
        lambda: teardown_group(group_name="g"),  # type: ignore[call-arg]
        lambda: registry.load_record(group_name="g"),  # type: ignore[call-arg]
        lambda: connect("127.0.0.1:1"),  # type: ignore[call-arg]
    ):
        with pytest.raises(TypeError, match="'ray_namespace'"):
            call()


def _signatures() -> list[tuple[str, inspect.Signature]]:
    out = []
    for info in pkgutil.iter_modules(controller.__path__):
        module = importlib.import_module(f"tgruntime.controller.{info.name}")
        for qual, obj in vars(module).items():
            if getattr(obj, "__module__", None) != module.__name__:
                continue
            members = [(qual, obj)]
            if inspect.isclass(obj):
                members += [
                    (f"{qual}.{k}", v.__func__ if isinstance(v, (classmethod, staticmethod)) else v)
                    for k, v in vars(obj).items()
                ]
            for label, fn in members:
                if inspect.isfunction(fn) or inspect.isclass(fn):
                    try:
                        sig = inspect.signature(fn)
                    except (TypeError, ValueError):
                        continue
                    out.append((f"{info.name}.{label}", sig))
    return out


def test_no_controller_signature_calls_rays_namespace_namespace() -> None:
    found = [name for name, sig in _signatures() if "namespace" in sig.parameters]
    assert found == []
