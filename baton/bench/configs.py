"""`baton bench compare`'s configurations: each one's server (a `baton up` command line, the
transformers baseline, or vLLM's CPU build) and the configuration it is compared with
(compare.py's docstring lists them)."""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from baton.bench.local import ServerSpec
from baton.bench.vllm_server import VllmSpec

_D, _C = "disaggregated", "colocated"
ROUTING_NUM_BLOCKS = 640
# "disaggregated" and "colocated" are `baton up` and `baton up --mode colocated` with every
# other flag at its default: what a user of the README gets is what is measured.
CONFIGS: dict[str, tuple[ServerSpec, str | None]] = {
    "disaggregated": (ServerSpec("disaggregated", mode=_D, routing="session"), "colocated"),
    "colocated": (ServerSpec("colocated", mode=_C, routing="session"), None),
    "session": (ServerSpec("session", mode=_C, routing="session", num_decode=2), "round-robin"),
    "kv": (ServerSpec("kv", mode=_C, routing="kv", num_decode=2), "round-robin"),
    "round-robin": (ServerSpec("round-robin", mode=_C, routing="round-robin", num_decode=2), None),
    "tiers": (ServerSpec("tiers", mode=_C, routing="session"), "no-tiers"),
    "no-tiers": (ServerSpec("no-tiers", mode=_C, routing="session",
                            extra_args=("--kv-host-tier-fraction", "0")), None),
    "admission": (ServerSpec("admission", mode=_D, routing="session"), "disaggregated"),
    # what decode holds reaches a remote prefill through the KV store instead of the pull
    "store": (ServerSpec("store", mode=_D, routing="session",
                         extra_args=("--no-kv-pull", "--kv-store", "mooncake")), "disaggregated"),
    "no-pull": (ServerSpec("no-pull", mode=_D, routing="session",
                           extra_args=("--no-kv-pull",)), "disaggregated"),
    "spec": (ServerSpec("spec", mode=_C, routing="session",
                        extra_args=("--speculative-method", "suffix")), "colocated"),
    "spec-disaggregated": (ServerSpec("spec-disaggregated", mode=_D, routing="session",
                                      extra_args=("--speculative-method", "suffix")),
                           "disaggregated"),
    "spec-synthetic": (ServerSpec("spec-synthetic", mode=_C, routing="session", extra_args=(
        "--speculative-method", "suffix",
        "--spec-benchmark-synthetic-acceptance", "0.7")), "colocated"),
    "hf": (ServerSpec("hf", kind="hf"), None),
    "vllm": (ServerSpec("vllm", kind="vllm"), None),
    # vLLM's own P/D on the same cores (NixlConnector; bench/vllm_pd.py), vs vLLM colocated
    "vllm-pd": (ServerSpec("vllm-pd", kind="vllm-pd"), "vllm"),
}
ROUTING = ("session", "kv", "round-robin")
TIERED = ("tiers", "no-tiers")
TIER_NUM_BLOCKS = 256
TIER_HOST_BYTES = 4 << 30
SLO_TTFT_S = 2.0  # the bench's --slo-ttft default


def add_vllm_args(p: argparse.ArgumentParser) -> None:
    """The flags of the "vllm" configuration (vLLM's CPU build from its own venv)."""
    p.add_argument("--vllm-python", default=sys.executable,
                   help="the interpreter of vLLM's venv (e.g. /tmp/vllm-venv/bin/python; "
                        "baton/bench/vllm_server.py says how to install it)")
    p.add_argument("--vllm-dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                   help="auto: the machine's choice (bfloat16 on CPUs with AVX512_BF16 or "
                        "AMX, else float32), as Baton's --dtype auto")
    p.add_argument("--vllm-kv-bytes", type=int, default=1 << 30,
                   help="vLLM's --kv-cache-memory-bytes")


def reference_of(name: str, reference: str | None) -> str | None:
    """The row `name` is compared with: `reference` when given (not for itself), else the
    configuration's own (none for a name that is no configuration)."""
    if reference:
        return None if name == reference else reference
    return CONFIGS[name][1] if name in CONFIGS else None


def vllm_spec(args: argparse.Namespace) -> VllmSpec:
    return VllmSpec(args.vllm_python, args.vllm_dtype, args.vllm_kv_bytes)


def spec_for(name: str, routing_num_blocks: int = ROUTING_NUM_BLOCKS,
             routing_workers: int = 2, tier_num_blocks: int = TIER_NUM_BLOCKS,
             tier_host_bytes: int = TIER_HOST_BYTES,
             slo_ttft_s: float = SLO_TTFT_S, vllm: VllmSpec | None = None) -> ServerSpec:
    """The configuration's server; routing ones get `routing_workers` pinned workers, each
    with the bounded pool; the tier pair gets the small pool, "tiers" a host tier below it;
    "admission" is "disaggregated" whose gateway rejects (429) a request predicted to miss
    the TTFT SLO `slo_ttft_s` (seconds: the bench's own --slo-ttft, so the requests it
    admits are judged by the SLO it predicts for); "vllm" and "vllm-pd" run `vllm`
    (default: vLLM from this interpreter, the machine's dtype)."""
    spec = CONFIGS[name][0]
    if name in ("vllm", "vllm-pd"):
        return replace(spec, vllm=vllm or VllmSpec(sys.executable))
    if name == "admission":
        spec = replace(spec, extra_args=spec.extra_args + (
            "--slo-ttft-ms", f"{slo_ttft_s * 1000:g}"))
    if name in TIERED:
        tier = ("--kv-host-tier-bytes", str(tier_host_bytes)) if name == "tiers" else ()
        spec = replace(spec, extra_args=spec.extra_args + (
            "--num-blocks", str(tier_num_blocks), *tier))
    if name in ROUTING:
        spec = replace(spec, num_decode=routing_workers, extra_args=spec.extra_args + (
            "--pin", "split", "--num-blocks", str(routing_num_blocks)))
    return spec
