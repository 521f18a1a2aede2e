"""The lab's client host: run inside the hub namespace, reads one JSON job on stdin and
prints one JSON result (standard library only, so it starts fast).

    {"wait_health": URL, "deadline_s": 60}   poll GET URL until 200 with every worker healthy
    {"post": [[URL, BODY], ...]}             POST JSON bodies in order, collect the replies
    {"get": [URL, ...]}                      GET texts (Prometheus metrics)
"""
from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request

OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never a proxy


def get(url: str, timeout: float) -> tuple[int, str]:
    try:
        with OPENER.open(url, timeout=timeout) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def wait_health(url: str, deadline_s: float) -> dict:
    deadline, last = time.monotonic() + deadline_s, None
    while time.monotonic() < deadline:
        try:
            status, text = get(url, 5)
            last = f"HTTP {status}: {text}"
            workers = json.loads(text).get("workers", {})
            if status == 200 and all(w["healthy"] == w["total"] > 0 for w in workers.values()):
                return {"ok": True, "health": json.loads(text)}
        except (OSError, ValueError) as e:
            last = repr(e)
        time.sleep(0.3)
    return {"ok": False, "last": last}


def main() -> None:
    job = json.load(sys.stdin)
    timeout = job.get("timeout_s", 120)
    out: dict = {}
    if "wait_health" in job:
        out["wait_health"] = wait_health(job["wait_health"], job.get("deadline_s", 60))
    if "post" in job:
        out["post"] = []
        for url, body in job["post"]:
            req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            try:
                with OPENER.open(req, timeout=timeout) as reply:
                    out["post"].append({"status": reply.status, "body": json.load(reply)})
            except urllib.error.HTTPError as e:
                out["post"].append({"status": e.code, "body": e.read().decode()})
    if "get" in job:
        out["get"] = [get(url, timeout) for url in job["get"]]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
