"""A KV tier shared between engine processes, on Mooncake Store over TCP (no etcd, no RDMA needed).

The store itself (a ``mooncake_master`` and a memory holder) is started by
`cellrunner.mooncake_store.MooncakeMaster`, the same one SGLang's HiCache uses.

`KVTier` is one engine's client. A sequence's KV is cut into pages of `page_tokens` tokens.
Page i is stored under a key made of the namespace, the weight version, the page size and the
sha256 of ALL token ids up to the end of page i. So a key names a whole prefix: two prompts that
share a prefix share its pages, and a page is never read against a different prefix, other
weights, or another page size. `get` returns the longest run of pages present from page 0.

A value is one page: a small header (magic, then JSON with the key, dtype, shapes) and the raw
tensor bytes, each layer's keys then values. The header is checked on every read, and a value
that fails the check is a miss that gets logged, never an exception. Nothing is pickled.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import socket
import struct
import time
from typing import Any

import numpy as np
import torch

from cellrunner.mooncake_store import INSTALL_HINT, METADATA_SERVER, KVTierUnavailable
from cellrunner.prefix_cache import KV

log = logging.getLogger(__name__)


DEFAULT_PAGE_TOKENS = 256
DEFAULT_LOCAL_BUFFER_BYTES = 64 << 20
"""A client's transfer buffer. Mooncake stages every value through it, so it bounds the page size
(a 256-token page of Qwen3-8B in bf16 is 38 MiB). Allocated once per client."""
CONNECT_TIMEOUT_S = 5.0
"""A store client's setup retries an absent master for about 90 s; a TCP probe first fails in this."""
UNREACHABLE_BACKOFF_S = 30.0
"""After the store fails to answer, calls skip it this long: each call to a gone master blocks seconds."""

_MAGIC = b"GKV1"
_PREFIX = struct.Struct("<4sI")  # magic, length of the JSON header that follows
_ALIGN = 64  # the JSON header is padded so tensor bytes start aligned
_MAX_HEADER_BYTES = 1 << 16
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class CorruptPage(ValueError):
    """A stored value is not a page this key may hold (torn, truncated, foreign or garbage)."""


# ---------------------------------------------------------------- keys and values


def page_keys(namespace: str, version: int, page_tokens: int, tokens: list[int], pages: int) -> list[str]:
    """The keys of the first `pages` pages of `tokens`: page i's key hashes tokens [0, (i+1) * page_tokens)."""
    ids = np.asarray(tokens[: pages * page_tokens], dtype="<i8")  # fixed byte order: keys match across hosts
    running = hashlib.sha256()
    keys = []
    for start in range(0, pages * page_tokens, page_tokens):
        running.update(ids[start:start + page_tokens].tobytes())
        keys.append(f"{namespace}/w{version}/p{page_tokens}/{running.hexdigest()}")  # hexdigest leaves it open
    return keys


def encode_page(key: str, kv: KV, start: int, page_tokens: int) -> list[Any]:
    """The value of the page of `kv` at tokens [start, start + page_tokens): a header, then one buffer per tensor."""
    tensors = [t[:, start:start + page_tokens].detach().cpu().contiguous() for layer in kv for t in layer]
    header = json.dumps({"key": key, "dtype": str(tensors[0].dtype).removeprefix("torch."),
                         "tokens": page_tokens, "shapes": [list(t.shape) for t in tensors]}).encode()
    header += b" " * (-(_PREFIX.size + len(header)) % _ALIGN)  # JSON allows trailing spaces
    return [_PREFIX.pack(_MAGIC, len(header)) + header, *(t.view(-1).view(torch.uint8).numpy() for t in tensors)]


def decode_page(key: str, value: torch.Tensor, page_tokens: int) -> KV:
    """The KV in `value` (uint8), read as the page `key` names; CorruptPage if it is not exactly that."""
    header = _read_header(value)
    if header.get("key") != key or header.get("tokens") != page_tokens:
        raise CorruptPage(f"header names {header.get('key')!r} of {header.get('tokens')!r} tokens")
    dtype_name, shapes = header.get("dtype"), header.get("shapes")
    dtype = _DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None or not _valid_shapes(shapes, page_tokens):
        raise CorruptPage(f"bad dtype {dtype_name!r} or shapes {shapes!r}")
    offset = _PREFIX.size + int(header["header_bytes"])
    sizes = [math.prod(shape) * dtype.itemsize for shape in shapes]
    if offset + sum(sizes) != value.numel():
        raise CorruptPage(f"{value.numel()} bytes where the header says {offset + sum(sizes)}")
    tensors = []
    for shape, size in zip(shapes, sizes):
        tensors.append(value[offset:offset + size].view(dtype).view(shape))
        offset += size
    return list(zip(tensors[0::2], tensors[1::2]))


def _read_header(value: torch.Tensor) -> dict[str, Any]:
    if value.numel() < _PREFIX.size:
        raise CorruptPage(f"{value.numel()} bytes, shorter than the header")
    magic, header_bytes = _PREFIX.unpack(value[:_PREFIX.size].numpy().tobytes())
    if magic != _MAGIC or header_bytes > min(_MAX_HEADER_BYTES, value.numel() - _PREFIX.size):
        raise CorruptPage(f"bad magic {magic!r} or header length {header_bytes}")
    try:
        header = json.loads(value[_PREFIX.size:_PREFIX.size + header_bytes].numpy().tobytes())
    except (ValueError, RecursionError) as exc:  # bad UTF-8, bad JSON, or nesting deeper than Python parses
        raise CorruptPage(f"header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise CorruptPage("header is not a JSON object")
    return header | {"header_bytes": header_bytes}


def _valid_shapes(shapes: Any, page_tokens: int) -> bool:
    """Keys and values of at least one layer, each [kv_heads, page_tokens, head_dim] with positive sizes."""
    return (isinstance(shapes, list) and len(shapes) >= 2 and len(shapes) % 2 == 0
            and all(isinstance(s, list) and len(s) == 3 and all(type(d) is int and d > 0 for d in s)
                    and s[1] == page_tokens for s in shapes))


def _layout(kv: KV) -> list[tuple[torch.dtype, tuple[int, ...], tuple[int, ...]]]:
    """What must match between pages joined into one KV: dtype and shapes, per layer."""
    return [(k.dtype, tuple(k.shape), tuple(v.shape)) for k, v in kv]


# ---------------------------------------------------------------- the client


@dataclasses.dataclass
class KVTierStats:
    """Counts since the client started, for benchmarks and logs."""

    pages_put: int = 0
    bytes_put: int = 0
    pages_skipped: int = 0  # present already when put
    put_failures: int = 0  # the store refused (full, or a page bigger than the local buffer)
    pages_got: int = 0
    bytes_got: int = 0
    corrupt_pages: int = 0  # read but not a valid page: counted as misses


class KVTier:
    """One process's client of the shared KV tier. Not thread-safe: call it from one thread (the engine's).

    `segment_bytes` is memory this client lends the store. Default 0: pages then live in the
    `MooncakeMaster`'s holder and outlive this process; a lent segment's pages go when it closes.
    `namespace` should name the model: weight versions of different models must not meet.
    """

    def __init__(self, master_address: str, *, metadata_server: str = METADATA_SERVER, namespace: str = "gyre-kv",
                 page_tokens: int = DEFAULT_PAGE_TOKENS, local_hostname: str = "127.0.0.1",
                 local_buffer_bytes: int = DEFAULT_LOCAL_BUFFER_BYTES, segment_bytes: int = 0) -> None:
        if page_tokens < 1 or local_buffer_bytes < 1 or segment_bytes < 0 or not namespace or " " in namespace:
            raise ValueError(f"kv tier: bad page_tokens {page_tokens}, local_buffer_bytes {local_buffer_bytes}, "
                             f"segment_bytes {segment_bytes} or namespace {namespace!r}")
        self.namespace, self.page_tokens, self.local_buffer_bytes = namespace, page_tokens, local_buffer_bytes
        self.stats = KVTierStats()
        self._unreachable_until = 0.0  # time.monotonic() before which the store is not called
        _probe_master(master_address)
        self._store = _store_class()()
        rc = self._store.setup(local_hostname, metadata_server, segment_bytes, local_buffer_bytes, "tcp", "",
                               master_address)
        if rc != 0:
            raise KVTierUnavailable(f"kv tier: store setup with master {master_address} returned {rc}")

    def close(self) -> None:
        self._store.close()

    def __enter__(self) -> KVTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def put(self, version: int, tokens: list[int], kv: KV) -> int:
        """Store the whole pages of `kv`, the KV of tokens[:n]; returns how many pages were new.

        Pages present already are skipped. The first refused page ends the put: a page is only
        ever read after all pages before it, so the ones after a gap would be dead weight.
        """
        kv_tokens = _kv_tokens(kv)
        if kv_tokens > len(tokens):
            raise ValueError(f"kv tier: KV of {kv_tokens} tokens for {len(tokens)} token ids")
        keys = page_keys(self.namespace, version, self.page_tokens, tokens, kv_tokens // self.page_tokens)
        present_pages = self._presence(keys)
        if present_pages is None:
            return 0
        stored = 0
        for index, (key, present) in enumerate(zip(keys, present_pages)):
            if present == 1:
                self.stats.pages_skipped += 1
                continue
            if not self._put_page(key, encode_page(key, kv, index * self.page_tokens, self.page_tokens)):
                break
            stored += 1
        return stored

    def get(self, version: int, tokens: list[int]) -> tuple[int, KV | None]:
        """(n, KV of tokens[:n]) from the longest run of stored pages from page 0, else (0, None).

        n is a whole number of pages, cut to len(tokens) - 1 so the engine still has a token to prefill.
        """
        if len(tokens) < 2:
            return 0, None
        keys = page_keys(self.namespace, version, self.page_tokens, tokens, len(tokens) // self.page_tokens)
        present = self._presence(keys) or []
        run = next((i for i, p in enumerate(present) if p != 1), len(present))
        pages = self._read_pages(keys[:run])
        if not pages:
            return 0, None
        n = min(len(pages) * self.page_tokens, len(tokens) - 1)
        return n, [(torch.cat(ks, dim=1)[:, :n], torch.cat(vs, dim=1)[:, :n])
                   for ks, vs in (zip(*layer) for layer in zip(*pages))]

    def _presence(self, keys: list[str]) -> list[int] | None:
        """Per key 1 (stored) or 0; None while the master is unreachable.

        A call to a master that has gone blocks seconds while the client reconnects, on the
        engine's thread. So after one failure the tier is left alone for UNREACHABLE_BACKOFF_S.
        """
        if not keys:
            return []
        if time.monotonic() < self._unreachable_until:
            return None
        present = self._store.batch_is_exist(keys)
        if any(p < 0 for p in present):  # an error code, e.g. -900 RPC_FAIL
            log.warning("kv tier: the store did not answer (%d); not used for %.0f s", min(present),
                        UNREACHABLE_BACKOFF_S)
            self._unreachable_until = time.monotonic() + UNREACHABLE_BACKOFF_S
            return None
        return present

    def _put_page(self, key: str, parts: list[Any]) -> bool:
        nbytes = sum(len(part) if isinstance(part, bytes) else part.nbytes for part in parts)
        if nbytes > self.local_buffer_bytes:  # Mooncake would refuse it: it stages values in that buffer
            log.warning("kv tier: a page of %d bytes is over the %d-byte local buffer; raise local_buffer_bytes",
                        nbytes, self.local_buffer_bytes)
            self.stats.put_failures += 1
            return False
        rc = self._store.put_parts(key, *parts)
        if rc != 0:
            log.warning("kv tier: put of %s refused with %d (store full, or unreachable)", key, rc)
            self.stats.put_failures += 1
            return False
        self.stats.pages_put += 1
        self.stats.bytes_put += nbytes
        return True

    def _read_pages(self, keys: list[str]) -> list[KV]:
        """The pages of `keys` in order, up to the first that cannot be read or is not valid."""
        if not keys:
            return []
        # Pages of one model and page size are all the size of the first. Reads go into one
        # writable buffer, in batches that fit the local buffer Mooncake stages them through.
        page_bytes = self._store.get_size(keys[0])
        if page_bytes <= 0 or page_bytes > self.local_buffer_bytes:
            log.warning("kv tier: page %s reads as %d bytes; taken as a miss", keys[0], page_bytes)
            return []
        buffer = torch.empty(len(keys) * page_bytes, dtype=torch.uint8)
        batch = max(1, self.local_buffer_bytes // 2 // page_bytes)
        pages: list[KV] = []
        for first in range(0, len(keys), batch):
            chunk = keys[first:first + batch]
            pointers = [buffer.data_ptr() + (first + i) * page_bytes for i in range(len(chunk))]
            for key, got, pointer in zip(chunk, self._store.batch_get_into(chunk, pointers, [page_bytes] * len(chunk)),
                                         pointers):
                page = self._decode(key, buffer, pointer - buffer.data_ptr(), got)
                if page is None:
                    return pages
                if pages and _layout(page) != _layout(pages[0]):
                    log.warning("kv tier: page %s does not match page 0's layout, taken as a miss", key)
                    self.stats.corrupt_pages += 1
                    return pages
                pages.append(page)
                self.stats.pages_got += 1
                self.stats.bytes_got += got
        return pages

    def _decode(self, key: str, buffer: torch.Tensor, offset: int, got: int) -> KV | None:
        """The page read into buffer[offset:offset + got], or None: gone meanwhile (`got` < 0) or corrupt."""
        if got < 0:  # -600: bigger than page 0, so not a page of this model and page size
            log.warning("kv tier: page %s not read (%d): evicted meanwhile, its holder gone, or too big", key, got)
            return None
        try:
            return decode_page(key, buffer[offset:offset + got], self.page_tokens)
        except (CorruptPage, RuntimeError) as exc:  # RuntimeError: torch refusing a misaligned view
            log.warning("kv tier: page %s is corrupt, taken as a miss: %s", key, exc)
            self.stats.corrupt_pages += 1
            return None


def _kv_tokens(kv: KV) -> int:
    """The token count every tensor of `kv` shares; ValueError unless all are 3-D of one dtype a page can hold."""
    tensors = [t for layer in kv for t in layer]
    counts, dtypes = {t.shape[1] for t in tensors if t.dim() == 3}, {t.dtype for t in tensors}
    if not kv or len(counts) != 1 or any(t.dim() != 3 for t in tensors) or len(dtypes) != 1 \
            or dtypes.pop() not in _DTYPES.values():
        raise ValueError(f"kv tier: want per layer (keys, values) of [kv_heads, tokens, head_dim] in one of "
                         f"{sorted(_DTYPES)}, got {_layout(kv)}")
    return counts.pop()


def _probe_master(master_address: str) -> None:
    host, _, port = master_address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except (OSError, ValueError) as exc:
        raise KVTierUnavailable(f"kv tier: master {master_address!r} does not answer: {exc}") from None


def _store_class() -> Any:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise KVTierUnavailable(f"kv tier: {INSTALL_HINT} (import failed: {exc})") from None
    return MooncakeDistributedStore
