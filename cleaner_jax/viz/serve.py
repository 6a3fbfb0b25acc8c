"""Serve a run's trajectory dumps to a browser, or export them as one HTML file.

    python -m cleaner_jax.viz.serve --workdir runs/toy [--port 8765] [--host 127.0.0.1]
    python -m cleaner_jax.viz.serve --workdir runs/toy --export runs/toy/trajectories.html [--steps 3:7] [--every 10]

The server binds the loopback interface unless told otherwise (dumps hold the model's outputs
and the training data), reads the dumps afresh on every request (a live run's new steps show up
on reload) and serves only its own static files and JSON: `/`, `/app.js`, `/style.css`,
`/api/index.json`, `/api/step/<N>.json`; an error is answered as JSON, `{"error": ...}`, naming
the file or step. An unreadable dump (truncated, not gzip: a trainer killed mid-write can leave
one) is listed in the index with its error, and the other steps are shown; the export leaves it
out, lists it in the page and warns on stderr.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from cleaner_jax.viz.dumps import DumpReadError
from cleaner_jax.viz.viewer import STATIC, export, page, step_filter, viewer_index, viewer_step

_STATIC_TYPES = {"/app.js": ("app.js", "text/javascript"), "/style.css": ("style.css", "text/css")}
_STEP = re.compile(r"^/api/step/(\d+)\.json$")


def make_server(workdir: str | Path, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """A server for `workdir` (port 0: the OS picks a free one; see `server.server_address`)."""
    workdir = Path(workdir)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path = self.path.split("?", 1)[0]
            try:
                self._get(path)
            except ConnectionError:  # the browser left mid-answer (a reload): nobody to tell
                return
            except Exception as err:  # answer with the error, never drop the connection
                # (a dropped one reads "TypeError: Failed to fetch" in the browser, naming nothing)
                sys.stderr.write(f"viz.serve: {path}: {type(err).__name__}: {err}\n")
                self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{path}: {type(err).__name__}: {err}")

        def _get(self, path: str) -> None:
            if path in ("/", "/index.html"):
                return self._send(page().encode(), "text/html; charset=utf-8")
            if path in _STATIC_TYPES:
                name, ctype = _STATIC_TYPES[path]
                return self._send((STATIC / name).read_bytes(), f"{ctype}; charset=utf-8")
            if path == "/api/index.json":
                return self._json(viewer_index(workdir))  # an unreadable dump is listed in it, not raised
            if m := _STEP.match(path):
                step = int(m.group(1))
                try:
                    return self._json(viewer_step(workdir, step))
                except DumpReadError as err:  # a torn or foreign file: name it, say what to do
                    return self._error(HTTPStatus.INTERNAL_SERVER_ERROR, str(err), file=str(err.path))
                except (FileNotFoundError, ValueError) as err:  # no such step / an old-format dump: say which
                    return self._error(HTTPStatus.NOT_FOUND, str(err))
            self._error(HTTPStatus.NOT_FOUND, f"no such page: {path}")

        def _error(self, status: HTTPStatus, message: str, **extra: str) -> None:
            """A JSON error body, `{"error": message, ...}`, which the page shows as it is."""
            self._send(json.dumps({"error": message, "status": int(status), **extra}).encode(), "application/json",
                       status)

        def _json(self, obj: object) -> None:
            self._send(json.dumps(obj).encode(), "application/json")

        def _send(self, body: bytes, ctype: str, status: HTTPStatus = HTTPStatus.OK) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt: str, *args: object) -> None:  # one short line per request, on stderr
            sys.stderr.write(f"viz.serve: {fmt % args}\n")

    return ThreadingHTTPServer((host, port), Handler)


def serve_in_thread(workdir: str | Path, host: str = "127.0.0.1", port: int = 0) -> tuple[ThreadingHTTPServer, str]:
    """Start a server on a daemon thread; returns it (call `.shutdown()`) and its base URL."""
    server = make_server(workdir, host, port)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    h, p = server.server_address[:2]
    return server, f"http://{h}:{p}/"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m cleaner_jax.viz.serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", required=True, help="the run's directory (its trajectories/ holds the dumps)")
    ap.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    ap.add_argument("--port", type=int, default=0, help="port (default 0: a free one, printed)")
    ap.add_argument("--export", metavar="OUT.html", help="write one self-contained HTML file instead of serving")
    ap.add_argument("--steps", metavar="FIRST:LAST", help="with --export: only these steps, both included "
                    "(3:7, 3:, :7 or one step, 5); a long run's export holds every step otherwise")
    ap.add_argument("--every", type=int, metavar="N", help="with --export: only the steps that are multiples of N")
    args = ap.parse_args(argv)
    if not (Path(args.workdir) / "trajectories").is_dir():
        raise SystemExit(f"error: {args.workdir}/trajectories does not exist: not a run directory with dumps "
                         "(a run writes them with train.dump_trajectories=True, the default)")
    if (args.steps is not None or args.every is not None) and not args.export:
        raise SystemExit("error: --steps and --every select what --export writes; the server shows every step "
                         "(filter by step on its list page)")
    if args.export:
        try:
            keep = step_filter(args.steps, args.every)
        except ValueError as err:
            raise SystemExit(f"error: {err}") from None
        out, index = export(args.workdir, args.export, keep)
        for bad in index["bad_files"]:  # left out of the export, listed in its page too
            print(f"warning: step {bad['step']} left out of the export: {bad['file']}: {bad['error']}", file=sys.stderr)
        print(f"wrote {out}: {len(index['steps'])} steps, {len(index['rows'])} episodes, "
              f"{out.stat().st_size / 2**20:.1f} MiB" + (f", {len(index['bad_files'])} unreadable dumps left out"
                                                       if index["bad_files"] else ""))
        return
    server = make_server(args.workdir, args.host, args.port)
    h, p = server.server_address[:2]
    print(f"serving {args.workdir} on http://{h}:{p}/ (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
