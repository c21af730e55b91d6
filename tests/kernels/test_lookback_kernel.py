"""The lookback-ratio decode-attention kernel against its float32 torch reference.

Without a GPU the Triton kernel runs under TRITON_INTERPRET=1 (set here before triton is imported). The CPU path
(certrag.certify.lookback.span_masses) is checked against the same reference.
"""

import math
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from certrag.kernels.lookback import lookback_attention, lookback_reference  # noqa: E402

pytestmark = pytest.mark.kernel
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _spans(rng, L, n):
    """n spans with random bounds, including empty ones and ones touching 0 and L."""
    starts, ends = [0, L, max(0, L - 1)], [min(L, 3), L, L]
    while len(starts) < n:
        a, b = sorted(rng.integers(0, L + 1, size=2))
        starts.append(int(a))
        ends.append(int(b))
    return torch.tensor(starts[:n]), torch.tensor(ends[:n])


def _inputs(B, HQ, HKV, L, D, dtype, seed, strided=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, D, generator=g) * 1.5
    if strided:  # a cache laid out (B, L, Hkv, D) and viewed as (B, Hkv, L, D), as some KV caches are
        k = torch.randn(B, L, HKV, D, generator=g).transpose(1, 2)
        v = torch.randn(B, L, HKV, D, generator=g).transpose(1, 2)
    else:
        k = torch.randn(B, HKV, L, D, generator=g)
        v = torch.randn(B, HKV, L, D, generator=g)
    return [t.to(DEVICE, dtype) for t in (q, k, v)]


TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("L", [1, 7, 63, 65, 1000])
@pytest.mark.parametrize("group, layout", [(1, "auto"), (4, "per_head"), (4, "per_group")])
def test_kernel_matches_reference_on_awkward_lengths(L, group, layout):
    rng = np.random.default_rng(L * 10 + group)
    q, k, v = _inputs(2, 2 * group, 2, L, 48, torch.float32, L)
    starts, ends = _spans(rng, L, 9)
    out, mass = lookback_attention(q, k, v, starts, ends, layout=layout)
    ref_out, ref_mass = lookback_reference(q, k, v, starts, ends)
    torch.testing.assert_close(out, ref_out, atol=TOL[torch.float32], rtol=1e-4)
    torch.testing.assert_close(mass, ref_mass.to(mass.device), atol=TOL[torch.float32], rtol=1e-4)
    assert float(mass[..., 1].abs().max()) == 0.0  # the empty span [L, L)


@pytest.mark.parametrize("group", [1, 4, 7])
@pytest.mark.parametrize("splits", [1, 3, 16])
def test_gqa_and_kv_splits(group, splits):
    HKV = 2
    q, k, v = _inputs(1, HKV * group, HKV, 333, 64, torch.float32, group + splits)
    starts, ends = _spans(np.random.default_rng(splits), 333, 5)
    out, mass = lookback_attention(q, k, v, starts, ends, num_splits=splits, block_n=32)  # group > 1: per_group
    ref_out, ref_mass = lookback_reference(q, k, v, starts, ends)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(mass, ref_mass, atol=2e-5, rtol=1e-4)
    # Spans that tile the whole cache carry all the mass.
    _, whole = lookback_attention(q, k, v, torch.tensor([0, 100]), torch.tensor([100, 333]), num_splits=splits)
    torch.testing.assert_close(whole.sum(-1), torch.ones_like(whole.sum(-1)), atol=1e-5, rtol=0)


@pytest.mark.parametrize("splits", [1, 5])
def test_masses_without_the_output_never_need_v(splits):
    q, k, v = _inputs(2, 8, 2, 300, 64, torch.float32, 11)
    starts, ends = _spans(np.random.default_rng(4), 300, 6)
    out, mass = lookback_attention(q, k, v, starts, ends, num_splits=splits, with_output=False)
    _, ref_mass = lookback_reference(q, k, v, starts, ends)
    assert out is None
    torch.testing.assert_close(mass, ref_mass, atol=2e-5, rtol=1e-4)
    # V is not read: NaNs in it leave the masses as they were.
    _, again = lookback_attention(q, k, torch.full_like(v, float("nan")), starts, ends, num_splits=splits,
                                  with_output=False)
    torch.testing.assert_close(again, mass, atol=0, rtol=0)


def test_one_span_many_spans_per_batch_and_strided_cache():
    q, k, v = _inputs(3, 8, 2, 129, 40, torch.float32, 5, strided=True)
    assert not k.is_contiguous()
    one = (torch.tensor([10]), torch.tensor([100]))
    out, mass = lookback_attention(q, k, v, *one)
    ref_out, ref_mass = lookback_reference(q, k, v, *one)
    torch.testing.assert_close(mass, ref_mass, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=1e-4)
    rng = np.random.default_rng(1)
    per_batch = [_spans(rng, 129, 40) for _ in range(3)]
    starts = torch.stack([s for s, _ in per_batch])
    ends = torch.stack([e for _, e in per_batch])
    _, mass = lookback_attention(q, k, v, starts, ends, num_splits=4)
    _, ref_mass = lookback_reference(q, k, v, starts, ends)
    torch.testing.assert_close(mass, ref_mass, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["per_head", "per_group"])
def test_half_precision_inputs(dtype, layout):
    q, k, v = _inputs(1, 4, 1, 200, 32, dtype, 9)
    starts, ends = _spans(np.random.default_rng(2), 200, 6)
    out, mass = lookback_attention(q, k, v, starts, ends, layout=layout)
    ref_out, ref_mass = lookback_reference(q, k, v, starts, ends)
    assert out.dtype == dtype and mass.dtype == torch.float32
    torch.testing.assert_close(out.float(), ref_out.float(), atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(mass, ref_mass, atol=1e-4, rtol=1e-3)


def test_bad_shapes_are_refused_naming_the_argument():
    q, k, v = _inputs(1, 4, 2, 10, 16, torch.float32, 0)
    with pytest.raises(ValueError, match="q must"):
        lookback_attention(q[0], k, v, [0], [1])
    with pytest.raises(ValueError, match="multiple"):
        lookback_attention(q[:, :3], k, v, [0], [1])
    with pytest.raises(ValueError, match="k and v"):
        lookback_attention(q, k, v[:, :, :5], [0], [1])
    with pytest.raises(ValueError, match="0 <= start <= end <= 10"):
        lookback_attention(q, k, v, [3], [11])
    with pytest.raises(ValueError, match="span_starts and span_ends"):
        lookback_attention(q, k, v, [0, 1], [1])
    with pytest.raises(ValueError, match="layout"):
        lookback_attention(q, k, v, [0], [1], layout="per_block")


def test_cpu_path_matches_reference():
    from certrag.certify.lookback import span_masses

    for L, group in ((1, 1), (7, 4), (65, 7), (1000, 4)):
        q, k, v = [t.cpu() for t in _inputs(2, 2 * group, 2, L, 64, torch.float32, L)]
        starts, ends = _spans(np.random.default_rng(L), L, 7)
        got = span_masses(q, k, starts, ends, scale=1 / math.sqrt(64))
        _, ref = lookback_reference(q, k, v, starts, ends)
        torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-5)
        # Spans per sequence, and no spans at all.
        both = [_spans(np.random.default_rng(L + i), L, 5) for i in range(2)]
        starts2, ends2 = torch.stack([s for s, _ in both]), torch.stack([e for _, e in both])
        _, ref2 = lookback_reference(q, k, v, starts2, ends2)
        torch.testing.assert_close(span_masses(q, k, starts2, ends2, 1 / math.sqrt(64)), ref2, atol=2e-6, rtol=1e-5)
        assert span_masses(q, k, torch.zeros(0), torch.zeros(0), 0.125).shape == (2, 2 * group, 0)
        # With v: the output of the same weights (the fused recording's one pass).
        ref_out, _ = lookback_reference(q, k, v, starts, ends)
        masses, out = span_masses(q, k, starts, ends, 1 / math.sqrt(64), v=v)
        torch.testing.assert_close(out, ref_out, atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(masses, got, atol=0, rtol=0)
    # A short span at the end of a long cache keeps its precision (summed from its own weights).
    q, k, v = [t.cpu().double() for t in _inputs(1, 4, 1, 50000, 32, torch.float32, 3)]
    starts, ends = torch.tensor([0, 49990, 123]), torch.tensor([50000, 49993, 124])
    got = span_masses(q.float(), k.float(), starts, ends, scale=32 ** -0.5)
    w = torch.softmax(torch.einsum("hd,ld->hl", q[0], k[0, 0]) * 32 ** -0.5, -1)
    exact = torch.stack([w[:, a:b].sum(-1) for a, b in zip(starts.tolist(), ends.tolist())], -1)
    torch.testing.assert_close(got[0].double(), exact, atol=1e-9, rtol=2e-5)


@pytest.mark.parametrize("group, layout", [(4, "per_group"), (4, "per_head"), (1, "auto")])
@pytest.mark.parametrize("splits", [1, 3, 7])
def test_a_longer_static_buffer_with_per_row_valid_lengths(group, layout, splits):
    """kv_len: each row attends to its own first kv_len[b] positions of a longer buffer (a static cache), and a span
    reaching past its end counts only the valid positions; what lies beyond (here NaN) is never read into a result."""
    B, L = 3, 200
    q, k, v = _inputs(B, 2 * group, 2, L, 32, torch.float32, 17 + splits)
    kv_len = torch.tensor([1, 131, 200], dtype=torch.int32, device=DEVICE)
    for b, n in enumerate(kv_len.tolist()):
        k[b, :, n:] = float("nan")
        v[b, :, n:] = float("nan")
    starts, ends = torch.tensor([0, 5, 100, 0]), torch.tensor([10, 150, L, 1])
    out, mass = lookback_attention(q, k, v, starts, ends, num_splits=splits, block_n=16, layout=layout,
                                   kv_len=kv_len)
    for b, n in enumerate(kv_len.tolist()):  # the oracle: the row's valid prefix alone, spans clipped to it
        rb = slice(b, b + 1)
        ref_out, ref_mass = lookback_reference(q[rb], k[rb, :, :n], v[rb, :, :n], starts.clamp(max=n),
                                               ends.clamp(max=n))
        torch.testing.assert_close(out[rb], ref_out, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(mass[rb], ref_mass, atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="kv_len must be an int32"):
        lookback_attention(q, k, v, starts, ends, kv_len=kv_len.long())


@pytest.mark.parametrize("splits", [1, 4])
def test_results_into_given_buffers_and_a_reused_workspace(splits):
    """out and mass may be strided views (a recorder's per-layer slot); a Workspace is reused call after call,
    and its arrival counters are back at zero after each (the last split of each head block combined them)."""
    from certrag.kernels.lookback import Workspace

    ws = Workspace()
    history = torch.full((5, 2, 8, 6), float("nan"), device=DEVICE)  # (steps, batch, heads, spans)
    outs = torch.full((2, 8, 3, 64), float("nan"), device=DEVICE)  # (batch, heads, 3, D): out is [:, :, 1]
    for step in range(3):
        q, k, v = _inputs(2, 8, 2, 150 + 40 * step, 64, torch.float32, 100 + step)
        starts, ends = _spans(np.random.default_rng(step), k.shape[2], 6)
        got_out, got_mass = lookback_attention(q, k, v, starts, ends, num_splits=splits, out=outs[:, :, 1],
                                               mass=history[step], workspace=ws)
        assert got_mass.data_ptr() == history[step].data_ptr() and got_out.data_ptr() == outs[:, :, 1].data_ptr()
        ref_out, ref_mass = lookback_reference(q, k, v, starts, ends)
        torch.testing.assert_close(history[step], ref_mass, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(outs[:, :, 1], ref_out, atol=2e-5, rtol=1e-4)
        if splits > 1:
            assert int(ws._counts.abs().sum()) == 0
    assert bool(torch.isnan(history[3:]).all()) and bool(torch.isnan(outs[:, :, [0, 2]]).all())  # nothing else
    with pytest.raises(ValueError, match="mass must be float32"):
        lookback_attention(q, k, v, starts, ends, mass=history[0, :1])
