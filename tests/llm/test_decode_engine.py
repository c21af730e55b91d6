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

LEVELS = [lv for lv in ("scalar", "avx2", "avx512") if lv in _core.build_info()["simd_compiled"]]


@pytest.mark.parametrize("shape", [(1, 7, 64), (3, 33, 96), (9, 17, 32), (13, 65, 160)])
@pytest.mark.parametrize("level", LEVELS)
def test_q8_matmul_equals_float64_products_and_does_not_depend_on_the_batch(shape, level):
    m, n, k = shape
    try:
        _core.q8_matmul(np.zeros((1, 32), np.float32), np.zeros((1, 32), np.int8), np.zeros((1, 1), np.float32),
                        level=level)
    except ValueError:
        pytest.skip(f"this CPU lacks {level}")
    rng = np.random.default_rng(7)
    w = rng.standard_normal((n, k)).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    q, s = _core.q8_quantize(w)
    # the quantisation: one scale per 32 columns, max |w| / 127, values within half a step
    assert s.shape == (n, k // 32) and q.dtype == np.int8
    np.testing.assert_allclose(s, np.abs(w.reshape(n, -1, 32)).max(-1) / 127, rtol=1e-6)
    dq = _core.q8_dequantize(q, s)
    assert np.all(np.abs(dq - w) <= np.repeat(s, 32, axis=1) / 2 + 1e-7)
    y = _core.q8_matmul(x, q, s, level=level)
    np.testing.assert_allclose(y, x.astype(np.float64) @ dq.astype(np.float64).T, rtol=1e-5, atol=1e-4)
    # batch invariance: each row alone, in any company, on any thread count, gives the same bits
    alone = np.concatenate([_core.q8_matmul(x[i:i + 1], q, s, level=level) for i in range(m)])
    assert np.array_equal(y, alone)
    perm = rng.permutation(m)
    assert np.array_equal(_core.q8_matmul(x[perm], q, s, level=level), y[perm])
    assert np.array_equal(_core.q8_matmul(x, q, s, level=level, num_threads=2), y)


def test_q8_bad_input_names_the_argument():
    q, s = _core.q8_quantize(np.ones((4, 64), np.float32))
    with pytest.raises(ValueError, match="x must be"):
        _core.q8_matmul(np.ones((2, 32), np.float32), q, s)
    with pytest.raises(ValueError, match="scales must"):
        _core.q8_matmul(np.ones((2, 64), np.float32), q, s[:, :1].copy())
    with pytest.raises(ValueError, match="q must be"):
        _core.q8_matmul(np.ones((2, 64), np.float32), q.astype(np.int16), s)
    with pytest.raises(ValueError, match="w must be"):
        _core.q8_quantize(np.ones((4, 33), np.float32))
    with pytest.raises(ValueError, match="finite"):
        _core.q8_quantize(np.full((1, 32), np.nan, np.float32))
    with pytest.raises(ValueError, match="num_threads"):
        _core.q8_matmul(np.ones((2, 64), np.float32), q, s, num_threads=0)


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
