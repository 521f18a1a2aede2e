"""Frozen configuration objects, one per concern, built once in `main` and passed down.

Nothing below `baton/cli.py` reads `os.environ`; every knob is a field here, and each field
that is a command-line flag declares it (help, name) on the field itself (baton/flagspec.py):
every role's parser and `baton up`'s are generated from these, so a default lives in one place.
Importing this module does not import torch (the gateway and `baton up` read it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from baton.dtypes import DTYPES, resolve_dtype
from baton.flagspec import flag

if TYPE_CHECKING:
    import torch

SCHEDULE_POLICIES = ("fcfs", "shortest_first")


def parse_dtype(name: str) -> torch.dtype:
    """Map "float32" | "bfloat16" | "float16" to a torch dtype; ValueError otherwise."""
    import torch
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return getattr(torch, name)


def parse_device(name: str) -> torch.device:
    """Map "cpu" | "cuda" | "cuda:N" to a torch device; ValueError otherwise (no CUDA check:
    allocating on a machine without it raises torch's own error)."""
    import torch
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {name!r}") from e
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {name!r}")
    return device


def _check_device(name: str) -> None:
    """parse_device's check without torch: "cpu", "cuda" or "cuda:N"."""
    kind, _, index = name.partition(":")
    if kind not in ("cpu", "cuda") or (index and (kind == "cpu" or not index.isdigit())):
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {name!r}")


def rates(text: str) -> tuple[float, ...]:
    """"0.8,0.6" → (0.8, 0.6) (ValueError, which argparse reports, on anything else)."""
    return tuple(float(x) for x in text.split(",") if x.strip())


def none_or(kind):
    """--flag TEXT where "none" (or "auto", "") means None: deployment files can pass the
    flag always and leave the value to an environment variable."""
    def parse(text: str):
        return None if text.strip().lower() in ("", "none", "auto") else kind(text)
    parse.__name__ = kind.__name__
    return parse


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache shape.

    block_size: tokens per KV block. kv_cache_memory_bytes: budget for the whole cache in bytes
    (num_blocks = budget // bytes_per_block) unless num_blocks is given (tests use tiny pools).
    Neither given: kv_memory_fraction of the memory free after the model is loaded, at least
    one max_model_len request, an error when that does not fit (engine/kv_budget.py);
    kv_pool_for_batch (the offline LLM) bounds that by max_num_seqs such requests.
    enable_prefix_caching: reuse full blocks whose chained hash and tokens match.
    kv_host_tier_bytes: host-memory tier below the pool for the blocks it evicts (0 = off).
    kv_disk_tier_dir / kv_disk_tier_bytes: disk tier below that (files in a fresh folder
    inside the dir; None = off). Tiers need prefix caching (engine/kv_tier.py).
    kv_store_url: the cluster's KV store, mooncake://HOST:PORT (None = off; engine/kv_store.py).
    kv_store_segment_bytes: memory this worker lends the store. kv_store_queue_bytes: staging
    for blocks waiting to be written. kv_store_local_host: address other store clients reach
    this one at (None: the one toward the master). kv_store_model: model identity in store
    keys (None: the folder or registered name, as the KV layout's).
    """

    block_size: int = flag(16, "tokens per KV block")
    kv_cache_memory_bytes: int | None = flag(
        None, "KV pool size in bytes (ignored with --num-blocks; default: --kv-memory-fraction "
              "of the memory free after the model loads, at least one --max-model-len request)")
    num_blocks: int | None = flag(None, "fixed KV pool size in blocks (tests)")
    kv_memory_fraction: float = flag(0.5, "share of MemAvailable the default KV pool takes")
    kv_pool_for_batch: bool = False
    enable_prefix_caching: bool = flag(True, "reuse cached KV blocks across requests",
                                       name="--prefix-caching")
    kv_host_tier_bytes: int = flag(0, "host-memory tier for blocks the KV pool evicts (0 = off)")
    kv_disk_tier_dir: str | None = flag(
        None, "disk tier below the host tier: block files go in a fresh folder here")
    kv_disk_tier_bytes: int = flag(8 << 30, "disk tier budget in bytes (with --kv-disk-tier-dir)")
    kv_store_url: str | None = flag(
        None, "cluster-wide KV store, mooncake://HOST:PORT (a mooncake_master): finished "
              "requests' blocks go there, prefills load from it (none: off)",
        parse=none_or(str))
    kv_store_segment_bytes: int = flag(128 << 20, "memory this worker lends the KV store")
    kv_store_queue_bytes: int = flag(
        256 << 20, "staging for blocks waiting to be written to the KV store; a finished "
                   "request's blocks beyond it are not written (counted)")
    kv_store_local_host: str | None = flag(
        None, "address other store clients reach this worker at (default: the one toward "
              "the master)", cluster=False)
    kv_store_model: str | None = None

    @property
    def kv_tier_enabled(self) -> bool:
        return self.enable_prefix_caching and bool(self.kv_host_tier_bytes
                                                   or self.kv_disk_tier_dir)

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two ≥ 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be ≥ 2, got {self.num_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be positive")
        if not 0 < self.kv_memory_fraction <= 1:
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got "
                             f"{self.kv_memory_fraction}")
        if self.kv_host_tier_bytes < 0 or self.kv_disk_tier_bytes <= 0:
            raise ValueError("kv_host_tier_bytes must be ≥ 0 and kv_disk_tier_bytes > 0")
        if self.kv_store_url is not None:
            from baton.engine.store_client import parse_store_url
            parse_store_url(self.kv_store_url)
        if self.kv_store_segment_bytes < 0 or self.kv_store_queue_bytes <= 0:
            raise ValueError("kv_store_segment_bytes must be ≥ 0 and kv_store_queue_bytes > 0")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching budgets.

    max_num_batched_tokens: tokens (prefill + decode) in one forward step.
    max_num_seqs: sequences running at once.
    long_prefill_token_threshold: cap on one request's prefill tokens per step, so one huge
    prompt cannot stall the running decodes (chunked prefill); 0 = no per-request cap.
    max_bypass_s: seconds a waiting request that cannot get KV blocks may be passed by smaller
    requests behind it; after that nothing behind it is admitted until it fits, so a steady
    stream of small requests cannot starve a large one (running requests finish and free
    blocks). 0 = strict FIFO admission.
    policy: the order waiting requests are considered for admission (scheduler.py):
    "fcfs" (arrival) or "shortest_first" (the default: fewest uncached prompt tokens first,
    with aging).
    max_prefill_wait_s: under shortest_first, a request waiting longer than this goes before
    the younger ones (in arrival order among such), so a long cold prefill still starts; a
    prefill this old also runs beside the prefill_target_tokens rows (one a step, under
    either policy).
    prefill_target_tokens: a step starts no further prefill rows once its prefill tokens reach
    this (decode rows and the one prefill older than max_prefill_wait_s a step may run beside
    it do not count; 0 = fill the budget). Prefill is compute-bound once a step holds a few hundred tokens, so batching more
    requests into the step buys no throughput and only delays the first tokens of all of them;
    one after the other (in policy order) they come at T, 2T, 3T instead of 3T, 3T, 3T. Under
    shortest_first a running partial prefill also yields the step to a waiting request with
    fewer uncached tokens (it keeps its blocks): shortest remaining first (scheduler.py).
    time_slice_s: with a KV tier, a request that has waited this long for pool space may
    preempt running decodes admitted at least this long ago (their KV goes to the tier and
    is loaded back, not recomputed: time_slice.py); 0 = never. No effect without a tier.
    """

    max_num_batched_tokens: int = flag(
        2048, "token budget of one engine step (decodes + prefill chunks)")
    max_num_seqs: int = flag(64, "most running requests")
    long_prefill_token_threshold: int = flag(
        512, "chunk cap: one request's prefill tokens per step (0 = none)")
    max_bypass_s: float = flag(
        5.0, "seconds smaller requests may pass one that cannot get KV blocks before "
             "admission waits for it (0 = FIFO)")
    policy: str = flag(
        "shortest_first", "order of waiting requests: fcfs (arrival) or shortest_first "
        "(fewest uncached prompt tokens first, with aging; with --prefill-target-tokens a "
        "running prefill yields to a shorter one)",
        name="--schedule-policy", choices=SCHEDULE_POLICIES)
    max_prefill_wait_s: float = flag(
        10.0, "shortest_first aging: a request waiting longer than this goes before younger "
              "ones, in arrival order (0 = fcfs)")
    prefill_target_tokens: int = flag(
        256, "a step starts no further prefill once it holds this many prompt tokens "
             "(prefill is compute-bound past it: one request after the other gives earlier "
             "first tokens than batching them; 0 = fill --max-num-batched-tokens)")
    time_slice_s: float = flag(
        2.0, "with a KV tier: a request waiting this long for pool space may preempt decodes "
             "running at least this long (their KV goes to the tier and is loaded back, not "
             "recomputed; 0 = never)")

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be ≥ 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be ≥ 1")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be ≥ 0")
        if self.prefill_target_tokens < 0:
            raise ValueError("prefill_target_tokens must be ≥ 0")
        if self.max_bypass_s < 0 or self.max_prefill_wait_s < 0 or self.time_slice_s < 0:
            raise ValueError("max_bypass_s, max_prefill_wait_s and time_slice_s must be ≥ 0")
        if self.policy not in SCHEDULE_POLICIES:
            raise ValueError(f"policy must be one of {SCHEDULE_POLICIES}, got {self.policy!r}")


SPECULATIVE_METHODS = ("suffix", "ngram")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Model-free speculative decoding (baton/engine/spec/): decode rows carry drafted tokens,
    verified in the same step; outputs are those of decoding without it (greedy: the same
    tokens; sampled: the same distribution, and a seed gives the same tokens).

    method: "suffix" (the session's tokens and recent outputs, longest match, adaptive
    length: spec/drafter.py), "ngram" (the request's own tokens, fixed length: vLLM's prompt
    lookup), or None (off, the default: see README "Speculative decoding").
    num_speculative_tokens: most drafted tokens a decode row carries per step.
    max_match_tokens: longest suffix compared when matching (suffix trees' depth; ngram:
    vLLM's prompt_lookup_max). min_match_tokens: shortest match that drafts (prompt_lookup_min).
    max_spec_factor: a suffix draft is at most this × its match length (ArcticInference).
    step_budget: each step verifies only the drafted tokens whose expected gain pays for
    their measured cost (spec/budget.py, SmartSpec's goodput rule); False verifies every
    draft (up to num_speculative_tokens a row).
    session_cache_tokens / recent_cache_tokens: tokens kept for sessions' next turns / of
    recently finished outputs (memory: about 50 bytes a token).
    synthetic_acceptance: BENCHMARK ONLY, outputs are not the model's: draft position i is
    accepted with probability synthetic_acceptance[i] (one value r: r, r², r³...), whatever the
    model says (vLLM's synthetic rejection sampler; SGLang's SGLANG_SIMULATE_ACC_LEN), so
    points with a chosen acceptance can be measured on synthetic prompts. () = off.
    """

    method: str | None = flag(
        None, "model-free drafts verified in the decode step, outputs unchanged: suffix (the "
              "session's tokens and recent outputs, adaptive length), ngram (the request's own "
              "tokens), none (off)", name="--speculative-method", parse=none_or(str),
        choices=(*SPECULATIVE_METHODS, None))
    num_speculative_tokens: int = flag(8, "most drafted tokens a decode row carries per step")
    max_match_tokens: int = 64
    min_match_tokens: int = flag(3, "shortest match of the recent tokens that drafts anything",
                                 name="--speculative-min-match-tokens")
    max_spec_factor: float = 1.0
    step_budget: bool = flag(True, "verify, per step, only the drafted tokens worth their "
                                   "measured cost (goodput: spec/budget.py); off: every draft",
                             name="--speculative-step-budget")
    session_cache_tokens: int = 1 << 20
    recent_cache_tokens: int = 1 << 16
    synthetic_acceptance: tuple[float, ...] = flag(
        (), "BENCHMARK ONLY, outputs are not the model's: keep draft position i with "
            "probability RATE_i whatever the model says (one RATE r: r, r², ...; as vLLM's "
            "synthetic rejection sampler); needs --speculative-method",
        name="--spec-benchmark-synthetic-acceptance", parse=rates, metavar="RATE[,RATE...]")

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {SPECULATIVE_METHODS} or "
                             f"None, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 64:
            raise ValueError("num_speculative_tokens must be in [1, 64]")
        if not 2 <= self.min_match_tokens <= self.max_match_tokens:
            raise ValueError("need 2 <= min_match_tokens <= max_match_tokens")
        if self.max_spec_factor <= 0:
            raise ValueError("max_spec_factor must be > 0")
        if self.session_cache_tokens < 0 or self.recent_cache_tokens < 0:
            raise ValueError("session_cache_tokens and recent_cache_tokens must be ≥ 0")
        object.__setattr__(self, "synthetic_acceptance", tuple(self.synthetic_acceptance))
        if self.synthetic_acceptance:
            if self.method is None:
                raise ValueError("synthetic_acceptance needs a speculative method")
            rates = self.synthetic_acceptance
            if not all(0.0 <= r <= 1.0 for r in rates) or any(
                    b > a for a, b in zip(rates, rates[1:])):
                raise ValueError("synthetic_acceptance: rates in [0, 1], non-increasing")

    @property
    def enabled(self) -> bool:
        return self.method is not None

    def acceptance_rates(self) -> tuple[float, ...]:
        """synthetic_acceptance per draft position, num_speculative_tokens long (P(position
        i accepted), unconditional as vLLM's per-position acceptance)."""
        r = self.synthetic_acceptance
        if len(r) == 1:
            return tuple(r[0] ** (i + 1) for i in range(self.num_speculative_tokens))
        return tuple(r[i] if i < len(r) else 0.0 for i in range(self.num_speculative_tokens))


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine (one worker) needs.

    model: a registered name (e.g. "smollm2-135m") or a Hugging Face folder path.
    dtype: "auto" | "float32" | "bfloat16" | "float16" (weights, activations and KV cache);
    "auto" is decided per machine (`resolved_dtype`).
    max_model_len: context limit in tokens; None = the model's max_position_embeddings.
    seed: seed of the default RNG used by unseeded sampled requests.
    device: where weights, the KV pool, the step's index tensors and sampling live: "cpu"
    (torch / native kernels) or "cuda" / "cuda:N" (Triton kernels; the KV tiers, the store
    and the gRPC transport copy blocks device ↔ host, NIXL registers the pool as VRAM).
    enforce_eager: on CUDA, run decode steps eagerly instead of replaying CUDA graphs
    (engine/cuda_graphs.py); no effect on CPU.
    speculative: speculative decoding (off unless its method is set).
    """

    model: str = flag("smollm2-135m", "registered name or Hugging Face model folder")
    dtype: str = flag("auto", "weights, activations and KV dtype; auto: bfloat16 on CUDA and "
                              "on CPUs with AVX512_BF16 or AMX, else float32",
                      choices=("auto", *DTYPES))
    max_model_len: int | None = flag(
        None, "context limit (default: the model's, within the KV pool)")
    seed: int = flag(0, "the default RNG's seed (requests without their own seed)")
    device: str = flag("cpu", "where the model runs: cpu, cuda or cuda:N")
    enforce_eager: bool = flag(
        False, "CUDA: run decode steps eagerly (no CUDA graphs; graphs are captured at start "
               "for decode steps of up to --max-num-seqs rows)")
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got "
                             f"{self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be ≥ 1")
        _check_device(self.device)

    @property
    def resolved_dtype(self) -> str:
        """The dtype this engine runs: `dtype`, with "auto" decided for this machine and
        `device` (baton/dtypes.py)."""
        return resolve_dtype(self.dtype, self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.resolved_dtype)

    @property
    def torch_device(self) -> torch.device:
        return parse_device(self.device)
