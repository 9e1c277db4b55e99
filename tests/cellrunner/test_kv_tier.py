"""The shared KV tier on a real Mooncake Store: a master and its memory holder on loopback TCP.

A KV put by one process is read bit for bit by another, after the putter has gone; a lookup
gets the longest run of whole pages its prompt shares from token 0; another weight version,
or a value that is not a valid page, is a miss and never an exception. Without the Mooncake
binaries these tests skip on a developer's machine and fail in CI (``CI=true``).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from cellrunner.kv_tier import KV, KVTier, encode_page, page_keys
from cellrunner.mooncake_store import KVTierUnavailable, MooncakeMaster, mooncake_binary

ROOT = Path(__file__).resolve().parents[2]
IN_CI = os.environ.get("CI") == "true"
PAGE = 256
NAMESPACE = "test-kv"
SEGMENT_BYTES = 64 << 20
LOCAL_BUFFER_BYTES = 16 << 20

# The putter: builds the seeded KV that `seeded_kv` builds here, puts it, closes and exits.
PUTTER = r"""
import json, sys
from cellrunner.kv_tier import KVTier
from tests.cellrunner.test_kv_tier import NAMESPACE, seeded_kv, seeded_tokens
master_address, metadata_server, version, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
with KVTier(master_address, metadata_server=metadata_server, namespace=NAMESPACE, local_buffer_bytes=16 << 20) as tier:
    stored = tier.put(version, seeded_tokens(n, seed=version), seeded_kv(n, seed=version))
print(json.dumps({"stored": stored}), flush=True)
"""


def _store_problem() -> str:
    """Why a Mooncake Store cannot run here, or ''."""
    try:
        mooncake_binary("mooncake_master")
        mooncake_binary("mooncake_client")
        import mooncake.store  # noqa: F401
    except (KVTierUnavailable, ImportError) as exc:
        return str(exc)
    return ""


def _require_store() -> None:
    """Skip without a Mooncake Store on a developer's machine; fail in CI, which must run these."""
    problem = _store_problem()
    if problem and IN_CI:
        pytest.fail(f"CI must run this: {problem}")
    if problem:
        pytest.skip(problem)


def seeded_tokens(n: int, *, seed: int) -> list[int]:
    return torch.randint(0, 50_000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def seeded_kv(n: int, *, seed: int, layers: int = 2, heads: int = 2, head_dim: int = 16) -> KV:
    """The KV of n tokens, the same in every process for one seed."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(heads, n, head_dim, generator=g), torch.randn(heads, n, head_dim, generator=g))
            for _ in range(layers)]


def assert_kv_equal(got: KV, want: KV, n: int) -> None:
    assert len(got) == len(want)
    for (gk, gv), (wk, wv) in zip(got, want):
        assert gk.shape == wk[:, :n].shape and torch.equal(gk, wk[:, :n])  # bit for bit
        assert gv.shape == wv[:, :n].shape and torch.equal(gv, wv[:, :n])


@pytest.fixture(scope="module")
def master() -> Iterator[MooncakeMaster]:
    _require_store()
    with MooncakeMaster(segment_bytes=SEGMENT_BYTES) as running:
        yield running


@pytest.fixture(scope="module")
def tier(master: MooncakeMaster) -> Iterator[KVTier]:
    with KVTier(master.master_address, metadata_server=master.metadata_server, namespace=NAMESPACE,
                local_buffer_bytes=LOCAL_BUFFER_BYTES) as client:
        yield client


@pytest.fixture(scope="module")
def raw_store(master: MooncakeMaster) -> Iterator[object]:
    """A bare store client, to write values no KVTier would."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", master.metadata_server, 0, LOCAL_BUFFER_BYTES, "tcp", "", master.master_address) == 0
    yield store
    store.close()


def test_a_kv_put_by_another_process_is_read_bit_for_bit(master: MooncakeMaster, tier: KVTier) -> None:
    version, n = 11, 600
    putter = subprocess.run([sys.executable, "-c", PUTTER, master.master_address, master.metadata_server,
                             str(version), str(n)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert putter.returncode == 0, putter.stderr[-2000:]
    assert json.loads(putter.stdout.splitlines()[-1]) == {"stored": 2}  # whole pages only: 600 // 256
    # The putter has exited: its pages live in the master's memory holder, not in the putter.
    n_got, kv = tier.get(version, seeded_tokens(n, seed=version))
    assert n_got == 2 * PAGE
    assert_kv_equal(kv, seeded_kv(n, seed=version), n_got)


def test_the_longest_run_of_shared_pages_is_returned(tier: KVTier) -> None:
    version, tokens, kv = 1, seeded_tokens(600, seed=1), seeded_kv(600, seed=1)
    assert tier.put(version, tokens, kv) == 2
    skipped = tier.stats.pages_skipped
    assert tier.put(version, tokens, kv) == 0 and tier.stats.pages_skipped == skipped + 2  # present: not sent again

    extended = tokens + seeded_tokens(400, seed=2)
    n, got = tier.get(version, extended)
    assert n == 2 * PAGE
    assert_kv_equal(got, kv, n)

    differs_at_300 = tokens[:300] + [t + 1 for t in tokens[300:]]
    n, got = tier.get(version, differs_at_300)
    assert n == PAGE  # page 0 covers tokens [0, 256), all shared; page 1 holds token 300
    assert_kv_equal(got, kv, n)

    assert tier.get(version, [tokens[0] + 1] + tokens[1:]) == (0, None)


def test_another_weight_version_misses(tier: KVTier) -> None:
    tokens, kv = seeded_tokens(300, seed=3), seeded_kv(300, seed=3)
    assert tier.put(3, tokens, kv) == 1
    assert tier.get(3, tokens)[0] == PAGE
    assert tier.get(4, tokens) == (0, None)


def test_n_never_reaches_the_prompt_length(tier: KVTier) -> None:
    tokens, kv = seeded_tokens(2 * PAGE, seed=5), seeded_kv(2 * PAGE, seed=5)
    assert tier.put(5, tokens, kv) == 2
    n, got = tier.get(5, tokens)  # both pages stored, but one token must be left to prefill
    assert n == 2 * PAGE - 1
    assert_kv_equal(got, kv, n)
    assert tier.get(5, tokens[:PAGE])[0] == PAGE - 1
    assert tier.get(5, tokens[:1]) == (0, None)
    assert tier.get(5, []) == (0, None)


def _garbage(key: str, kv: KV) -> bytes:
    return b"\x00not a page" * 100


def _truncated(key: str, kv: KV) -> bytes:
    return _page_bytes(key, kv)[:-8]


def _filed_under_another_key(key: str, kv: KV) -> bytes:
    return _page_bytes(key[:-1] + ("0" if key[-1] != "0" else "1"), kv)


def _bad_header_json(key: str, kv: KV) -> bytes:
    value = bytearray(_page_bytes(key, kv))
    value[8:12] = b"\xff\xfe{["
    return bytes(value)


def _page_bytes(key: str, kv: KV) -> bytes:
    return b"".join(bytes(part) for part in encode_page(key, kv, PAGE, PAGE))  # page 1's tokens


@pytest.mark.parametrize(("corrupt", "version"), [(_garbage, 100), (_truncated, 101), (_filed_under_another_key, 102),
                                                  (_bad_header_json, 103)])
def test_a_corrupt_value_is_a_miss(tier: KVTier, raw_store: object, corrupt: Callable[[str, KV], bytes], version: int,
                                   caplog: pytest.LogCaptureFixture) -> None:
    tokens, kv = seeded_tokens(600, seed=version), seeded_kv(600, seed=version)
    _, page1 = page_keys(NAMESPACE, version, PAGE, tokens, 2)
    assert raw_store.put(page1, corrupt(page1, kv)) == 0  # type: ignore[attr-defined]
    assert tier.put(version, tokens, kv) == 1  # page 0 only: page 1's key is taken
    corrupt_before = tier.stats.corrupt_pages
    with caplog.at_level(logging.WARNING, logger="cellrunner.kv_tier"):
        n, got = tier.get(version, tokens)
    assert n == PAGE  # page 1 read as a miss; page 0 still serves
    assert_kv_equal(got, kv, n)
    assert tier.stats.corrupt_pages == corrupt_before + 1
    assert "corrupt" in caplog.text


def test_a_corrupt_first_page_is_a_whole_miss(tier: KVTier, raw_store: object) -> None:
    tokens = seeded_tokens(300, seed=200)
    (page0,) = page_keys(NAMESPACE, 200, PAGE, tokens, 1)
    assert raw_store.put(page0, b"GKV1" + b"\xff" * 60) == 0  # type: ignore[attr-defined]
    assert tier.get(200, tokens) == (0, None)


def test_an_absent_master_is_one_clear_error() -> None:
    with pytest.raises(KVTierUnavailable, match="does not answer"):
        KVTier("127.0.0.1:1")


def test_a_store_that_goes_away_costs_the_engine_nothing() -> None:
    _require_store()
    tokens, kv = seeded_tokens(300, seed=300), seeded_kv(300, seed=300)
    with MooncakeMaster(segment_bytes=SEGMENT_BYTES) as master, \
            KVTier(master.master_address, namespace=NAMESPACE, local_buffer_bytes=LOCAL_BUFFER_BYTES) as tier:
        assert tier.put(300, tokens, kv) == 1
        master.close()
        started = time.monotonic()
        assert tier.get(300, tokens) == (0, None)  # the store's error is a miss...
        assert tier.put(301, tokens, kv) == 0
        assert tier.get(300, tokens) == (0, None)  # ...and later calls do not wait on a reconnect
        assert time.monotonic() - started < 3.0
