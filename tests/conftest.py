"""Test lanes. ``make test`` runs everything; ``make test-fast`` (the edit loop, a few minutes on
2 cores) leaves out ``e2e`` tests, the ``tests/slurm`` folder, and the files below marked
``slow``: they start several processes (ranks of a cell, SGLang stand-ins, Mooncake engines),
run the real harness binaries or sandboxes, or search with hypothesis for tens of seconds. Each
of them still runs in ``make test``, which CI runs, spread over pytest-xdist workers."""

from __future__ import annotations

from pathlib import Path

import pytest

SLOW_FILES = {
    # several processes: ranks of a cell over gloo, SGLang stand-ins, Mooncake engines
    "cellrunner/test_spmd.py", "cellrunner/test_spmd_trainer.py", "cellrunner/test_megatron_trainer.py",
    "cellrunner/test_megatron_scale.py", "cellrunner/test_megatron_resume.py",
    "cellrunner/test_megatron_offload_export.py", "cellrunner/test_cell_servers.py",
    "cellrunner/test_engine_sglang.py", "cellrunner/test_transfer_mooncake.py", "cellrunner/test_mooncake_slots.py",
    "cellrunner/test_export_dtype.py", "cellrunner/test_kv_tier.py", "cellrunner/test_engine_kv_tier.py", "cellrunner/test_command_timeout.py", "cellrunner/test_cell_heartbeat.py",
    "cellrunner/test_hf_checkpoint.py", "cellrunner/test_checkpoint.py",
    # real harness binaries, the proxy restarted under them
    "harness_proxy/test_harnesses.py", "harness_proxy/test_claude_code.py", "harness_proxy/test_qwen_code.py", "harness_proxy/test_mini_swe_agent.py",
    "harness_proxy/test_proxy_restart.py", "harness_proxy/test_main.py", "harness_proxy/test_engine_client.py",
    # sandboxes and graders running real test suites
    "workloads/test_taskset_pkgbugs.py", "workloads/test_taskset_pyfix.py", "workloads/test_grader_tests.py",
    "workloads/test_harness.py", "controller/test_executions.py", "controller/test_preflight.py",
    # benchmarks that start engines, proxies under load, or transfers between processes
    "bench/test_bench_transfer_switch.py", "bench/test_bench_proxy_load.py", "bench/test_bench_kv_reuse.py",
    "cellrunner/test_sglang_hicache.py",
    # long searches and whole simulations
    "controller/test_scheduler_properties.py", "controller/test_bounds.py", "controller/test_loggers.py",
    "base/test_lifecycle.py", "trajectory/test_main_process.py",
    # system packages beyond the venv: bubblewrap, cgroups, apptainer, chromium
    "workloads/test_sandbox_aftercare.py", "workloads/test_sandbox_apptainer.py", "workloads/test_sandbox_bwrap.py",
    "workloads/test_sandbox_cgroups.py", "workloads/test_sandbox_inner.py", "workloads/test_taskset_swe.py",
    "viewer/test_chromium.py",
}
TESTS = Path(__file__).resolve().parent


# Folders whose files share one session-scoped thing, so they run on one pytest-xdist worker
# (make test runs several): the local Slurm cluster that the first slurm test brings up and that
# worker's session end takes down; the viewer's one real Claude Code run.
SHARED_FOLDERS = ("tests/slurm/", "tests/viewer/")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: left out of make test-fast (tests/conftest.py says which and why)")
    if config.pluginmanager.hasplugin("xdist"):  # its hook exists only with it
        config.pluginmanager.register(_FileScheduling(), "gyre-file-scheduling")


class _FileScheduling:
    @staticmethod
    def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
        """Each test file whole on one worker (its tests share module fixtures: engines, proxies),
        and each SHARED_FOLDERS folder whole on one."""
        from xdist.scheduler import LoadScopeScheduling

        class FileOrFolder(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                path = nodeid.split("::", 1)[0]
                return next((folder for folder in SHARED_FOLDERS if path.startswith(folder)), path)

        return FileOrFolder(config, log)  # type: ignore[arg-type]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        rel = Path(str(item.fspath)).resolve().relative_to(TESTS).as_posix()
        if rel in SLOW_FILES or rel.startswith(("slurm/", "e2e/")):
            item.add_marker(pytest.mark.slow)
    # The longest first (the Slurm folder, whole runs, then other slow files), so that xdist's
    # workers do not end on one long file while the others idle; the order within a file stays.
    items.sort(key=lambda item: _weight(Path(str(item.fspath)).resolve().relative_to(TESTS).as_posix()))


LONGEST_FILES = ("e2e/test_resume_loop.py", "e2e/test_megatron_cells.py", "e2e/test_harness_runs.py",
                 "e2e/test_kill_services.py")
"""Files of several minutes each (``--durations`` in CI): they start before the rest, else one
of them left to the end runs alone while the other workers idle (the ten-kill resume loop did)."""


def _weight(rel: str) -> int:
    if rel in LONGEST_FILES:
        return LONGEST_FILES.index(rel) - len(LONGEST_FILES)  # in the order listed
    if rel.startswith("slurm/"):
        return 0
    if rel.startswith("e2e/"):
        return 1
    return 2 if rel in SLOW_FILES else 3
