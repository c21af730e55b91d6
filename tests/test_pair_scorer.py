"""The native fused pair scorer against the unfused MLP (float64 numpy and float32 torch)."""

import numpy as np
import pytest

import certrag
from certrag import _core
from certrag.segment.head import SegmenterHead

LEVELS = certrag.info()["simd_compiled"]


def _supported(level):
    try:
        SegmenterHead.random(4, 3).scorer(level)
        return True
    except ValueError:
        return False


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("n", [1, 2, 7, 49, 1001])
@pytest.mark.parametrize("dim, hidden", [(384, 256), (17, 5), (8, 13), (3, 1)])
def test_native_scorer_matches_the_unfused_reference(level, n, dim, hidden, rng):
    if not _supported(level):
        pytest.skip(f"CPU lacks {level}")
    head = SegmenterHead.random(dim, hidden, seed=n + dim)
    x = rng.standard_normal((n, dim)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    got = head.score_adjacent(x, level=level)
    assert got.dtype == np.float32 and got.shape == (n - 1,)
    np.testing.assert_allclose(got, head.score_reference(x), rtol=0, atol=1e-5)


def test_native_scorer_matches_float32_torch_with_trained_scale_weights(rng):
    torch = pytest.importorskip("torch")
    dim, hidden = 384, 256
    # Larger weights than the initialisation, so logits spread over the whole sigmoid as a trained head's do.
    head = SegmenterHead(rng.normal(0, 0.2, (hidden, 4 * dim)), rng.normal(0, 0.5, hidden),
                         rng.normal(0, 0.5, hidden), 0.3)
    x = rng.standard_normal((1001, dim)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    mlp = torch.nn.Sequential(torch.nn.Linear(4 * dim, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))
    with torch.no_grad():
        mlp[0].weight.copy_(torch.from_numpy(head.w1))
        mlp[0].bias.copy_(torch.from_numpy(head.b1))
        mlp[2].weight.copy_(torch.from_numpy(head.w2[None, :]))
        mlp[2].bias.fill_(head.b2)
        a, b = torch.from_numpy(x[:-1]), torch.from_numpy(x[1:])
        ref = torch.sigmoid(mlp(torch.cat([a, b, a - b, a * b], dim=1))).squeeze(1).numpy()
    got = head.score_adjacent(x)
    assert np.ptp(ref) > 0.5  # the check covers the steep part of the sigmoid
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5)


def test_threads_do_not_change_results(rng):
    head = SegmenterHead.random(64, 32, seed=1)
    x = rng.standard_normal((777, 64)).astype(np.float32)
    np.testing.assert_array_equal(head.score_adjacent(x, num_threads=1), head.score_adjacent(x, num_threads=2))


def test_pairs_helper_matches_adjacent_scoring(rng):
    head = SegmenterHead.random(16, 8, seed=2)
    left, right = rng.standard_normal((9, 16)), rng.standard_normal((9, 16))
    both = np.stack([left, right], axis=1).reshape(18, 16)
    np.testing.assert_allclose(head.score_adjacent_pairs(left, right), head.score_reference(both)[0::2], atol=1e-5)


def test_bad_input_raises_clearly(rng):
    head = SegmenterHead.random(8, 4)
    with pytest.raises(ValueError, match=r"embeddings must .*\(n, 8\)"):
        head.score_adjacent(rng.standard_normal((5, 7)))
    x = rng.standard_normal((5, 8)).astype(np.float32)
    x[3, 1] = np.nan
    with pytest.raises(ValueError, match=r"embeddings\[3\] holds a NaN"):
        head.score_adjacent(x)
    with pytest.raises(ValueError, match="w1 must have shape"):
        SegmenterHead(np.zeros((4, 10)), np.zeros(4), np.zeros(4), 0.0)
    with pytest.raises(ValueError, match="b1 and w2"):
        SegmenterHead(np.zeros((4, 8)), np.zeros(3), np.zeros(4), 0.0)
    with pytest.raises(ValueError, match="w1 holds a NaN"):
        _core.PairScorer(np.full((2, 8), np.nan, dtype=np.float32), np.zeros(2, np.float32),
                         np.zeros(2, np.float32), 0.0)
    with pytest.raises(ValueError, match="level must be"):
        head.scorer("sse9")
    assert head.score_adjacent(np.zeros((0, 8), dtype=np.float32)).shape == (0,)
    assert head.score_adjacent(np.zeros((1, 8), dtype=np.float32)).shape == (0,)


def test_saved_head_round_trips_bit_exactly(tmp_path):
    head = SegmenterHead.random(12, 7, seed=5)
    head.card = {"note": "test"}
    head.save(tmp_path / "h.safetensors")
    again = SegmenterHead.load(tmp_path / "h.safetensors")
    for name in ("w1", "b1", "w2"):
        assert getattr(again, name).tobytes() == getattr(head, name).tobytes()
    assert np.float32(again.b2).tobytes() == np.float32(head.b2).tobytes()
    assert again.card == {"note": "test"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h.json", "h.safetensors"]


def test_bfloat16_path_stays_close_to_float32(rng):
    import certrag

    if not certrag.info()["bfloat16_pair_scorer"]:
        pytest.skip("CPU lacks AVX512_BF16")
    for dim, hidden, n in [(384, 256, 1001), (17, 5, 7), (3, 1, 2)]:
        head = SegmenterHead(rng.normal(0, 0.2, (hidden, 4 * dim)), rng.normal(0, 0.5, hidden),
                             rng.normal(0, 0.5, hidden), 0.3)
        x = rng.standard_normal((n, dim)).astype(np.float32)
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        ref = head.score_reference(x)
        got = head.score_adjacent(x, precision="bfloat16")
        err = np.abs(got - ref)
        # bfloat16 keeps 8 significant bits: the stated bound is 0.05 at worst and 0.01 on average.
        assert err.max() < 0.05 and err.mean() < 0.01, (err.max(), err.mean())
        assert err.max() > 0 or n < 3  # it really ran in reduced precision


def test_bfloat16_refused_clearly_without_support(rng):
    import certrag

    head = SegmenterHead.random(8, 4)
    if certrag.info()["bfloat16_pair_scorer"]:
        with pytest.raises(ValueError, match="precision must be"):
            head.score_adjacent(rng.standard_normal((3, 8)), precision="fp8")
    else:
        with pytest.raises(ValueError, match="AVX512_BF16"):
            head.score_adjacent(rng.standard_normal((3, 8)), precision="bfloat16")
