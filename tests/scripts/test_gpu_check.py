"""scripts/gpu_check.py's trainer stages on the CPU: a tiny Megatron core on gloo (the shims of
tests/cellrunner/megatron_cpu_shims.py), its offload run on the host as stop() runs it on CUDA.
The GPU figures (seconds per billion parameters, GPU 0's peak, the first out-of-memory length)
come from the GPU check itself; here the same functions run end to end and their results must
say what the check claims: an offloaded core exports what it held, checkpoints, comes back and
takes a step with a non-zero gradient; a Mooncake publisher's slots sit in host memory."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import megatron.core  # noqa: E402,F401  (the [test] extra: missing is a failure, never a skip)

from tests.cellrunner.test_megatron_offload_export import trained_core  # noqa: E402  (installs the shims)
from tests.cellrunner.test_megatron_trainer import VOCAB, make_shard  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


GC = load_gpu_check()


@pytest.fixture(autouse=True)
def _host_sync(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *_: None)  # Megatron's grad-buffer offload calls it


def test_the_cycle_around_serving_ends_in_a_step_with_a_gradient(tmp_path):
    core = trained_core("float32")  # one step in: Adam has moments, the checkpoint carries them
    limits = GC.cluster_limits()
    assert limits == {"heartbeat_timeout_s": 15.0, "start_timeout_s": 900.0}  # conf/cluster/{local,slurm}.yaml
    out = GC.trainer_cycle(core, make_shard(5, step=1), str(tmp_path / "ckpt"), limits)
    assert out["offloaded"] and out["weights_after_stop_equal"]
    assert list(out["ops"]) == ["stop", "weights", "checkpoint", "start", "step"]
    for op in out["ops"].values():
        billions = out["parameters"] / 1e9  # "s" is rounded to 0.1 ms: a fast op's ratio moves by that much
        assert op["s"] > 0 and op["s_per_billion"] == pytest.approx(op["s"] / billions, rel=1e-2, abs=0.6e-4 / billions)
        assert op["billion_within_heartbeat_timeout_s"] > 0
    assert out["nonzero_grad"] and out["grad_l2"] > 0 and out["step_tokens"] > 0
    assert Path(out["checkpoint"]) == tmp_path / "ckpt" / f"v{core.version}" and out["checkpoint_bytes"] > 0
    assert out["heartbeat_kept"] and out["max_tick_gap_s"] < limits["heartbeat_timeout_s"]
    # Back in training: the core still steps, and the version moves on.
    before = core.version
    core.microstep(make_shard(6, step=before))
    w, norm = core.apply([], num_executions=4)
    assert w.version == before + 1 and norm > 0


def test_long_context_steps_report_each_length_until_the_first_failure():
    core = trained_core("float32")
    out = GC.long_context(core, [16, 48], vocab=VOCAB)
    assert out["first_oom"] is None and out["longest_fit"] == 48
    for length in ("16", "48"):
        row = out["lengths"][length]
        assert row["target_tokens"] == int(length) // 2 and row["fwd_bwd_s"] > 0 and row["loss_finite"]
    assert core.num_microsteps == 0  # each step's gradient was taken: the next real step starts clean


def test_one_trajectory_is_one_sequence_of_that_length_with_its_second_half_trained():
    shard = GC.one_trajectory(4096, seed=1)
    (seq,) = shard.sequences
    assert len(seq.tokens) == 4096 and sum(seq.target_mask) == 2048 and seq.target_mask[-1] == 1
    assert all(0 < t < GC.VOCAB for t in seq.tokens)


def test_publisher_slots_stay_off_the_trainers_device():
    core = trained_core("float32")
    w = core.weights(everywhere=False)
    out = GC.publisher_slots_during_step(core, w, make_shard(7, step=core.version), memory="cpu", protocol="tcp",
                                         dtypes=("float32", "bfloat16"))
    fp = out["footprint"]
    assert fp["placement"] == ["host"] and fp["slots"] == 4 and fp["bytes_per_parameter"] == 12.0
    assert out["gpu_bytes_added_by_slots"] == 0 and out["step_grad_nonzero"]


def test_a_tick_watch_sees_a_stall():
    with GC.TickWatch(0.05) as watch:
        import time

        time.sleep(0.2)
    assert 0.04 < watch.max_gap_s < 1.0
    assert np.isfinite(watch.max_gap_s)


def test_the_check_builds_its_configs_from_the_runs_yaml(tmp_path):
    """The check builds SGLang's and Megatron's configs from conf/ as a run does: a field added
    there (with no default) reaches the check instead of breaking it on the GPU machine."""
    args = GC.parser().parse_args(["--work-dir", str(tmp_path)])
    algo, sglang, megatron = GC.stack_configs(args)
    assert (sglang.tp_size, sglang.nnodes, sglang.weight_dir) == (1, 1, str(tmp_path))
    assert (megatron.tensor_model_parallel_size, megatron.params_dtype, megatron.offload_when_serving) == (1, "bfloat16", True)
    assert [int(x) for x in args.long_context.split(",")] == [4096, 8192, 16384, 32768]
    assert args.mooncake_protocols.split(",")[0] == "tcp"  # the TCP pull first: no RDMA NIC needed
