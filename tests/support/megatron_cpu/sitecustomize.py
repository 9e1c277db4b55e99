"""Test support only: megatron-core's CPU shims in *every* process of a test run.

A test that runs the whole system with ``trainer=megatron`` on CPU puts this folder on
``PYTHONPATH`` and sets ``GYRE_TEST_MEGATRON_CPU_SHIMS=1``; Python imports ``sitecustomize`` at
start-up, so the cellrunners (and their follower ranks) get ``tests/cellrunner/megatron_cpu_shims``
installed before any Gyre code runs. Production code never sees it: ``cellrunner/`` runs on CUDA
unpatched.
"""

import os
import sys

if os.environ.get("GYRE_TEST_MEGATRON_CPU_SHIMS") == "1":
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    if root not in sys.path:
        sys.path.append(root)
    from tests.cellrunner import megatron_cpu_shims

    megatron_cpu_shims.install()
