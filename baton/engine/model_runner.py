"""Turns a scheduled batch into tensors, runs the model over the paged KV cache, samples.

Row order inside a step: decode rows first (one known token, plus its drafted tokens when
speculating: baton/engine/spec/), then prefill chunks, so decode rows use the batched
paged-decode kernel and prefill rows the variable-length prefix kernel.

    scheduled: [A: decode 1 tok] [B: decode 1 + 2 drafts] [C: prefill 5 tok] [D: chunk 3 tok]
    input_ids:   a                b  b1 b2                 c0 c1 c2 c3 c4      d0 d1 d2
    slot_mapping: slot(A, pos)    slot(B, n..n+2)          slot(C, 0..4)       slot(D, n..n+2)
    logits rows:  A, B ×3 (every position: verified), C (last token), D only if its chunk
                  completes the prompt; every prompt position of a request asking for
                  prompt logprobs (prompt_logprobs.py)

On CUDA a step of single-token decode rows only (no drafts) replays a captured CUDA graph
instead (cuda_graphs.py: the same forward, its inputs padded into static buffers), unless the
engine runs eagerly.
"""
from __future__ import annotations

import torch

from baton.models.decoder import AttentionMetadata, DecoderModel
from baton.engine.cuda_graphs import DecodeGraphs
from baton.engine.host_zeros import host_zeros
from baton.engine.penalties import needs_token_history
from baton.engine.prompt_logprobs import fill_prompt_logprobs
from baton.engine.request import Request
from baton.engine.sampler import Sampler, SamplerOutput
from baton.engine.sched_output import ScheduledRequest
from baton.engine.spec.verify import Verifier, VerifyRow


MAX_GRAPH_BATCH = 256  # larger decode steps run eagerly (launch cost is small next to them)


class ModelRunner:
    """Owns the KV tensor and runs one forward + sample per step.

    kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_size], model dtype,
    on the model's device; each step's index tensors are built on the host and copied there.
    cuda_graphs: capture decode steps of up to max_num_seqs rows (at most MAX_GRAPH_BATCH)
    as CUDA graphs (the model must be on CUDA; max_model_len sets the block-table width, see
    cuda_graphs.py); steps holding a prefill row, or more rows, run eagerly.
    """

    def __init__(self, model: DecoderModel, num_blocks: int, block_size: int,
                 max_num_seqs: int = 1, max_model_len: int = 1,
                 cuda_graphs: bool = False) -> None:
        self.model = model
        self.block_size = block_size
        self.device = model.device
        s = model.shape
        shape = (num_blocks, s.num_layers, 2, block_size, s.num_kv_heads, s.head_size)
        if torch.device(self.device).type == "cpu" and num_blocks > 0:
            self.kv_cache = host_zeros(shape, model.dtype)  # pages committed as KV is written
        else:
            self.kv_cache = torch.zeros(shape, dtype=model.dtype, device=self.device)
        self.sampler = Sampler()
        self.verifier = Verifier()  # steps with speculative rows (the engine may replace it)
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs:
            self.graphs = DecodeGraphs(self.decode_step, self.device,
                                       min(max_num_seqs, MAX_GRAPH_BATCH),
                                       -(-max_model_len // block_size))
            self.graphs.capture()

    @staticmethod
    def bytes_per_block(model: DecoderModel, block_size: int) -> int:
        s = model.shape
        return (s.num_layers * 2 * block_size * s.num_kv_heads * s.head_size
                * torch.empty(0, dtype=model.dtype).element_size())

    def decode_step(self, input_ids: torch.Tensor, positions: torch.Tensor,
                    meta: AttentionMetadata) -> torch.Tensor:
        """A step of decode rows only → logits [B, vocab] float32 (what cuda_graphs captures)."""
        return self.model.compute_logits(self.model.forward(input_ids, positions, meta,
                                                            self.kv_cache))

    @torch.inference_mode()  # no autograd bookkeeping on any op of the step
    def execute(self, batch: list[ScheduledRequest]) -> tuple[list[ScheduledRequest],
                                                              SamplerOutput | None]:
        """Run one step. Returns the rows that sampled (in output order) and their samples
        (with `row_lengths` when some row verified drafts: spec/verify.py)."""
        batch = sorted(batch, key=lambda s: not _is_decode(s))
        if self.graphs is not None and self.graphs.fits(len(batch)) \
                and all(_is_decode(s) and not s.spec_token_ids for s in batch):
            return batch, self._sample(batch, self._graph_step(batch))
        input_ids, positions, meta = self._prepare(batch)
        hidden = self.model.forward(input_ids, positions, meta, self.kv_cache)
        if any(s.request.prompt_logprobs is not None for s in batch):
            fill_prompt_logprobs(batch, hidden, self.model.compute_logits, self._to_device)
        ends = torch.tensor([s.num_new_tokens for s in batch]).cumsum(0) - 1
        sampling = [i for i, s in enumerate(batch) if s.completes_prompt]
        if not sampling:
            return [], None
        rows = [batch[i] for i in sampling]
        if not any(r.spec_token_ids for r in rows):
            logits = self.model.compute_logits(hidden[self._to_device(ends[sampling])])
            return rows, self._sample(rows, logits)
        params, history, grammars = _sampling_inputs(rows)
        places = [p for i in sampling for p in range(
            int(ends[i]) - len(batch[i].spec_token_ids), int(ends[i]) + 1)]
        logits = self.model.compute_logits(hidden[self._to_device(torch.tensor(places))])
        return rows, self.verifier(logits, [
            VerifyRow(p, r.request.generator, history[j] if history else None, g,
                      r.spec_token_ids, min_tokens_bans(r.request, 1 + len(r.spec_token_ids)))
            for j, (r, p, g) in enumerate(zip(rows, params, grammars))])

    def _sample(self, rows: list[ScheduledRequest], logits: torch.Tensor) -> SamplerOutput:
        """One token for each row from its logits [len(rows), vocab]."""
        params, history, grammars = _sampling_inputs(rows)
        bans = [min_tokens_bans(r.request, 1) for r in rows]
        return self.sampler(logits, params, [r.request.generator for r in rows], history,
                            grammars if any(g is not None for g in grammars) else None,
                            [b[0] if b else frozenset() for b in bans] if any(bans) else None)

    def _graph_step(self, batch: list[ScheduledRequest]) -> torch.Tensor:
        """A decode-only step through the captured graphs → logits [len(batch), vocab]."""
        bs = self.block_size
        pos = [s.request.num_computed_tokens for s in batch]
        return self.graphs.run(
            [s.request.all_token_ids[p] for s, p in zip(batch, pos)], pos,
            [s.block_table[p // bs] * bs + p % bs for s, p in zip(batch, pos)],
            [s.block_table for s in batch], [p + 1 for p in pos])

    def _prepare(self, batch: list[ScheduledRequest]):
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        num_decode = num_decode_rows = 0
        for s in batch:
            r, start = s.request, s.request.num_computed_tokens
            end = start + s.num_new_tokens
            ids.extend(r.all_token_ids[start:end - len(s.spec_token_ids)])
            ids.extend(s.spec_token_ids)
            p = range(start, end)
            pos.extend(p)
            table = s.block_table
            slots.extend(table[i // bs] * bs + i % bs for i in p)
            if _is_decode(s) and num_decode == len(ids) - s.num_new_tokens:
                num_decode += s.num_new_tokens
                num_decode_rows += 1
        dev = self._to_device
        meta = AttentionMetadata(slot_mapping=dev(torch.tensor(slots, dtype=torch.int64)),
                                 num_decode_tokens=num_decode)
        dec, pre = batch[:num_decode_rows], batch[num_decode_rows:]
        if dec:
            meta.decode_block_tables = dev(_pad_tables([s.block_table for s in dec]))
            meta.decode_context_lens = dev(torch.tensor(
                [s.request.num_computed_tokens + s.num_new_tokens for s in dec],
                dtype=torch.int32))
            if num_decode > len(dec):  # some row carries drafts: causal within each row
                q_lens = torch.tensor([s.num_new_tokens for s in dec], dtype=torch.int32)
                meta.decode_query_start_loc = dev(torch.nn.functional.pad(
                    q_lens.cumsum(0), (1, 0)).to(torch.int32))
                meta.decode_max_query_len = int(q_lens.max())
        if pre:
            meta.prefill_block_tables = dev(_pad_tables([s.block_table for s in pre]))
            q_lens = torch.tensor([s.num_new_tokens for s in pre], dtype=torch.int32)
            meta.prefill_query_start_loc = dev(torch.nn.functional.pad(
                q_lens.cumsum(0), (1, 0)).to(torch.int32))
            meta.prefill_seq_lens = dev(torch.tensor(
                [s.request.num_computed_tokens + s.num_new_tokens for s in pre],
                dtype=torch.int32))
        return (dev(torch.tensor(ids, dtype=torch.int64)),
                dev(torch.tensor(pos, dtype=torch.int64)), meta)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor on the runner's device (itself on CPU, so that path is unchanged)."""
        return t if self.device.type == "cpu" else t.to(self.device, non_blocking=True)


def _sampling_inputs(rows: list[ScheduledRequest]):
    """The rows' SamplingParams, token histories (None when no penalty needs them) and
    grammar matchers."""
    params = [r.request.sampling_params for r in rows]
    history = [(r.request.prompt_token_ids, r.request.output_token_ids) for r in rows] \
        if needs_token_history(params) else None
    return params, history, [r.request.grammar for r in rows]


def min_tokens_bans(req: Request, positions: int) -> tuple[frozenset[int], ...]:
    """The ids `req` may not sample at its next `positions` output positions (min_tokens,
    as vLLM: eos and stop_token_ids wait until min_tokens tokens were generated); () when
    none. A structured output's grammar decides its own end, so it bans nothing."""
    p = req.sampling_params
    left = p.min_tokens - len(req.output_token_ids)
    if left <= 0 or req.grammar is not None:
        return ()
    return (req.eos_token_ids | frozenset(p.stop_token_ids),) * min(left, positions)


def _is_decode(s: ScheduledRequest) -> bool:
    """A decode row: one known token left (plus any drafts)."""
    return s.request.num_tokens - s.request.num_computed_tokens == 1


def _pad_tables(tables: list[list[int]]) -> torch.Tensor:
    """Block tables → [B, max_blocks] int32, padded with 0 (never read past a sequence's end)."""
    width = max(len(t) for t in tables)
    out = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        out[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    return out
