"""Runs parts of the pinned sglang wheel on CPU, in a process of its own: SGLang's own server
argument parser, and its Mooncake backend's config loading.

``import sglang`` runs ``sglang/__init__.py``, which needs a CUDA torch, transformers and more
that this venv does not have. So the ``sglang`` and ``sglang.srt`` packages are entered without
their ``__init__`` (empty package modules pointing at the wheel's folders), and the three
third-party modules ``srt/server_args.py`` imports but never calls while it builds the parser
are empty stand-ins. Both would break anything else in the process, hence a process of its own.

- ``ServerArgs.add_cli_args`` (``srt/server_args.py``), the parser ``sglang.launch_server``
  builds (``prepare_server_args``), parses each argv; an argv it refuses comes back as the
  message argparse printed.
- ``srt/mem_cache/storage/mooncake_store/mooncake_store.py`` imports its host pools, which need
  Triton kernels; so its config half is run from its own source, statement by statement:
  ``MooncakeStoreConfig`` and the two helpers it calls, ``MooncakeBaseStore._load_config``, and
  ``HybridCacheController.parse_storage_backend_extra_config``
  (``srt/mem_cache/hybrid_cache/hybrid_cache_controller.py``), which turns the flag's JSON into
  the dict the backend gets. Each extra config goes through both, in that order, with the given
  environment in ``os.environ``.

Reads a JSON object on stdin: ``{"argv": [[...], ...], "extra_configs": ["<json>", ...],
"env": {...}}``; writes ``{"parsed": [...], "mooncake": [...]}`` on stdout.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import importlib.abc
import importlib.machinery
import importlib.util
import io
import json
import logging
import os
import sys
import types
from pathlib import Path
from typing import Any, Optional

UNUSED_IMPORTS = ("pybase64", "triton", "starlette")
"""Imported at module level by what ``server_args.py`` pulls in, not installed here, and not
called while the parser is built (a parse that needed them would fail, not pass)."""


class _Empty(types.ModuleType):
    __path__: list[str] = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {})


class _EmptyModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name.split(".")[0] in UNUSED_IMPORTS:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _Empty(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _enter_wheel() -> Path:
    root = Path(next(iter(importlib.util.find_spec("sglang").submodule_search_locations)))
    for name, folder in (("sglang", root), ("sglang.srt", root / "srt")):
        package = types.ModuleType(name)
        package.__path__ = [str(folder)]
        sys.modules[name] = package
    sys.meta_path.insert(0, _EmptyModules())
    return root


def parse_all(argvs: list[list[str]]) -> list[dict]:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    out = []
    for argv in argvs:
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                ns = parser.parse_args(argv)
        except SystemExit:
            out.append({"ok": False, "error": err.getvalue().strip().splitlines()[-1]})
            continue
        out.append({"ok": True, "values": json.loads(json.dumps(vars(ns), default=repr))})
    return out


def _run_definitions(source_path: Path, wanted: dict[str, str | None], namespace: dict) -> None:
    """Execute the top-level definitions named in ``wanted`` (a class, a function or an assigned
    name; a value names the class a wanted method lives in) from ``source_path`` in ``namespace``."""
    tree = ast.parse(source_path.read_text(), filename=str(source_path))
    picked: list[ast.stmt] = []
    for node in tree.body:
        names = [t.id for t in node.targets if isinstance(t, ast.Name)] if isinstance(node, ast.Assign) else \
            [getattr(node, "name", None)]
        for name, owner in wanted.items():
            if owner is None and name in names:
                picked.append(node)
            elif owner is not None and isinstance(node, ast.ClassDef) and node.name == owner:
                picked += [item for item in node.body if isinstance(item, ast.FunctionDef) and item.name == name]
    for fn in picked:  # methods become plain functions; their decorators (staticmethod) go
        if isinstance(fn, ast.FunctionDef):
            fn.decorator_list = [d for d in fn.decorator_list if not (isinstance(d, ast.Name) and d.id == "staticmethod")]
    exec(compile(ast.Module(body=picked, type_ignores=[]), str(source_path), "exec"), namespace)  # noqa: S102


def mooncake_configs(root: Path, extra_configs: list[str], env: dict[str, str]) -> list[dict]:
    from sglang.srt.environ import envs

    ns: dict[str, Any] = {"dataclass": dataclasses.dataclass, "Optional": Optional, "Any": Any, "os": os,
                          "json": json, "envs": envs, "logger": logging.getLogger("sglang_wheel_probe")}
    store = root / "srt" / "mem_cache" / "storage" / "mooncake_store" / "mooncake_store.py"
    _run_definitions(store, {"DEFAULT_TENANT_ID": None, "_parse_global_segment_size": None,
                             "_normalize_tenant_id": None, "MooncakeStoreConfig": None,
                             "_load_config": "MooncakeBaseStore"}, ns)
    controller = root / "srt" / "mem_cache" / "hybrid_cache" / "hybrid_cache_controller.py"
    _run_definitions(controller, {"parse_storage_backend_extra_config": "HybridCacheController"}, ns)
    os.environ.update(env)
    out = []
    for raw in extra_configs:
        extra, *_ = ns["parse_storage_backend_extra_config"](raw)
        config = ns["_load_config"](None, types.SimpleNamespace(extra_config=extra))
        out.append({"extra_config": extra, "config": dataclasses.asdict(config)})
    return out


def main() -> None:
    request = json.load(sys.stdin)
    root = _enter_wheel()
    result = {"parsed": parse_all(request.get("argv", [])),
              "mooncake": mooncake_configs(root, request.get("extra_configs", []), request.get("env", {}))}
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
