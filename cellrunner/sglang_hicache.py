"""SGLang's HiCache with Mooncake Store as the L3 tier every server of the run shares.

What it builds, all pure: the ``sglang.launch_server`` flags of ``engine.kv_tier``, the Mooncake
config those flags carry, the environment a server part needs, and the body that re-attaches the
store at a new weight version. The store's own processes (``mooncake_master`` and the memory
holders) are ``cellrunner.mooncake_store``'s.

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

from cellrunner.config import SGLangKVTierConfig
from cellrunner.mooncake_store import METADATA_SERVER

STORAGE_BACKEND = "mooncake"
"""``--hicache-storage-backend``: one of the choices in ``srt/arg_groups/fields/memory.py``."""
BOOT_TAG = "boot"
"""The tag a server starts with: its weights are the start-up ones (dummy, or the checkpoint's),
which no loaded version shares. ``/health`` runs a one-token generation, whose page may land here."""
LOCAL_HOSTNAME_ENV = "MOONCAKE_LOCAL_HOSTNAME"


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
