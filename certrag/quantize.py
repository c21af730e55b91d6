"""int8 Linear layers whose results do not depend on the batch: the encoders' ``int8`` backend (certrag.backends).

torch's dynamic quantisation takes one activation scale over a whole batch, so the same text scored beside others
moves (by up to 0.23 reranker logits, measured). Here each row of a Linear's input (one token) gets its own scale,
the weights one scale per output channel, and the int8 product is accumulated exactly in int32: every output row
depends on its own input row alone.

How, on torch's own int8 GEMM (fbgemm, VNNI): each row is divided by its largest magnitude, so every
row lies in [-1, 1]; two fixed sentinel rows (+1 and -1) go in front, so the batch's range -- from which fbgemm
takes its one activation scale -- is [-1, 1] whatever the batch holds; the product's rows are multiplied back by
their magnitudes and the bias added. Where the quantised engine cannot pack the weights, the same per-row scheme
runs as ``torch._int_mm`` (exact int32 products). Either way the normalising and the rescaling are passes over
the activations of their own, which cost what the int8 product saves on one pass over two threads; with a call's
passes side by side, one thread each (certrag.backends.passes), the reranker in int8 is 5-10% faster than in
bfloat16 (bench_encoders.py).
"""

from __future__ import annotations

import warnings

import torch


def _pack(weight_q: torch.Tensor, weight_scale: torch.Tensor):
    """fbgemm's packed form of int8 weights with a scale per output channel; None where the engine cannot."""
    try:
        with warnings.catch_warnings():  # torch flags its quantised tensors as deprecated; they still work
            warnings.simplefilter("ignore")
            qw = torch._make_per_channel_quantized_tensor(
                weight_q, weight_scale.double(), torch.zeros(weight_q.shape[0], dtype=torch.long), 0)
            return torch.ops.quantized.linear_prepack(qw, None)
    except (RuntimeError, AttributeError, NotImplementedError):
        return None


class RowwiseInt8Linear(torch.nn.Module):
    """y = x W^T + b with W in int8 (a scale per output channel) and x quantised per row (a scale per row).

    An input entry's quantisation error is at most half a step of its row's scale (its row's largest magnitude
    over 127, or over 63 with reduce_range), a weight's half a step of its channel's scale; the integer product is
    exact, so batching never changes a result.

    reduce_range: 7-bit activations on fbgemm's path. Without VNNI fbgemm sums pairs of uint8 x int8 products in
    int16, which can saturate; 7 bits avoid it (the quantised engines' own rule). certrag.backends passes False
    where the CPU has VNNI; the default is the choice that is safe everywhere."""

    def __init__(self, weight_q: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None, *,
                 packed: bool = True, reduce_range: bool = True):
        """weight_q: int8 (out, in); weight_scale: float32 (out,); packed=False: the ``torch._int_mm`` path even
        where fbgemm could pack the weights."""
        super().__init__()
        self.out_features, self.in_features = weight_q.shape
        self.register_buffer("weight_scale", weight_scale)  # float32 (out,)
        self.register_buffer("bias", bias)  # float32 (out,) or None
        self.reduce_range = bool(reduce_range)
        self._packed = _pack(weight_q, weight_scale) if packed else None
        self.register_buffer("weight_t", None if self._packed is not None else weight_q.t().contiguous())
        sentinels = torch.zeros(2, self.in_features)
        sentinels[0, 0], sentinels[1, 0] = 1.0, -1.0
        self.register_buffer("sentinels", sentinels)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, *, packed: bool = True,
                    reduce_range: bool = True) -> "RowwiseInt8Linear":
        w = linear.weight.detach().float()
        scale = w.abs().amax(1).clamp_min(1e-12) / 127.0
        q = torch.round(w / scale[:, None]).to(torch.int8)
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        return cls(q, scale, bias, packed=packed, reduce_range=reduce_range)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features).float()
        if self._packed is not None:
            mag = rows.abs().amax(1, keepdim=True).clamp_min_(1e-12)
            unit = torch.cat([self.sentinels, rows / mag])  # the batch's range is [-1, 1], whatever it holds
            y = torch.ops.quantized.linear_dynamic(unit, self._packed, self.reduce_range)[2:]
            y = y.mul_(mag)  # separate ops, not addcmul: a fused multiply-add may round differently per shape
        else:
            mag = rows.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127.0
            q = torch.round(rows / mag).to(torch.int8)  # |rows / mag| <= 127 by construction
            y = torch._int_mm(q, self.weight_t).float().mul_(mag).mul_(self.weight_scale)
        if self.bias is not None:
            y = y.add_(self.bias)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        kind = "fbgemm" if self._packed is not None else "_int_mm"
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per row ({kind})"


def rowwise_int8(module: torch.nn.Module, *, reduce_range: bool = True) -> torch.nn.Module:
    """`module` with every torch.nn.Linear replaced, in place, by a RowwiseInt8Linear of the same weights."""
    for name, child in module.named_children():
        if isinstance(child, torch.nn.Linear):
            setattr(module, name, RowwiseInt8Linear.from_linear(child, reduce_range=reduce_range))
        else:
            rowwise_int8(child, reduce_range=reduce_range)
    return module
