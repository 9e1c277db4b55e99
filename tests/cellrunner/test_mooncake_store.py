"""The run's Mooncake Store processes: their command lines, and a start that fails in words."""

from __future__ import annotations

import psutil
import pytest

from cellrunner import mooncake_store
from cellrunner.mooncake_store import (
    METADATA_SERVER, KVTierUnavailable, MooncakeMaster, memory_holder_command, mooncake_master_command,
)
from tests.cellrunner.test_kv_tier import _require_store


def test_the_master_evicts_and_serves_no_metadata_of_its_own():
    cmd = mooncake_master_command("/bin/mooncake_master", host="10.0.0.5", rpc_port=50051, metrics_port=9003)
    assert cmd[0] == "/bin/mooncake_master"
    assert {"--rpc_address=10.0.0.5", "--rpc_port=50051", "--metrics_host=10.0.0.5", "--metrics_port=9003",
            "--eviction_high_watermark_ratio=0.95", "--eviction_ratio=0.05",
            "--enable_http_metadata_server=false"} <= set(cmd)
    with pytest.raises(ValueError, match="ratios in"):
        mooncake_master_command("m", host="h", rpc_port=1, metrics_port=2, eviction_ratio=0.0)
    with pytest.raises(ValueError, match="port in 1..65535"):
        mooncake_master_command("m", host="h", rpc_port=0, metrics_port=2)


def test_a_memory_holder_lends_memory_and_buffers_nothing():
    cmd = memory_holder_command("c", host="h", port=7, segment_bytes=1 << 30, master_address="m:1")
    assert {"--global_segment_size=1073741824", "--local_buffer_size=0", f"--metadata_server={METADATA_SERVER}",
            "--master_server_address=m:1", "--protocol=tcp"} <= set(cmd)
    assert not any(a.startswith("--device_names") for a in cmd)  # NICs only with RDMA
    rdma = memory_holder_command("c", host="h", port=7, segment_bytes=1, master_address="m:1", protocol="rdma",
                                 device_name="mlx5_0")
    assert "--device_names=mlx5_0" in rdma
    with pytest.raises(ValueError, match="segment_bytes >= 1"):
        memory_holder_command("c", host="h", port=7, segment_bytes=0, master_address="m:1")


def test_the_running_store_is_started_from_these_command_lines_and_stops_whole():
    _require_store()
    with MooncakeMaster(segment_bytes=16 << 20) as master:
        children = psutil.Process().children()
        running = [p.cmdline() for p in children if p.pid in {q.pid for q in master._processes}]
        assert [c[0].rsplit("/", 1)[-1] for c in running] == ["mooncake_master", "mooncake_client"]
        assert "--eviction_high_watermark_ratio=0.95" in running[0]
        assert f"--master_server_address={master.master_address}" in running[1]
        pids = [p.pid for p in master._processes]
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids)


def test_a_master_that_cannot_start_says_so_with_its_log(monkeypatch):
    _require_store()
    real = mooncake_store.mooncake_master_command
    monkeypatch.setattr(mooncake_store, "mooncake_master_command",
                        lambda *a, **k: [*real(*a, **k), "--no_such_flag=1"])
    with pytest.raises(KVTierUnavailable, match="mooncake_master exited .*last log line"):
        MooncakeMaster(segment_bytes=0, start_timeout_s=10)
