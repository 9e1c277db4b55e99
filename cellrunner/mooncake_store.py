"""The run's Mooncake Store: a ``mooncake_master`` and a memory holder, started and stopped as one.

Both binaries come from the ``mooncake-transfer-engine-non-cuda`` wheel (or PATH). The master
keeps the object index and evicts; the memory holder (``mooncake_client`` with no local buffer)
lends the memory the pages live in. The memory sits in its own process because Mooncake keeps an
object in the segment of the client that allocated it: pages stored in an engine's own segment
would vanish when that engine stops, and cells stop their engines every time they switch to
training (and SGLang drops its backend at every weight version). Peers find each other by P2P
handshake, so no metadata server runs.

The same store serves the embedded engine (``cellrunner.kv_tier.KVTier``) and SGLang's HiCache
(``cellrunner.sglang_hicache``); the command lines here are the only ones Gyre starts it with.
Nothing here imports mooncake: the binaries are found by path, never loaded.
"""

from __future__ import annotations

import importlib.util
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable
from pathlib import Path

from cellrunner.errors import BackendUnavailable

DEFAULT_SEGMENT_BYTES = 512 << 20
"""Memory the store holds for pages. Small by default: the embedded default runs on a laptop."""
METADATA_SERVER = "P2PHANDSHAKE"
"""Peers exchange transfer metadata in a handshake: no etcd and no HTTP metadata server to run."""
INSTALL_HINT = "pip install mooncake-transfer-engine-non-cuda==0.3.13.post1"
START_TIMEOUT_S = 30.0
EVICTION_HIGH_WATERMARK_RATIO = 0.95
"""Memory use at which the master starts evicting: the HiCache backend's README suggests 0.95."""
EVICTION_RATIO = 0.05
"""Share of objects evicted each time (Mooncake's default)."""


class KVTierUnavailable(BackendUnavailable):
    """The store cannot be started or reached; the message says why and how to fix it."""


def mooncake_binary(name: str) -> Path:
    """The ELF binary `name` shipped inside the ``mooncake`` package, else one on PATH."""
    spec = importlib.util.find_spec("mooncake")  # finds the package without loading store.so
    if spec is not None and spec.origin is not None:
        shipped = Path(spec.origin).parent / name
        if shipped.is_file():
            return shipped
    on_path = shutil.which(name)
    if on_path is None:
        raise KVTierUnavailable(f"kv tier: {name} not found; {INSTALL_HINT}")
    return Path(on_path)


def free_port(host: str) -> int:
    """A port free on `host` now. Another process could take it before ours binds; startup then fails in words."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


# ---------------------------------------------------------------- command lines


def mooncake_master_command(binary: str | Path, *, host: str, rpc_port: int, metrics_port: int,
                            eviction_high_watermark_ratio: float = EVICTION_HIGH_WATERMARK_RATIO,
                            eviction_ratio: float = EVICTION_RATIO) -> list[str]:
    """The run's ``mooncake_master``: the object index and its eviction, no memory of its own.

    ``host`` is an address every client reaches: clients connect to ``host:rpc_port``; SGLang also
    polls ``http://host:metrics_port/get_all_segments`` (``MooncakeStore.check_server``)."""
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


def _port(port: int) -> int:
    if not 0 < port < 65536:
        raise ValueError(f"want a port in 1..65535, got {port}")
    return port


# ---------------------------------------------------------------- the running store


class MooncakeMaster:
    """A Mooncake Store on `host`: the master and, if `segment_bytes` > 0, a process holding that much memory.

    Clients in any process connect with `master_address` and `metadata_server` (plain strings);
    `admin_url` is the master's HTTP server (``/health``, ``/get_all_segments``). `close()` stops
    both processes; a finalizer does it at exit if the owner never calls it. A process that exits
    or stays silent at start is a `KVTierUnavailable` carrying its log's last line.
    """

    def __init__(self, *, segment_bytes: int = DEFAULT_SEGMENT_BYTES, host: str = "127.0.0.1",
                 start_timeout_s: float = START_TIMEOUT_S) -> None:
        if segment_bytes < 0:
            raise ValueError(f"kv tier: want segment_bytes >= 0, got {segment_bytes}")
        self.host = host
        self.metadata_server = METADATA_SERVER
        self._deadline = time.monotonic() + start_timeout_s
        self._log_dir = tempfile.TemporaryDirectory(prefix="gyre-mooncake-")
        self._processes: list[subprocess.Popen[bytes]] = []
        self._stop = weakref.finalize(self, _stop_processes, self._processes, self._log_dir)
        try:
            rpc_port, admin_port = free_port(host), free_port(host)
            self.master_address = f"{host}:{rpc_port}"
            self.admin_url = f"http://{host}:{admin_port}"
            self._spawn(mooncake_master_command(mooncake_binary("mooncake_master"), host=host,
                                                rpc_port=rpc_port, metrics_port=admin_port))
            self._wait_until(lambda: _http_get(f"{self.admin_url}/health") is not None)
            if segment_bytes:
                self._spawn(memory_holder_command(mooncake_binary("mooncake_client"), host=host,
                                                  port=free_port(host), segment_bytes=segment_bytes,
                                                  master_address=self.master_address))
                # The master lists a segment once it is mounted; before that a put finds no space.
                self._wait_until(lambda: bool((_http_get(f"{self.admin_url}/get_all_segments") or "").strip()))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self._stop()

    def __enter__(self) -> MooncakeMaster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _spawn(self, command: list[str]) -> None:
        log_path = Path(self._log_dir.name) / f"{Path(command[0]).name}.log"
        glog = ["--logtostderr=true", "--minloglevel=1"]  # warnings and errors only, into the log file
        with log_path.open("wb") as log_file:
            process = subprocess.Popen([*command, *glog], stdin=subprocess.DEVNULL,
                                       stdout=log_file, stderr=subprocess.STDOUT)
        self._processes.append(process)

    def _wait_until(self, ready: Callable[[], bool]) -> None:
        process = self._processes[-1]
        name = Path(str(process.args[0])).name  # type: ignore[index]
        while not ready():
            if process.poll() is not None or time.monotonic() > self._deadline:
                state = f"exited with {process.returncode}" if process.poll() is not None else "did not answer in time"
                raise KVTierUnavailable(f"kv tier: {name} {state}; last log line: {self._last_log_line(name)!r}")
            time.sleep(0.05)

    def _last_log_line(self, name: str) -> str:
        lines = (Path(self._log_dir.name) / f"{name}.log").read_text(errors="replace").strip().splitlines()
        return lines[-1] if lines else ""


def _http_get(url: str) -> str | None:
    """The body of a GET that answers 200, else None (not up yet, or refused)."""
    try:
        with urllib.request.urlopen(url, timeout=2.0) as response:
            return response.read().decode() if response.status == 200 else None
    except (urllib.error.URLError, OSError):
        return None


def _stop_processes(processes: list[subprocess.Popen[bytes]], log_dir: tempfile.TemporaryDirectory[str]) -> None:
    """Stop the store's processes, newest first (the memory holder before its master), then drop their logs."""
    for process in reversed(processes):
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    log_dir.cleanup()
