"""A plain transformers server: the baseline `baton bench compare` measures Baton against.

    python -m baton.bench.hf_baseline --model smollm2-135m --port 8100

OpenAI-compatible enough for the benchmark (`/v1/chat/completions`, `/v1/completions` with text
or token-id prompts, `stream: true`, `max_tokens`, `ignore_eos`, usage with cached_tokens = 0,
`/health`, `/v1/models`). One request at a time: requests queue on a lock and each runs
`model.generate` (greedy, its own KV cache, no prefix cache, no batching) in a thread, streaming
tokens back as they come. A client disconnect stops that generation.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
import uuid

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria
from transformers.generation.streamers import BaseStreamer


class _QueueStreamer(BaseStreamer):
    """Hands each new token id to the event loop; the first put() is the prompt (skipped)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue):
        self.loop, self.queue, self.prompt_seen = loop, queue, False

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        for tok in value.reshape(-1).tolist():
            self.loop.call_soon_threadsafe(self.queue.put_nowait, tok)

    def end(self) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, None)


class _Stop(StoppingCriteria):
    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool)


class Baseline:
    def __init__(self, folder: str, threads: int):
        torch.set_num_threads(threads)
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        self.lock = asyncio.Lock()

    def prompt_ids(self, body: dict, chat: bool) -> list[int]:
        if chat:
            text = self.tokenizer.apply_chat_template(body["messages"], tokenize=False,
                                                      add_generation_prompt=True)
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        prompt = body["prompt"]
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return prompt
        return self.tokenizer(prompt if isinstance(prompt, str) else prompt[0])["input_ids"]

    async def stream(self, body: dict, chat: bool):
        """Yields SSE lines for one request; holds the lock for the whole generation."""
        ids = self.prompt_ids(body, chat)
        max_tokens = int(body.get("max_tokens") or 16)
        rid, created = f"cmpl-{uuid.uuid4().hex[:12]}", int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"
        async with self.lock:
            loop, queue, stop = asyncio.get_running_loop(), asyncio.Queue(), threading.Event()
            kwargs = dict(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                          dtype=torch.long), max_new_tokens=max_tokens, do_sample=False,
                          streamer=_QueueStreamer(loop, queue), stopping_criteria=[_Stop(stop)],
                          pad_token_id=self.tokenizer.eos_token_id)
            if body.get("ignore_eos"):
                kwargs["min_new_tokens"] = max_tokens
            worker = loop.run_in_executor(None, lambda: self.model.generate(**kwargs))
            out, sent = [], ""
            try:
                while (tok := await queue.get()) is not None:
                    out.append(tok)
                    text = self.tokenizer.decode(out, skip_special_tokens=True)
                    if text.endswith("\ufffd") or len(text) <= len(sent):
                        continue
                    piece, sent = text[len(sent):], text
                    choice = ({"index": 0, "delta": {"content": piece}} if chat
                              else {"index": 0, "text": piece})
                    yield _sse({"id": rid, "object": kind, "created": created,
                                "choices": [choice]})
                await worker
            finally:
                stop.set()
                await asyncio.shield(worker)
        final = {"index": 0, "delta": {}, "finish_reason": "length"} if chat else \
            {"index": 0, "text": "", "finish_reason": "length"}
        yield _sse({"id": rid, "object": kind, "created": created, "choices": [final]})
        yield _sse({"id": rid, "object": kind, "created": created, "choices": [],
                    "usage": {"prompt_tokens": len(ids), "completion_tokens": len(out),
                              "total_tokens": len(ids) + len(out),
                              "prompt_tokens_details": {"cached_tokens": 0}}})
        yield "data: [DONE]\n\n"


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def build_app(baseline: Baseline, model_name: str) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model"}]}

    async def handle(request: Request, chat: bool):
        body = await request.json()
        if not body.get("stream"):
            return JSONResponse({"error": {"message": "only stream: true is served"}}, 400)
        return StreamingResponse(baseline.stream(body, chat), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, False)

    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m baton.bench.hf_baseline")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    import uvicorn

    from baton.models.registry import resolve_model

    baseline = Baseline(str(resolve_model(args.model)), args.threads)
    uvicorn.run(build_app(baseline, args.model), host=args.host, port=args.port,
                log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
