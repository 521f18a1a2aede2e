"""A stand-in role process for `baton up` tests (no model, no gRPC).

FAKE_ROLE_EXIT=N: says so on stderr and exits with N at once. Otherwise it binds its --port
on 127.0.0.1 (0: any free one; taken: exits with 1), writes `pid=P port=N` to stderr (its
log), prints `READY port=N` and serves until terminated. As the gateway (--workers-file or
--decode given) with FAKE_ROLE_HEALTH=1 it answers GET /health on that port with every
worker it was given healthy (the workers file as it reads at that moment); without, it only
prints `READY port=1` (a gateway that never gets healthy).
"""
import json
import os
import socket
import sys
import time
from http.server import BaseHTTPRequestHandler, HTTPServer


def flag(name: str, default: str = "") -> str:
    args = sys.argv[1:]
    return args[args.index(name) + 1] if name in args else default


def health_body() -> bytes:
    counts = {role: len([a for a in flag(f"--{role}").split(",") if a])
              for role in ("decode", "prefill")}
    if flag("--workers-file"):
        with open(flag("--workers-file")) as f:
            listed = json.load(f)
        counts = {role: n + len(listed.get(role, [])) for role, n in counts.items()}
    return json.dumps({"status": "ok", "workers": {
        role: {"healthy": n, "total": n} for role, n in counts.items()}}).encode()


def serve_health(port: int) -> None:
    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            body = health_body()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", port), Health)
    print(f"pid={os.getpid()} port={server.server_port}", file=sys.stderr, flush=True)
    print(f"READY port={server.server_port}", flush=True)
    server.serve_forever()


def serve_port(port: int) -> None:
    try:
        sock = socket.create_server(("127.0.0.1", port))
    except OSError as e:
        print(f"cannot bind port {port}: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    bound = sock.getsockname()[1]
    print(f"pid={os.getpid()} port={bound}", file=sys.stderr, flush=True)
    print(f"READY port={bound}", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    code = os.environ.get("FAKE_ROLE_EXIT")
    if code is not None:
        print("fake role failing on purpose", file=sys.stderr, flush=True)
        sys.exit(int(code))
    if "--decode" not in sys.argv and "--workers-file" not in sys.argv:
        serve_port(int(flag("--port", "0")))
    elif os.environ.get("FAKE_ROLE_HEALTH") == "1":
        serve_health(int(flag("--port", "0")))
    else:
        print("READY port=1", flush=True)
        time.sleep(600)
