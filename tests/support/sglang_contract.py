"""SGLang's own HTTP contract, read from the pinned sglang wheel without importing sglang.

``import sglang`` runs ``sglang/__init__.py``, which imports transformers and a CUDA torch this
venv does not have, so nothing here imports it:

- ``sglang/api/v1/api_types.py`` (generated msgspec types: generate, abort, model info...) needs
  only msgspec and is loaded by file path;
- ``sglang/srt/managers/io_struct.py`` (the request structs the Python server's routes parse)
  imports torch and zmq, so its classes are read with ``ast`` and rebuilt as msgspec Structs with
  the same field names, types where they are plain, and defaults, which refuse unknown fields
  (SGLang ignores them: a misspelt key would be dropped without a word);
- ``sglang/srt/entrypoints/http_server.py`` is read with ``ast`` for which struct a route parses
  its body into, and which query parameters it takes;
- ``sglang/srt/configs/load_config.py`` with ``ast`` for the ``LoadFormat`` names;
- any function's source as text (``function_source``), where what matters is what it reads.

``tests/support/sglang_wheel_probe.py`` goes further in a process of its own: it runs SGLang's
own server argument parser and its Mooncake backend's config loading.

The wheel is installed without its dependencies (Makefile). Missing, the tests that use it skip
on a workstation and fail in CI (``CI=true``).
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
import os
import sys
import typing
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec
import pytest

SGLANG_VERSION = "0.5.23"
"""The version Gyre pins (pyproject ``gpu`` extra, Makefile)."""


@functools.cache
def _root_or_problem() -> Path | str:
    spec = importlib.util.find_spec("sglang")  # a top-level name: located, not imported
    if spec is None or not spec.submodule_search_locations:
        return "sglang is not installed"
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return "sglang has no distribution metadata"
    if version != SGLANG_VERSION:
        return f"sglang {version} is installed, the contract is {SGLANG_VERSION}"
    return Path(next(iter(spec.submodule_search_locations)))


def wheel_root() -> Path:
    """The installed ``sglang`` package folder; skips (fails in CI) when the pinned wheel is absent."""
    root = _root_or_problem()
    if isinstance(root, Path):
        return root
    msg = f"{root}: run `make venv` (pip install --no-deps sglang=={SGLANG_VERSION})"
    if os.environ.get("CI") == "true":
        pytest.fail(msg)
    pytest.skip(msg)


@functools.cache
def api_types() -> ModuleType:
    """``sglang/api/v1/api_types.py``, loaded by path under a name of its own."""
    path = wheel_root() / "api" / "v1" / "api_types.py"
    name = "_gyre_test_sglang_api_types"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # msgspec resolves the postponed annotations through it
    spec.loader.exec_module(module)
    return module


@functools.cache
def _tree(relpath: str) -> ast.Module:
    return ast.parse((wheel_root() / relpath).read_text(), filename=relpath)


def load_formats() -> set[str]:
    """The values of ``LoadFormat`` in ``sglang/srt/configs/load_config.py``."""
    for node in _tree("srt/configs/load_config.py").body:
        if isinstance(node, ast.ClassDef) and node.name == "LoadFormat":
            return {ast.literal_eval(s.value) for s in node.body if isinstance(s, ast.Assign)}
    raise AssertionError("load_config.py: no LoadFormat")


# ------------------------------------------------------------------ http_server.py routes


def _route_functions() -> dict[str, ast.AsyncFunctionDef]:
    out = {}
    for node in _tree("srt/entrypoints/http_server.py").body:
        if not isinstance(node, ast.AsyncFunctionDef):
            continue
        for dec in node.decorator_list:
            if (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)
                    and isinstance(dec.func.value, ast.Name) and dec.func.value.id == "app"
                    and dec.args and isinstance(dec.args[0], ast.Constant)):
                out[dec.args[0].value] = node
    return out


def _route_methods(dec: ast.Call) -> set[str]:
    """The HTTP methods of one ``@app.<get|post|put|delete|api_route>(...)`` decorator."""
    if dec.func.attr != "api_route":
        return {dec.func.attr.upper()}
    for kw in dec.keywords:
        if kw.arg == "methods":
            return set(ast.literal_eval(kw.value))
    return {"GET"}


def route_handler(route: str, method: str) -> str:
    """The name of the function ``http_server.py`` serves ``method route`` with (one path may
    have a handler per method: ``/hicache/storage-backend`` has GET, PUT and DELETE)."""
    for node in _tree("srt/entrypoints/http_server.py").body:
        if not isinstance(node, ast.AsyncFunctionDef):
            continue
        for dec in node.decorator_list:
            if (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)
                    and isinstance(dec.func.value, ast.Name) and dec.func.value.id == "app"
                    and dec.args and isinstance(dec.args[0], ast.Constant) and dec.args[0].value == route
                    and method in _route_methods(dec)):
                return node.name
    raise AssertionError(f"http_server.py: no {method} {route}")


def route_body_type(route: str, method: str | None = None) -> str | None:
    """The class ``http_server.py`` parses ``route``'s JSON body into (``Annotated[X, Body()]``);
    ``method`` picks the handler where a path has several."""
    fn = _route_functions()[route]
    if method is not None:
        fn = next(n for n in _tree("srt/entrypoints/http_server.py").body
                  if isinstance(n, ast.AsyncFunctionDef) and n.name == route_handler(route, method))
    for arg in fn.args.args:
        ann = arg.annotation
        if (isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name) and ann.value.id == "Annotated"
                and isinstance(ann.slice, ast.Tuple) and "Body" in ast.unparse(ann.slice.elts[1])):
            return ast.unparse(ann.slice.elts[0])
    return None


def route_query_params(route: str) -> set[str]:
    """The query parameters ``route`` declares (``x: T = Query(...)``)."""
    fn = _route_functions()[route]
    args = fn.args.args
    defaults = dict(zip([a.arg for a in args[len(args) - len(fn.args.defaults):]], fn.args.defaults))
    return {name for name, d in defaults.items()
            if isinstance(d, ast.Call) and isinstance(d.func, ast.Name) and d.func.id == "Query"}


# ------------------------------------------------------------------ io_struct.py structs

_TYPING_NAMES = {n: getattr(typing, n) for n in ("Any", "Dict", "List", "Literal", "Optional", "Tuple", "Union")}
_NO_DEFAULT = object()


def _field_type(annotation: str) -> Any:
    try:
        return eval(annotation, {"__builtins__": {}}, {**_TYPING_NAMES, "int": int, "float": float,  # noqa: S307
                                                          "str": str, "bool": bool, "dict": dict, "list": list})
    except NameError:  # a type of SGLang's own (FinishReasonDict...): any JSON value
        return Any


def _default(node: ast.expr | None) -> Any:
    if node is None:
        return _NO_DEFAULT
    try:
        return ast.literal_eval(node)
    except ValueError:  # field(default_factory=...) and the like: optional, shape not checked here
        return None


@functools.cache
def io_struct(name: str) -> type[msgspec.Struct]:
    """``io_struct.<name>`` rebuilt from its source, bases' fields included, unknown fields refused."""
    classes = {n.name: n for n in _tree("srt/managers/io_struct.py").body if isinstance(n, ast.ClassDef)}
    fields: dict[str, tuple[Any, Any]] = {}

    def collect(cls_name: str) -> None:
        node = classes[cls_name]
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                collect(base.id)
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                fields[stmt.target.id] = (_field_type(ast.unparse(stmt.annotation)), _default(stmt.value))

    collect(name)
    spec = [(k, t) if d is _NO_DEFAULT else (k, t, d) for k, (t, d) in fields.items()]
    return msgspec.defstruct(name, spec, kw_only=True, forbid_unknown_fields=True)


def check_body(route: str, body: Any, method: str | None = None) -> None:
    """Raise ``msgspec.ValidationError`` unless ``body`` is what ``route``'s struct accepts, strictly:
    known fields only, declared types, required fields present."""
    type_name = route_body_type(route, method)
    assert type_name is not None, f"{route}: http_server.py declares no JSON body"
    msgspec.convert(body, type=io_struct(type_name), strict=True)


def check_api_type(type_name: str, value: Any) -> None:
    """Decode ``value`` with api_types' ``<type_name>``, and refuse keys it does not declare (its
    decoders ignore unknown keys on most types)."""
    cls = getattr(api_types(), type_name)
    cls.from_json_value(value)
    if isinstance(value, dict):
        unknown = set(value) - set(cls.__struct_encode_fields__)
        assert not unknown, f"{type_name}: unknown fields {sorted(unknown)}"


# ------------------------------------------------------------------ source, function by function


def function_source(relpath: str, function: str, class_name: str | None = None) -> str:
    """The source of ``function`` (a method of ``class_name`` if given) in the wheel's ``relpath``:
    a contract read as text where running it would need SGLang's GPU dependencies."""
    body = _tree(relpath).body
    if class_name is not None:
        body = next((n.body for n in body if isinstance(n, ast.ClassDef) and n.name == class_name), [])
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == function:
            return ast.get_source_segment((wheel_root() / relpath).read_text(), node)
    raise AssertionError(f"{relpath}: no {class_name + '.' if class_name else ''}{function}")
