"""certrag's decode engine (certrag.llm.engine) and the native q8 kernel it multiplies with, on tiny random
Qwen2 / Llama models (shapes only) with transformers as the oracle, and the batch-invariance contract bit for bit."""

import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from certrag import _core  # noqa: E402
from certrag.llm.decoder import Decoder, KVCache  # noqa: E402
from certrag.llm.engine import DecodeEngine, Request  # noqa: E402
from certrag.llm.weights import from_transformers  # noqa: E402

def test_q8_quantize_is_symmetric_per_group_of_32_and_dequantize_inverts_it():
    rng = np.random.default_rng(7)
    n, k = 33, 96
    w = rng.standard_normal((n, k)).astype(np.float32)
    w[0, :32] = 0
    q, s = _core.q8_quantize(w)
    # one scale per 32 columns, max |w| / 127, values within half a step
    assert s.shape == (n, k // 32) and q.dtype == np.int8 and s[0, 0] == 0
    np.testing.assert_allclose(s, np.abs(w.reshape(n, -1, 32)).max(-1) / 127, rtol=1e-6)
    dq = _core.q8_dequantize(q, s)
    assert np.all(np.abs(dq - w) <= np.repeat(s, 32, axis=1) / 2 + 1e-7)
    np.testing.assert_array_equal(dq, q.astype(np.float32) * np.repeat(s, 32, axis=1))


def test_q8_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="w must be"):
        _core.q8_quantize(np.ones((4, 33), np.float32))
    with pytest.raises(ValueError, match="finite"):
        _core.q8_quantize(np.full((1, 32), np.nan, np.float32))
    q, s = _core.q8_quantize(np.ones((4, 64), np.float32))
    with pytest.raises(ValueError, match="q must be"):
        _core.Q8Packed(q.astype(np.int16), s)
    with pytest.raises(ValueError, match="scales must"):
        _core.q8_dequantize(q, s[:, :1].copy())


def _packed_oracle(x, q, s):
    """The integer product by hand in numpy: x quantised per row and group of 32 (scale max|x| / 127 in float32,
    round half to even), exact integer sums per group, then per group in order acc = fma(sum, w_scale * x_scale,
    acc) in float32 (the fma as a float64 product and sum -- exact for these operands -- rounded once)."""
    m, k = x.shape
    xg = x.reshape(m, -1, 32).astype(np.float32)
    sx = np.abs(xg).max(-1) / np.float32(127)
    inv = np.where(sx > 0, np.float32(1) / np.where(sx > 0, sx, 1), 0).astype(np.float32)
    xq = np.clip(np.rint(xg * inv[:, :, None]), -127, 127).astype(np.int64)
    isum = np.einsum("mgi,ngi->mng", xq, q.reshape(q.shape[0], -1, 32).astype(np.int64))  # exact
    acc = np.zeros((m, q.shape[0]), np.float32)
    for g in range(k // 32):
        scale = (s[None, :, g] * sx[:, None, g]).astype(np.float32)
        acc = (acc + isum[:, :, g].astype(np.float32).astype(np.float64) * scale).astype(np.float32)
    return acc


@pytest.mark.parametrize("shape", [(1, 7, 64), (3, 33, 96), (9, 17, 32), (13, 65, 160), (8, 48, 4864)])
def test_packed_q8_matmul_is_the_integer_product_bit_identical_across_levels_and_batches(shape):
    m, n, k = shape
    rng = np.random.default_rng(11)
    w = rng.standard_normal((n, k)).astype(np.float32)
    x = (rng.standard_normal((m, k)) * rng.uniform(0.01, 10, (m, 1))).astype(np.float32)
    x[0, :32] = 0  # an all-zero group
    q, s = _core.q8_quantize(w)
    packed = _core.Q8Packed(q, s)
    assert packed.shape == (n, k) and packed.nbytes >= q.nbytes + s.nbytes
    uq, us = packed.unpack()
    assert np.array_equal(uq, q) and np.array_equal(us, s)
    ids = [n - 1, 0, n // 2]
    np.testing.assert_array_equal(packed.rows(ids), _core.q8_dequantize(q, s)[ids])
    y = packed.matmul(x)
    np.testing.assert_array_equal(y, _packed_oracle(x, q, s))
    # close to the float product too: int8 activations cost about half a percent of its scale
    ref = x.astype(np.float64) @ _core.q8_dequantize(q, s).astype(np.float64).T
    assert np.abs(y - ref).max() <= 0.02 * np.abs(ref).max()
    assert _core.build_info()["q8_kernel"] in _core.q8_paths()
    for level in _core.q8_paths():
        assert np.array_equal(packed.matmul(x, level=level), y), level
        alone = np.concatenate([packed.matmul(x[i:i + 1], level=level) for i in range(m)])
        assert np.array_equal(alone, y), level
        perm = rng.permutation(m)
        assert np.array_equal(packed.matmul(x[perm], level=level, num_threads=2), y[perm]), level


def test_packed_q8_a_non_finite_activation_poisons_its_row_only_and_bad_input_names_the_argument():
    rng = np.random.default_rng(3)
    q, s = _core.q8_quantize(rng.standard_normal((20, 64)).astype(np.float32))
    packed = _core.Q8Packed(q, s)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    x[1, 40] = np.nan
    x[2, 3] = np.inf
    for level in _core.q8_paths():
        y = packed.matmul(x, level=level)
        assert np.isfinite(y[0]).all() and np.isnan(y[1]).all() and np.isnan(y[2]).all(), level
    with pytest.raises(ValueError, match="x must be"):
        packed.matmul(np.ones((2, 32), np.float32))
    with pytest.raises(ValueError, match="level"):
        packed.matmul(np.ones((2, 64), np.float32), level="avx9")
    with pytest.raises(ValueError, match="num_threads"):
        packed.matmul(np.ones((2, 64), np.float32), num_threads=0)
    with pytest.raises(ValueError, match="scales must"):
        _core.Q8Packed(q, s[:, :1].copy())
    with pytest.raises(IndexError, match="outside"):
        packed.rows([20])


# 64: the AVX-512 kernel where the CPU has it, else AVX2's; 24: not a multiple of 16 (AVX2's or the portable one);
# 20: not a multiple of 8 (the portable one everywhere); 136: past the 16 registers AVX2 names. Every kernel this CPU
# runs is covered by the test below, which reruns this one with CERTRAG_SIMD capping the choice.
@pytest.mark.parametrize("head_dim", [64, 24, 20, 136])
def test_decode_attention_equals_softmax_attention_writes_the_cache_and_sums_spans(head_dim):
    """The native batched decode attention against float64 softmax(q k^T / sqrt(d)) v per sequence and head
    (grouped-query), with its new key and value written first; recording rows' masses against sums of those
    weights over the spans; and each row's bits the same alone as in the batch."""
    rng = np.random.default_rng(5)
    layers, heads, kv = 3, 6, 2
    lengths, caps = [1, 17, 40, 5], [40, 64, 40, 7]  # each sequence's cache has its own capacity
    B = len(lengths)
    ks = [rng.standard_normal((layers, kv, c, head_dim)).astype(np.float32) for c in caps]
    vs = [rng.standard_normal((layers, kv, c, head_dim)).astype(np.float32) for c in caps]
    q = rng.standard_normal((B, heads, head_dim)).astype(np.float32)
    k_new = rng.standard_normal((B, kv, head_dim)).astype(np.float32)
    v_new = rng.standard_normal((B, kv, head_dim)).astype(np.float32)
    spans = [None, np.array([[0, 10], [10, 17], [3, 6], [15, 99]]), None, np.array([[0, 2], [2, 5]])]
    layer, scale = 1, 1 / np.sqrt(head_dim)
    before = [k.copy() for k in ks]
    out, masses = _core.decode_attention(q, k_new, v_new, ks, vs, layer, lengths, spans, scale)
    group = heads // kv
    for b, n in enumerate(lengths):
        np.testing.assert_array_equal(ks[b][layer, :, n - 1], k_new[b])
        np.testing.assert_array_equal(vs[b][layer, :, n - 1], v_new[b])
        untouched = np.ones(ks[b].shape, bool)
        untouched[layer, :, n - 1] = False
        np.testing.assert_array_equal(ks[b][untouched], before[b][untouched])
        for head in range(heads):
            K = ks[b][layer, head // group, :n].astype(np.float64)
            V = vs[b][layer, head // group, :n].astype(np.float64)
            sc = K @ q[b, head].astype(np.float64) * scale
            wts = np.exp(sc - sc.max())
            wts /= wts.sum()
            np.testing.assert_allclose(out[b, head * head_dim:(head + 1) * head_dim], wts @ V, rtol=1e-5, atol=1e-5)
            if spans[b] is None:
                assert masses[b] is None
            else:
                want = [wts[max(0, a):min(n, e)].sum() for a, e in spans[b]]
                np.testing.assert_allclose(masses[b][head], want, rtol=1e-5, atol=1e-6)
    # batch invariance: row 2 alone (its cache as the batch left it, the same new key written again)
    alone, _ = _core.decode_attention(q[2:3], k_new[2:3], v_new[2:3], [ks[2]], [vs[2]], layer, lengths[2:3], [None],
                                      scale)
    assert np.array_equal(alone[0], out[2])
    two, _ = _core.decode_attention(q, k_new, v_new, ks, vs, layer, lengths, spans, scale, num_threads=2)
    assert np.array_equal(two, out)


@pytest.mark.slow
def test_every_decode_attention_kernel_this_cpu_runs_equals_softmax_attention():
    """The test above in a fresh process per SIMD level (CERTRAG_SIMD caps the kernel choice when the module
    loads), so the AVX-512, AVX2 and portable kernels are each checked against the float64 oracle where the CPU has
    them; each process says which kernel head_dim 64 ran on."""
    import os
    import subprocess
    import sys

    levels = {"scalar": "scalar", "avx2": "avx2", "avx512": "avx512"}
    ran = set()
    for cap in levels:
        env = {**os.environ, "CERTRAG_SIMD": cap}
        kernel = subprocess.run([sys.executable, "-c", "from certrag import _core; "
                                 "print(_core.decode_attention_kernel(64))"], env=env, capture_output=True,
                                text=True, check=True).stdout.strip()
        if kernel != levels[cap]:  # the CPU lacks this level: the cap never raises the choice
            continue
        ran.add(kernel)
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                               "decode_attention_equals_softmax_attention_writes"], env=env, capture_output=True,
                              text=True)
        assert done.returncode == 0, f"CERTRAG_SIMD={cap}:\n{done.stdout[-3000:]}"
    assert "scalar" in ran
    if "avx2" in (_core.decode_attention_kernel(64), _core.decode_attention_kernel(24)):
        assert "avx2" in ran


def test_decode_attention_kernel_names_the_path_by_head_size():
    """head_dim 20 (not a multiple of 8) and 264 (past the registers) always run the portable kernel; 64 runs the
    widest the CPU has, and 24 never the AVX-512 one (not a multiple of 16)."""
    assert _core.decode_attention_kernel(20) == "scalar" == _core.decode_attention_kernel(264)
    assert _core.decode_attention_kernel(64) in ("scalar", "avx2", "avx512")
    assert _core.decode_attention_kernel(24) in ("scalar", "avx2")


def test_decode_attention_bad_input_names_the_argument():
    k = np.zeros((2, 1, 8, 16), np.float32)
    q, kn = np.zeros((1, 2, 16), np.float32), np.zeros((1, 1, 16), np.float32)
    with pytest.raises(ValueError, match="lengths must be"):
        _core.decode_attention(q, kn, kn, [k], [k.copy()], 0, [9], [None], 0.25)
    with pytest.raises(ValueError, match="layer 2"):
        _core.decode_attention(q, kn, kn, [k], [k.copy()], 2, [3], [None], 0.25)
    with pytest.raises(ValueError, match="one entry per row"):
        _core.decode_attention(q, kn, kn, [k, k], [k.copy()], 0, [3], [None], 0.25)
    with pytest.raises(ValueError, match="k_new and v_new"):
        _core.decode_attention(q, kn[:, :, :8].copy(), kn, [k], [k.copy()], 0, [3], [None], 0.25)
    with pytest.raises(ValueError, match="spans must be"):
        _core.decode_attention(q, kn, kn, [k], [k.copy()], 0, [3], [np.zeros(3, np.int64)], 0.25)
    with pytest.raises(ValueError, match="writable"):
        ro = k.copy()
        ro.setflags(write=False)
        _core.decode_attention(q, kn, kn, [ro], [k.copy()], 0, [3], [None], 0.25)


def _tiny(arch: str, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    cls, model = (Qwen2Config, Qwen2ForCausalLM) if arch == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    torch.manual_seed(seed)
    cfg = cls(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)
    return model(cfg).eval()


class _Tokenizer:
    """Decodes ids as space-separated numbers: enough for the engine's text handling on a random model."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f" {i}" for i in ids)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_decoder_logits_equal_transformers_in_float32(arch):
    model = _tiny(arch)
    ids = torch.randint(0, 101, (1, 37), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        want = model(ids).logits[0]
        w = from_transformers(model, "float32")
        d = Decoder(w)
        cache = KVCache.allocate(w, 40)
        got = [d.logits(d.prefill(cache, ids[0, :11].tolist()))[0], d.logits(d.prefill(cache, ids[0, 11:30].tolist()))[0]]
        for t in ids[0, 30:].tolist():
            got.append(d.decode([cache], [t], [None])[0])
    positions = [10, 29] + list(range(30, 37))
    for g, p in zip(got, positions):
        torch.testing.assert_close(g, want[p], rtol=1e-5, atol=1e-5)


def _engine(arch="qwen2", fmt="q8", **kw):
    w = from_transformers(_tiny(arch), fmt, eos_ids=[100])
    return DecodeEngine(Decoder(w), _Tokenizer(), **kw)


def _prompts(n, seed=11):
    rng = np.random.default_rng(seed)
    return [tuple(int(t) for t in rng.integers(0, 100, int(rng.integers(3, 90)))) for _ in range(n)]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_sequence_decodes_the_same_alone_and_in_a_batch_of_eight_mixed_lengths(arch):
    engine = _engine(arch, prefill_chunk=16)
    try:
        prompts = _prompts(8)
        alone = [engine.generate(Request(prompt=p, max_new_tokens=20)) for p in prompts]
        futures = [engine.submit(Request(prompt=p, max_new_tokens=20)) for p in prompts]
        together = [f.result() for f in futures]
        assert engine.max_rows >= 4  # they really shared decode steps
        for a, b in zip(alone, together):
            assert a.token_ids == b.token_ids
            assert a.token_logprobs == b.token_logprobs  # bit for bit
        # the oracle for the tokens themselves: the decoder run by hand, greedy
        d = engine.decoder
        for p, a in zip(prompts[:3], alone):
            cache = KVCache.allocate(d.w, len(p) + 20)
            with torch.inference_mode():
                ref = [int(d.logits(d.prefill(cache, list(p)))[0].argmax())]
                while len(ref) < 20 and ref[-1] != 100:
                    ref.append(int(d.decode([cache], [ref[-1]], [None])[0].argmax()))
            assert a.token_ids == ref
    finally:
        engine.close()


def test_sampling_is_seeded_per_sequence_whatever_runs_beside_it():
    engine = _engine()
    try:
        p = _prompts(1)[0]
        a = engine.generate(Request(prompt=p, max_new_tokens=12, temperature=1.0, seed=5))
        futures = [engine.submit(Request(prompt=q, max_new_tokens=12, temperature=1.0, seed=i)) for i, q in
                   enumerate(_prompts(5, seed=2))]
        b = engine.submit(Request(prompt=p, max_new_tokens=12, temperature=1.0, seed=5)).result()
        [f.result() for f in futures]
        c = engine.generate(Request(prompt=p, max_new_tokens=12, temperature=1.0, seed=6))
        assert a.token_ids == b.token_ids and a.token_ids != c.token_ids
    finally:
        engine.close()


def test_stop_strings_streaming_and_cancellation_are_per_sequence():
    engine = _engine(prefill_chunk=8)
    try:
        p = _prompts(1, seed=4)[0]
        whole = engine.generate(Request(prompt=p, max_new_tokens=15))
        pieces = []
        streamed = engine.generate(Request(prompt=p, max_new_tokens=15, on_text=pieces.append))
        assert "".join(pieces) == streamed.text == whole.text
        words = whole.text.split()
        stop = " " + words[3]
        cut = engine.generate(Request(prompt=p, max_new_tokens=15, stop=(stop,)))
        assert cut.finish_reason == "stop" and cut.text == whole.text[:whole.text.index(stop)]
        # cancelled after three tokens, while another sequence runs on untouched
        flag = threading.Event()
        seen = []
        other = engine.submit(Request(prompt=_prompts(1, seed=9)[0], max_new_tokens=15))
        c = engine.generate(Request(prompt=p, max_new_tokens=15, cancelled=flag.is_set,
                                    on_text=lambda t: (seen.append(t), len(seen) >= 3 and flag.set())))
        assert c.finish_reason == "cancelled" and len(c.token_ids) <= 4
        assert other.result().token_ids == engine.generate(
            Request(prompt=_prompts(1, seed=9)[0], max_new_tokens=15)).token_ids
        # a deadline in the past cancels before any work
        late = engine.generate(Request(prompt=p, max_new_tokens=5, deadline=0.0))
        assert late.finish_reason == "cancelled" and late.token_ids == []
    finally:
        engine.close()


def test_lookback_masses_per_row_in_the_batch_equal_explicit_attention_weights():
    """The masses recorded inside a batched step equal those of the sequence decoded alone and, for one layer, the
    sums of the attention weights computed from scratch (oracle: softmax(q K^T / sqrt(d)) from transformers'
    own eager attention of the same tokens, with the float32 weights)."""
    p = _prompts(1, seed=6)[0]
    spans = ((2, 7), (10, 12))
    engine = _engine()  # q8: the batch-invariant served format
    try:
        alone = engine.generate(Request(prompt=p, max_new_tokens=6, chunk_spans=spans))
        futures = [engine.submit(Request(prompt=q, max_new_tokens=6, chunk_spans=((0, 1),))) for q in _prompts(4)]
        mixed = engine.submit(Request(prompt=p, max_new_tokens=6, chunk_spans=spans)).result()
        [f.result() for f in futures]
        assert len(alone.masses) == len(alone.token_ids) - 1
        for a, b in zip(alone.masses, mixed.masses):
            np.testing.assert_array_equal(a, b)
        plain = engine.generate(Request(prompt=p, max_new_tokens=6))
        assert plain.token_ids == alone.token_ids  # recording changes no token
    finally:
        engine.close()
    engine = _engine(fmt="float32")
    try:
        alone = engine.generate(Request(prompt=p, max_new_tokens=6, chunk_spans=spans))
        model = _tiny("qwen2")
        model.set_attn_implementation("eager")
        full = torch.tensor([list(p) + alone.token_ids[:-1]])
        with torch.inference_mode():
            att = model(full, output_attentions=True).attentions  # per layer (1, heads, T, T)
        for step, masses in enumerate(alone.masses):
            row = len(p) + step  # the decode step's query position
            for layer in range(2):
                w = att[layer][0, :, row, :row + 1].double().numpy()
                want = [w[:, :len(p)].sum(-1), w[:, len(p):].sum(-1)] + [w[:, a:b].sum(-1) for a, b in spans]
                np.testing.assert_allclose(masses[layer], np.stack(want, -1), rtol=1e-4, atol=1e-6)
    finally:
        engine.close()


def test_probe_returns_next_token_probabilities():
    model = _tiny("qwen2")
    engine = DecodeEngine(Decoder(from_transformers(model, "float32", eos_ids=[100])), _Tokenizer())
    try:
        p = _prompts(1, seed=8)[0]
        r = engine.generate(Request(prompt=p, max_new_tokens=0, probe=(3, 50, 99)))
        with torch.inference_mode():
            want = torch.softmax(model(torch.tensor([list(p)])).logits[0, -1].double(), -1)[[3, 50, 99]].numpy()
        np.testing.assert_allclose(r.probs, want, rtol=1e-4)
        assert r.token_ids == []
    finally:
        engine.close()


def test_bad_requests_are_refused_naming_the_argument():
    engine = _engine()
    try:
        for request, match in ((Request(prompt=()), "prompt"), (Request(prompt=(1,), max_new_tokens=0),
                                                                  "max_new_tokens"),
                               (Request(prompt=(1,), temperature=-1), "temperature"),
                               (Request(prompt=(500,)), "prompt token ids"),
                               (Request(prompt=(1, 2), chunk_spans=((0, 5),)), "chunk span"),
                               (Request(prompt=(1,) * 500, max_new_tokens=20), "context")):
            with pytest.raises(ValueError, match=match):
                engine.submit(request)
        with pytest.raises(ValueError, match="max_batch"):
            DecodeEngine(engine.decoder, _Tokenizer(), max_batch=0)
    finally:
        engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit(Request(prompt=(1,)))
