"""The decoder's weight matrices: `y = x @ W.T` for a W given (out, in), stored for the path used.

Two storages, chosen once at load for the whole model (`use_native_gemv`):

- native (fp32 or bf16 on CPU with the `kernels.gemv` extension built): W kept (out, in)
  contiguous, the layout the native GEMV streams (one contiguous dot product per output). Steps
  of at most `kernels.gemv.MAX_ROWS` tokens run the native kernel (bf16: fp32 sums, batch
  invariant); larger ones (prefill) torch's GEMM on `W.T` (same speed as (in, out) there; bf16
  goes to oneDNN, with AMX where the CPU has it).
- torch (every other case, and the fallback when the extension does not build): W stored
  (in, out) so `x @ W` streams rows (faster than `x @ W.T` for a GEMV on CPU, see
  shared/PLATFORM.md); with `split=True` as two column halves multiplied by one batched matmul
  (`_split_matmul`), which spreads a one-row GEMV over two cores where MKL's uses one.
"""
from __future__ import annotations

import torch

from kernels import gemv as native


def use_native_gemv(dtype: torch.dtype) -> bool:
    """Whether a model of this dtype on CPU should store its matrices for the native GEMV
    (fp32 or bf16; builds the extension on the first call; False if it cannot be built)."""
    return dtype in (torch.float32, torch.bfloat16) and native.gemv_available()


def _split_columns(w: torch.Tensor) -> torch.Tensor:
    """(in, out) matrix → [2, in, ceil(out/2)]: its two column halves (the last zero-padded when
    `out` is odd), for `_split_matmul`."""
    n = -(-w.shape[1] // 2)
    w = torch.nn.functional.pad(w, (0, 2 * n - w.shape[1]))
    return w.view(w.shape[0], 2, n).transpose(0, 1).contiguous()


def _split_matmul(x: torch.Tensor, w2: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [T, in] @ W [in, out] with W stored as `_split_columns(W)`: one batched matmul over the
    two halves. Each output column is the same dot product as `x @ W` (no split sums); the gain
    is threading: MKL's GEMV for one row runs on one core here, a batch of two GEMVs on two."""
    y = torch.matmul(x, w2).transpose(0, 1).reshape(x.shape[0], -1)  # [T, 2·ceil(out/2)]
    return y if y.shape[1] == out_features else y[:, :out_features]


class Linear:
    """One weight matrix W [out, in] (no bias) and its product `x [T, in] → x @ W.T [T, out]`.

    Args: w (out, in) of the model's dtype (not modified; the native storage may share its
    memory when it is already contiguous, e.g. a tied embedding reused as lm_head); native:
    store for `kernels.gemv`; split: in the torch storage, use `_split_matmul`.
    """

    def __init__(self, w: torch.Tensor, native: bool, split: bool = False) -> None:
        self.out_features, self.in_features = w.shape
        self.native = native
        self.split = split and not native
        if native:
            self.weight = w.contiguous()
        elif self.split:
            self.weight = _split_columns(w.t())
        else:
            self.weight = w.t().contiguous()

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    @property
    def nbytes(self) -> int:
        """Bytes one product reads (the stored matrix, padding included)."""
        return self.weight.numel() * self.weight.element_size()

    def matrix(self) -> torch.Tensor:
        """W as given, (out, in) (a view of the storage; a copy for the split one)."""
        if self.native:
            return self.weight
        if self.split:
            w = self.weight.transpose(0, 1).reshape(self.in_features, -1)  # [in, 2·ceil(out/2)]
            return w[:, :self.out_features].t()
        return self.weight.t()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            return native.gemv(x, self.weight)
        if self.split:
            return _split_matmul(x, self.weight, self.out_features)
        return x @ self.weight
