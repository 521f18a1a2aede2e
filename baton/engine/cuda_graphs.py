"""Decode steps replayed as CUDA graphs: one graph per batch size, inputs in static buffers.

At small batch a decode step on a GPU is launch-bound: every layer is about ten kernels of a
few microseconds each, and launching them one by one from Python (torch's dispatcher, Triton's
launcher) costs more than they run. A graph captured once replays the whole step's kernels
with one launch (the approach of vLLM's CUDA-graph model runner and gpt-fast's
`torch.compile(mode="reduce-overhead")`; PyTorch's `torch.cuda.graphs`).

A graph replays fixed addresses and shapes, so a step of n decode rows is padded to the next
captured size b, and its inputs are copied into static buffers the graph reads:

    static buffer      rows [0, n)         rows [n, b) (padding)
    input_ids [b]      the rows' tokens    0
    positions [b]      their positions     0
    slot_mapping [b]   their KV slots      -1  (write_kv skips a negative slot: padding writes
                                                no KV)
    context_lens [b]   their lengths       1   (attention reads one position ...)
    block_tables [b,W] their tables        0   (... of block 0; the row's output is discarded)

    graph[b].replay() ──▶ logits [b, vocab] (static); the caller gets the view logits[:n]

W = ceil(max_model_len / block_size): the decode kernel reads only the blocks its row's
context_len covers, so the width costs nothing per step and one capture fits every length.
Captured sizes: 1, 2, 4, 8, then multiples of 8 up to max_batch (vLLM's default shape);
larger decode steps, and every step holding a prefill row, run eagerly. All graphs share one
memory pool (captured largest first, as PyTorch recommends).

Without CUDA (tests) `capture=False` runs the same padding and static buffers with the step
called directly instead of replayed: what is checked on CPU is everything but the capture.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from baton.models.decoder import AttentionMetadata

StepFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def capture_sizes(max_batch: int) -> list[int]:
    """Batch sizes to capture, ascending: 1, 2, 4, 8, 16, 24, ... up to max_batch (included).
    ValueError when max_batch < 1."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be ≥ 1, got {max_batch}")
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch, 8))
    return sorted(set(sizes + [max_batch]))


class DecodeGraphs:
    """One decode step per captured batch size over static buffers on `device`.

    step(input_ids [b] int64, positions [b] int64, meta) -> logits [b, vocab] float32: the
    model's decode step (forward over the paged KV cache, then lm_head); it must not sync
    with the host or allocate host tensors (it is captured). max_blocks: block-table width
    W. capture: record CUDA graphs (needs `device` to be CUDA); False calls `step` on the
    static buffers at each `run` (CPU tests of the padding).
    """

    def __init__(self, step: StepFn, device: torch.device, max_batch: int, max_blocks: int,
                 capture: bool = True) -> None:
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.step, self.device, self.capture_graphs = step, device, capture
        self.sizes = capture_sizes(max_batch)
        self.max_batch, self.max_blocks = self.sizes[-1], max(1, max_blocks)
        b, w, pin = self.max_batch, self.max_blocks, device.type == "cuda"

        def pair(shape, dtype, fill):  # (host staging, pinned for async copies; device)
            host = torch.full(shape, fill, dtype=dtype, pin_memory=pin)
            return host, host.to(device)

        self._ids = pair((b,), torch.int64, 0)
        self._pos = pair((b,), torch.int64, 0)
        self._slots = pair((b,), torch.int64, -1)
        self._lens = pair((b,), torch.int32, 1)
        self._tables = pair((b, w), torch.int32, 0)
        self._copied = torch.cuda.Event() if pin else None  # host staging free again
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]] = {}

    def fits(self, num_rows: int) -> bool:
        """Whether a decode step of `num_rows` rows can replay a graph."""
        return 0 < num_rows <= self.max_batch

    def padded_size(self, num_rows: int) -> int:
        """The captured size a step of `num_rows` rows runs at (the smallest ≥ num_rows)."""
        return next(s for s in self.sizes if s >= num_rows)

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=self._slots[1][:b], num_decode_tokens=b,
                                 decode_block_tables=self._tables[1][:b],
                                 decode_context_lens=self._lens[1][:b])

    def _call(self, b: int) -> torch.Tensor:
        return self.step(self._ids[1][:b], self._pos[1][:b], self._meta(b))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, into one memory pool (static buffers hold the
        padding values, so warm-up and capture write no KV). No-op when capture=False."""
        if not self.capture_graphs:
            return
        with torch.cuda.device(self.device):  # graphs, pool and streams on the model's GPU
            self._capture_all()

    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.sizes):
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm-up: Triton compiles, allocator fills
                for _ in range(2):
                    self._call(b)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: a worker's other threads (gRPC, NIXL progress) may touch CUDA
            # meanwhile; only this thread's calls must be capture-safe
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                out = self._call(b)
            self._graphs[b] = (graph, out)
        torch.cuda.synchronize(self.device)

    def run(self, input_ids: Sequence[int], positions: Sequence[int],
            slot_mapping: Sequence[int], block_tables: Sequence[Sequence[int]],
            context_lens: Sequence[int]) -> torch.Tensor:
        """One decode step of n = len(input_ids) rows (n ≤ max_batch; tables no wider than
        max_blocks): logits [n, vocab] float32, a view of a static buffer valid until the
        next run. Raises ValueError for a batch or a table that does not fit."""
        n = len(input_ids)
        if not self.fits(n):
            raise ValueError(f"{n} rows do not fit the captured sizes (≤ {self.max_batch})")
        width = max(len(t) for t in block_tables)
        if width > self.max_blocks:
            raise ValueError(f"a block table of {width} blocks exceeds {self.max_blocks}")
        b = self.padded_size(n)
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have left the staging
        self._stage(n, b, width, input_ids, positions, slot_mapping, block_tables, context_lens)
        if self.capture_graphs:
            graph, out = self._graphs[b]
            with torch.cuda.device(self.device):  # replays on the current device's stream
                graph.replay()
        else:
            out = self._call(b)
        return out[:n]

    def _stage(self, n: int, b: int, width: int, input_ids, positions, slot_mapping,
               block_tables, context_lens) -> None:
        """Fill the host staging (rows [0, n) the step's, [n, b) padding) and copy rows
        [0, b) (table columns [0, width)) to the device buffers."""
        values = ((self._ids, input_ids, 0), (self._pos, positions, 0),
                  (self._slots, slot_mapping, -1), (self._lens, context_lens, 1))
        for (host, _), rows, pad in values:
            h = host.numpy()  # a view: numpy fills a few rows faster than torch ops
            h[:n] = rows
            h[n:b] = pad
        tables = self._tables[0]
        t = tables.numpy()
        for i, row in enumerate(block_tables):
            t[i, :len(row)] = row
        t[n:b, 0] = 0
        blocking = self._copied is None
        for host, dev in (self._ids, self._pos, self._slots, self._lens):
            dev[:b].copy_(host[:b], non_blocking=not blocking)
        self._tables[1][:b, :width].copy_(tables[:b, :width], non_blocking=not blocking)
        if self._copied is not None:
            self._copied.record(torch.cuda.current_stream(self.device))
