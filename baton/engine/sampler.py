"""Turns one step's logits into next tokens, one row per running sequence.

Per row: logit bias and penalties (penalties.py, only for rows that ask), the ids min_tokens
still bans (eos, stop_token_ids: -inf), the grammar's mask
(grammar.py, only for rows with a structured output), temperature, then
top-k, top-p and min-p filtering, then one draw, all vectorized over the batch with the
per-row parameters held as tensors. Greedy rows take the argmax.

Drawing (the exponential race, a form of the Gumbel-max trick): with q_i ~ Exp(1)
independent, argmax_i p_i / q_i is distributed as Categorical(p), because
q_i / p_i ~ Exp(p_i) and the smallest of independent exponentials is the i-th with
probability p_i / sum_j p_j (Gumbel 1954; Maddison, Tarlow & Minka, "A* Sampling", 2014;
vLLM's `random_sample` in vllm/v1/sample/ops/topk_topp_sampler.py samples the same way).
So each row needs exactly one draw of V exponentials per step, whatever its parameters.
A row with its own `torch.Generator` (a seeded request) draws only from it, so a seed gives
the same tokens whatever else shares the batch; the other rows share one batched draw from
the default RNG. A CPU batch of plain greedy rows (no processing, no top logprobs) takes the
argmax and the chosen tokens' logprobs from one native pass per row (kernels/cpu_sample.py).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from baton.engine.grammar import GrammarMatcher, apply_grammar_masks
from baton.engine.penalties import apply_bans, apply_logit_processing
from baton.outputs import TokenLogprob
from baton.sampling_params import SamplingParams
from kernels import cpu_sample


class SamplerOutput(NamedTuple):
    """token_ids: [B] int64. logprobs: [B] float32, log_softmax(raw logits) at token_ids.

    top_logprobs: None when no row asked for logprobs, else (ids [B, k] int64,
    logprobs [B, k] float32), sorted by descending logprob, where k is the largest
    `logprobs` asked for in the batch; a row that asked for fewer uses its first columns.
    ranks: None when no row asked for logprobs, else [B] int64: 1 + the number of tokens
    whose raw logit is strictly above the sampled token's (1 = the most likely token).
    row_lengths: None when each row sampled one token; else the tokens each row sampled
    (speculative rows: 1 + its accepted drafts; spec/verify.py), the fields above holding
    sum(row_lengths) entries, row by row.
    """

    token_ids: Tensor
    logprobs: Tensor
    top_logprobs: tuple[Tensor, Tensor] | None
    ranks: Tensor | None = None
    row_lengths: tuple[int, ...] | None = None


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded once with `seed`, for one seeded request (device = logits' device)."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


class Sampler:
    """Stateless; call it with a step's logits, the rows' params and their generators."""

    def __call__(self, logits: Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None],
                 history: list[tuple[list[int], list[int]]] | None = None,
                 grammars: list[GrammarMatcher | None] | None = None,
                 banned: list[frozenset[int]] | None = None) -> SamplerOutput:
        """logits: [B, V] float32 (raw, before temperature); params, generators: length B;
        history: per row (prompt ids, output ids), needed when a row has penalties
        (`penalties.needs_token_history`); grammars: per row (None = unconstrained), or None
        when no row is constrained; banned: per row the ids it may not sample (min_tokens),
        or None. Logprobs and ranks come from the raw logits."""
        assert logits.dim() == 2 and logits.shape[0] == len(params) == len(generators), (
            f"logits {tuple(logits.shape)}, {len(params)} params, {len(generators)} generators")
        if _native_greedy(logits, params, grammars) and not any(banned or ()):
            ids, lse = cpu_sample.greedy_lse(logits)
            chosen = logits.gather(1, ids[:, None]).squeeze(1).float()
            return SamplerOutput(ids, chosen - lse, None)
        logits = logits.float()
        processed = apply_logit_processing(logits, params, history)
        processed = apply_bans(processed, banned, owned=processed is not logits)
        processed = apply_grammar_masks(processed, grammars, owned=processed is not logits)
        greedy = [p.is_greedy for p in params]
        token_ids = processed.argmax(dim=-1)
        if not all(greedy):
            probs = sampling_probs(processed, params, greedy)
            sampled = probs.div_(_exponentials(probs, generators, greedy)).argmax(dim=-1)
            mask = torch.tensor(greedy, device=logits.device)
            token_ids = torch.where(mask, token_ids, sampled)
        return token_logprobs(logits, token_ids, params)


def _native_greedy(logits: Tensor, params: list[SamplingParams],
                   grammars: list[GrammarMatcher | None] | None) -> bool:
    """Whether kernels.cpu_sample can do the whole step: CPU logits, every row greedy with
    nothing that changes its logits (bias, penalties, grammar) and no top logprobs asked."""
    return (logits.device.type == "cpu" and logits.stride(1) == 1
            and logits.dtype in (torch.float32, torch.bfloat16)
            and (grammars is None or all(g is None for g in grammars))
            and all(p.is_greedy and p.logprobs is None and not p.logit_bias
                    and not p.has_penalties for p in params)
            and cpu_sample.available())


def _logsumexp(logits: Tensor) -> Tensor:
    """logsumexp of each row of logits [N, V] → [N] float32: on CPU kernels.cpu_sample's (the
    native greedy path's own sum), so a row's logprobs do not depend on which path its batch
    took; torch's elsewhere."""
    if (logits.device.type == "cpu" and logits.stride(1) == 1 and logits.shape[0] > 0
            and logits.dtype in (torch.float32, torch.bfloat16) and cpu_sample.available()):
        return cpu_sample.greedy_lse(logits)[1]
    return torch.logsumexp(logits.float(), dim=-1)


def token_logprobs(logits: Tensor, token_ids: Tensor, params: list[SamplingParams],
                   row_lengths: tuple[int, ...] | None = None) -> SamplerOutput:
    """The SamplerOutput of chosen `token_ids` [N] under raw `logits` [N, V] (row i's
    `params[i]`): logprobs, and top logprobs and ranks if a row asked for logprobs."""
    lse = _logsumexp(logits)[:, None]  # [N, 1]
    chosen = logits.gather(1, token_ids[:, None])
    logprobs = (chosen - lse).squeeze(1)
    top = _top_logprobs(logits, lse, params)
    ranks = (logits > chosen).sum(dim=-1) + 1 if top is not None else None
    return SamplerOutput(token_ids, logprobs, top, ranks, row_lengths)


def sampling_probs(logits: Tensor, params: list[SamplingParams], greedy: list[bool]) -> Tensor:
    """[B, V] float32 probabilities each row samples from (temperature, top-k, top-p, min-p
    applied to processed `logits`); greedy rows' values are meaningless (never drawn)."""
    device, vocab = logits.device, logits.shape[1]
    temps = torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)],
                         dtype=torch.float32, device=device)
    scaled = logits / temps[:, None]
    sampling = [p for p, g in zip(params, greedy) if not g]
    if any(p.top_k_enabled or p.top_p < 1.0 for p in sampling):
        top_k = torch.tensor([p.top_k if p.top_k_enabled and not g else vocab
                              for p, g in zip(params, greedy)], device=device)
        top_p = torch.tensor([1.0 if g else p.top_p for p, g in zip(params, greedy)],
                             dtype=torch.float32, device=device)
        scaled = apply_top_k_top_p(scaled, top_k.clamp_(max=vocab), top_p)
    if any(p.min_p > 0.0 for p in sampling):
        min_p = torch.tensor([0.0 if g else p.min_p for p, g in zip(params, greedy)],
                             dtype=torch.float32, device=device)
        scaled = apply_min_p(scaled, min_p)
    return scaled.softmax(dim=-1)


def seeded_draw(generator: torch.Generator, vocab_size: int) -> Tensor:
    """[V] float32 Exp(1): the one draw a seeded, non-greedy row takes per sampled token
    (verified positions included: spec/verify.py), clamped as `_exponentials` does."""
    q = torch.empty(vocab_size, device=generator.device).exponential_(generator=generator)
    return q.clamp_min_(torch.finfo(q.dtype).tiny)


def skip_draw(generator: torch.Generator, vocab_size: int) -> None:
    """Advance a seeded request's generator past one sampled token, exactly as sampling it
    here would have: the decode side of a remote prefill calls this for the first token,
    which the prefill worker drew from its own copy of the seed, so later tokens match a
    colocated run."""
    seeded_draw(generator, vocab_size)


def _exponentials(probs: Tensor, generators: list[torch.Generator | None],
                  greedy: list[bool]) -> Tensor:
    """[B, V] Exp(1) draws: one V-sized draw per seeded row from its own generator; one
    batched draw from the default RNG covers the other rows (greedy rows ignore theirs)."""
    if any(g is None and not gr for g, gr in zip(generators, greedy)):
        q = torch.empty_like(probs).exponential_()
    else:
        q = torch.ones_like(probs)
    for i, (g, gr) in enumerate(zip(generators, greedy)):
        if g is not None and not gr:  # drawn on the generator's own device, then moved
            q[i] = seeded_draw(g, probs.shape[1])
    # Exp(1) can round to 0.0; 0/0 would be NaN, which argmax treats as the maximum and
    # could pick a filtered-out token.
    return q.clamp_min_(torch.finfo(q.dtype).tiny)


def apply_top_k_top_p(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Set logits outside each row's top-k, then outside its top-p nucleus, to -inf.

    logits: [B, V] float32; top_k: [B] int64 in [1, V] (V = off); top_p: [B] float32 in
    (0, 1] (1 = off). Top-p keeps the smallest set of most likely tokens whose probability,
    renormalized after top-k, sums to >= p (Holtzman et al., "The Curious Case of Neural
    Text Degeneration", 2019). One ascending sort serves both, as in vLLM's
    `apply_top_k_top_p`. Ties with the k-th logit are kept.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[1]
    kth = sorted_logits.gather(1, (vocab - top_k)[:, None])  # [B, 1] k-th largest logit
    sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [B, V] ascending mass
    drop = cum <= (1.0 - top_p)[:, None]
    drop[:, -1] = False  # the most likely token always stays
    sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """Set to -inf the logits whose probability is below min_p * the row's top probability.

    logits: [B, V] float32; min_p: [B] float32 in [0, 1]. Done in log space:
    p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p) (Nguyen et al., "Min-p
    Sampling", 2024). The threshold is unchanged by the renormalization after top-k/top-p.
    """
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log()[:, None]  # log(0) = -inf
    return logits.masked_fill(logits < threshold, float("-inf"))


def _top_logprobs(logits: Tensor, lse: Tensor,
                  params: list[SamplingParams]) -> tuple[Tensor, Tensor] | None:
    asked = [p.logprobs for p in params if p.logprobs is not None]
    if not asked:
        return None
    k = min(max(asked), logits.shape[1])
    values, ids = logits.topk(k, dim=-1, sorted=True)  # log_softmax is monotone in logits
    return ids, values - lse


def logprob_lists(sampled: SamplerOutput, asked: list[int | None],
              lengths: tuple[int, ...]) -> list[list[TokenLogprob]]:
    """Per sampled token (row by row, `lengths[i]` for row i) its TokenLogprob list as a
    StepOutput carries it: [] for a row that asked for none (`asked[i]` None), else the
    chosen token's logprob and rank with the row's top `asked[i]`."""
    top = sampled.top_logprobs
    if top is None:
        return [[] for _ in range(sum(lengths))]
    token_ids, chosen = sampled.token_ids.tolist(), sampled.logprobs.tolist()
    top_ids, top_vals = top[0].tolist(), top[1].tolist()
    ranks = sampled.ranks.tolist()
    out, i = [], 0
    for k, n in zip(asked, lengths):
        for _ in range(n):
            out.append([] if k is None else [TokenLogprob(
                token_ids[i], chosen[i], dict(zip(top_ids[i][:k], top_vals[i][:k])) if k else {},
                ranks[i])])
            i += 1
    return out
