"""``make gpu-env`` installs what the GPU recipes run with, where they look for it.

The set (scripts/gpu_requirements.py, which scripts/install_gpu.sh installs) is held against the
pinned sglang wheel's own metadata: the default venv carries that wheel (installed --no-deps by the
Makefile), so its Requires-Dist is read here without importing sglang. Nothing CUDA is installed.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from importlib.metadata import distribution
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
GPU_RECIPES = ["gyre_122b.sbatch", "gyre_2p4t.sbatch"]


def load_gpu_requirements():
    spec = importlib.util.spec_from_file_location("gpu_requirements", ROOT / "scripts" / "gpu_requirements.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GR = load_gpu_requirements()


def installed_set() -> dict[str, Requirement]:
    """What install_gpu.sh hands pip: the script's own output, as the install runs it."""
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_requirements.py")], capture_output=True,
                         text=True, check=True, timeout=60)
    reqs = [Requirement(line) for line in out.stdout.splitlines() if line.strip()]
    by_name = {GR.name_of(r.name): r for r in reqs}
    assert len(by_name) == len(reqs), "a project named twice"
    return by_name


def sglang_pins() -> dict[str, Requirement]:
    """sglang 0.5.23's unconditional requirements for this platform, from its installed wheel."""
    dist = distribution("sglang")
    assert dist.version == "0.5.23", f"the default venv's sglang wheel is {dist.version} (make venv installs 0.5.23)"
    reqs = [Requirement(r) for r in dist.requires or []]
    env = {"sys_platform": "linux", "platform_machine": "x86_64", "extra": ""}
    return {GR.name_of(r.name): r for r in reqs if r.marker is None or r.marker.evaluate(env)}


def test_the_gpu_recipes_run_the_python_make_gpu_env_installs(tmp_path):
    # The venv install_gpu.sh fills, as the script itself asks for it.
    venv = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_requirements.py"), "--venv"],
                          capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    assert 'VENV="$("$PYTHON" scripts/gpu_requirements.py --venv)"' in (ROOT / "scripts/install_gpu.sh").read_text()
    assert re.search(r"^gpu-env:\n\tscripts/install_gpu\.sh$", (ROOT / "Makefile").read_text(), re.M)
    fake = tmp_path / venv / "bin" / "python"  # stands in for the installed interpreter: says it ran
    fake.parent.mkdir(parents=True)
    fake.write_text('#!/bin/sh\necho "gpu-venv-python $*"\n[ "$2" = controller.layout ] && exit 3\nexit 0\n')
    fake.chmod(0o755)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    base = {k: v for k, v in os.environ.items() if k != "GYRE_PYTHON" and not k.startswith("SLURM_")}
    for script in GPU_RECIPES:
        # In the job: the controller runs under the GPU venv's Python (before: .venv, the CPU one).
        env = {**base, "GYRE_ROOT": str(tmp_path), "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_JOB_ID": "1",
               "SLURM_JOB_NUM_NODES": "24"}
        out = subprocess.run(["bash", str(ROOT / "slurm" / script), f"model.path={tmp_path}/m"], env=env,
                             capture_output=True, text=True, timeout=30, cwd=tmp_path)
        assert out.returncode == 0, (script, out.stderr)
        assert out.stdout.strip().splitlines()[-1].startswith("gpu-venv-python -m controller.main"), out.stdout
        # On the login node: the layout check runs under it too (the fake refuses, so nothing is queued).
        out = subprocess.run(["bash", str(ROOT / "slurm" / script), f"model.path={tmp_path}/m"], env=base,
                             capture_output=True, text=True, timeout=30, cwd=tmp_path)
        assert out.returncode == 2 and "gpu-venv-python -m controller.layout" in out.stderr, (script, out.stderr)
    check = (ROOT / "scripts" / "gpu_check.sh").read_text()
    assert f'PY="${{GYRE_GPU_PYTHON:-{venv}/bin/python}}"' in check


def test_the_gpu_set_pins_sglang_and_the_torch_its_wheel_pins():
    have, pins = installed_set(), sglang_pins()
    assert str(have["sglang"].specifier) == "==0.5.23"
    assert str(pins["torch"].specifier) == "==2.14.1"  # a new sglang wheel: read this file again
    # Every package both name, the set allows sglang's version: sglang's exact pins (torch,
    # transformers, tokenizers) are in the set as they are, or in what the set allows.
    for name, req in have.items():
        want = pins.get(name)
        if want is None:
            continue
        exact = [s.version for s in want.specifier if s.operator == "=="]
        for version in exact:
            assert req.specifier.contains(version, prereleases=True), f"{req} excludes sglang's {want}"
    assert have["torch"].specifier == pins["torch"].specifier
    assert have["transformers"].specifier == pins["transformers"].specifier


def test_mooncake_is_the_build_for_sglangs_cuda():
    have, pins = installed_set(), sglang_pins()
    # sglang 0.5.23 needs cuda-python >= 13 and cu13 kernels: its torch is the CUDA 13 build.
    cuda = int(str(next(iter(pins["cuda-python"].specifier)).version).split(".")[0])
    assert cuda == 13
    mooncakes = sorted(n for n in have if n.startswith("mooncake"))
    # Not mooncake-transfer-engine (CUDA 12: libcudart.so.12) nor the -non-cuda build: one `mooncake`.
    assert mooncakes == [f"mooncake-transfer-engine-cuda{cuda}"]
    cpu_build = [r for r in GR.tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
                 ["optional-dependencies"]["cpu"] if r.startswith("mooncake")]
    # The same Mooncake release as the CPU build the tests run: the same API.
    assert [str(Requirement(r).specifier) for r in cpu_build] == [str(have[mooncakes[0]].specifier)]
    # pip install '.[gpu]' names the same builds as make gpu-env.
    extra = GR.tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    for r in map(Requirement, extra):
        assert GR.name_of(r.name) in have and str(have[GR.name_of(r.name)].specifier) == str(r.specifier), r


def test_the_gpu_set_has_every_dependency_gyre_imports():
    have = installed_set()
    for dep in GR.gyre_dependencies():
        assert GR.name_of(dep) in have, f"{dep} (pyproject.toml) is missing from the GPU environment"
    assert "tensorboard" in have  # logger=tensorboard, the default logger, imports it
    assert str(have["megatron-core"].specifier) == "==0.16.1"


@pytest.mark.parametrize("line,name", [("Foo_Bar.baz>=1", "foo-bar-baz"), ("torch==2.14.1", "torch")])
def test_names_fold_as_pip_folds_them(line, name):
    assert GR.name_of(line) == name
