"""The proxy process: ``python -m harness_proxy.main --config-json F --controller ADDR --processor ADDR
--secret-file F --ready-file F [--unix-socket PATH] [--curve-keys DIR]``.

- ``--config-json``: ``{"proxy": <conf/proxy fields>, "model": {"tokenizer", "compact_ranks", "path"},
  "rollout": <algo.rollout fields>}``.
- ``--controller``: a ZMQ ROUTER; the proxy connects a DEALER, sends ``Hello(peer="proxy")``, then
  obeys ``RoutingTable``, ``SealExecution`` and ``Shutdown``. A frame it cannot decode is logged and
  answered with ``ErrorReply``; the process keeps running.
- ``--processor``: the processor's records ROUTER; the proxy's DEALER sends one ``CallRecord`` per
  successful call and, on a seal, ``ExecutionSealed`` once that execution's records are all
  acknowledged, and keeps each until the processor's ``RecordsAck`` (``harness_proxy.record_sink``).
- ``--secret-file``: a 0600 file holding the HMAC secret of the per-execution bearer tokens, hex
  (``base.execution_token.write_secret``); a file, not the value, so ``/proc/<pid>/cmdline`` shows no secret.
- ``--ready-file``: written (atomically) as ``{"url": "http://host:port"}`` once HTTP is listening,
  with ``"unix_socket": PATH`` added when it also listens there.
- ``--unix-socket``: the same HTTP app also on this Unix socket (the relay inside each bwrap sandbox
  connects there, as the sandbox has no network of its own). Mode 0600, set before it listens, so
  only this user connects: sandboxes run as this same user (root on a development machine), and
  other users of the node cannot reach the proxy through it. A stale socket file there is replaced;
  the file is removed on exit.

SIGTERM or SIGINT (or ``Shutdown``) stops it cleanly: HTTP closes, queued records are sent, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import stat
import sys
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
from aiohttp import web

from base import curve, engine_key, wire
from base.lifecycle import exit_with_parent
from base.typed_config import ConfigError, build
from base.execution_token import read_secret
from harness_proxy.config import ProxyConfig
from harness_proxy.record_sink import ZmqRecordSink
from harness_proxy.server import ProxyServer
from base.tokenizer import QwenTokenizer, load_tokenizer
from base.algo_config import RolloutSampling

log = logging.getLogger(__name__)

CONTROL_MESSAGES = (wire.RoutingTable, wire.SealExecution, wire.Shutdown, wire.ErrorReply)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m harness_proxy.main", description="Gyre harness proxy")
    p.add_argument("--config-json", required=True, type=Path)
    p.add_argument("--controller", required=True, help="controller ROUTER address, e.g. tcp://127.0.0.1:5555")
    p.add_argument("--processor", required=True, help="the trajectory processor's records address (a ROUTER)")
    p.add_argument("--secret-file", required=True, type=Path,
                   help="0600 file with the HMAC secret of the execution tokens, hex")
    p.add_argument("--ready-file", required=True, type=Path)
    p.add_argument("--curve-keys", default="", help="the run's CURVE keys folder (base.curve); '' for plain sockets")
    p.add_argument("--engine-key-file", type=Path, default=None,
                   help="0600 file with the run's engine API key (base.engine_key); none for open engines")
    p.add_argument("--unix-socket", type=Path, default=None,
                   help="also serve on this Unix socket (mode 0600), for the relays inside bwrap sandboxes")
    p.add_argument("--heartbeat-s", type=float, default=1.0, help="seconds between ServiceHeartbeats")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING"])
    return p.parse_args(argv)


def load_config(path: Path) -> tuple[ProxyConfig, QwenTokenizer, RolloutSampling]:
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or not all(isinstance(data.get(k), dict) for k in ("proxy", "model", "rollout")):
        raise ConfigError(f"{path}: want {{'proxy': {{...}}, 'model': {{'tokenizer', 'compact_ranks', 'path'}}, "
                          "'rollout': {{'temperature', 'top_p', 'top_k'}}}}")
    cfg = build(ProxyConfig, data["proxy"], "proxy")
    rollout = build(RolloutSampling, data["rollout"], "rollout")
    model: dict[str, Any] = data["model"]
    kind, ranks, folder = model.get("tokenizer"), model.get("compact_ranks"), model.get("path", "")
    if kind not in ("qwen", "qwen_compact", "hf") or type(ranks) is not int or not isinstance(folder, str):
        raise ConfigError(f"model: want tokenizer qwen|qwen_compact|hf, an int compact_ranks and a str path, "
                          f"got {kind!r}, {ranks!r}, {folder!r}")
    try:
        return cfg, load_tokenizer(kind, ranks, folder), rollout
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def write_ready_file(path: Path, url: str, unix_socket: Path | None = None) -> None:
    ready: dict[str, str] = {"url": url}
    if unix_socket is not None:
        ready["unix_socket"] = str(unix_socket)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(ready))
    os.replace(tmp, path)


def bind_unix_socket(path: Path) -> socket.socket:
    """A bound Unix socket at ``path``, mode 0600 before anyone can connect (it listens only later)."""
    if path.is_socket():
        path.unlink()  # left by a proxy that was killed
    elif path.exists() or path.is_symlink():
        raise FileExistsError("exists and is not a socket")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
        os.chmod(path, stat.S_IRUSR | stat.S_IWUSR)
    except OSError:
        sock.close()
        raise
    return sock


async def serve_unix_socket(server: ProxyServer, path: Path) -> None:
    """Serve the proxy's app, already started on TCP, on ``path`` too (same runner, same handlers)."""
    runner = server._runner  # noqa: SLF001 -- one app, one runner: a second site, not a second app
    assert runner is not None, "start the server first"
    await web.SockSite(runner, bind_unix_socket(path)).start()
    log.info("proxy listening on unix:%s", path)


def handle_control_frame(server: ProxyServer, frame: bytes) -> tuple[wire.Message | None, bool]:
    """Apply one controller frame; return (a reply to send or None, whether to shut down)."""
    try:
        msg = wire.decode(frame, expect=CONTROL_MESSAGES)
    except wire.ProtocolError as exc:
        log.error("bad frame from the controller: %s", exc)
        return wire.ErrorReply(where="proxy", message=str(exc)), False
    if isinstance(msg, wire.RoutingTable):
        server.apply_routing_table(msg)
    elif isinstance(msg, wire.SealExecution):
        server.seal(msg.execution_id)
    elif isinstance(msg, wire.Shutdown):
        log.info("shutdown requested by the controller: %s", msg.reason or "-")
        return None, True
    else:
        assert isinstance(msg, wire.ErrorReply)
        log.error("the controller refused a frame of ours (%s): %s", msg.where, msg.message)
    return None, False


async def control_loop(sock: zmq.asyncio.Socket, server: ProxyServer, stop: asyncio.Event) -> None:
    while not stop.is_set():
        parts = await sock.recv_multipart()
        reply, shutdown = handle_control_frame(server, parts[-1])
        if reply is not None:
            await sock.send(wire.encode(reply))
        if shutdown:
            stop.set()


async def heartbeats(sock: zmq.asyncio.Socket, every_s: float) -> None:
    """From the event loop itself, so a loop that stops turning falls silent (the controller kills
    a proxy silent for ``cluster.heartbeat_timeout_s``)."""
    while True:
        await sock.send(wire.encode(wire.ServiceHeartbeat(peer="proxy", pid=os.getpid())))
        await asyncio.sleep(every_s)


async def run(args: argparse.Namespace, cfg: ProxyConfig, tok: QwenTokenizer, rollout: RolloutSampling, secret: bytes,
              api_key: str = "") -> int:
    ctx = zmq.asyncio.Context()
    sink = ZmqRecordSink(ctx, args.processor, resend_s=cfg.record_resend_s)
    sink.start()
    server = ProxyServer(cfg, tokenizer=tok, rollout=rollout, secret=secret, sink=sink, engine_api_key=api_key)
    control = ctx.socket(zmq.DEALER)
    control.setsockopt(zmq.LINGER, 1000)
    curve.client(control, "controller")
    control.connect(args.controller)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        url = await server.start()
        if args.unix_socket is not None:
            try:
                await serve_unix_socket(server, args.unix_socket)
            except OSError as exc:  # exists and is no socket, a path over 107 bytes, no such folder
                log.error("proxy failed to start: --unix-socket %s: %s", args.unix_socket, exc)
                return 2
        await control.send(wire.encode(wire.Hello(peer="proxy", pid=os.getpid())))
        control_task = loop.create_task(control_loop(control, server, stop))
        beat_task = loop.create_task(heartbeats(control, args.heartbeat_s))
        write_ready_file(args.ready_file, url, args.unix_socket)
        log.info("proxy ready: %s, controller %s, processor %s", url, args.controller, args.processor)
        stopped = loop.create_task(stop.wait())
        done, _ = await asyncio.wait({control_task, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if control_task in done and control_task.exception() is not None:
            log.error("control loop failed: %r", control_task.exception())
        control_task.cancel()
        beat_task.cancel()
        stopped.cancel()
    finally:
        log.info("proxy shutting down")
        await server.stop()
        if args.unix_socket is not None and args.unix_socket.is_socket():
            args.unix_socket.unlink()
        await sink.close()
        control.close()
        ctx.term()
    return 0


def main(argv: list[str] | None = None) -> int:
    # Everything a run writes (checkpoints, logs, prompts, task files with gold patches and hidden
    # tests) is the run user's alone on a shared node: files 0600, folders 0700.
    os.umask(0o077)
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level, stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    exit_with_parent()  # a controller that died without stopping us
    try:
        cfg, tok, rollout = load_config(args.config_json)
        secret = read_secret(args.secret_file)
        api_key = engine_key.read_key(args.engine_key_file) if args.engine_key_file else ""
        curve.install(args.curve_keys, "proxy")
    except (ConfigError, OSError, ValueError, curve.CurveError) as exc:  # JSON and hex errors are ValueErrors
        log.error("proxy failed to start: %s", exc)
        return 2
    return asyncio.run(run(args, cfg, tok, rollout, secret, api_key))


if __name__ == "__main__":
    sys.exit(main())
