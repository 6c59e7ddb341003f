"""Hypothesis strategies for TrainerGroup specs, built from the field model (tgapi.model).

Every dataclass becomes a dict with some of its wire keys, each value either a plausible
one for the field (bounds, enums, quantities, near and beyond the limits) or garbage (a
wrong type, a huge or negative number, unicode, nesting), plus now and then a key the
model does not have.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from hypothesis import strategies as st

from tgapi.fields import field_meta
from tgapi.model import TrainerGroupSpec

JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
GARBAGE = st.recursive(
    JSON_SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)
QUANTITIES = st.one_of(
    st.sampled_from(["1", "500m", "8Gi", "32Gi", "64Gi", "1Ti", "1e9", "0", ".5Ki", "2048Mi"]),
    st.from_regex(r"\A[0-9]{1,4}(\.[0-9]{0,2})?(Ki|Mi|Gi|Ti|m|k|M|G)?\Z"),
)


def _ints(meta: Any) -> st.SearchStrategy[int]:
    low = int(meta.minimum) if meta.minimum is not None else -(2**40)
    high = int(meta.maximum) if meta.maximum is not None else 2**40
    near = st.sampled_from([low, low + 1, high, high + 1, low - 1, 2**63, 10**20, 2**31])
    small = st.integers(min_value=max(low, 0), max_value=max(low, 0) + 64)
    return st.one_of(small, small, near, st.integers(min_value=low - 10, max_value=high + 10))


def _floats(meta: Any) -> st.SearchStrategy[float]:
    return st.one_of(
        st.floats(min_value=-1.0, max_value=2.0),
        st.sampled_from([0.0, 1e-6, 1.0, -0.0, 1e308]),
        st.integers(min_value=-3, max_value=10),  # ints are numbers too
    )


def _strings(meta: Any) -> st.SearchStrategy[str]:
    options: list[st.SearchStrategy[str]] = [st.text(max_size=12)]
    if meta.enum is not None:
        options += [st.sampled_from(list(meta.enum))] * 3
    if meta.pattern is not None:
        if "KMGTPE" in meta.pattern:
            options += [QUANTITIES] * 3
        else:
            options += [st.from_regex(meta.pattern, fullmatch=True).map(lambda s: s[:80])] * 2
    return st.one_of(*options)


def value_for(tp: Any, field: dataclasses.Field[Any] | None, depth: int) -> st.SearchStrategy[Any]:
    """Mostly the right shape for ``tp``, sometimes garbage."""
    meta = field_meta(field) if field is not None else None
    good = _good(tp, field, depth)
    return st.one_of(good, good, good, GARBAGE) if meta is not None else good


def _good(tp: Any, field: dataclasses.Field[Any] | None, depth: int) -> st.SearchStrategy[Any]:
    meta = field_meta(field) if field is not None else None
    if meta is not None and meta.bool_or_auto:
        return st.sampled_from([True, False, "auto", "Auto", 1, 0, "true"])
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = next(a for a in args if a is not type(None))
        return st.one_of(st.none(), _good(inner, field, depth))
    if dataclasses.is_dataclass(tp):
        return spec_dicts(tp, depth=depth + 1)  # type: ignore[arg-type]
    if origin is list:
        if meta is not None and meta.free_form:
            return st.lists(GARBAGE, max_size=2)
        item = _good(args[0], field, depth)
        return st.lists(st.one_of(item, item, GARBAGE), max_size=4)
    if origin is dict:
        return st.dictionaries(st.text(max_size=10), st.one_of(st.text(max_size=10), GARBAGE),
                               max_size=3)
    if tp is bool:
        return st.booleans()
    if tp is int:
        return _ints(meta)
    if tp is float:
        return _floats(meta)
    if tp is str:
        return _strings(meta) if meta is not None else st.text(max_size=12)
    return GARBAGE


def spec_dicts(cls: type[Any] = TrainerGroupSpec, *, depth: int = 0) -> st.SearchStrategy[Any]:
    """A dict for ``cls`` (``TrainerGroupSpec`` by default): random keys of it, random values."""
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    optional = {
        field_meta(f).name: value_for(hints[f.name], f, depth) for f in fields
    }
    extra = st.dictionaries(st.text(min_size=1, max_size=10), GARBAGE, max_size=1)
    body = st.fixed_dictionaries({}, optional=optional)
    return st.one_of(
        st.tuples(body, extra).map(lambda t: {**t[1], **t[0]}),
        body,
        body,
    )


def _leaves(cls: type[Any], prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any, Any]]:
    hints = typing.get_type_hints(cls)
    out: list[tuple[tuple[str, ...], Any, Any]] = []
    for f in dataclasses.fields(cls):
        tp, path = hints[f.name], (*prefix, field_meta(f).name)
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        inner = args[0] if typing.get_origin(tp) in (typing.Union, types.UnionType) else tp
        if dataclasses.is_dataclass(inner):
            out += _leaves(inner, path)  # type: ignore[arg-type]
        else:
            out.append((path, tp, f))
    return out


LEAVES = _leaves(TrainerGroupSpec)
"""Every scalar/list/map field of the spec: (wire path, type, dataclass field)."""


def _base(rnd: Any) -> dict[str, Any]:
    """A small spec that is usually valid (before the mutations of near_valid_specs)."""
    heads = rnd.choice([2, 4, 8])
    ppn = [rnd.choice([1, 2, 4])] * rnd.choice([1, 2])
    use_gpu = rnd.choice([True, False, "auto"])
    spec: dict[str, Any] = {
        "workers": {"processesPerNode": ppn, "useGpu": use_gpu},
        "parallelism": {"tensor": rnd.choice([1, 1, 2]) if min(ppn) > 1 else 1},
        "model": {"numAttentionHeads": heads, "hiddenSize": heads * rnd.choice([8, 16, 1024]),
                  "vocabSize": rnd.choice([256, 32000]), "ffnHiddenSize": rnd.choice([64, 28672]),
                  "numLayers": rnd.choice([2, 4, 80, 4096]), "maxSequenceLength": 1024},
        "training": {"batchSize": 16, "sequenceLength": 1024},
    }
    if rnd.random() < 0.7:
        gpus = 0 if use_gpu is False else max(ppn) * rnd.choice([1, 2])
        spec["rayCluster"] = {"workers": {
            "replicas": len(ppn) + rnd.choice([0, 1]), "gpusPerWorker": gpus,
            "memory": rnd.choice(["1Gi", "32Gi", "2Ti"]),
            "gpuMemory": rnd.choice(["", "", "80Gi", "1Gi"]),
            "nodeSelector": rnd.choice([{}, {"nvidia.com/gpu.product": "NVIDIA-H200"}])}}
    else:
        spec["rayClusterRef"] = {"name": "x"}
    return spec


@st.composite
def near_valid_specs(draw: Any) -> dict[str, Any]:
    """A small, often valid spec with up to two fields replaced by random values."""
    spec = _base(draw(st.randoms(use_true_random=False)))
    for _ in range(draw(st.integers(min_value=0, max_value=2))):
        path, tp, f = draw(st.sampled_from(LEAVES))
        node = spec
        for key in path[:-1]:
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        node[path[-1]] = draw(value_for(tp, f, 0))
    return spec
