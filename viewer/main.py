"""``gyre-view runs/<id> [--host 127.0.0.1] [--port 8765]``: serve the run's page until Ctrl-C.

Loopback unless told otherwise (``--host``); ``--port 0`` picks a free port. The run folder is
read again when its files change, so a live run can be watched; nothing in it is written."""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from harness_proxy.auth import EXECUTION_ID_RE
from viewer.pages import error_page, execution_page, parse_filters, run_page
from viewer.runfolder import Run, RunFolderError, open_run

log = logging.getLogger("gyre-view")


class RunCache:
    """The run as last read, read again when a file under it changed size or time."""

    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()
        self._key: tuple | None = None
        self._run: Run | None = None

    def get(self) -> Run:
        key = tuple(sorted((str(p), p.stat().st_size, p.stat().st_mtime_ns)
                           for p in [self.path / "metrics.jsonl", self.path / "summary.json",
                                     *self.path.glob("processor*/processor.log")] if p.exists()))
        with self._lock:
            if self._run is None or key != self._key:
                self._run, self._key = open_run(self.path), key
            return self._run


def make_handler(cache: RunCache) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            url = urlsplit(self.path)
            try:
                if not cache.path.is_dir():
                    raise RunFolderError(f"no run folder at {cache.path}")
                run = cache.get()
                if url.path == "/":
                    self._send(HTTPStatus.OK, run_page(run, parse_filters(parse_qs(url.query))))
                elif url.path.startswith("/execution/"):
                    eid = unquote(url.path.removeprefix("/execution/"))
                    if not EXECUTION_ID_RE.fullmatch(eid) or eid not in run.executions:
                        self._send(HTTPStatus.NOT_FOUND, error_page(f"no execution {eid!r} in this run"))
                    else:
                        self._send(HTTPStatus.OK, execution_page(run, eid))
                else:
                    self._send(HTTPStatus.NOT_FOUND, error_page(f"no page {url.path!r}"))
            except RunFolderError as exc:
                self._send(HTTPStatus.NOT_FOUND, error_page(str(exc)))
            except ValueError as exc:
                self._send(HTTPStatus.BAD_REQUEST, error_page(f"bad request: {exc}"))
            except Exception as exc:  # a page, never a traceback; the log keeps the details
                log.exception("gyre-view: %s", self.path)
                self._send(HTTPStatus.INTERNAL_SERVER_ERROR, error_page(f"could not show this: {exc}"))

        def _send(self, status: HTTPStatus, html: str) -> None:
            body = html.encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt: str, *args: object) -> None:
            log.info("%s %s", self.address_string(), fmt % args)

    return Handler


def serve(run_dir: Path, host: str = "127.0.0.1", port: int = 8765) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer((host, port), make_handler(RunCache(run_dir)))
    server.daemon_threads = True
    return server


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gyre-view", description="A run's steps, executions and call trees in the browser")
    p.add_argument("run_dir", type=Path, help="runs/<id> (or runs/latest)")
    p.add_argument("--host", default="127.0.0.1", help="address to serve on (loopback unless told otherwise)")
    p.add_argument("--port", type=int, default=8765, help="0 picks a free port")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    server = serve(args.run_dir.resolve(), args.host, args.port)
    print(f"gyre-view: http://{args.host}:{server.server_port}/ ({args.run_dir})", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
