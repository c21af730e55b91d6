"""Decode attention that also returns the attention mass of each span of the KV cache (lookback ratios).

For one query row per head over a KV cache, with grouped-query heads, one pass over the keys computes both the
attention output and, for each span [start, end) of positions (system prompt, question, each retrieved chunk, the
generated tokens), the softmax mass sum_{j in span} a_j. It is the online softmax of FlashAttention / flash-decoding
with extra accumulators: each program keeps a running maximum m, the running denominator l, the output accumulator
and one accumulator per span, and rescales all of them by exp(m_old - m_new) when the maximum grows, so no attention
row or matrix is ever written to memory. Long contexts are split over the KV length (flash-decoding): each split
writes (m, l, acc, span sums) and a second small kernel combines the splits with the same rescaling.

Two layouts: one program per query head (per_head), or one per KV head holding its whole group of query heads
(per_group, the default for grouped-query attention): each K / V tile is then read once for the group and the
scores, output and span sums are matrix products (tensor cores for 16-bit inputs). With with_output=False only the
masses are computed and V is never read (for callers that take the output from SDPA).

Shapes (B batch, Hq query heads, Hkv key/value heads with Hq % Hkv == 0, L cached positions, D head dim, S spans):
    q: (B, Hq, D); k, v: (B, Hkv, L, D), any strides; float16, bfloat16 or float32 on a CUDA device.
    span_starts, span_ends: integer (S,) or (B, S), 0 <= start <= end <= L; an empty span has mass 0.
    returns out: (B, Hq, D) in q's dtype (accumulated in float32), mass: (B, Hq, S) float32.

lookback_reference computes the same in float32 from explicit softmax weights: the test oracle.
This module imports triton; `import certrag` never imports it (certrag.certify.lookback loads it lazily for CUDA tensors).
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl


@triton.jit
def _lookback_split_kernel(
    q_ptr, k_ptr, v_ptr, starts_ptr, ends_ptr,
    m_ptr, l_ptr, acc_ptr, span_ptr,
    L, S, HQ, GROUP, chunk, scale_log2,
    sq_b, sq_h, sq_d,
    sk_b, sk_h, sk_l, sk_d,
    sv_b, sv_h, sv_l, sv_d,
    ss_b, ss_s,
    NUM_SPLITS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr, WITH_OUT: tl.constexpr,
):
    bh = tl.program_id(0)  # b * HQ + h
    split = tl.program_id(1)
    b = bh // HQ
    h = bh % HQ
    kvh = h // GROUP

    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(q_ptr + b * sq_b + h * sq_h + d * sq_d, mask=d_ok, other=0.0).to(tl.float32)

    s_idx = tl.arange(0, BLOCK_S)
    s_ok = s_idx < S
    st = tl.load(starts_ptr + b * ss_b + s_idx * ss_s, mask=s_ok, other=0)
    en = tl.load(ends_ptr + b * ss_b + s_idx * ss_s, mask=s_ok, other=0)

    m_i = tl.full([], -float("inf"), tl.float32)
    l_i = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    span_acc = tl.zeros([BLOCK_S], dtype=tl.float32)

    lo = split * chunk
    hi = tl.minimum(lo + chunk, L)
    k_base = k_ptr + b * sk_b + kvh * sk_h
    v_base = v_ptr + b * sv_b + kvh * sv_h
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + n[:, None] * sk_l + d[None, :] * sk_d, mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1) * scale_log2  # log2-domain scores
        s = tl.where(n_ok, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new)
        if WITH_OUT:  # masses alone never read V
            v = tl.load(v_base + n[:, None] * sv_l + d[None, :] * sv_d, mask=kv_mask, other=0.0).to(tl.float32)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        in_span = (n[None, :] >= st[:, None]) & (n[None, :] < en[:, None])
        span_acc = span_acc * alpha + tl.sum(tl.where(in_span, p[None, :], 0.0), axis=1)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new

    row = bh * NUM_SPLITS + split
    tl.store(m_ptr + row, m_i)
    tl.store(l_ptr + row, l_i)
    if WITH_OUT:
        tl.store(acc_ptr + row * BLOCK_D + d, acc)
    tl.store(span_ptr + row * BLOCK_S + s_idx, span_acc)


@triton.jit
def _lookback_group_kernel(
    q_ptr, k_ptr, v_ptr, starts_ptr, ends_ptr,
    m_ptr, l_ptr, acc_ptr, span_ptr,
    L, S, HQ, HKV, GROUP, chunk, scale_log2,
    sq_b, sq_h, sq_d,
    sk_b, sk_h, sk_l, sk_d,
    sv_b, sv_h, sv_l, sv_d,
    ss_b, ss_s,
    NUM_SPLITS: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, WITH_OUT: tl.constexpr, IEEE: tl.constexpr,
):
    """The same online softmax with one program per (batch, KV head, split) holding all GROUP query heads of that KV
    head: each K / V tile is read once for the group, and scores, outputs and span sums are matrix products
    (tensor cores for 16-bit inputs, p rounded to their type for the output as FlashAttention does; IEEE float32
    products for float32 inputs and for the span sums)."""
    bkv = tl.program_id(0)  # b * HKV + kv head
    split = tl.program_id(1)
    b = bkv // HKV
    kvh = bkv % HKV
    g = tl.arange(0, BLOCK_G)
    g_ok = g < GROUP
    h = kvh * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(q_ptr + b * sq_b + h[:, None] * sq_h + d[None, :] * sq_d, mask=g_ok[:, None] & d_ok[None, :],
                other=0.0)

    s_idx = tl.arange(0, BLOCK_S)
    s_ok = s_idx < S
    st = tl.load(starts_ptr + b * ss_b + s_idx * ss_s, mask=s_ok, other=0)
    en = tl.load(ends_ptr + b * ss_b + s_idx * ss_s, mask=s_ok, other=0)

    m_i = tl.full([BLOCK_G], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    span_acc = tl.zeros([BLOCK_G, BLOCK_S], dtype=tl.float32)

    lo = split * chunk
    hi = tl.minimum(lo + chunk, L)
    k_base = k_ptr + b * sk_b + kvh * sk_h
    v_base = v_ptr + b * sv_b + kvh * sv_h
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + n[:, None] * sk_l + d[None, :] * sk_d, mask=kv_mask, other=0.0)
        if IEEE:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(n_ok[None, :], s * scale_log2, -float("inf"))  # log2-domain scores (BLOCK_G, BLOCK_N)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        if WITH_OUT:
            v = tl.load(v_base + n[:, None] * sv_l + d[None, :] * sv_d, mask=kv_mask, other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        member = ((n[:, None] >= st[None, :]) & (n[:, None] < en[None, :])).to(tl.float32)  # (BLOCK_N, BLOCK_S)
        span_acc = span_acc * alpha[:, None] + tl.dot(p, member, input_precision="ieee")
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

    rows = (b * HQ + h) * NUM_SPLITS + split
    tl.store(m_ptr + rows, m_i, mask=g_ok)
    tl.store(l_ptr + rows, l_i, mask=g_ok)
    if WITH_OUT:
        tl.store(acc_ptr + rows[:, None] * BLOCK_D + d[None, :], acc, mask=g_ok[:, None])
    tl.store(span_ptr + rows[:, None] * BLOCK_S + s_idx[None, :], span_acc, mask=g_ok[:, None])


@triton.jit
def _combine_kernel(m_ptr, l_ptr, acc_ptr, span_ptr, out_ptr, mass_ptr, D, S,
                    NUM_SPLITS: tl.constexpr, BLOCK_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_S: tl.constexpr, WITH_OUT: tl.constexpr):
    """flash-decoding's reduction, one program per (batch, head): rescale each split by 2^(m_i - M), normalise."""
    bh = tl.program_id(0)
    i = tl.arange(0, BLOCK_SPLITS)
    i_ok = i < NUM_SPLITS
    m = tl.load(m_ptr + bh * NUM_SPLITS + i, mask=i_ok, other=-float("inf"))
    w = tl.exp2(m - tl.max(m, axis=0))  # empty splits have m = -inf -> weight 0
    w = tl.where(i_ok, w, 0.0)
    denom = tl.sum(w * tl.load(l_ptr + bh * NUM_SPLITS + i, mask=i_ok, other=0.0), axis=0)
    rows = bh * NUM_SPLITS + i
    s_idx = tl.arange(0, BLOCK_S)
    span = tl.load(span_ptr + rows[:, None] * BLOCK_S + s_idx[None, :], mask=i_ok[:, None], other=0.0)
    tl.store(mass_ptr + bh * S + s_idx, tl.sum(w[:, None] * span, axis=0) / denom, mask=s_idx < S)
    if WITH_OUT:
        d = tl.arange(0, BLOCK_D)
        acc = tl.load(acc_ptr + rows[:, None] * BLOCK_D + d[None, :], mask=i_ok[:, None], other=0.0)
        tl.store(out_ptr + bh * D + d, tl.sum(w[:, None] * acc, axis=0) / denom, mask=d < D)


def _check(q, k, v, span_starts, span_ends, check_spans: bool = True):
    if q.dim() != 3:
        raise ValueError(f"q must have shape (batch, query_heads, head_dim); got {tuple(q.shape)}")
    if k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"k and v must both have shape (batch, kv_heads, length, head_dim); got {tuple(k.shape)} "
                         f"and {tuple(v.shape)}")
    B, HQ, D = q.shape
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k must have shape ({B}, kv_heads, length, {D}); got {tuple(k.shape)}")
    if HQ % k.shape[1]:
        raise ValueError(f"query heads ({HQ}) must be a multiple of kv heads ({k.shape[1]})")
    if k.shape[2] < 1:
        raise ValueError("the KV cache must hold at least one position")
    # Spans are checked where they are (lists and CPU tensors: no device sync), then moved to q's device.
    starts, ends = torch.as_tensor(span_starts), torch.as_tensor(span_ends)
    if starts.shape != ends.shape or starts.dim() not in (1, 2) or (starts.dim() == 2 and starts.shape[0] != B):
        raise ValueError(f"span_starts and span_ends must both have shape (S,) or ({B}, S); got "
                         f"{tuple(starts.shape)} and {tuple(ends.shape)}")
    if check_spans and starts.numel() and (bool((starts < 0).any()) or bool((ends < starts).any())
                                           or bool((ends > k.shape[2]).any())):
        raise ValueError(f"spans must satisfy 0 <= start <= end <= {k.shape[2]}")
    if starts.dim() == 1:
        starts, ends = starts.expand(B, -1), ends.expand(B, -1)
    return (starts.to(q.device, torch.int32, non_blocking=True), ends.to(q.device, torch.int32, non_blocking=True))


def lookback_reference(q, k, v, span_starts, span_ends, scale: float | None = None):
    """float32 oracle: explicit softmax weights, output = weights @ v, mass = weights summed over each span."""
    starts, ends = _check(q, k, v, span_starts, span_ends)
    B, HQ, D = q.shape
    group = HQ // k.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    w = torch.softmax(torch.einsum("bhd,bhld->bhl", q.float(), kf) * scale, dim=-1)
    out = torch.einsum("bhl,bhld->bhd", w, vf)
    pos = torch.arange(k.shape[2], device=q.device)
    member = (pos[None, None, :] >= starts[:, :, None]) & (pos[None, None, :] < ends[:, :, None])  # (B, S, L)
    mass = torch.einsum("bhl,bsl->bhs", w, member.float())
    return out.to(q.dtype), mass


def _interpreted() -> bool:
    """Under TRITON_INTERPRET=1 the group kernel computes its products in float32: the interpreter's tl.dot
    mishandles bfloat16 operands (Triton 3.9: garbage results), while float16 and float32 are right."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def lookback_attention(q, k, v, span_starts, span_ends, scale: float | None = None, *, num_splits: int | None = None,
                       block_n: int = 64, check_spans: bool = True, with_output: bool = True,
                       layout: str = "auto"):
    """The fused kernel (see the module docstring): (out, mass). num_splits: KV-length splits (default: enough
    programs to fill the GPU, each split at least 4 blocks long). check_spans=False skips the bounds check of the
    span values (a device sync when they are on the GPU) for callers that build valid spans themselves.
    with_output=False computes the masses alone (V is never read) and returns (None, mass): for callers that take
    the attention output from elsewhere. layout: "per_head" (one program per query head), "per_group" (one per KV
    head and its group of query heads, matrix products), or "auto" (per_group when query heads share KV heads)."""
    if layout not in ("auto", "per_head", "per_group"):
        raise ValueError(f"layout must be 'auto', 'per_head' or 'per_group'; got {layout!r}")
    starts, ends = _check(q, k, v, span_starts, span_ends, check_spans)
    B, HQ, D = q.shape
    HKV, L, S = k.shape[1], k.shape[2], starts.shape[1]
    grouped = layout == "per_group" or (layout == "auto" and HQ > HKV)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    if num_splits is None:
        programs = B * (HKV if grouped else HQ)
        num_splits = max(1, min(triton.cdiv(L, 4 * block_n), triton.cdiv(2 * _multiprocessors(q.device), programs),
                                128))
    if num_splits < 1:
        raise ValueError(f"num_splits must be at least 1; got {num_splits}")
    chunk = triton.cdiv(triton.cdiv(L, num_splits), block_n) * block_n
    block_d = triton.next_power_of_2(D)
    block_s = triton.next_power_of_2(max(S, 1))
    if grouped:  # matrix products need every dimension >= 16
        block_d, block_s = max(block_d, 16), max(block_s, 16)
    rows = B * HQ * num_splits
    # One workspace for the per-split state: m, l, span sums and (with the output) the output accumulators.
    work = torch.empty(rows * (2 + block_s + (block_d if with_output else 0)), dtype=torch.float32, device=q.device)
    m, l, span = work[:rows], work[rows:2 * rows], work[2 * rows:rows * (2 + block_s)]
    acc = work[rows * (2 + block_s):] if with_output else span  # (unused without the output)
    starts, ends = starts.contiguous(), ends.contiguous()
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), k.stride(3),
               v.stride(0), v.stride(1), v.stride(2), v.stride(3), starts.stride(0), starts.stride(1))
    if grouped:
        group = HQ // HKV
        _lookback_group_kernel[(B * HKV, num_splits)](
            q, k, v, starts, ends, m, l, acc, span, L, S, HQ, HKV, group, chunk, scale * 1.4426950408889634,
            *strides, NUM_SPLITS=num_splits, D=D, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d,
            BLOCK_N=max(16, block_n), BLOCK_S=block_s, WITH_OUT=with_output,
            IEEE=q.dtype == torch.float32 or k.dtype == torch.float32 or _interpreted())
    else:
        _lookback_split_kernel[(B * HQ, num_splits)](
            q, k, v, starts, ends, m, l, acc, span, L, S, HQ, HQ // HKV, chunk, scale * 1.4426950408889634,
            *strides, NUM_SPLITS=num_splits, D=D, BLOCK_D=block_d, BLOCK_N=block_n, BLOCK_S=block_s,
            WITH_OUT=with_output)
    mass = torch.empty(B, HQ, S, dtype=torch.float32, device=q.device)
    out = torch.empty(B, HQ, D, dtype=q.dtype, device=q.device) if with_output else mass  # stored in q's dtype
    _combine_kernel[(B * HQ,)](m, l, acc, span, out, mass, D, S, NUM_SPLITS=num_splits,
                               BLOCK_SPLITS=triton.next_power_of_2(num_splits), BLOCK_D=block_d, BLOCK_S=block_s,
                               WITH_OUT=with_output)
    return (out if with_output else None), mass
