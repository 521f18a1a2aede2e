"""GPU readiness in one run (at most 9 minutes): engine, bf16, kernels, graphs, P/D, NIXL.

    python benchmarks/gpu_check.py [--json PATH] [--only engine,kernels] [--budget-s 540]
    python benchmarks/gpu_check.py --dry-run      # CPU, tiny shapes, TRITON_INTERPRET=1 (CI)

Sections, each timed and ending in one line `== [name] PASS|FAIL|SKIP (seconds): reason`:

    env          torch / triton / transformers versions, the GPU's name and memory
    engine       LLMEngine(device="cuda") on random-weight models of SmolLM2-135M's and
                 Llama-3.2-1B's shapes (configs built here, nothing from a hub), fp32 greedy
                 tokens == transformers' on the same device, decode steps replayed as CUDA
                 graphs; tokens/s at batch 1 and 8 (gpu_check_engine.py)
    bf16         the engine in bf16 against transformers in bf16, 24 prompts per model, by
                 vLLM's check_logprobs_close rule (gpu_check_bf16.py)
    kernels      every Triton launcher, compiled (not interpreted), against its torch
                 reference (benchmarks/gpu_kernels.py's checks), bf16 and fp32
    graphs       the engine's CUDA-graph decode step (batch 1, 3 padded to 4, 8) == its eager
                 step, and the time of both (gpu_check_graphs.py; CUDA only: the dry-run
                 checks the padding and static buffers without capture)
    disagg       prefill + decode workers in bf16 on the device == the colocated engine,
                 token for token, over gRPC and NIXL (gpu_check_disagg.py)
    tiers        the KV pool on the device over pinned host and disk tiers: a prefix evicted
                 and loaded back gives the tokens it gives from the pool (gpu_check_tiers.py)
    decode_bw    paged decode attention at 4K and 32K context: achieved GB/s of K+V read and
                 its ratio to a torch device copy measured in the same run
    decode_floor the batch-1 bf16 decode step (graph replay) against the weight-read floor at
                 the read bandwidth measured in the same run (gpu_check_graphs.py)
    nixl         NIXL device-to-device (VRAM) between two processes on the one GPU (SKIP
                 where the `nixl` package does not import)

Without CUDA (or with --dry-run) every section runs on CPU with tiny shapes and the Triton
interpreter (the engine's greedy check goes through the attention path CUDA takes, the
Triton launchers, see gpu_check_engine.triton_launchers_on_cpu); the CUDA-only parts SKIP
with their reason. Exits 0 only when no section
FAILed. A watchdog (SIGALRM) ends the section running at --budget-s; later sections SKIP.
The script imports nothing the GPU machine lacks at module level (xgrammar, nixl: guarded).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ("env", "engine", "bf16", "kernels", "graphs", "disagg", "tiers", "decode_bw",
            "decode_floor", "nixl")
MODULES = {"engine": "gpu_check_engine", "bf16": "gpu_check_bf16", "kernels": "gpu_check_kernels",
           "graphs": "gpu_check_graphs", "disagg": "gpu_check_disagg", "tiers": "gpu_check_tiers",
           "decode_bw": "gpu_check_kernels", "decode_floor": "gpu_check_graphs",
           "nixl": "gpu_check_nixl"}
PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


class Budget(Exception):
    """Raised in the main thread by the watchdog when the run's time budget is spent."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, tiny shapes, Triton interpreter (automatic without CUDA)")
    p.add_argument("--only", default=",".join(SECTIONS),
                   help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--budget-s", type=float, default=540.0, help="whole-run time limit")
    p.add_argument("--json", default=None, help="write the report (statuses, numbers) here")
    args = p.parse_args(argv)
    args.only = [s for s in args.only.split(",") if s]
    unknown = set(args.only) - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    return args


def setup(args: argparse.Namespace) -> SimpleNamespace:
    """Decide dry-run (before triton is imported: TRITON_INTERPRET is read at @triton.jit)
    and build the context every section gets."""
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device (torch.cuda.is_available() is False): running the dry-run")
        args.dry_run = True
        os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(ROOT))  # baton, kernels; this folder is sys.path[0] already
    return SimpleNamespace(dry_run=args.dry_run, device=torch.device(
        "cpu" if args.dry_run else "cuda"), report={}, engines={}, engines_bf16={}, models={},
        workdir=None)


def log(msg: str) -> None:
    print(f"   {msg}", flush=True)


def _env(ctx) -> tuple[str, str]:
    import torch
    import triton

    info = {"python": sys.version.split()[0], "torch": torch.__version__,
            "torch_cuda": torch.version.cuda, "triton": triton.__version__,
            "triton_interpret": os.environ.get("TRITON_INTERPRET", "")}
    for name in ("transformers", "google.protobuf", "nixl"):  # None: not importable
        try:
            info[name] = getattr(importlib.import_module(name), "__version__", "importable")
        except Exception as e:  # noqa: BLE001 - a broken install is a report, not a crash
            info[name] = None if isinstance(e, ImportError) else f"{type(e).__name__}: {e}"
    if ctx.device.type == "cuda":
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info()
        info.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                    sms=props.multi_processor_count, memory_gib=round(total / 2**30, 1),
                    free_gib=round(free / 2**30, 1))
    for k, v in info.items():
        log(f"{k:<16} {v}")
    ctx.report["env"] = info
    where = info.get("gpu", "cpu (dry-run)")
    return PASS, f"{where}, torch {info['torch']}, triton {info['triton']}"


def _section(name: str):
    """The function running section `name` (imported late: each module imports torch)."""
    if name == "env":
        return _env
    m = importlib.import_module(MODULES[name])
    return getattr(m, f"section_{name}")


def run_sections(ctx, names, budget_s: float, section=_section) -> list[dict]:
    """Run each named section under one deadline; every one reports exactly once."""
    results, deadline = [], time.monotonic() + budget_s

    def on_alarm(signum, frame):
        raise Budget(f"time budget of {budget_s:.0f} s spent")

    old = signal.signal(signal.SIGALRM, on_alarm)
    try:
        for name in names:
            left = deadline - time.monotonic()
            print(f"-- [{name}]", flush=True)
            t0 = time.monotonic()
            if left <= 0.05:
                status, reason = SKIP, "time budget spent before this section"
            else:
                signal.setitimer(signal.ITIMER_REAL, left)
                try:
                    status, reason = section(name)(ctx)
                except Budget as e:
                    status, reason = FAIL, f"stopped: {e}"
                except BaseException as e:  # noqa: BLE001 - a section's failure is its report
                    if isinstance(e, KeyboardInterrupt):
                        raise
                    traceback.print_exc(limit=6)
                    status, reason = FAIL, f"{type(e).__name__}: {e}".splitlines()[0][:300]
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
            seconds = time.monotonic() - t0
            print(f"== [{name}] {status} ({seconds:.1f} s): {reason}", flush=True)
            results.append({"section": name, "status": status, "seconds": round(seconds, 2),
                            "reason": reason, "details": ctx.report.get(name)})
    finally:
        signal.signal(signal.SIGALRM, old)
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    ctx = setup(args)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="baton-gpu-check-") as tmp:
        ctx.workdir = Path(tmp)
        names = [s for s in SECTIONS if s in args.only]
        results = run_sections(ctx, names, args.budget_s)
        ctx.engines.clear()
        ctx.engines_bf16.clear()
    counts = {s: sum(r["status"] == s for r in results) for s in (PASS, FAIL, SKIP)}
    mode = "dry-run (CPU, interpreter)" if ctx.dry_run else "CUDA"
    print(f"gpu_check {mode}: {counts[PASS]} PASS, {counts[FAIL]} FAIL, {counts[SKIP]} SKIP "
          f"in {time.monotonic() - t0:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"dry_run": ctx.dry_run, "sections": results}, indent=2, default=str))
    return 1 if counts[FAIL] else 0


if __name__ == "__main__":
    sys.exit(main())
