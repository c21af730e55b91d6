"""Decode attention that also returns the attention mass of each span of the KV cache (lookback ratios).

For one query row per head over a KV cache, with grouped-query heads, one pass over the keys computes both the
attention output and, for each span [start, end) of positions (system prompt, question, each retrieved chunk, the
generated tokens), the softmax mass sum_{j in span} a_j. It is the online softmax of FlashAttention / flash-decoding
with extra accumulators: each program keeps a running maximum m, the running denominator l, the output accumulator
and one accumulator per span, and rescales all of them by exp(m_old - m_new) when the maximum grows, so no attention
row or matrix is ever written to memory. Long contexts are split over the KV length (flash-decoding): each split
writes (m, l, acc, span sums), and the last split of each head block to finish combines them with the same
rescaling, in the same launch (an arrival counter per head block; no second kernel, no host synchronisation, so a
decode step that calls it can be captured in a CUDA graph: see kv_len, out, mass and Workspace).

Two layouts: one program per query head (per_head), or one per KV head holding its whole group of query heads
(per_group, the default for grouped-query attention): each K / V tile is then read once for the group. Either way
the scores, output and span sums are matrix products (tensor cores for 16-bit inputs). With with_output=False only the
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
def _lookback_kernel(
    q_ptr, k_ptr, v_ptr, starts_ptr, ends_ptr, kv_len_ptr,
    m_ptr, l_ptr, acc_ptr, span_ptr, count_ptr, out_ptr, mass_ptr,
    L, S, HQ, HPP, GROUP, NB, chunk, num_splits, scale_log2,
    sq_b, sq_h, sq_d,
    sk_b, sk_h, sk_l, sk_d,
    sv_b, sv_h, sv_l, sv_d,
    ss_b, ss_s,
    so_b, so_h, so_d,
    sm_b, sm_h, sm_s,
    ONE_SPLIT: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, WITH_OUT: tl.constexpr,
    IEEE: tl.constexpr, SPAN_PRECISION: tl.constexpr, HAS_KV_LEN: tl.constexpr,
):
    """One program per (batch, block of HPP query heads sharing a KV head, split of the KV length).

    HPP = GROUP (per-group layout): each K / V tile is read once for all query heads of its KV head; HPP = 1
    (per-head layout): one query head per program. Scores, outputs and span sums are matrix products over BLOCK_G
    rows (tensor cores for 16-bit inputs, p rounded to their type for the output as FlashAttention does; IEEE float32
    products for float32 inputs). The span sums p @ membership take SPAN_PRECISION: "ieee" (float32 FMAs), or for
    16-bit inputs, whose scores carry bf16 / fp16 rounding already, "tf32x3" (three tensor-core products, float32's
    accuracy) or "tf32" (one: p rounded to 10 mantissa bits, a relative error of 2^-11 per weight).

    With one split the program normalises and writes the results itself. With several, each writes its partial
    state (m, l, output accumulator, span sums), then takes a ticket from its (batch, head block)'s arrival counter;
    the program that arrives last combines all splits (flash-decoding's reduction, rescaling each by 2^(m_i - M))
    and sets the counter back to zero, so one launch does the whole call and the counters are ready for the next
    call (or graph replay) without a memset. The split count is a run-time value (decoding changes it as the cache
    grows, and it must not recompile the kernel)."""
    pid = tl.program_id(0)  # b * NB + head block
    split = tl.program_id(1)
    b = pid // NB
    h0 = (pid % NB) * HPP
    kvh = h0 // GROUP
    g = tl.arange(0, BLOCK_G)
    g_ok = g < HPP
    h = h0 + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(q_ptr + b * sq_b + h[:, None] * sq_h + d[None, :] * sq_d, mask=g_ok[:, None] & d_ok[None, :],
                other=0.0)

    s_idx = tl.arange(0, BLOCK_S)
    s_ok = s_idx < S
    st = tl.load(starts_ptr + b * ss_b + s_idx * ss_s, mask=s_ok, other=0)
    en = tl.load(ends_ptr + b * ss_b + s_idx * ss_s, mask=s_ok, other=0)
    if HAS_KV_LEN:  # the valid length of this row's cache (a static cache's buffer is longer)
        n_len = tl.minimum(tl.load(kv_len_ptr + b), L)
    else:
        n_len = L

    m_i = tl.full([BLOCK_G], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    span_acc = tl.zeros([BLOCK_G, BLOCK_S], dtype=tl.float32)

    lo = split * chunk
    hi = tl.minimum(lo + chunk, n_len)
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
        if WITH_OUT:  # masses alone never read V
            v = tl.load(v_base + n[:, None] * sv_l + d[None, :] * sv_d, mask=kv_mask, other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        member = ((n[:, None] >= st[None, :]) & (n[:, None] < en[None, :])).to(tl.float32)  # (BLOCK_N, BLOCK_S)
        span_acc = span_acc * alpha[:, None] + tl.dot(p, member, input_precision=SPAN_PRECISION)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

    out_rows = out_ptr + b * so_b + h[:, None] * so_h + d[None, :] * so_d
    mass_rows = mass_ptr + b * sm_b + h[:, None] * sm_h + s_idx[None, :] * sm_s
    if ONE_SPLIT:
        tl.store(mass_rows, span_acc / l_i[:, None], mask=g_ok[:, None] & s_ok[None, :])
        if WITH_OUT:
            tl.store(out_rows, acc / l_i[:, None], mask=g_ok[:, None] & d_ok[None, :])
    else:
        rows = (b * HQ + h) * num_splits + split
        tl.store(m_ptr + rows, m_i, mask=g_ok)
        tl.store(l_ptr + rows, l_i, mask=g_ok)
        if WITH_OUT:
            tl.store(acc_ptr + rows[:, None] * BLOCK_D + d[None, :], acc, mask=g_ok[:, None])
        tl.store(span_ptr + rows[:, None] * BLOCK_S + s_idx[None, :], span_acc, mask=g_ok[:, None])
        # Every thread's partial stores happen before the ticket (the barrier), and the ticket is a release; the
        # last program's acquire then sees all splits' partials (read from L2, .cg, never a stale L1 line).
        tl.debug_barrier()
        ticket = tl.atomic_add(count_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if ticket == num_splits - 1:
            first = (b * HQ + h) * num_splits
            m_run = tl.full([BLOCK_G], -float("inf"), tl.float32)
            denom = tl.zeros([BLOCK_G], dtype=tl.float32)
            out_sum = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
            span_sum = tl.zeros([BLOCK_G, BLOCK_S], dtype=tl.float32)
            for j in range(num_splits):  # the splits' states merged as they come, rescaled to a running maximum
                m_j = tl.load(m_ptr + first + j, mask=g_ok, other=-float("inf"), cache_modifier=".cg")
                m_new = tl.maximum(m_run, m_j)
                keep = tl.where(m_run > -float("inf"), tl.exp2(m_run - m_new), 0.0)  # an empty split weighs 0
                w = tl.where(m_j > -float("inf"), tl.exp2(m_j - m_new), 0.0)
                denom = denom * keep + w * tl.load(l_ptr + first + j, mask=g_ok, other=0.0, cache_modifier=".cg")
                span_sum = span_sum * keep[:, None] + w[:, None] * tl.load(
                    span_ptr + (first + j)[:, None] * BLOCK_S + s_idx[None, :], mask=g_ok[:, None], other=0.0,
                    cache_modifier=".cg")
                if WITH_OUT:
                    out_sum = out_sum * keep[:, None] + w[:, None] * tl.load(
                        acc_ptr + (first + j)[:, None] * BLOCK_D + d[None, :], mask=g_ok[:, None], other=0.0,
                        cache_modifier=".cg")
                m_run = m_new
            tl.store(mass_rows, span_sum / denom[:, None], mask=g_ok[:, None] & s_ok[None, :])
            if WITH_OUT:
                tl.store(out_rows, out_sum / denom[:, None], mask=g_ok[:, None] & d_ok[None, :])
            tl.atomic_xchg(count_ptr + pid, 0, sem="relaxed", scope="gpu")


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
    if (isinstance(span_starts, torch.Tensor) and isinstance(span_ends, torch.Tensor) and not check_spans
            and span_starts.dtype == span_ends.dtype == torch.int32 and span_starts.device == q.device
            and span_ends.device == q.device and span_starts.dim() == 2 and span_starts.shape == span_ends.shape
            and span_starts.shape[0] == B):
        return span_starts, span_ends  # the decode path's prepared spans: nothing to convert or copy
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


def _check_kv_len(kv_len, q):
    if kv_len is None:
        return None
    if not isinstance(kv_len, torch.Tensor) or kv_len.shape != (q.shape[0],) or kv_len.dtype != torch.int32:
        raise ValueError(f"kv_len must be an int32 tensor of shape ({q.shape[0]},); got "
                         f"{getattr(kv_len, 'dtype', type(kv_len).__name__)} {tuple(getattr(kv_len, 'shape', ()))}")
    if kv_len.device != q.device:
        raise ValueError(f"kv_len must be on q's device ({q.device}); got {kv_len.device}")
    return kv_len


def lookback_reference(q, k, v, span_starts, span_ends, scale: float | None = None, kv_len=None):
    """float32 oracle: explicit softmax weights, output = weights @ v, mass = weights summed over each span. With
    kv_len (B,), row b attends to its first kv_len[b] positions only."""
    starts, ends = _check(q, k, v, span_starts, span_ends)
    B, HQ, D = q.shape
    group = HQ // k.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    s = torch.einsum("bhd,bhld->bhl", q.float(), kf) * scale
    pos = torch.arange(k.shape[2], device=q.device)
    if kv_len is not None:
        s = s.masked_fill(pos[None, None, :] >= kv_len.to(q.device).long()[:, None, None], float("-inf"))
    w = torch.softmax(s, dim=-1)
    out = torch.einsum("bhl,bhld->bhd", w, vf)
    member = (pos[None, None, :] >= starts[:, :, None]) & (pos[None, None, :] < ends[:, :, None])  # (B, S, L)
    mass = torch.einsum("bhl,bsl->bhs", w, member.float())
    return out.to(q.dtype), mass


def _interpreted() -> bool:
    """Under TRITON_INTERPRET=1 the kernel computes its products in float32: the interpreter's tl.dot mishandles
    bfloat16 operands (Triton 3.9: garbage results), while float16 and float32 are right."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


class Workspace:
    """Scratch memory for lookback_attention's split reduction: the per-split partial state and the arrival
    counters (which every call leaves at zero). Pass one to calls that must not allocate, such as a decode step
    captured in a CUDA graph (make one call at the largest shape before capturing, so the buffers already fit).
    One workspace serves one stream at a time: calls that may run concurrently need one each."""

    def __init__(self) -> None:
        self._work = None
        self._counts = None

    def get(self, device, n_work: int, n_counts: int):
        if self._work is None or self._work.device != device or self._work.numel() < n_work:
            self._work = torch.empty(max(n_work, 1), dtype=torch.float32, device=device)
        if self._counts is None or self._counts.device != device or self._counts.numel() < n_counts:
            self._counts = torch.zeros(max(n_counts, 1), dtype=torch.int32, device=device)
        return self._work, self._counts


# Launch parameters by (BLOCK_D, BLOCK_G), from the H200 sweep of 2026-12-04 (bench_lookback_gpu.py --sweep; the
# span sums' tf32 products were no faster than float32 FMAs there, tf32x3 1.1-2.8x slower): block_n, num_warps,
# num_stages, programs per multiprocessor (the split count's target), the fewest blocks of block_n positions a split
# holds, and the span sums' precision for 16-bit inputs; _DEFAULT_LAUNCH otherwise.
_TUNED: dict[tuple[int, int], tuple[int, int, int, int, int, str]] = {
    (64, 16): (128, 4, 3, 2, 4, "ieee"),  # Qwen2.5-0.5B's heads (head dim 64, 7 query heads per KV head)
    (128, 16): (64, 4, 3, 1, 1, "ieee"),  # an 8B model's (head dim 128, 4 per KV head)
}
_DEFAULT_LAUNCH = (64, 4, 3, 2, 4, "ieee")
SPAN_PRECISIONS = ("ieee", "tf32x3", "tf32")


def lookback_attention(q, k, v, span_starts, span_ends, scale: float | None = None, *, num_splits: int | None = None,
                       block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                       check_spans: bool = True, with_output: bool = True, layout: str = "auto", kv_len=None,
                       out=None, mass=None, workspace: Workspace | None = None, span_precision: str | None = None):
    """The fused kernel (see the module docstring): (out, mass), in one launch.

    num_splits: KV-length splits (default: the tuned number of programs per multiprocessor, each split at least the
    tuned number of blocks long); block_n, num_warps, num_stages: launch parameters (default: the tuned table for the
    head layout); span_precision: the span sums' products for 16-bit inputs ("ieee", "tf32x3" or "tf32"; default:
    the tuned table's; float32 inputs always take "ieee"). check_spans=False
    skips the bounds check of the span values (a device sync when they are on the GPU) for callers that build valid
    spans themselves; int32 (B, S) spans on q's device are then used as they are. with_output=False computes the
    masses alone (V is never read) and returns (None, mass). layout: "per_head" (one program per query head),
    "per_group" (one per KV head and its group of query heads), or "auto" (per_group when query heads share KV heads).
    kv_len: int32 (B,) on q's device, row b's valid cache length (1 <= kv_len <= L; a static cache's buffer is longer
    than what it holds): positions from kv_len on are not attended, and spans may reach past it (a span's mass
    counts its valid positions). out (B, Hq, D) in q's dtype and mass (B, Hq, S) float32, any strides: where to write
    (for buffers a CUDA graph replays into); workspace: reused scratch memory (Workspace)."""
    if layout not in ("auto", "per_head", "per_group"):
        raise ValueError(f"layout must be 'auto', 'per_head' or 'per_group'; got {layout!r}")
    if span_precision is not None and span_precision not in SPAN_PRECISIONS:
        raise ValueError(f"span_precision must be one of {SPAN_PRECISIONS}; got {span_precision!r}")
    starts, ends = _check(q, k, v, span_starts, span_ends, check_spans)
    kv_len = _check_kv_len(kv_len, q)
    B, HQ, D = q.shape
    HKV, L, S = k.shape[1], k.shape[2], starts.shape[1]
    group = HQ // HKV
    hpp = group if (layout == "per_group" or (layout == "auto" and group > 1)) else 1  # query heads per program
    block_g = max(16, triton.next_power_of_2(hpp))  # matrix products need every dimension >= 16
    block_d = max(16, triton.next_power_of_2(D))
    block_s = max(16, triton.next_power_of_2(max(S, 1)))
    tuned_n, tuned_warps, tuned_stages, per_sm, min_blocks, tuned_precision = _TUNED.get((block_d, block_g),
                                                                                       _DEFAULT_LAUNCH)
    block_n = max(16, tuned_n if block_n is None else block_n)
    num_warps = tuned_warps if num_warps is None else num_warps
    num_stages = tuned_stages if num_stages is None else num_stages
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    ieee = q.dtype == torch.float32 or k.dtype == torch.float32 or _interpreted()
    span_precision = "ieee" if ieee else (tuned_precision if span_precision is None else span_precision)
    programs = B * (HQ // hpp)
    if num_splits is None:
        num_splits = max(1, min(triton.cdiv(L, min_blocks * block_n),
                                triton.cdiv(per_sm * _multiprocessors(q.device), programs), 128))
    if num_splits < 1:
        raise ValueError(f"num_splits must be at least 1; got {num_splits}")
    chunk = triton.cdiv(triton.cdiv(L, num_splits), block_n) * block_n
    num_splits = triton.cdiv(L, chunk)  # no split left without positions
    if mass is None:
        mass = torch.empty(B, HQ, S, dtype=torch.float32, device=q.device)
    elif mass.shape != (B, HQ, S) or mass.dtype != torch.float32 or mass.device != q.device:
        raise ValueError(f"mass must be float32 of shape ({B}, {HQ}, {S}) on {q.device}; got {mass.dtype} "
                         f"{tuple(mass.shape)} on {mass.device}")
    if not with_output:
        out = None
    elif out is None:
        out = torch.empty(B, HQ, D, dtype=q.dtype, device=q.device)
    elif out.shape != (B, HQ, D) or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must be {q.dtype} of shape ({B}, {HQ}, {D}) on {q.device}; got {out.dtype} "
                         f"{tuple(out.shape)} on {out.device}")
    if num_splits > 1:  # per-split state: m, l, span sums and (with the output) the output accumulators
        rows = B * HQ * num_splits
        n_work = rows * (2 + block_s + (block_d if with_output else 0))
        if workspace is None:
            work = torch.empty(n_work, dtype=torch.float32, device=q.device)
            counts = torch.zeros(programs, dtype=torch.int32, device=q.device)
        else:
            work, counts = workspace.get(q.device, n_work, programs)
        m_buf, l_buf, span_buf = work[:rows], work[rows:2 * rows], work[2 * rows:rows * (2 + block_s)]
        acc_buf = work[rows * (2 + block_s):] if with_output else span_buf
    else:  # one split writes its results directly: no scratch (the pointers below are never read)
        m_buf = l_buf = span_buf = acc_buf = mass
        counts = starts
    o = mass if out is None else out  # (never written without the output)
    _lookback_kernel[(programs, num_splits)](
        q, k, v, starts, ends, starts if kv_len is None else kv_len,
        m_buf, l_buf, acc_buf, span_buf, counts, o, mass,
        L, S, HQ, hpp, group, HQ // hpp, chunk, num_splits, scale * 1.4426950408889634,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), k.stride(3),
        v.stride(0), v.stride(1), v.stride(2), v.stride(3), starts.stride(0), starts.stride(1),
        o.stride(0), o.stride(1), o.stride(2), mass.stride(0), mass.stride(1), mass.stride(2),
        ONE_SPLIT=num_splits == 1, D=D, BLOCK_G=block_g,
        BLOCK_D=block_d, BLOCK_N=block_n, BLOCK_S=block_s, WITH_OUT=with_output,
        IEEE=ieee, SPAN_PRECISION=span_precision, HAS_KV_LEN=kv_len is not None,
        num_warps=num_warps, num_stages=num_stages)
    return out, mass
