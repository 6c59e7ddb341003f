"""Property-based tests (hypothesis) of everything tgapi reads: spec mappings built from the
field model with garbage mixed in, whole YAML files (random text, random bytes, several
documents, non-mappings) and tgctl's error line for them.

The property: never a traceback; either a valid spec (which survives its own wire round
trip) or SpecErrors whose every entry names a field and says what to change.
"""

from __future__ import annotations

import contextlib
import io
import tempfile
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tgapi
from tests.api.strategies import GARBAGE, spec_dicts
from tgruntime.entrypoints import cli

# 2 cores: modest counts; the derandomized database-free profile keeps CI repeatable.
FAST = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])


def _check_errors(exc: tgapi.SpecErrors, *, prefixes: tuple[str, ...]) -> None:
    assert exc.errors
    for e in exc.errors:
        assert e.field and e.field.startswith(prefixes), e.field
        assert e.problem and e.fix, e
        assert len(str(e)) < 2000, str(e)[:300]


@FAST
@given(spec=spec_dicts(), local=st.booleans())
def test_any_spec_is_parsed_or_refused_field_by_field(spec: dict[str, Any], local: bool) -> None:
    try:
        parsed = tgapi.parse_spec(spec, local=local)
    except tgapi.SpecErrors as exc:
        _check_errors(exc, prefixes=("spec",))
    else:
        assert tgapi.parse_spec(tgapi.to_wire(parsed), local=local) == parsed


@FAST
@given(spec=GARBAGE)
def test_any_value_as_a_spec(spec: Any) -> None:
    try:
        tgapi.parse_spec(spec, local=True)
    except tgapi.SpecErrors as exc:
        _check_errors(exc, prefixes=("spec",))


def _manifests() -> st.SearchStrategy[Any]:
    name = st.one_of(st.from_regex(r"\A[a-z][a-z0-9-]{0,20}[a-z0-9]\Z"), GARBAGE)
    metadata = st.one_of(
        st.fixed_dictionaries({"name": name}, optional={"namespace": GARBAGE, "labels": GARBAGE,
                                                        "generation": GARBAGE, "uid": GARBAGE}),
        GARBAGE,
    )
    return st.fixed_dictionaries(
        {"kind": st.just(tgapi.KIND), "spec": spec_dicts()},
        optional={"apiVersion": st.sampled_from([f"{tgapi.API_GROUP}/{tgapi.API_VERSION}", "v1"]),
                  "metadata": metadata},
    )


YAML_DOCS = st.lists(st.one_of(_manifests(), _manifests(), GARBAGE), min_size=0, max_size=3)
# The file prefixes: the document's path names the file (a field of its own).
_PREFIXES = ("spec", "metadata", "apiVersion", "kind", "/")


def _load(text: str | bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tg.yaml"
        path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"))
        try:
            tgapi.load_file(path, local=True)
        except tgapi.SpecErrors as exc:
            _check_errors(exc, prefixes=_PREFIXES)


@FAST
@given(docs=YAML_DOCS)
def test_yaml_documents(docs: list[Any]) -> None:
    _load(yaml.safe_dump_all(docs, allow_unicode=True))


@FAST
@given(text=st.text(max_size=300))
def test_yaml_text(text: str) -> None:
    _load(text)


@FAST
@given(prefix=st.sampled_from(["kind: TrainerGroup\n", "kind: TrainerGroup\nspec:\n  ", ""]),
       tail=st.text(alphabet=st.sampled_from(list("[]{}:-,&*!|>'\"#%@` \n\t0123456789.eE+")),
                    max_size=80))
def test_yaml_syntax_garbage(prefix: str, tail: str) -> None:
    _load(prefix + tail)


@FAST
@given(data=st.binary(max_size=200))
def test_binary_files(data: bytes) -> None:
    _load(data)


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(text=st.one_of(
    st.just("- a\n- b\n"), st.just("kind: TrainerGroup\nspec: [1]\n"),
    st.just("---\nkind: Pod\n---\nkind: TrainerGroup\nmetadata: {name: x}\nspec:\n  model: 5\n"),
    st.just("x: 1e99999\nkind: TrainerGroup\nspec: {seed: 1" + "0" * 5000 + "}\n"),
    st.just("kind: TrainerGroup\nmetadata: {name: a}\nspec: {model: {numLayers: 1e400}}\n"),
    st.just("kind: TrainerGroup\nmetadata: {name: a, creationTimestamp: 2024-02-30}\n"),
    st.just("[" * 3000), YAML_DOCS.map(yaml.safe_dump_all)))
def test_tgctl_prints_one_error_line(text: str) -> None:
    """The real tgctl entry point (in-process): exit 2 and its error on stderr, no traceback."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tg.yaml"
        path.write_text(text)
        try:
            tgapi.load_file(path, local=True)
        except tgapi.SpecErrors:
            pass
        else:
            return  # a valid file: `up` would start Ray (tests/flow covers that path)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = cli.main(["up", "-f", str(path)])
        assert code == 2, err.getvalue()
        out = err.getvalue()
        assert out.startswith("tgctl up: invalid TrainerGroup spec"), out[:300]
        assert "Fix: " in out and "Traceback" not in out
