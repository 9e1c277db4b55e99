"""``gyre-view runs/<id> [--host 127.0.0.1] [--port 8765]``: serve the run's pages until Ctrl-C.

Loopback unless told otherwise (``--host``); ``--port 0`` picks a free port and prints the URL.
The run folder is read again as it grows, so a live run can be watched; nothing in it is written.
"""

from __future__ import annotations

import argparse
import logging
import sys
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from base.execution_token import EXECUTION_ID_RE
from viewer.pages import error_page, execution_page, parse_filters, run_page
from viewer.runfolder import RunFolderError, RunReader

log = logging.getLogger("gyre-view")


def route(reader: RunReader, target: str) -> tuple[HTTPStatus, str]:
    """The status and page for a request target (path and query)."""
    url = urlsplit(target)
    if url.path == "/":
        try:
            filters = parse_filters(parse_qs(url.query))
        except ValueError as exc:
            return HTTPStatus.BAD_REQUEST, error_page(f"bad filter: {exc}")
        return HTTPStatus.OK, run_page(reader.read(), filters)
    if url.path.startswith("/execution/"):
        eid = unquote(url.path.removeprefix("/execution/"))
        run = reader.read()
        if not EXECUTION_ID_RE.fullmatch(eid) or eid not in run.executions:
            return HTTPStatus.NOT_FOUND, error_page(f"no execution {eid!r} in {run.path}")
        return HTTPStatus.OK, execution_page(run, eid)
    return HTTPStatus.NOT_FOUND, error_page(f"no page {url.path!r}: try /")


def make_handler(reader: RunReader) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            try:
                status, html = route(reader, self.path)
            except RunFolderError as exc:
                status, html = HTTPStatus.NOT_FOUND, error_page(str(exc))
            except Exception as exc:  # a page, never a traceback; the server's log keeps the details
                log.exception("gyre-view: %s", self.path)
                status, html = HTTPStatus.INTERNAL_SERVER_ERROR, error_page(f"could not show this: {exc!r}")
            body = html.encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the browser went away (a headless one that has its DOM closes at once)

        def log_message(self, fmt: str, *args: object) -> None:
            log.info("%s %s", self.address_string(), fmt % args)

    return Handler


def serve(run_dir: Path, host: str = "127.0.0.1", port: int = 8765) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer((host, port), make_handler(RunReader(run_dir)))
    server.daemon_threads = True
    return server


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gyre-view", description="A run's steps, executions and call trees in the browser")
    p.add_argument("run_dir", type=Path, help="runs/<id> (or runs/latest)")
    p.add_argument("--host", default="127.0.0.1", help="address to serve on (loopback unless told otherwise)")
    p.add_argument("--port", type=int, default=8765, help="0 picks a free port")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    try:
        server = serve(args.run_dir.resolve(), args.host, args.port)
    except OSError as exc:
        print(f"gyre-view: cannot serve on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    if not args.run_dir.is_dir():
        print(f"gyre-view: no run folder at {args.run_dir} (yet); the page will say so", file=sys.stderr)
    print(f"gyre-view: http://{args.host}:{server.server_port}/ ({args.run_dir})", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
