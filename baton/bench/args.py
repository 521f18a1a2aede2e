"""The workload and run flags `baton bench` and `baton bench compare` share, and the two
helpers both call on them: `counter_for(args)` (the token counter of the served model) and
`load_workload(args, counter)` (the sessions a `--workload` names)."""
from __future__ import annotations

import argparse
from pathlib import Path

from baton.bench import loaders
from baton.bench.local import ServerSpec
from baton.bench.synthetic import BurstsConfig, SyntheticConfig, bursts, generate
from baton.bench.tokens import TokenCounter
from baton.bench.workload import Scaling, Session

# Slices of the public traces, shipped in the package (traces/README.md: sources, licences).
TRACES = Path(__file__).resolve().parent / "traces"
DEFAULT_TRACE = {
    "tau-bench": "tau_bench/gpt-4o-airline.head48.json.gz",
    "swe-agent": "swe_agent_trajectories",
    "mooncake": "mooncake_fast25/conversation_trace.head1500.jsonl.gz",
}
WORKLOADS = ("tau-bench", "swe-agent", "mooncake", "agentx", "synthetic", "bursts")


class HelpFormatter(argparse.RawDescriptionHelpFormatter,
                    argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and every flag's default in --help."""


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload flags: which trace, its model/tokenizer, how it is cut and scaled."""
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=WORKLOADS, default="tau-bench",
                   help="which agent traffic to replay (BENCHMARKS.md: Workloads)")
    g.add_argument("--trace", type=Path,
                   help="trace file or folder (default: the slice shipped in baton/bench/traces/)")
    g.add_argument("--model", default="smollm2-135m", help="served model (and its tokenizer)")
    g.add_argument("--tokenizer", help="tokenizer folder or model name; 'none' = chars/4")
    g.add_argument("--max-sessions", type=int, help="replay at most this many sessions")
    g.add_argument("--max-turns", type=int, help="and at most this many turns of each")
    g.add_argument("--max-context-tokens", type=int, default=None,
                   help="end a session before a turn's prompt would exceed this")
    g.add_argument("--max-output-tokens", type=int, default=None,
                   help="cap each request's max_tokens")
    g.add_argument("--block-tokens", type=int, help="tokens per hash id (block traces)")
    g.add_argument("--time-scale", type=float, default=1.0, help="multiplies think/tool times")
    g.add_argument("--max-think-time", type=float, default=10.0, help="cap per gap, seconds")
    g.add_argument("--think-time", type=float, default=1.0,
                   help="gap between turns of text traces without recorded times, seconds")
    g.add_argument("--synthetic-sessions", type=int, default=32,
                   help="sessions of the synthetic and bursts workloads")
    g.add_argument("--prompt-format", choices=("tokens", "text"), default="tokens",
                   help="block traces: token-id prompts or text from a word list")
    g.add_argument("--seed", type=int, default=0, help="seed of the synthetic workloads")


def add_run_args(p: argparse.ArgumentParser) -> None:
    """The run flags: loop mode, concurrency, timings, SLOs and outputs."""
    g = p.add_argument_group("run")
    g.add_argument("--mode", choices=("closed", "open"), default="closed",
                   help="closed: --concurrency live sessions; open: sessions arrive at "
                        "--session-rate (or the trace's timestamps)")
    g.add_argument("--concurrency", default="4", help="live sessions; a sweep: 1,2,4")
    g.add_argument("--duration", type=float, default=120.0, help="seconds per run, warm-up incl.")
    g.add_argument("--warmup", type=float, default=10.0, help="seconds excluded at the start")
    g.add_argument("--grace", type=float, default=10.0, help="seconds to drain at the end")
    g.add_argument("--session-rate", type=float, default=0.5, help="open loop, sessions/s")
    g.add_argument("--max-retries", type=int, default=2,
                   help="send a 429 again after its Retry-After this many times (as the "
                        "OpenAI client does)")
    g.add_argument("--slo-ttft", type=float, default=2.0, help="seconds")
    g.add_argument("--slo-itl", type=float, default=0.2, help="seconds (per-request mean ITL)")
    g.add_argument("--output", type=Path, help="default: bench-results/<timestamp>/")
    g.add_argument("--no-progress", action="store_true", help="no progress line")
    g.add_argument("--no-plots", action="store_true", help="skip the PNG plots")


def counter_for(args) -> TokenCounter:
    """The token counter of `--tokenizer` (or `--model`); 'none' counts chars/4."""
    name = args.tokenizer or args.model
    return TokenCounter(None) if name == "none" else TokenCounter.for_model(name)


def load_workload(args, counter: TokenCounter) -> list[Session]:
    """The sessions `--workload` names, cut and scaled by the workload flags."""
    scaling = Scaling(block_tokens=args.block_tokens, max_context_tokens=args.max_context_tokens,
                      max_output_tokens=args.max_output_tokens, time_scale=args.time_scale,
                      max_think_s=args.max_think_time, max_sessions=args.max_sessions,
                      max_turns=args.max_turns)
    if args.workload == "synthetic":
        return generate(SyntheticConfig(sessions=args.synthetic_sessions, seed=args.seed), scaling)
    if args.workload == "bursts":
        return bursts(BurstsConfig(sessions=args.synthetic_sessions, seed=args.seed), scaling)
    if args.workload == "agentx" and args.trace is None:
        raise SystemExit("--workload agentx needs --trace FILE_OR_DIR (WEKA/AgentX JSON)")
    path = Path(args.trace) if args.trace else TRACES / DEFAULT_TRACE[args.workload]
    if not path.exists():
        raise SystemExit(f"--workload {args.workload}: no trace at {path}; pass --trace "
                         f"FILE_OR_DIR (see baton/bench/traces/README.md)")
    if args.workload == "tau-bench":
        return loaders.load_tau_bench(path, counter, scaling, args.think_time)
    if args.workload == "swe-agent":
        return loaders.load_swe_agent(path, counter, scaling, args.think_time)
    if args.workload == "mooncake":
        return loaders.load_mooncake(path, scaling)
    return loaders.load_agentx(path, scaling)


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    """The flags of the local cluster started when no --url is given."""
    g = p.add_argument_group("local cluster (without --url)")
    g.add_argument("--cluster-mode", choices=("disaggregated", "colocated"),
                   default="disaggregated", help="the local cluster's `baton up --mode`")
    g.add_argument("--routing", choices=("session", "kv", "round-robin"), default="session",
                   help="the local cluster's gateway routing")
    g.add_argument("--num-decode", type=int, default=1, help="local cluster: decode workers")
    g.add_argument("--num-prefill", type=int, default=1, help="local cluster: prefill workers")
    g.add_argument("--startup-timeout", type=float, default=600.0,
                   help="seconds the local cluster may take to become ready")


def parse_levels(text: str) -> list[int]:
    levels = [int(x) for x in str(text).split(",") if x.strip()]
    if not levels or min(levels) < 1:
        raise SystemExit(f"--concurrency needs positive integers, got {text!r}")
    return levels


def cluster_spec(args) -> ServerSpec:
    """The local cluster `add_cluster_args` describes."""
    return ServerSpec(name=f"baton-{args.cluster_mode}-{args.routing}", mode=args.cluster_mode,
                      routing=args.routing, num_decode=args.num_decode,
                      num_prefill=args.num_prefill)
