"""A small fake OpenAI-compatible streaming server for the benchmark's tests.

Serves `/v1/chat/completions` and `/v1/completions` (stream only) and `/health`; as Baton
(`baton=True`) also `/version`, `/v1/models` and `/metrics/workers` (two fake workers whose
running count is the requests in flight, in vLLM's metric names). Prompts are
"tokenized" as 4-character pieces (chat: ChatML rendering, counted as the client counts), as
words (completion text) or taken as given token ids. A simulated prefix cache reports
`cached_tokens` = the longest prefix shared with any earlier prompt, in 16-token blocks, capped
at len - 1. Every request is logged with its arrival/finish times and `X-Session-ID`.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
import zlib
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from baton.bench.tokens import TokenCounter

BLOCK = 16


@dataclass
class Logged:
    path: str
    session_id: str | None
    body: dict
    prompt: list[int]
    arrived: float
    finished: float | None = None
    cached: int = 0


@dataclass
class FakeServer:
    ttft_s: float = 0.01
    token_s: float = 0.002
    fail_every: int = 0                  # every Nth request answers HTTP 500
    reject_429: int = 0                  # the first N requests answer 429, Retry-After 0.2
    max_len: int = 0                     # longer prompts get a context-length 400
    baton: bool = True                   # False: /version, /metrics/workers answer 404
    log: list[Logged] = field(default_factory=list)
    _prompts: list[list[int]] = field(default_factory=list)

    def tokens(self, body: dict, chat: bool) -> list[int]:
        if chat:
            # the client's own count (ChatML, 4-character pieces per rendered message), so
            # the fake's prefix hits and the client's bounds are in the same tokens
            messages = body["messages"]
            return TokenCounter(None).chat_prompts(messages, [len(messages)],
                                                   body.get("tools"))[0].tolist()
        prompt = body["prompt"]
        if isinstance(prompt, list):
            return list(prompt)
        return [zlib.crc32(w.encode()) for w in prompt.split()]  # a word-level tokenizer

    def cached(self, prompt: list[int]) -> int:
        best = 0
        for q in self._prompts:
            n = 0
            for a, b in zip(prompt, q):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        self._prompts.append(prompt)
        return min(best // BLOCK * BLOCK, max(len(prompt) - 1, 0))

    async def stream(self, entry: Logged, chat: bool):
        n = int(entry.body.get("max_tokens") or entry.body.get("max_completion_tokens") or 16)
        obj = "chat.completion.chunk" if chat else "text_completion"
        if chat:  # a role-only chunk first, as real servers send: not a token
            yield _sse({"object": obj, "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        await asyncio.sleep(self.ttft_s)
        for i in range(n):
            if i:
                await asyncio.sleep(self.token_s)
            choice = {"index": 0, "delta": {"content": f" t{i}"}} if chat else \
                {"index": 0, "text": f" t{i}"}
            yield _sse({"object": obj, "choices": [choice]})
        entry.finished = time.perf_counter()
        yield _sse({"object": obj, "choices": [], "usage": {
            "prompt_tokens": len(entry.prompt), "completion_tokens": n,
            "total_tokens": len(entry.prompt) + n,
            "prompt_tokens_details": {"cached_tokens": entry.cached}}})
        yield "data: [DONE]\n\n"

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health():
            return {"status": "ok"}

        async def handle(request: Request, chat: bool):
            body = await request.json()
            prompt = self.tokens(body, chat)
            entry = Logged(request.url.path, request.headers.get("x-session-id"), body, prompt,
                           time.perf_counter())
            self.log.append(entry)
            if self.fail_every and len(self.log) % self.fail_every == 0:
                return JSONResponse({"error": {"message": "injected failure"}}, 500)
            if len(self.log) <= self.reject_429:
                return JSONResponse({"error": {"message": "slo", "code": "slo_unattainable"}},
                                    429, headers={"Retry-After": "0.2"})
            if self.max_len and len(prompt) > self.max_len:
                msg = f"This model's maximum context length is {self.max_len} tokens"
                return JSONResponse({"error": {"message": msg}}, 400)
            entry.cached = self.cached(prompt)
            return StreamingResponse(self.stream(entry, chat), media_type="text/event-stream")

        if self.baton:
            self.baton_routes(app)

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await handle(request, True)

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await handle(request, False)

        return app


    def baton_routes(self, app: FastAPI) -> None:
        """The routes only a Baton gateway serves."""
        @app.get("/version")
        async def version():
            return {"version": "9.9.9", "commit": "abc123"}

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "fake", "object": "model",
                                                "max_model_len": 4096}]}

        @app.get("/metrics/workers")
        async def worker_metrics():
            return PlainTextResponse(self.worker_metrics())

    def worker_metrics(self) -> str:
        """Exposition text of two workers: decode runs what is in flight, prefill none."""
        live = sum(1 for e in self.log if e.finished is None)
        lines = []
        for name, kind in (("vllm:num_requests_running", "gauge"),
                           ("vllm:num_requests_waiting", "gauge"),
                           ("vllm:kv_cache_usage_perc", "gauge")):
            lines += [f"# HELP {name} fake", f"# TYPE {name} {kind}"]
            for worker, role, value in (("127.0.0.1:50051", "decode", live),
                                        ("127.0.0.1:50052", "prefill", 0)):
                if name.endswith("perc"):
                    value = min(value / 10, 1.0)
                lines.append(f'{name}{{engine="0",model_name="fake",role="{role}",'
                             f'worker="{worker}"}} {float(value)}')
        return "\n".join(lines) + "\n"


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class ServerThread:
    """Run a FastAPI app with uvicorn on 127.0.0.1:0 in a background thread."""

    def __init__(self, app: FastAPI):
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
