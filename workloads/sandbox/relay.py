"""The relay inside a bwrap sandbox with ``network=proxy``: 127.0.0.1:PORT -> the proxy's Unix socket.

``/usr/bin/python3 -I -S relay.py PORT SOCKET ARGV...``

The sandbox has its own network namespace (loopback only), so the harness cannot reach the node or
beyond. This program listens on 127.0.0.1:PORT in that namespace and copies each TCP connection, in
both directions, to a fresh connection on the Unix socket SOCKET (the proxy's, bind-mounted in). Then
it starts ARGV as its child with this process's environment, forwards SIGTERM, SIGINT and SIGHUP to it,
and exits as the child did (its exit code, or killed by the same signal).

Standard library only and run with ``-I -S`` (no site, no user paths) from a read-only bind of this one
file, so nothing of Gyre's own tree is visible inside. A thread per direction per connection: each
direction ends on its own (a half-close is passed on as ``shutdown(SHUT_WR)``), the pair is closed
when both have ended, and an error on either side closes both. A harness that never connects costs
one idle accepting thread.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading

CHUNK_BYTES = 64 * 1024
THREAD_STACK_BYTES = 256 * 1024  # two threads per connection: keep many connections cheap
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """Copy src to dst until src's EOF (passed on as a half-close) or an error (both torn down)."""
    try:
        while True:
            data = src.recv(CHUNK_BYTES)
            if not data:
                dst.shutdown(socket.SHUT_WR)
                return
            dst.sendall(data)
    except OSError:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)  # wakes the other direction's recv
            except OSError:
                pass


def _serve(client: socket.socket, unix_path: str) -> None:
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        upstream.connect(unix_path)
    except OSError as exc:
        print(f"gyre relay: proxy socket {unix_path}: {exc}", file=sys.stderr, flush=True)
        upstream.close()
        client.close()
        return
    back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
    back.start()
    _pump(client, upstream)
    back.join()
    client.close()
    upstream.close()


def _accept_loop(listener: socket.socket, unix_path: str) -> None:
    while True:
        try:
            client, _ = listener.accept()
        except OSError:  # EMFILE and the like: back off a little instead of spinning
            threading.Event().wait(0.05)
            continue
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=_serve, args=(client, unix_path), daemon=True).start()


def main(argv: list[str]) -> int:
    if len(argv) < 3 or not argv[0].isdigit():
        print("usage: relay.py PORT UNIX_SOCKET ARGV...", file=sys.stderr)
        return 2
    port, unix_path, command = int(argv[0]), argv[1], argv[2:]
    threading.stack_size(THREAD_STACK_BYTES)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # not inherited by the child (CLOEXEC)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(512)
    threading.Thread(target=_accept_loop, args=(listener, unix_path), daemon=True).start()

    child = 0
    pending: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        if child:
            os.kill(child, signum)
        else:
            pending.append(signum)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    try:
        # Python ignores SIGPIPE and SIGXFSZ for itself; the child gets every default back, as with subprocess.
        child = os.posix_spawnp(command[0], command, os.environ,
                                setsigdef=(*FORWARDED, signal.SIGPIPE, signal.SIGXFSZ))
    except OSError as exc:
        print(f"gyre relay: cannot start {command[0]!r}: {exc}", file=sys.stderr, flush=True)
        return 127
    for signum in pending:
        os.kill(child, signum)
    _, status = os.waitpid(child, 0)  # retried after each forwarded signal (PEP 475)
    if os.WIFSIGNALED(status):  # die the same way, so whoever waits on the sandbox sees the signal
        signum = os.WTERMSIG(status)
        if signum != signal.SIGKILL:
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return 128 + signum  # a signal whose default is to be ignored
    return os.WEXITSTATUS(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
