"""SGLang's HiCache with Mooncake Store as the L3 tier every server of the run shares.

What it builds, all pure except the two ``start_*`` functions: the ``sglang.launch_server`` flags
of ``engine.kv_tier``, the Mooncake config those flags carry, the environment a server part needs,
the body that re-attaches the store at a new weight version, and the command lines of the run's
store processes (``mooncake_master`` and the memory holders).

Why a new backend per weight version (read in the pinned sglang 0.5.23 wheel):

- ``srt/mem_cache/storage/mooncake_store/mooncake_store.py``, ``MooncakeStore.__init__``: the key
  prefix is ``<extra_backend_tag>_<served model name>``, fixed when the backend is made;
  ``_tag_keys`` puts it before every page key. The weight version is not part of it.
- ``srt/managers/scheduler_components/weight_updater.py``, ``update_weights_from_disk``: after a
  load it calls the scheduler's ``flush_cache``, which resets the radix tree and the host pool
  (``srt/mem_cache/unified_radix_cache.py``, ``_reset_full``) and leaves the L3 as it is.
- ``srt/entrypoints/http_server.py``, ``attach_hicache_storage_backend`` /
  ``detach_hicache_storage_backend`` (``PUT`` / ``DELETE /hicache/storage-backend``): a new backend
  with a new extra config, so a new tag. Both need ``--admin-api-key`` and an idle scheduler
  (``srt/managers/scheduler.py``, ``attach_hicache_storage_wrapped``).
- ``POST /hicache/storage-backend/clear`` is no substitute: it empties the whole store
  (``MooncakeStore.clear`` -> ``remove_all``), and other cells, still at the old version, would
  write old pages under the same keys again.

So a server detaches the store before it loads version v and attaches it again with a tag naming v
(``cellrunner.engine_sglang.SGLangServer``): a server at v never asks for a key written at v - 1.
The old pages stay until the master's eviction drops them.

The store's memory: the pages live in memory holders (``mooncake_client``) the run starts with
its master (``segment_bytes``); a server lends none by default (``server_segment_bytes``). Mooncake
keeps an object in the segment of the client that allocated it, and a server's own segment goes
with its backend, that is at every version switch.

Nothing here imports sglang or mooncake; it runs in the cellrunner and the controller.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from cellrunner.config import SGLangKVTierConfig

STORAGE_BACKEND = "mooncake"
"""``--hicache-storage-backend``: one of the choices in ``srt/arg_groups/fields/memory.py``."""
METADATA_SERVER = "P2PHANDSHAKE"
"""Peers exchange transfer metadata in a handshake: no etcd and no HTTP metadata server to run."""
BOOT_TAG = "boot"
"""The tag a server starts with: its weights are the start-up ones (dummy, or the checkpoint's),
which no loaded version shares. ``/health`` runs a one-token generation, whose page may land here."""
LOCAL_HOSTNAME_ENV = "MOONCAKE_LOCAL_HOSTNAME"
EVICTION_HIGH_WATERMARK_RATIO = 0.95
"""Memory use at which the master starts evicting: the backend's README suggests 0.95 for HiCache."""
EVICTION_RATIO = 0.05
"""Share of objects evicted each time (Mooncake's default)."""
START_TIMEOUT_S = 60.0


# ---------------------------------------------------------------- one server's flags and config


def storage_tag(tier: SGLangKVTierConfig, *, tp_size: int, version: int | None) -> str:
    """The ``extra_backend_tag`` of a server serving ``version`` (None: the start-up weights).

    The TP size, page size and host layout are in it too: the backend's README says the KV format
    and host layout are not in its keys, and a page key holds the TP rank but not the TP size."""
    served = BOOT_TAG if version is None else f"w{version}"
    return f"{tier.namespace}-tp{tp_size}-p{tier.page_size}-{tier.mem_layout}-{served}"


def mooncake_extra_config(tier: SGLangKVTierConfig, *, tp_size: int, version: int | None) -> dict:
    """What ``--hicache-storage-backend-extra-config`` carries to SGLang's Mooncake backend.

    ``MooncakeBaseStore._load_config`` takes the extra config first whenever it names
    ``master_server_address``, and ``MooncakeStoreConfig.load_from_extra_config`` reads the rest,
    falling back to defaults this sets explicitly (``global_segment_size`` would be 4 GB, the
    protocol RDMA). ``local_hostname`` is left out on purpose: the server's environment gives it
    (``server_env``)."""
    if not tier.master_address:
        raise ValueError("engine.kv_tier.master_address: empty; the run fills it in when it starts its "
                         "mooncake_master (or set it to host:port of one that runs)")
    config = {
        "master_server_address": tier.master_address,
        "metadata_server": METADATA_SERVER,
        "protocol": tier.protocol,
        "device_name": tier.device_name if tier.protocol == "rdma" else "",
        "global_segment_size": tier.server_segment_bytes,  # split over the server's TP x PP ranks
        "check_server": bool(tier.master_metrics_port),
        "extra_backend_tag": storage_tag(tier, tp_size=tp_size, version=version),
    }
    if tier.master_metrics_port:
        # MooncakeStore.check_server: wait (up to 10 min) until the master there lists a segment,
        # so a server never starts against a store with no memory.
        config["master_metrics_port"] = tier.master_metrics_port
    return config


def launch_flags(tier: SGLangKVTierConfig, *, tp_size: int, served_model_name: str) -> list[str]:
    """The ``sglang.launch_server`` flags of ``tier`` (enabled), the store tagged ``BOOT_TAG``.

    ``served_model_name`` is the other half of every key prefix (``MooncakeStore.__init__``), and
    SGLang defaults it to ``--model-path``, which differs between servers started without a
    checkpoint (each writes its own config folder): every server of the run must give the same."""
    if not served_model_name or ":" in served_model_name:  # validation_hook.py refuses a colon
        raise ValueError(f"kv_tier: want a served model name without ':', got {served_model_name!r}")
    host_pool = (["--hicache-size", str(tier.host_size_gb)] if tier.host_size_gb
                 else ["--hicache-ratio", repr(tier.host_ratio)])
    config = mooncake_extra_config(tier, tp_size=tp_size, version=None)
    return [
        "--enable-hierarchical-cache",
        "--page-size", str(tier.page_size),
        *host_pool,
        "--hicache-write-policy", tier.write_policy,
        "--hicache-mem-layout", tier.mem_layout,
        "--hicache-io-backend", tier.io_backend,
        "--hicache-storage-backend", STORAGE_BACKEND,
        "--hicache-storage-prefetch-policy", tier.prefetch_policy,
        "--hicache-storage-backend-extra-config", json.dumps(config, sort_keys=True),
        "--served-model-name", served_model_name,
    ]


def server_env(host: str) -> dict[str, str]:
    """The environment one node's part of a server adds: its own address for the store.

    ``MooncakeStoreConfig._resolve_local_hostname`` takes ``MOONCAKE_LOCAL_HOSTNAME`` before any
    config value, and a re-attach's extra config reaches every rank of a server spanning nodes,
    so the address cannot travel in it (the backend's README says so for runtime attach)."""
    return {LOCAL_HOSTNAME_ENV: host}


def attach_body(tier: SGLangKVTierConfig, *, tp_size: int, version: int) -> dict:
    """``PUT /hicache/storage-backend`` (``io_struct.AttachHiCacheStorageReqInput``): the store again,
    its keys tagged with ``version``; the policies restated so the attach cannot change them."""
    config = mooncake_extra_config(tier, tp_size=tp_size, version=version)
    return {
        "hicache_storage_backend": STORAGE_BACKEND,
        "hicache_storage_backend_extra_config_json": json.dumps(config, sort_keys=True),
        "hicache_storage_prefetch_policy": tier.prefetch_policy,
        "hicache_write_policy": tier.write_policy,
    }


# ---------------------------------------------------------------- the run's store processes


def mooncake_master_command(binary: str | Path, *, host: str, rpc_port: int, metrics_port: int,
                            eviction_high_watermark_ratio: float = EVICTION_HIGH_WATERMARK_RATIO,
                            eviction_ratio: float = EVICTION_RATIO) -> list[str]:
    """The run's ``mooncake_master``: the object index and its eviction, no memory of its own.

    ``host`` is an address every server reaches: SGLang connects to ``host:rpc_port`` and polls
    ``http://host:metrics_port/get_all_segments`` (``MooncakeStore.check_server``)."""
    if not 0 < eviction_high_watermark_ratio <= 1 or not 0 < eviction_ratio <= 1:
        raise ValueError(f"mooncake_master: want ratios in (0, 1], got eviction_high_watermark_ratio="
                         f"{eviction_high_watermark_ratio}, eviction_ratio={eviction_ratio}")
    return [
        str(binary),
        f"--rpc_address={host}", f"--rpc_port={_port(rpc_port)}",
        f"--metrics_host={host}", f"--metrics_port={_port(metrics_port)}",
        f"--eviction_high_watermark_ratio={eviction_high_watermark_ratio!r}",
        f"--eviction_ratio={eviction_ratio!r}",
        "--enable_http_metadata_server=false",  # peers use the P2P handshake (METADATA_SERVER)
        "--enable_metric_reporting=false",  # its periodic summary would fill the run's log
    ]


def memory_holder_command(binary: str | Path, *, host: str, port: int, segment_bytes: int, master_address: str,
                          protocol: str = "tcp", device_name: str = "") -> list[str]:
    """One node's ``mooncake_client``: it lends ``segment_bytes`` of that node's memory to the
    store and only serves reads and writes of it (no local buffer: it never puts or gets)."""
    if segment_bytes < 1:
        raise ValueError(f"memory holder: want segment_bytes >= 1, got {segment_bytes}")
    nics = [f"--device_names={device_name}"] if protocol == "rdma" and device_name else []
    return [
        str(binary), f"--host={host}", f"--port={_port(port)}",
        f"--global_segment_size={segment_bytes}", "--local_buffer_size=0",
        f"--metadata_server={METADATA_SERVER}", f"--master_server_address={master_address}",
        f"--protocol={protocol}", *nics,
    ]


def start_mooncake_master(command: list[str], *, host: str, metrics_port: int, log_path: Path,
                          timeout_s: float = START_TIMEOUT_S) -> subprocess.Popen[bytes]:
    """Start the master and return once its HTTP server answers ``/health``; RuntimeError with the
    log's last line if it exits or stays silent. The caller stops it (``stop_store_process``)."""
    url = f"http://{host}:{metrics_port}"
    return _start(command, log_path, lambda: _http_get(url + "/health") is not None, timeout_s)


def start_memory_holder(command: list[str], *, master_host: str, master_metrics_port: int, log_path: Path,
                        timeout_s: float = START_TIMEOUT_S) -> subprocess.Popen[bytes]:
    """Start a memory holder and return once the master lists a segment (until then a put finds no
    space, and SGLang's ``check_server`` keeps waiting)."""
    url = f"http://{master_host}:{master_metrics_port}/get_all_segments"
    return _start(command, log_path, lambda: bool((_http_get(url) or "").strip()), timeout_s)


def stop_store_process(process: subprocess.Popen[bytes], grace_s: float = 5.0) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _start(command: list[str], log_path: Path, ready: Callable[[], bool], timeout_s: float) -> subprocess.Popen[bytes]:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log_file:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while not ready():
        if process.poll() is not None or time.monotonic() > deadline:
            state = f"exited with {process.returncode}" if process.poll() is not None else f"not ready in {timeout_s}s"
            stop_store_process(process)
            raise RuntimeError(f"{Path(command[0]).name} {state}; last log line: {_last_line(log_path)!r}")
        time.sleep(0.05)
    return process


def _port(port: int) -> int:
    if not 0 < port < 65536:
        raise ValueError(f"want a port in 1..65535, got {port}")
    return port


def _http_get(url: str) -> str | None:
    """The body of a GET that answers 200, else None (not up yet, or refused)."""
    try:
        with urllib.request.urlopen(url, timeout=2.0) as response:
            return response.read().decode() if response.status == 200 else None
    except (urllib.error.URLError, OSError):
        return None


def _last_line(path: Path) -> str:
    lines = path.read_text(errors="replace").strip().splitlines()
    return lines[-1] if lines else ""
