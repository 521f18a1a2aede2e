"""vLLM's own disaggregated serving on this host, for `baton bench compare`'s "vllm-pd": the
peer's P/D measured on the same cores, model and harness as Baton's default cluster.

Run with vLLM's interpreter (its venv has vLLM, NIXL, FastAPI, httpx and uvicorn; nothing of
Baton is imported, so the file runs as a script there):

    VENV/bin/python baton/bench/vllm_pd.py --port P [--pin share|split] -- VLLM_ARGS...

It starts two `vllm.entrypoints.openai.api_server` processes with VLLM_ARGS (bench's
vllm_server.py builds them: model, dtype, prefix caching, KV bytes; no port), a prefill one
and a decode one, each with vLLM's NixlConnector over UCX on host memory
(`kv_buffer_device` "cpu", `kv_role` kv_producer / kv_consumer, UCX_NET_DEVICES=lo unless set,
its own VLLM_NIXL_SIDE_CHANNEL_PORT), and serves on P the proxy of vLLM's NIXL tests
(tests/v1/kv_connector/nixl_integration/toy_proxy_server.py, rewritten here): the client's
request goes to prefill with max_tokens 1, no stream and kv_transfer_params
{"do_remote_decode": true}; the kv_transfer_params prefill answers with are added to the
client's own request, which decode serves (streamed as it streams). `--pin share`: both
servers' OpenMP threads on every core of this process (Baton's default `--pin share` shares
cores too; vLLM has no idle-lending, so two busy servers oversubscribe); `split`: prefill
on the upper half of the cores, decode on the lower (Baton's `--pin split`).

The children are in this process's group: stopping the group (bench/local.py) stops them.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

PREFILL_FIELDS = {"do_remote_decode": True, "do_remote_prefill": False,
                  "remote_engine_id": None, "remote_block_ids": None, "remote_host": None,
                  "remote_port": None}


def prefill_body(body: dict) -> dict:
    """The prefill server's request for a client's `body` (a chat or completions body): one
    token, not streamed, asking vLLM to keep the KV for a remote decode (toy_proxy_server's
    rule). Returns a new dict; `body` is unchanged."""
    out = {k: v for k, v in body.items() if k != "stream_options"}
    out.update(stream=False, max_tokens=1, kv_transfer_params=dict(PREFILL_FIELDS))
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def decode_body(body: dict, prefill_answer: dict) -> dict:
    """The decode server's request: the client's `body` with the kv_transfer_params that
    prefill answered (where its KV is to be read from); unchanged without them."""
    params = prefill_answer.get("kv_transfer_params")
    return {**body, "kv_transfer_params": params} if params else dict(body)


def make_app(prefill_url: str, decode_url: str, client):
    """The proxy: a FastAPI app relaying /v1/chat/completions and /v1/completions through
    prefill then decode with `client` (an httpx.AsyncClient); /v1/models from decode;
    /health 200 only while both servers answer theirs (else 503)."""
    app = FastAPI()

    async def relay(path: str, request: Request):
        body = await request.json()
        first = await client.post(prefill_url + path, json=prefill_body(body))
        if first.status_code != 200:
            return Response(first.content, status_code=first.status_code,
                            media_type="application/json")
        body = decode_body(body, first.json())
        if not body.get("stream"):
            r = await client.post(decode_url + path, json=body)
            return Response(r.content, status_code=r.status_code, media_type="application/json")
        upstream = await client.send(client.build_request("POST", decode_url + path, json=body),
                                     stream=True)

        async def chunks():
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()
        return StreamingResponse(chunks(), status_code=upstream.status_code,
                                 media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await relay("/v1/chat/completions", request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await relay("/v1/completions", request)

    @app.get("/v1/models")
    async def models():
        r = await client.get(decode_url + "/v1/models")
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    @app.get("/health")
    async def health():
        for url in (prefill_url, decode_url):
            try:
                if (await client.get(url + "/health")).status_code != 200:
                    return JSONResponse({"ready": False}, status_code=503)
            except Exception:  # noqa: BLE001 - any failure to answer is "not ready"
                return JSONResponse({"ready": False}, status_code=503)
        return {"ready": True}

    return app


def cpu_halves(pin: str, cpus: list[int]) -> tuple[str, str]:
    """(prefill, decode) VLLM_CPU_OMP_THREADS_BIND lists: both every core for "share", the
    upper and lower halves for "split" (one core each on two). Raises ValueError for split
    with fewer than two cores or an unknown pin."""
    cpus = sorted(cpus)
    if pin == "share":
        both = ",".join(map(str, cpus))
        return both, both
    if pin != "split" or len(cpus) < 2:
        raise ValueError(f"--pin {pin} needs 'share', or 'split' with ≥ 2 cores")
    half = len(cpus) // 2
    return ",".join(map(str, cpus[half:])), ",".join(map(str, cpus[:half]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server(vllm_args: list[str], port: int, cpus: str, role: str) -> subprocess.Popen:
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=cpus,
               VLLM_NIXL_SIDE_CHANNEL_PORT=str(_free_port()))
    env.setdefault("UCX_NET_DEVICES", "lo")
    config = {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}
    return subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                             *vllm_args, "--port", str(port),
                             "--kv-transfer-config", json.dumps(config)], env=env)


def main(argv: list[str] | None = None) -> None:
    import httpx
    import uvicorn

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--pin", default="share", choices=("share", "split"))
    p.add_argument("vllm_args", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    vllm_args = a.vllm_args[1:] if a.vllm_args[:1] == ["--"] else a.vllm_args
    prefill_cpus, decode_cpus = cpu_halves(a.pin, list(os.sched_getaffinity(0)))
    ports = _free_port(), _free_port()
    children = [_server(vllm_args, ports[0], prefill_cpus, "kv_producer"),
                _server(vllm_args, ports[1], decode_cpus, "kv_consumer")]
    try:
        client = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=256))
        app = make_app(f"http://127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[1]}", client)
        uvicorn.run(app, host="127.0.0.1", port=a.port, log_level="warning")
    finally:
        for c in children:
            c.terminate()
        deadline = time.monotonic() + 30
        for c in children:
            try:
                c.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.kill()


if __name__ == "__main__":
    main()
