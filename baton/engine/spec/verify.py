"""Sampling a step's speculative rows: each drafted token is kept only when the token the
target model samples at its position equals it, so outputs are those of decoding without
speculation.

    row: known token x, drafts d1 d2 d3  →  logits at 4 positions: p(·|x), p(·|x d1), ...
    position j: t_j = the token sampled from p(·|x d1..dj), exactly as a plain step samples
                (logit bias, penalties over output + d1..dj, grammar mask after d1..dj,
                temperature, top-k/p, min-p, one draw)
    keep t_0; keep t_j (j ≥ 1) while t_{j-1} == d_j; t_last is the correction or the bonus

Why the distribution is the target's: t_j is a sample of the target's next-token
distribution given the prefix x d1..dj, and it is used only when that prefix is exactly the
output so far (every earlier t equals its draft); whether it is used depends only on earlier
positions' samples. For a deterministic draft this is the rejection rule of speculative
sampling (Leviathan et al. 2023; Chen et al. 2023) with the residual drawn as a fresh
target sample. Greedy rows take the argmax at each position: the same tokens as without
speculation.

Seeds: a seeded row draws from its generator once per output position, in order, and only
for positions it outputs (a rejected position draws nothing), so the generator is where a
plain decode would have left it and a seed gives the same tokens with speculation on or off.
Unseeded rows share one batched draw of the default RNG.

Benchmark mode (`SpeculativeConfig.synthetic_acceptance`): draft j is kept with the
configured probability whatever the model says; the first position not kept outputs the
target's token and ends the row. Outputs are not the model's; never on by default.
"""
from __future__ import annotations

import random
from typing import NamedTuple

import torch
from torch import Tensor

from baton.engine.grammar import GrammarMatcher, apply_grammar_masks, masks_along
from baton.engine.penalties import apply_bans, apply_logit_processing, needs_token_history
from baton.engine.sampler import SamplerOutput, sampling_probs, seeded_draw, token_logprobs
from baton.sampling_params import SamplingParams


class VerifyRow(NamedTuple):
    """One sampled row of a step: its params, generator (seeded requests), history (prompt
    ids, output ids: needed when some row has penalties), grammar matcher and drafts (() for
    a row without: one position), and the ids min_tokens bans at its first positions."""

    params: SamplingParams
    generator: torch.Generator | None
    history: tuple[list[int], list[int]] | None
    grammar: GrammarMatcher | None
    drafts: tuple[int, ...]
    banned: tuple[frozenset[int], ...] = ()  # per leading position: ids min_tokens bans


class Verifier:
    """Samples rows of 1 + len(drafts) positions each (module docstring). `synthetic_rates`:
    the benchmark mode's P(draft position i kept), () = off; `seed` seeds its coin flips."""

    def __init__(self, synthetic_rates: tuple[float, ...] = (), seed: int = 0) -> None:
        prev = (1.0,) + tuple(synthetic_rates[:-1])
        self._keep = tuple(r / p if p > 0 else 0.0 for r, p in zip(synthetic_rates, prev))
        self._coin = random.Random(seed)

    def __call__(self, logits: Tensor, rows: list[VerifyRow]) -> SamplerOutput:
        """logits: [sum(1 + len(drafts)), V] raw, rows' positions back to back. Returns the
        output tokens of every row (row_lengths: how many each row has, 1 + kept drafts)."""
        assert logits.shape[0] == sum(1 + len(r.drafts) for r in rows), "one logit row a position"
        logits = logits.float()
        params, history, grammars = _positions(rows, logits.shape[1])
        processed = apply_logit_processing(logits, params, history)
        banned = [b for r in rows for b in r.banned + (frozenset(),) * (
            1 + len(r.drafts) - len(r.banned))] if any(r.banned for r in rows) else None
        processed = apply_bans(processed, banned, owned=processed is not logits)
        processed = apply_grammar_masks(processed, grammars, owned=processed is not logits)
        greedy = [p.is_greedy for p in params]
        best = processed.argmax(dim=-1).tolist()
        probs = drawn = None
        if not all(greedy):
            probs = sampling_probs(processed, params, greedy)
            if any(not r.params.is_greedy and r.generator is None for r in rows):
                q = torch.empty_like(probs).exponential_().clamp_min_(torch.finfo(probs.dtype).tiny)
                drawn = (probs / q).argmax(dim=-1).tolist()
        tokens, places, lengths, base = [], [], [], 0
        for row in rows:
            out = self._walk(row, base, best, drawn, probs)
            tokens += out
            places += range(base, base + len(out))
            lengths.append(len(out))
            base += 1 + len(row.drafts)
        index = torch.tensor(places, device=logits.device)
        return token_logprobs(logits[index], torch.tensor(tokens, device=logits.device),
                              [params[i] for i in places], tuple(lengths))

    def _walk(self, row: VerifyRow, base: int, best: list[int], drawn: list[int] | None,
              probs: Tensor | None) -> list[int]:
        """The row's output tokens: positions in order until one's token is not its draft."""
        out, k = [], len(row.drafts)
        for j in range(k + 1):
            if j < k and self._keep and self._coin.random() < self._keep[j]:
                out.append(row.drafts[j])  # benchmark mode: kept whatever the model says
                continue
            if row.params.is_greedy:
                t = best[base + j]
            elif row.generator is not None:  # its one draw for this output position
                q = seeded_draw(row.generator, probs.shape[1]).to(probs.device)
                t = int((probs[base + j] / q).argmax())
            else:
                t = drawn[base + j]
            out.append(t)
            if j == k or t != row.drafts[j] or self._keep:
                break
        return out


def _positions(rows: list[VerifyRow], vocab_size: int):
    """Per position: params, history (output + the drafts before it) and grammar stand-in
    (the mask after the drafts before it), or None lists when no row needs them."""
    params, history, grammars = [], None, None
    if needs_token_history([r.params for r in rows]):
        history = []
    if any(r.grammar is not None for r in rows):
        grammars = []
    for r in rows:
        n = 1 + len(r.drafts)
        params += [r.params] * n
        if history is not None:
            prompt, output = r.history
            history += [(prompt, list(output) + list(r.drafts[:j])) for j in range(n)]
        if grammars is not None:
            grammars += [None] * n if r.grammar is None else \
                masks_along(r.grammar, r.drafts, vocab_size)
    return params, history, grammars
