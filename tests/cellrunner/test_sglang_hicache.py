"""engine.kv_tier: SGLang's HiCache with Mooncake Store as the run's shared L3, checked on CPU.

- The command line parses with the pinned SGLang's own ``ServerArgs`` parser, to the values
  SGLang then holds, and the Mooncake config it carries is read by the backend's own config code
  as meant (both run from the wheel in a process of their own: ``tests/support/sglang_wheel_probe.py``).
- The wheel's source still keys pages the way the per-version tag relies on, and the re-attach
  routes still take the bodies the engine sends (``tests/support/sglang_contract.py``).
- Bad combinations stop in ``engine.kv_tier``'s check, in words.
- A whole lifecycle against the SGLang stand-in: no load ever runs with the store attached, and
  after each load the store is back under the new version's tag.
- The run's ``mooncake_master`` and a memory holder start from the command lines built here, and
  take a client set up with the values SGLang's backend reads from our config.

No GPU: what SGLang does with these pages is not exercised (cellrunner/GPU.md). Without the pinned
wheel or the Mooncake binaries, those tests skip on a workstation and fail in CI (``CI=true``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import msgspec
import psutil
import pytest
import yaml

from base.typed_config import ConfigError, build
from cellrunner import sglang_hicache
from cellrunner.config import SGLangKVTierConfig
from cellrunner.engine_sglang import SGLangEngine, SGLangError, launch_command
from cellrunner.mooncake_store import MooncakeMaster
from tests.cellrunner.test_kv_tier import _require_store
from tests.cellrunner.test_engine_sglang import (  # noqa: F401 (fake_sglang is a fixture)
    KEY, ROOT, fake_sglang, generate, make_engine, sglang_cfg, weights,
)

IN_CI = os.environ.get("CI") == "true"
MASTER = "10.0.0.1:50051"
HOST = "10.0.0.7"
TP = 4


def tier_dict(**over) -> dict:
    """conf/engine/sglang.yaml's kv_tier, turned on, with the run's master given."""
    base = yaml.safe_load(open(ROOT / "conf/engine/sglang.yaml"))["kv_tier"]
    return {**base, "enabled": True, "master_address": MASTER, **over}


def tier(**over) -> SGLangKVTierConfig:
    return build(SGLangKVTierConfig, tier_dict(**over))


def command(tmp_path: Path, *, model_name: str = "qwen3_8b", **over) -> list[str]:
    cfg = sglang_cfg(tmp_path, tp_size=TP, kv_tier=tier_dict(**over))
    return launch_command(cfg, model_path=str(tmp_path / "init"), host=HOST, port=30001, max_running=64, seed=5,
                          dummy_weights=True, served_model_name=model_name)


def flags_of(cmd: list[str]) -> dict[str, str]:
    """``--flag value`` pairs after the launcher (``python -c <code>``), and ``--switch``: ""."""
    args, out = cmd[3:], {}
    for i, a in enumerate(args):
        if a.startswith("--"):
            nxt = args[i + 1] if i + 1 < len(args) else "--"
            out[a] = "" if nxt.startswith("--") else nxt
    return out


# ---------------------------------------------------------------- the command line


def test_off_by_default_and_nothing_added(tmp_path):
    assert build(SGLangKVTierConfig, yaml.safe_load(open(ROOT / "conf/engine/sglang.yaml"))["kv_tier"]).enabled is False
    cmd = launch_command(sglang_cfg(tmp_path), model_path="/m", host="h", port=1, max_running=1, seed=0,
                         dummy_weights=False)
    assert not any(a.startswith(("--hicache", "--enable-hierarchical-cache", "--page-size", "--served-model-name"))
                   for a in cmd)
    assert "--admin-api-key" not in cmd[2]  # the key goes in as --api-key only, as before


def test_the_flags_and_the_store_config(tmp_path):
    cmd = command(tmp_path)
    # the launcher adds the run's key as --api-key and --admin-api-key inside the process
    assert "['--api-key', '--admin-api-key']" in cmd[2] and "runpy.run_module('sglang.launch_server'" in cmd[2]
    flags = flags_of(cmd)
    assert {k: v for k, v in flags.items() if k.startswith(("--hicache", "--enable-hierarchical", "--page-size",
                                                             "--served-model-name"))} == {
        "--enable-hierarchical-cache": "",
        "--page-size": "64",
        "--hicache-ratio": "2.0",
        "--hicache-write-policy": "write_through",
        "--hicache-mem-layout": "page_first",
        "--hicache-io-backend": "kernel",
        "--hicache-storage-backend": "mooncake",
        "--hicache-storage-prefetch-policy": "timeout",
        "--hicache-storage-backend-extra-config": flags["--hicache-storage-backend-extra-config"],
        "--served-model-name": "qwen3_8b",
    }
    assert json.loads(flags["--hicache-storage-backend-extra-config"]) == {
        "master_server_address": MASTER, "metadata_server": "P2PHANDSHAKE", "protocol": "tcp", "device_name": "",
        "global_segment_size": 0, "check_server": False, "extra_backend_tag": f"gyre-tp{TP}-p64-page_first-boot",
    }
    assert sglang_hicache.server_env(HOST) == {"MOONCAKE_LOCAL_HOSTNAME": HOST}

    sized = flags_of(command(tmp_path, host_ratio=0.0, host_size_gb=200, mem_layout="page_first_direct",
                             io_backend="direct", protocol="rdma", device_name="mlx5_0,mlx5_1",
                             master_metrics_port=9003))
    assert sized["--hicache-size"] == "200" and "--hicache-ratio" not in sized
    assert (sized["--hicache-mem-layout"], sized["--hicache-io-backend"]) == ("page_first_direct", "direct")
    extra = json.loads(sized["--hicache-storage-backend-extra-config"])
    assert (extra["protocol"], extra["device_name"]) == ("rdma", "mlx5_0,mlx5_1")
    assert (extra["check_server"], extra["master_metrics_port"]) == (True, 9003)
    lent = json.loads(flags_of(command(tmp_path, server_segment_bytes=1 << 30))["--hicache-storage-backend-extra-config"])
    assert (lent["global_segment_size"], lent["check_server"]) == (1 << 30, False) and "master_metrics_port" not in lent


def test_each_version_has_a_tag_of_its_own():
    t = tier()
    tags = {sglang_hicache.storage_tag(t, tp_size=TP, version=v) for v in (None, 0, 1, 10)}
    assert len(tags) == 4 and sglang_hicache.storage_tag(t, tp_size=TP, version=7) == "gyre-tp4-p64-page_first-w7"
    assert sglang_hicache.storage_tag(t, tp_size=8, version=7) != sglang_hicache.storage_tag(t, tp_size=4, version=7)
    body = sglang_hicache.attach_body(t, tp_size=TP, version=7)
    assert body["hicache_storage_backend"] == "mooncake" and body["hicache_write_policy"] == "write_through"
    assert json.loads(body["hicache_storage_backend_extra_config_json"])["extra_backend_tag"] == "gyre-tp4-p64-page_first-w7"


@pytest.mark.parametrize(("over", "message"), [
    ({"page_size": 0}, "page_size: want >= 1"),
    ({"host_size_gb": 100}, "exactly one of host_ratio"),
    ({"host_ratio": 0.0}, "exactly one of host_ratio"),
    ({"write_policy": "write_back"}, "write_back puts a page in the shared L3 only when"),
    ({"write_policy": "write_around"}, "write_policy: want one of"),
    ({"mem_layout": "layer_first"}, "cannot store layer_first pages"),
    ({"io_backend": "direct"}, "mem_layout page_first goes with io_backend kernel"),
    ({"mem_layout": "page_first_direct"}, "mem_layout page_first_direct goes with io_backend direct"),
    ({"master_address": "10.0.0.1"}, "master_address: want host:port"),
    ({"master_address": "h:99999"}, "master_address: want host:port"),
    ({"master_metrics_port": -1}, "master_metrics_port: want 0..65535"),
    ({"segment_bytes": -1}, "want >= 0 and not both 0"),
    ({"segment_bytes": 0}, "want >= 0 and not both 0 (the store needs memory)"),
    ({"server_segment_bytes": 1 << 30, "master_metrics_port": 9003}, "would wait for its own segment"),
    ({"namespace": "a_b"}, "namespace: want letters, digits"),
    ({"namespace": ""}, "namespace: want letters, digits"),
    ({"protocol": "efa"}, "protocol: want one of"),
])
def test_bad_settings_are_refused_in_words(over, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        tier(**over)


def test_flags_from_two_sources_and_a_store_without_versions_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="--hicache-storage-backend keeps no weight version"):
        sglang_cfg(tmp_path, extra_args=["--hicache-storage-backend", "mooncake"])
    with pytest.raises(ConfigError, match=r"\['--hicache-ratio', '--page-size'\] are set by engine.kv_tier"):
        sglang_cfg(tmp_path, kv_tier=tier_dict(), extra_args=["--page-size", "16", "--hicache-ratio=3"])
    assert sglang_cfg(tmp_path, extra_args=["--enable-hierarchical-cache"]).kv_tier.enabled is False  # L1+L2 only
    with pytest.raises(ValueError, match="master_address: empty; the run fills it in"):
        command(tmp_path, master_address="")
    with pytest.raises(ValueError, match="served model name without ':'"):
        command(tmp_path, model_name="org:model")
    with pytest.raises(ValueError, match="--admin-api-key"):
        SGLangEngine(sglang_cfg(tmp_path, kv_tier=tier_dict()), model_cfg=None, vocab_size=1, host="h", port=0,
                     cell_id=0, max_running=1, seed=0, log_dir=str(tmp_path), api_key="")


# ---------------------------------------------------------------- SGLang's own code, from the wheel


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    """What the pinned wheel's parser and Mooncake config code make of our command lines."""
    from tests.support import sglang_contract

    sglang_contract.wheel_root()  # skips (fails in CI) without the pinned wheel
    tmp = tmp_path_factory.mktemp("probe")
    cmds = {
        "default": command(tmp),
        "sized": command(tmp, host_ratio=0.0, host_size_gb=200, mem_layout="page_first_direct", io_backend="direct",
                         protocol="rdma", device_name="mlx5_0", server_segment_bytes=1 << 30),
        "off": launch_command(sglang_cfg(tmp, tp_size=TP), model_path="/m", host=HOST, port=1, max_running=1, seed=0,
                              dummy_weights=True),
    }
    keys = ["--api-key", KEY, "--admin-api-key", KEY]  # what the launcher appends in the process
    argvs = [cmd[3:] + keys for cmd in cmds.values()] + [cmds["default"][3:] + ["--hicache-storage-backend", "s3"]]
    extras = [flags_of(cmds["default"])["--hicache-storage-backend-extra-config"],
              sglang_hicache.attach_body(tier(), tp_size=TP, version=3)["hicache_storage_backend_extra_config_json"]]
    request = {"argv": argvs, "extra_configs": extras, "env": sglang_hicache.server_env(HOST)}
    run = subprocess.run([sys.executable, str(ROOT / "tests/support/sglang_wheel_probe.py")], input=json.dumps(request),
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    return {"parsed": dict(zip([*cmds, "bad"], out["parsed"])), "mooncake": out["mooncake"], "cmds": cmds}


def test_sglangs_own_parser_takes_the_command_line(probe):
    parsed = probe["parsed"]
    assert parsed["bad"] == {"ok": False, "error": parsed["bad"]["error"]}  # it does refuse what SGLang refuses
    assert "argument --hicache-storage-backend: invalid choice: 's3'" in parsed["bad"]["error"]
    for name in ("default", "sized", "off"):
        assert parsed[name]["ok"], parsed[name]
    v = parsed["default"]["values"]
    assert (v["enable_hierarchical_cache"], v["page_size"], v["hicache_ratio"], v["hicache_size"]) == (True, 64, 2.0, 0)
    assert (v["hicache_write_policy"], v["hicache_mem_layout"], v["hicache_io_backend"]) == \
        ("write_through", "page_first", "kernel")
    assert (v["hicache_storage_backend"], v["hicache_storage_prefetch_policy"]) == ("mooncake", "timeout")
    assert v["hicache_storage_backend_extra_config"] == flags_of(probe["cmds"]["default"])[
        "--hicache-storage-backend-extra-config"]
    assert (v["served_model_name"], v["api_key"], v["admin_api_key"]) == ("qwen3_8b", KEY, KEY)
    assert (v["tp_size"], v["load_format"], v["enable_memory_saver"], v["skip_tokenizer_init"]) == (TP, "dummy", True, True)
    s = parsed["sized"]["values"]
    assert (s["hicache_size"], s["hicache_ratio"], s["hicache_mem_layout"], s["hicache_io_backend"]) == \
        (200, None, "page_first_direct", "direct")
    off = parsed["off"]["values"]
    assert (off["enable_hierarchical_cache"], off["hicache_storage_backend"], off["page_size"]) == (False, None, None)


def test_the_mooncake_backend_reads_our_config_as_meant(probe):
    start, attach = probe["mooncake"]
    want = {"local_hostname": HOST, "metadata_server": "P2PHANDSHAKE", "global_segment_size": 0, "protocol": "tcp",
            "device_name": "", "master_server_address": MASTER, "master_metrics_port": 9003, "check_server": False,
            "standalone_storage": False, "tenant_id": "default"}
    for got in (start, attach):
        assert {k: got["config"][k] for k in want} == want
    # the tag survives the extra config's parsing, and it is what names the version
    assert start["extra_config"]["extra_backend_tag"] == f"gyre-tp{TP}-p64-page_first-boot"
    assert attach["extra_config"]["extra_backend_tag"] == f"gyre-tp{TP}-p64-page_first-w3"


def test_every_key_we_send_is_one_the_backend_reads():
    from tests.support import sglang_contract

    store = "srt/mem_cache/storage/mooncake_store/mooncake_store.py"
    read = set()
    for fn, cls in (("load_from_extra_config", "MooncakeStoreConfig"), ("__init__", "MooncakeStore")):
        src = sglang_contract.function_source(store, fn, cls)
        read |= set(re.findall(r'extra_config(?:\.get\(|\[)\s*"(\w+)"', src))
    sent = json.loads(sglang_hicache.attach_body(tier(), tp_size=TP, version=1)["hicache_storage_backend_extra_config_json"])
    assert set(sent) <= read, set(sent) - read


def test_the_wheel_still_keys_pages_as_the_tag_relies_on():
    """The mechanism, as the pinned source has it: the tag is the key prefix; flushing after a
    weight update leaves the L3 alone; the store is re-attached with a new config only through
    the admin routes, which take the bodies the engine sends."""
    from tests.support import sglang_contract as c

    store = "srt/mem_cache/storage/mooncake_store/mooncake_store.py"
    init = c.function_source(store, "__init__", "MooncakeStore")
    assert 'extra_config.get("extra_backend_tag")' in init and "storage_config.model_name" in init
    assert "self.config_prefix" in c.function_source(store, "_tag_keys", "MooncakeStore")
    flush = c.function_source("srt/managers/scheduler.py", "flush_cache", "Scheduler")
    assert "tree_cache.reset()" in flush and "storage" not in flush and "remove_all" not in flush
    update = c.function_source("srt/managers/scheduler_components/weight_updater.py", "update_weights_from_disk",
                               "SchedulerWeightUpdaterManager")
    assert "flush_cache_after_weight_update" in update and "storage" not in update

    http = "srt/entrypoints/http_server.py"
    assert c.route_handler("/hicache/storage-backend", "PUT") == "attach_hicache_storage_backend"
    assert c.route_handler("/hicache/storage-backend", "DELETE") == "detach_hicache_storage_backend"
    for handler in ("attach_hicache_storage_backend", "detach_hicache_storage_backend"):
        assert "admin_api_key" in c.function_source(http, handler)
    c.check_body("/hicache/storage-backend", sglang_hicache.attach_body(tier(), tp_size=TP, version=2), method="PUT")
    assert c.route_body_type("/hicache/storage-backend", "DELETE") is None
    with pytest.raises(msgspec.ValidationError):
        c.check_body("/hicache/storage-backend", {"hicache_storage_backend": "mooncake", "tag": "x"}, method="PUT")


# ---------------------------------------------------------------- the engine, against the stand-in


def kv_engine(tmp_path: Path) -> SGLangEngine:
    return make_engine(tmp_path, kv_tier=tier_dict(master_address="127.0.0.1:50051"))


def tag(version: int | None) -> str:
    return sglang_hicache.storage_tag(tier(), tp_size=1, version=version)


def test_no_load_runs_with_the_store_attached(tmp_path, fake_sglang):
    from tests.support import sglang_contract

    engine = kv_engine(tmp_path)
    engine.start()
    try:
        rec = fake_sglang()
        assert rec["argv"][-4:] == ["--api-key", KEY, "--admin-api-key", KEY]
        server = psutil.Process(engine.process.proc.pid)
        assert all(KEY not in " ".join(p.cmdline()) for p in [server, *server.children(recursive=True)])
        assert rec["mooncake_local_hostname"] == "127.0.0.1" and rec["l3_tag"] == tag(None)

        engine.resume(weights(0))
        rec = fake_sglang()
        assert [c[0] for c in rec["calls"]] == ["detach_hicache_storage", "update_weights_from_disk",
                                               "attach_hicache_storage"]
        assert rec["l3_tag"] == tag(0)

        # An update while serving: a running call is aborted (SGLang swaps the store only when
        # idle), the load runs detached, the store comes back tagged v1, serving goes on.
        replies: list[dict] = []
        running = threading.Thread(target=lambda: replies.append(generate(engine.url, 2000)))
        running.start()
        deadline = time.monotonic() + 10
        while engine.num_running() < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        calls_before = len(fake_sglang()["calls"])
        engine.update_weights(weights(1))
        running.join(10)
        assert replies[0]["meta_info"]["finish_reason"]["type"] == "abort"
        rec = fake_sglang()
        names = [c[0] for c in rec["calls"][calls_before:]]
        assert names[0] == "pause_generation" and rec["calls"][calls_before][1] == {"mode": "abort"}
        assert names[-4:] == ["detach_hicache_storage", "update_weights_from_disk", "attach_hicache_storage",
                              "continue_generation"]
        assert set(names[1:-4]) == {"flush_cache"}
        assert rec["l3_tag"] == tag(1) and generate(engine.url, 1)["meta_info"]["weight_version"] == "1"

        calls_before = len(rec["calls"])
        engine.release()
        engine.resume(weights(2))
        rec = fake_sglang()
        assert [c[0] for c in rec["calls"][calls_before:]] == [
            "pause_generation", "flush_cache", "release_memory_occupation", "resume_memory_occupation",
            "flush_cache", "detach_hicache_storage", "update_weights_from_disk", "resume_memory_occupation",
            "attach_hicache_storage", "continue_generation",
        ]
        assert rec["tags_at_load"] == [None, None, None] and rec["l3_tag"] == tag(2)
        for name, body in rec["calls"]:
            if name == "attach_hicache_storage":
                sglang_contract.check_body("/hicache/storage-backend", body, method="PUT")
    finally:
        engine.stop()


def test_a_failed_load_leaves_the_server_serving_without_the_store(tmp_path, fake_sglang):
    engine = kv_engine(tmp_path)
    engine.start()
    try:
        engine.resume(weights(0))
        urllib.request.urlopen(urllib.request.Request(
            engine.url + "/fake/mode", data=json.dumps({"mode": "not_json"}).encode(), method="POST",
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}), timeout=10).close()
        with pytest.raises(SGLangError, match="update_weights_from_disk: reply is not JSON"):
            engine.update_weights(weights(1))
        rec = fake_sglang()
        assert rec["calls"][-1][0] == "continue_generation" and rec["l3_tag"] is None
    finally:
        engine.stop()


# ---------------------------------------------------------------- the run's store, for real


def test_the_run_store_starts_and_serves_a_client_set_up_as_sglang_does(probe):
    """The run's store (``MooncakeMaster``: the master and a memory holder); then a store client
    set up with the values SGLang's backend read from our config (``MooncakeStore.__init__`` calls
    ``setup`` with them), writing and reading a page key under the version's tag."""
    _require_store()
    from mooncake.store import MooncakeDistributedStore

    with MooncakeMaster(segment_bytes=32 << 20, host="127.0.0.1") as master:
        read = dict(probe["mooncake"][1]["config"], master_server_address=master.master_address,
                    local_hostname=master.host)
        store = MooncakeDistributedStore()
        assert store.setup(read["local_hostname"], read["metadata_server"], read["global_segment_size"], 16 << 20,
                           read["protocol"], read["device_name"], read["master_server_address"], None) == 0
        key = f"{probe['mooncake'][1]['extra_config']['extra_backend_tag']}_qwen3_8b_page0_0_k"
        assert store.put(key, b"kv" * 1000) == 0
        assert store.get(key) == b"kv" * 1000 and store.is_exist(key) == 1
        assert store.is_exist(key.replace("-w3_", "-w4_")) != 1  # another version's key: a miss
        store.close()
