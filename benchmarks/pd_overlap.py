"""Disaggregated TTFT of one long prompt vs the prefill worker's own prefill time, with the KV
sent per chunk (overlapped with the next chunk's compute) and sent once at the end.

    python benchmarks/pd_overlap.py [--model smollm2-135m] [--prompt-tokens 6000] [--runs 4]
                                    [--transport grpc | nixl]

Starts three worker processes on 127.0.0.1 over the gRPC transport (or --transport): prefill A
(--kv-send-per-chunk), prefill B (--no-kv-send-per-chunk) and one decode worker; each run
sends a fresh random prompt (no prefix hit anywhere) with max_tokens=1 and
PREFILL_MODE_REMOTE to A or B, alternating A, B, A, B, ... after one unmeasured warm-up each.
Per run it prints the decode worker's TTFT (arrival → first token sent,
Finished.timings.ttft_seconds), the prefill worker's prefill time (scheduled → first token,
its compute_seconds), the transfer time it reported (last push → DONE per chunk; the whole
transfer when sent at the end) and TTFT / prefill; then the medians and the load average
before and after. Every process is stopped at the end.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from baton.sampling_params import SamplingParams  # noqa: E402
from baton.worker.process import parse_ready  # noqa: E402
from baton.worker.wire import sampling_params_to_proto  # noqa: E402
from protos import decode_pb2, decode_pb2_grpc  # noqa: E402


def start(module: str, args: list[str], ready_s: float = 300.0) -> tuple[subprocess.Popen, int]:
    """A worker process and its gRPC port, once it printed READY (RuntimeError if it dies)."""
    proc = subprocess.Popen([sys.executable, "-m", module, "--host", "127.0.0.1", "--port", "0",
                             "--log-level", "WARNING", *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + ready_s
    for line in proc.stdout:
        if (ready := parse_ready(line)) is not None:
            return proc, ready.port
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError(f"{module} did not start (exit {proc.wait()})")


def run_once(stub, prompt: list[int], prefill: str, rid: str) -> dict[str, float]:
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    req = decode_pb2.GenerateRequest(
        request_id=rid, prompt_token_ids=prompt, sampling_params=sampling_params_to_proto(params),
        prefill_address=prefill, prefill_mode=decode_pb2.PREFILL_MODE_REMOTE)
    t0, first, fin = time.perf_counter(), None, None
    for msg in stub.Generate(req, timeout=600):
        if msg.HasField("tokens") and first is None:
            first = time.perf_counter() - t0
        elif msg.HasField("finished"):
            fin = msg.finished
    t = fin.timings
    if not t.remote_prefill:
        raise RuntimeError(f"{rid} was not prefilled remotely: {fin}")
    return {"client_ttft": first, "ttft": t.ttft_seconds, "prefill": t.prefill_seconds,
            "transfer": t.transfer_seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompt-tokens", type=int, default=6000)
    p.add_argument("--runs", type=int, default=4, help="measured runs per mode")
    p.add_argument("--num-blocks", type=int, default=448)
    p.add_argument("--chunk", type=int, default=512, help="--long-prefill-token-threshold")
    p.add_argument("--transport", choices=["grpc", "nixl"], default="grpc")
    a = p.parse_args()
    common = ["--model", a.model, "--transport", a.transport, "--num-blocks", str(a.num_blocks)]
    load_before = os.getloadavg()
    procs = []
    try:
        ports = {}
        for mode, flag in (("per-chunk", "--kv-send-per-chunk"), ("at-end", "--no-kv-send-per-chunk")):
            proc, ports[mode] = start("prefill_service", [*common, flag,
                                                          "--long-prefill-token-threshold", str(a.chunk)])
            procs.append(proc)
        proc, dport = start("decode_service", [*common, "--prefill-address",
                                               f"127.0.0.1:{ports['per-chunk']}"])
        procs.append(proc)
        stub = decode_pb2_grpc.DecodeServiceStub(grpc.insecure_channel(f"127.0.0.1:{dport}"))
        rng = random.Random(0)
        results: dict[str, list[dict[str, float]]] = {m: [] for m in ports}
        order = [m for _ in range(a.runs + 1) for m in ports]  # first of each: warm-up
        for i, mode in enumerate(order):
            prompt = [rng.randrange(100, 30000) for _ in range(a.prompt_tokens)]
            r = run_once(stub, prompt, f"127.0.0.1:{ports[mode]}", f"run-{i}")
            warm = i < len(ports)
            if not warm:
                results[mode].append(r)
            print(f"{'warm-up' if warm else 'run'} {i:2d} {mode:9s}: TTFT {r['ttft']:.3f} s "
                  f"(client {r['client_ttft']:.3f}), prefill {r['prefill']:.3f} s, transfer "
                  f"{r['transfer']:.3f} s, TTFT/prefill {r['ttft'] / r['prefill']:.3f}",
                  flush=True)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in results.items()}
    for mode, m in med.items():
        ratios = [r["ttft"] / r["prefill"] for r in results[mode]]
        print(f"{mode:9s} median of {len(ratios)}: TTFT {m['ttft']:.3f} s, prefill "
              f"{m['prefill']:.3f} s, transfer {m['transfer']:.3f} s, TTFT/prefill "
              f"{statistics.median(ratios):.3f} (runs {', '.join(f'{x:.3f}' for x in ratios)})")
    on, off = med["per-chunk"], med["at-end"]
    print(f"per-chunk TTFT / at-end TTFT {on['ttft'] / off['ttft']:.3f}; per-chunk TTFT / "
          f"at-end prefill {on['ttft'] / off['prefill']:.3f}")
    print(f"transport {a.transport}; load average before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, "
          f"after {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
