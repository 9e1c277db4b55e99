"""The floors: ``base`` imports no other Gyre package; each process package imports only ``base``
and itself; ``controller`` composes and launches them. Checked twice: every import statement in
the source (including ones inside functions), and what loading each package's entry points
really pulls into ``sys.modules`` in a fresh interpreter."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROJECT = ("base", "controller", "cellrunner", "harness_proxy", "trajectory", "workloads", "bench", "viewer", "scripts")
ALLOWED = {
    "base": set(),
    "cellrunner": {"base"},
    "harness_proxy": {"base"},
    "trajectory": {"base"},
    "workloads": {"base"},
    "controller": {"base", "cellrunner", "harness_proxy", "trajectory", "workloads"},
}


def project_imports(path: Path) -> set[str]:
    """The Gyre packages a file imports, at any depth of its code."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        found |= {n.split(".")[0] for n in names if n.split(".")[0] in PROJECT}
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_a_package_imports_only_the_floors_below_it(package):
    wrong = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        extra = project_imports(path) - ALLOWED[package] - {package}
        if extra:
            wrong[str(path.relative_to(ROOT))] = sorted(extra)
    assert not wrong, f"{package} may import only {sorted(ALLOWED[package] | {package})}: {wrong}"


ENTRY_POINTS = {
    "trajectory": "trajectory.tree, trajectory.sampling, trajectory.samples, trajectory.log, trajectory.processor, "
                  "trajectory.main",
    "harness_proxy": "harness_proxy.server, harness_proxy.main",
    "cellrunner": "cellrunner.main, cellrunner.follower",
    "workloads": "workloads.validate, workloads.harnesses",
    "base": "base.wire, base.typed_config, base.lifecycle, base.curve, base.engine_key, base.execution_token, "
            "base.checkpoints, base.tokenizer, base.ranks, base.algo_config, base.advantages",
}


@pytest.mark.parametrize("package", sorted(ENTRY_POINTS))
def test_loading_a_package_loads_only_base_and_itself(package):
    check = f"import json, sys\nimport {ENTRY_POINTS[package]}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    loaded = {m.split(".")[0] for m in json.loads(out.stdout.strip().splitlines()[-1])} & set(PROJECT)
    assert loaded <= ALLOWED[package] | {package}, f"{package} loads {sorted(loaded)}"


def test_trajectory_loads_only_base_and_no_heavy_libraries():
    check = f"import json, sys\nimport {ENTRY_POINTS['trajectory']}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    modules = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert not {"torch", "aiohttp", "transformers"} & modules
