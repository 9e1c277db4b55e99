"""The trajectory package loads no other Gyre package but the wire, typed-config, (stdlib-only)
child-lifecycle and CURVE-key (zmq-only) modules."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.trajectory import REPO

CHECK = """
import json, sys
import trajectory.tree, trajectory.sampling, trajectory.samples, trajectory.advantages
import trajectory.log, trajectory.processor, trajectory.main
print(json.dumps(sorted(m for m in sys.modules)))
"""
OTHER_PACKAGES = ("cellrunner", "harness_proxy", "workloads", "bench")
ALLOWED_CONTROLLER = {"controller", "controller.wire", "controller.typed_config", "controller.lifecycle",
                      "controller.curve"}


def test_only_wire_and_typed_config_are_loaded() -> None:
    out = subprocess.run(
        [sys.executable, "-c", CHECK], cwd=REPO, capture_output=True, text=True, check=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    modules = set(json.loads(out.stdout))
    assert not {m for m in modules if m.split(".")[0] in OTHER_PACKAGES}
    assert {m for m in modules if m.split(".")[0] == "controller"} <= ALLOWED_CONTROLLER
    assert not {"torch", "aiohttp", "transformers"} & modules
