"""What the gateway adds to time-to-first-token: TTFT via the gateway vs. decode's gRPC directly.

    python benchmarks/gateway_overhead.py                      # fake decode worker (default)
    python benchmarks/gateway_overhead.py --decode 127.0.0.1:50051 --model smollm2-135m

Same chat prompts on both paths, one request at a time, the two paths interleaved:
- direct:  the prompt templated and tokenized here (not timed), then DecodeService.Generate;
           TTFT = until the first TokenChunk.
- gateway: POST /v1/chat/completions with stream=true from a minimal keep-alive HTTP/1.1
           client (so the client's own cost stays out); TTFT = until the first SSE event with
           content. The gateway's templating, tokenization, block hashing, routing and relay
           are all inside this number.
The gateway runs as its own process (`python -m gateway`); with no --decode, a fake decode
worker (tests/gateway/fake_decode.py, first token at once) runs as another. With a real decode
worker every prompt is sent once first, so both paths then hit the prefix cache alike.
Prints p50/p90 of both and of the paired difference; the target is <= 2 ms added at p50.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402

from protos import common_pb2, decode_pb2, decode_pb2_grpc  # noqa: E402

WORDS = ("agent tool result context decode prefill cache block token session stream "
         "latency gateway route worker batch").split()


def make_prompts(count: int, seed: int = 0) -> list[list[dict]]:
    """Agent-like chats of varied length (about 50 to 1,500 words)."""
    import random
    rng = random.Random(seed)
    out = []
    for i in range(count):
        words = rng.randint(50, 1500)
        body = " ".join(rng.choice(WORDS) for _ in range(words))
        out.append([{"role": "system", "content": f"You are agent {i}."},
                    {"role": "user", "content": f"Tool output:\n{body}\nWhat next?"}])
    return out


def start(cmd: list[str], env: dict) -> tuple[subprocess.Popen, str]:
    """Start a process and return it with its first stdout line."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    if not line:
        raise SystemExit(f"{cmd[2]} did not start (exit {proc.poll()})")
    return proc, line


def child_env() -> dict:
    """This process's environment for the children: the repository importable, one thread."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1"}


def start_gateway(model: str, decode: str, env: dict, *flags: str
                  ) -> tuple[subprocess.Popen, int]:
    """`python -m gateway` on any free port in front of `decode`: (process, HTTP port)."""
    proc, line = start([sys.executable, "-m", "gateway", "--model", model, "--decode", decode,
                        "--port", "0", "--log-level", "warning", *flags], env)
    return proc, int(line.split(" on http://127.0.0.1:")[1].split()[0].rstrip(","))


def stop(procs: list[subprocess.Popen]) -> None:
    """Terminate the processes, last started first."""
    for proc in reversed(procs):
        proc.terminate()
        proc.wait(10)


class RawHTTP:
    """One keep-alive HTTP/1.1 connection; returns seconds until the first content event."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader = self.writer = None

    async def ttft(self, body: bytes, session: str) -> float:
        try:
            return await self._ttft(body, session)
        except ConnectionError:  # the server closed an idle keep-alive connection: reconnect
            self.writer = None
            return await self._ttft(body, session)

    async def _ttft(self, body: bytes, session: str) -> float:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {self.host}\r\n"
                f"Content-Type: application/json\r\nX-Session-ID: {session}\r\n"
                f"Content-Length: {len(body)}\r\n\r\n")
        start = time.perf_counter()
        self.writer.write(head.encode() + body)
        buf, first = b"", None
        while True:
            data = await self.reader.read(65536)
            if not data:
                raise ConnectionError(f"connection closed: {buf[:300]!r}")
            buf += data
            if not buf.startswith(b"HTTP/1.1 200") and b"\r\n\r\n" in buf:
                raise RuntimeError(buf[:400].decode(errors="replace"))
            if first is None and b'"content":"' in buf.replace(b'"content":""', b""):
                first = time.perf_counter() - start
            if buf.endswith(b"\r\n0\r\n\r\n"):
                return first


async def direct_ttft(stub, ids: list[int], max_tokens: int) -> float:
    req = decode_pb2.GenerateRequest(
        request_id=f"direct-{time.perf_counter_ns()}", prompt_token_ids=ids,
        sampling_params=common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens),
        prefill_mode=decode_pb2.PREFILL_MODE_AUTO)
    start = time.perf_counter()
    first = None
    async for msg in stub.Generate(req, timeout=600):
        if first is None and msg.WhichOneof("kind") == "tokens":
            first = time.perf_counter() - start
    return first


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


async def run(args, tokenizer, port: int, decode_address: str) -> None:
    import uvloop  # noqa: F401  (the loop is already uvloop)
    prompts = make_prompts(args.prompts)
    warm = make_prompts(args.warmup, seed=1)  # distinct texts: round 0 stays cold
    ids = [_ids(tokenizer, p) for p in prompts]
    http = RawHTTP("127.0.0.1", port)
    async with grpc.aio.insecure_channel(decode_address) as channel:
        stub = decode_pb2_grpc.DecodeServiceStub(channel)
        for i, p in enumerate(warm):
            await http.ttft(_body(args, p), f"warmup-{i}")
            await direct_ttft(stub, _ids(tokenizer, p), args.max_tokens)
        if args.decode:  # a real worker: fill its prefix cache so both paths hit it alike
            for i in range(len(prompts)):
                await direct_ttft(stub, ids[i], args.max_tokens)
        rounds = []
        for r in range(args.rounds):
            gw, direct = [], []
            for i in range(len(prompts)):
                if (i + r) % 2:
                    gw.append(await http.ttft(_body(args, prompts[i]), f"s{i}"))
                    direct.append(await direct_ttft(stub, ids[i], args.max_tokens))
                else:
                    direct.append(await direct_ttft(stub, ids[i], args.max_tokens))
                    gw.append(await http.ttft(_body(args, prompts[i]), f"s{i}"))
            rounds.append((gw, direct))
    print(f"{len(prompts)} chat prompts of {min(map(len, ids))}-{max(map(len, ids))} tokens, "
          f"{args.rounds} rounds, one request at a time")
    report("round 1 (cold: the gateway tokenizes every prompt in full)", *rounds[0])
    if len(rounds) > 1:
        report("rounds 2+ (warm: the history was seen before, as in agent sessions)",
               [g for gw, _ in rounds[1:] for g in gw], [d for _, d in rounds[1:] for d in d])


def _ids(tokenizer, messages: list[dict]) -> list[int]:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                         return_dict=False)


def _body(args, messages: list[dict]) -> bytes:
    return json.dumps({"model": args.model, "messages": messages, "stream": True,
                       "max_tokens": args.max_tokens, "temperature": 0}).encode()


def report(title: str, gw: list[float], direct: list[float]) -> None:
    ms = 1e3
    diff = [g - d for g, d in zip(gw, direct, strict=True)]
    print(f"\n{title}: {len(gw)} requests per path")
    print(f"{'':14s}{'p50 ms':>10s}{'p90 ms':>10s}{'mean ms':>10s}")
    for name, xs in (("direct gRPC", direct), ("via gateway", gw), ("paired diff", diff)):
        print(f"{name:14s}{pct(xs, .5) * ms:10.3f}{pct(xs, .9) * ms:10.3f}"
              f"{statistics.fmean(xs) * ms:10.3f}")
    added = pct(gw, .5) - pct(direct, .5)
    print(f"added at p50: {added * ms:.3f} ms (target <= 2 ms: "
          f"{'met' if added <= 0.002 else 'NOT met'})")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--decode", default=None, help="a running decode worker (default: a fake)")
    p.add_argument("--model", default="smollm2-135m",
                   help="the served model (the fake worker only needs its tokenizer)")
    p.add_argument("--prompts", type=int, default=50)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=4)
    args = p.parse_args()
    env = child_env()
    procs = []
    try:
        from transformers import AutoTokenizer

        from baton.models.registry import resolve_model
        tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model))
        decode = args.decode
        if decode is None:
            proc, decode = start([sys.executable, "-m", "tests.gateway.fake_decode",
                                  "--tokens", str(args.max_tokens)], env)
            procs.append(proc)
        proc, port = start_gateway(args.model, decode, env)
        procs.append(proc)
        time.sleep(1.0)  # first health/stats poll
        import uvloop
        uvloop.run(run(args, tokenizer, port, decode))
    finally:
        stop(procs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
