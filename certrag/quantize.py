"""int8 Linear layers whose results do not depend on the batch: the encoders' ``int8`` backend (certrag.backends).

torch's dynamic quantisation takes one activation scale over a whole batch, so the same text scored beside others
moves (by up to 0.23 reranker logits, measured). Here each row of a Linear's input (one token) gets its own scale,
the weights one scale per output channel, and the int8 x int8 product is accumulated exactly in int32
(``torch._int_mm``: oneDNN's VNNI kernels on x86): every output row depends on its own input row alone.
"""

from __future__ import annotations

import torch


class RowwiseInt8Linear(torch.nn.Module):
    """y = x W^T + b with W in int8 (a scale per output channel) and x quantised per row (a scale per row).

    The quantisation error of an entry is at most half a step of its row's and its channel's scale; the rest is
    exact, so batching never changes a result."""

    def __init__(self, weight_t: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.register_buffer("weight_t", weight_t)  # int8 (in, out), contiguous, as _int_mm wants it
        self.register_buffer("weight_scale", weight_scale)  # float32 (out,)
        self.register_buffer("bias", bias)  # float32 (out,) or None
        self.in_features, self.out_features = weight_t.shape

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> "RowwiseInt8Linear":
        w = linear.weight.detach().float()
        scale = w.abs().amax(1).clamp_min(1e-12) / 127.0
        q = torch.round(w / scale[:, None]).to(torch.int8)
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        return cls(q.t().contiguous(), scale, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features).float()
        scale = rows.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127.0
        q = torch.round(rows / scale).to(torch.int8)  # |rows / scale| <= 127 by construction
        y = torch._int_mm(q, self.weight_t).float().mul_(scale).mul_(self.weight_scale)
        if self.bias is not None:
            y.add_(self.bias)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per row"


def rowwise_int8(module: torch.nn.Module) -> torch.nn.Module:
    """`module` with every torch.nn.Linear replaced, in place, by a RowwiseInt8Linear of the same weights."""
    for name, child in module.named_children():
        if isinstance(child, torch.nn.Linear):
            setattr(module, name, RowwiseInt8Linear.from_linear(child))
        else:
            rowwise_int8(child)
    return module
