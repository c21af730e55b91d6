"""The encoders' backends and the work they no longer repeat: run-time fallback, length-sorted batches equal to one
padded batch, each distinct text embedded once, batched segmentation equal to one text at a time, the adaptive
reranking rule and its trace."""

import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from certrag.backends import BACKENDS, length_batches, resolve  # noqa: E402
from certrag.embed import Embedder, EmbeddingCache  # noqa: E402


@pytest.fixture(scope="module")
def texts():
    from certrag.data.corpora import wiki_leads

    leads = [f"{t}\n{x}" for t, x, _ in wiki_leads()[:30]]
    return [p[: 20 + (i * 331) % 1800] for i, p in enumerate(leads)]


@pytest.fixture(scope="module")
def embedder32():
    return Embedder.default("float32")


def test_backends_fall_back_where_the_cpu_cannot_run_them():
    none, bf16, vnni = frozenset(), frozenset({"avx512_bf16"}), frozenset({"vnni"})
    assert resolve("auto", none).backend == "float32"
    assert resolve("auto", bf16).backend == "bfloat16"
    assert resolve("bfloat16", none).backend == "float32" and "fallback" in resolve("bfloat16", none).reason
    assert resolve("bfloat16", frozenset({"amx_bf16"})).backend == "bfloat16"
    assert resolve("int8", bf16).backend == "float32" and "VNNI" in resolve("int8", bf16).reason
    assert resolve("int8", vnni).backend == "int8"
    assert resolve("auto", bf16 | vnni).backend == "bfloat16"  # int8 is opt-in (slower than bfloat16 here)
    assert resolve("float32", bf16 | vnni).backend == "float32"
    for bad in ("fp16", "", None, 3):
        with pytest.raises(ValueError, match="backend"):
            resolve(bad)
    assert set(BACKENDS) == {"auto", "float32", "bfloat16", "int8"}


def test_config_names_the_backend_and_refuses_unknown_ones():
    from certrag.config import EngineConfig

    assert EngineConfig().encoder_backend == "auto"
    assert EngineConfig.from_dict({"encoder_backend": "float32"}).encoder_backend == "float32"
    with pytest.raises(ValueError, match="encoder_backend"):
        EngineConfig(encoder_backend="onnx")


def test_length_batches_cover_every_row_once_sorted_by_length():
    lengths = [5, 1, 9, 9, 3, 7, 2]
    batches = list(length_batches(lengths, 3))
    flat = np.concatenate(batches)
    assert sorted(flat.tolist()) == list(range(len(lengths)))
    assert [len(b) for b in batches] == [3, 3, 1]
    assert [lengths[i] for i in flat] == sorted(lengths, reverse=True)


def test_embeddings_in_length_sorted_batches_match_one_padded_batch(embedder32, texts):
    """Oracle: the Hugging Face tokenizer and model on the same files, one padded batch, mean pooling by hand."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(embedder32.model_dir), local_files_only=True)
    model = AutoModel.from_pretrained(str(embedder32.model_dir), local_files_only=True).eval()
    with torch.inference_mode():
        enc = tok(texts, return_tensors="pt", padding=True, truncation=True, max_length=256)
        hidden = model(**enc).last_hidden_state
        m = enc["attention_mask"].unsqueeze(-1).float()
        want = torch.nn.functional.normalize((hidden * m).sum(1) / m.sum(1), dim=1).numpy()
    fresh = Embedder(backend="float32", batch_size=4, memo_size=0)
    np.testing.assert_allclose(fresh.embed(texts), want, atol=2e-5)


def test_bfloat16_embeddings_keep_their_direction(embedder32, texts):
    bf = Embedder(backend="bfloat16", memo_size=0)
    if bf.backend.backend != "bfloat16":
        pytest.skip(f"no native bfloat16 here: {bf.backend.reason}")
    cos = np.sum(bf.embed(texts) * embedder32.embed(texts), axis=1)
    assert cos.min() > 0.995


def test_each_distinct_text_is_embedded_once(texts, tmp_path, monkeypatch):
    e = Embedder(backend="float32", memo_size=8)
    seen = []
    real = e._embed_uncached

    def counting(batch):
        seen.extend(batch)
        return real(batch)

    monkeypatch.setattr(e, "_embed_uncached", counting)
    a = e.embed([texts[0], texts[1], texts[0], texts[2], texts[1]])
    assert sorted(seen) == sorted({texts[0], texts[1], texts[2]})
    np.testing.assert_array_equal(a[0], a[2])
    np.testing.assert_array_equal(a[1], a[4])
    seen.clear()
    b = e.embed([texts[1], texts[3]])  # texts[1] is remembered
    assert seen == [texts[3]]
    np.testing.assert_array_equal(b[0], a[1])
    seen.clear()
    e.embed(texts[10:20])  # more than memo_size new texts: the oldest are forgotten
    assert len(e._memo) == 8
    e.embed([texts[0]])
    assert seen[-1] == texts[0]


def test_the_embedding_cache_writes_a_linear_total_and_loses_nothing(texts, tmp_path, monkeypatch):
    path = tmp_path / "cache.safetensors"
    cache = EmbeddingCache(path)
    writes = []
    real_save = EmbeddingCache.save

    def counting_save(self):
        if self._dirty:
            writes.append(len(self._index))
        real_save(self)

    monkeypatch.setattr(EmbeddingCache, "save", counting_save)
    e = Embedder(backend="float32", cache=cache, memo_size=0)
    for t in texts:  # one miss per call, the pattern that used to rewrite the file every time
        e.embed([t])
    assert len(writes) < len(texts) // 2
    cache.save()
    assert EmbeddingCache(path).__len__() == len(set(texts))
    # vectors of another backend are kept apart from the float32 ones
    bf = Embedder(backend="bfloat16", cache=EmbeddingCache(path), memo_size=0)
    if bf.backend.backend == "bfloat16":
        bf.embed(texts[:3])
        bf.cache.save()
        assert len(EmbeddingCache(path)) == len(set(texts)) + 3


def test_batched_segmentation_equals_one_text_at_a_time(texts):
    from certrag.segment import Segmenter

    seg = Segmenter(embedder=Embedder(backend="float32", memo_size=0))
    docs = [" ".join(texts[i:i + 4]) for i in range(0, 24, 4)] + ["", "One sentence only."]
    one = [seg.split(d) for d in docs]
    many = seg.split_many(docs)
    assert [[(c.start, c.end) for c in x] for x in many] == [[(c.start, c.end) for c in x] for x in one]
    assert many[-2] == []


def test_fit_threshold_against_a_hand_count():
    from certrag.train.skip_rule import apply, fit_threshold, reciprocal_rank

    assert reciprocal_rank(np.array([0.1, 0.9, 0.5]), 2) == 0.5
    assert reciprocal_rank(np.array([0.1, 0.9]), -1) == 0.0
    gaps = np.array([0.30, 0.20, 0.15, 0.10, 0.05])
    dense = np.array([1.0, 1.0, 0.5, 1.0, 0.5])
    rerank = np.array([1.0, 1.0, 1.0, 1.0, 1.0])
    # skipping the two largest gaps loses nothing; the third loses 0.5 / 5 = 0.1
    fit = fit_threshold(gaps, dense, rerank, budget=0.05)
    assert fit["skip_rate"] == 0.4 and fit["threshold"] == pytest.approx(0.175)
    # with budget 0.1 the first four can go (the fourth loses nothing more)
    fit = fit_threshold(gaps, dense, rerank, budget=0.1)
    assert fit["skip_rate"] == 0.8 and fit["threshold"] == pytest.approx(0.075)
    out = apply(gaps, dense, rerank, fit["threshold"])
    assert out["skip_rate"] == 0.8 and out["mrr_drop"] == pytest.approx(0.1)
    assert fit_threshold(gaps, 1 - rerank, rerank, budget=0.0)["skip_rate"] == 0.0
    # a cut never falls between equal gaps
    fit = fit_threshold(np.array([0.2, 0.2, 0.1]), np.array([1.0, 0.0, 1.0]), np.ones(3), budget=0.0)
    assert fit["skip_rate"] == 0.0


def test_adaptive_reranking_skips_decisive_questions_and_says_so(tmp_path):
    from certrag.config import EngineConfig, RetrievalConfig
    from certrag.data.corpora import wiki_leads
    from certrag.engine import Engine
    from certrag.rerank import CrossEncoderReranker

    leads = [{"id": f"wiki:{t}", "text": f"{t}\n{x}"} for t, x, _ in wiki_leads()[:30]]
    questions = [f"what is {d['id'][5:]}" for d in leads[:10]]
    reranker = CrossEncoderReranker(backend="float32")
    config = EngineConfig(chunker="fixed_sentence", encoder_backend="float32",
                          retrieval=RetrievalConfig(candidates=6, adaptive_rerank=True))
    with Engine.build(leads, tmp_path / "s", config, reranker=reranker, progress=False) as engine:
        always = engine.retrieve_batch(questions, rerank=True)
        gaps = sorted(r.trace["dense_gap"] for r in always)
        reranker.skip_rule = {"threshold": gaps[len(gaps) // 2]}  # half of them are "decisive"
        adaptive = engine.retrieve_batch(questions)
        for a, r in zip(adaptive, always):
            skip = r.trace["dense_gap"] >= reranker.skip_rule["threshold"]
            assert a.trace["rerank_skipped"] is skip and a.trace["reranked"] is (not skip)
            if skip:  # dense order, no logits; cut on w * cos, the fused score's dense term
                assert np.all(np.isnan(a.rerank_scores)) and np.all(np.diff(a.dense_scores) <= 0)
                w = reranker.dense_weight * a.dense_scores.astype(np.float64)
                keep = 1
                while keep < min(10, len(w)) and w[keep - 1] - w[keep] < np.log(1.5):
                    keep += 1
                assert a.selected == keep
            else:
                np.testing.assert_allclose(a.rerank_scores, r.rerank_scores, atol=1e-5)
        assert 0 < sum(a.trace["rerank_skipped"] for a in adaptive) < len(questions)
        assert not any(r.trace["rerank_skipped"] for r in always)
        assert not any(r.trace["reranked"] for r in engine.retrieve_batch(questions[:2], rerank=False))
        with pytest.raises(ValueError, match="rerank"):
            engine.retrieve(questions[0], rerank="sometimes")
        reranker.skip_rule = None
        with pytest.raises(ValueError, match="skip_rule"):
            engine.retrieve(questions[0])


def test_a_rows_result_does_not_depend_on_what_it_is_batched_with(texts):
    """The server's dynamic batchers mix requests: a request must get the numbers it would get alone (bit for bit),
    whatever the backend."""
    from certrag.rerank import CrossEncoderReranker

    for backend in ("float32", "auto", "int8"):
        e = Embedder(backend=backend, memo_size=0, batch_size=4)
        alone = np.stack([e.embed([t])[0] for t in texts[:6]])
        mixed = e.embed(texts[:6] + texts[10:20])[:6]
        np.testing.assert_array_equal(alone, mixed)
        r = CrossEncoderReranker(backend=backend)
        q1, q2 = "who founded the city", "what is the population"
        a = r.cross_scores([q1] * 8, texts[:8])
        b = r.cross_scores([q1] * 8 + [q2] * 9, texts[:8] + texts[8:17])[:8]
        np.testing.assert_array_equal(a, b)


_GEMMS = ("addmm", "mm", "bmm", "baddbmm", "_linear_pointwise", "linear_dynamic", "_int_mm", "matmul", "linear")


def test_no_product_spans_two_texts_and_every_pass_runs_on_one_thread(texts):
    """Why the invariance above holds on any CPU, checked on this one: a BLAS chooses its kernel and order of
    summation by a call's shape and thread count (MKL on an AVX512_FP16 Xeon moved float32 rows by 1e-7 when they were
    batched), so no matrix product may hold rows of two texts, and every forward pass runs on one torch thread,
    whether the call holds one text or many. Every product the models issue is recorded at the dispatcher."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from certrag.backends import grid_width
    from certrag.rerank import CrossEncoderReranker

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.rows = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            if name in _GEMMS:
                a = args[1] if name in ("addmm", "baddbmm") else args[0]
                self.rows.append(int(np.prod(a.shape[:-1])))
            return func(*args, **(kwargs or {}))

    before = torch.get_num_threads()
    try:
        for backend in ("float32", "auto"):
            e = Embedder(backend=backend, memo_size=0, batch_size=8)
            r = CrossEncoderReranker(backend=backend)
            torch.set_num_threads(1)  # dispatch modes are per thread: record with the passes on this one
            widths = [grid_width(len(x.ids), e.pad_grid) for x in e._tokenizer.encode_batch(texts[:16])]
            with Record() as rec:
                e.embed(texts[:16])
            assert rec.rows and max(rec.rows) <= max(widths)
            enc = r._tokenizer.encode_batch([("who founded the city", t) for t in texts[:12]])
            with Record() as rec:
                r.cross_scores(["who founded the city"] * 12, texts[:12])
            assert rec.rows and max(rec.rows) <= max(grid_width(len(x.ids), r.pad_grid) for x in enc)

            torch.set_num_threads(2)
            seen = []
            hook = e.model.register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
            e.embed(texts[:1])
            e.embed(texts[:20])
            hook.remove()
            hook = r.model.register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
            r.cross_scores(["who"], texts[:1])
            hook.remove()
            assert seen and set(seen) == {1}
    finally:
        torch.set_num_threads(before)


def test_passes_side_by_side_give_the_numbers_of_one_pass_after_another(texts):
    """With two torch threads a call's batches run as passes side by side, one thread each; the oracle is the same
    call on one thread (one pass after another): bit for bit, for both encoders. The groups cover every batch once
    and a failing pass reaches the caller."""
    import torch

    from certrag.backends import pass_groups, passes
    from certrag.rerank import CrossEncoderReranker

    before = torch.get_num_threads()
    try:
        e, r = Embedder(memo_size=0), CrossEncoderReranker()
        got = {}
        for threads in (2, 1):
            torch.set_num_threads(threads)
            got[threads] = (e.embed(texts), r.cross_scores(["who founded the city"] * 20, texts[:20]))
        for a, b in zip(got[2], got[1]):
            np.testing.assert_array_equal(a, b)

        torch.set_num_threads(2)
        seen = []
        passes(torch, [len(t) // 4 for t in texts], 8, 16, lambda rows: seen.append(threading.current_thread().name))
        assert any(name.startswith("certrag-pass") for name in seen)  # it did run side by side
        with pytest.raises(ZeroDivisionError):
            passes(torch, [300, 300, 300, 300], 8, 16, lambda rows: 1 / 0)
        fresh = []  # a thread started after the passes gets the process's thread count, not the workers' one
        t = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert fresh == [2]
    finally:
        torch.set_num_threads(before)
    batches = [np.array([0, 1, 2]), np.array([3]), np.array([4, 5]), np.array([6])]
    widths = [32, 32, 32, 64, 16, 16, 48]
    groups = pass_groups(batches, widths, 2)
    assert sorted(np.concatenate([np.concatenate(g) for g in groups]).tolist()) == list(range(7))
    loads = sorted(sum(len(b) * max(widths[i] for i in b) for b in g) for g in groups)
    assert loads == [112, 128]  # 64 + 48 against 96 + 32: as even as these four batches allow


def test_passes_in_a_forked_child_do_not_wait_on_the_parents_pool():
    """A child forked after the pool exists has no copy of its threads: its passes must run, not hang."""
    import multiprocessing

    import torch

    from certrag.backends import passes

    def child(out):
        torch.set_num_threads(2)
        seen = []
        passes(torch, [300, 300, 300, 300], 8, 16, lambda rows: seen.extend(rows.tolist()))
        out.put(sorted(seen))

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        passes(torch, [300, 300, 300, 300], 8, 16, lambda rows: None)  # the parent's pool exists
    finally:
        torch.set_num_threads(before)
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    proc = ctx.Process(target=child, args=(out,))
    proc.start()
    proc.join(timeout=60)
    if proc.is_alive():
        proc.kill()
    assert proc.exitcode == 0, "the forked child's passes hung or failed"
    assert out.get(timeout=5) == [0, 1, 2, 3]


def test_length_batches_keep_to_the_token_budget():
    lengths = [100, 90, 30, 30, 30, 30, 10]
    for grid in (0, 16):
        batches = list(length_batches(lengths, 32, grid, max_tokens=128))
        assert sorted(np.concatenate(batches).tolist()) == list(range(len(lengths)))
        for b in batches:
            width = max(lengths[i] for i in b)
            width = -(-width // grid) * grid if grid else width
            assert len(b) == 1 or len(b) * width <= 128
    # short rows go several to a batch, long ones alone
    assert [len(b) for b in length_batches(lengths, 32, 16, max_tokens=128)] == [1, 1, 4, 1]


def test_rowwise_int8_linear_against_a_hand_quantisation():
    """Oracle: numpy in float64 -- weights quantised per output channel, each input row per row, the integer
    product exact, then rescaled. The _int_mm path must agree to float32 rounding; the fbgemm path (its own
    activation grid) must keep every entry within the error bound per-row quantisation promises -- which a scale
    shared by the batch breaks on the row scaled by 1e-3. Both: a row must not move when batched."""
    from certrag.quantize import RowwiseInt8Linear, rowwise_int8

    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(24, 10)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(10, 24, generator=g))
        lin.weight[3] *= 40.0  # channels of very different ranges get their own scales
    x = torch.randn(7, 24, generator=g)
    x[2] *= 1e-3  # rows too
    x[4, 5] = -10.0  # a row whose largest magnitude is negative
    x[5] = 0.0  # and an empty one: its result is the bias
    w = lin.weight.detach().double().numpy()
    bias = lin.bias.detach().double().numpy()
    ws = np.abs(w).max(1) / 127.0
    wq = np.round(w / ws[:, None])
    xv = x.double().numpy()
    mag = np.maximum(np.abs(xv).max(1, keepdims=True), 1e-12)
    exact = (xv @ w.T) + bias
    from certrag.backends import cpu_features

    ranges = (True, False) if "vnni" in cpu_features() else (True,)  # full 8 bits need VNNI (no int16 sums)
    for packed, reduce_range in [(False, True)] + [(True, r) for r in ranges]:
        layer = RowwiseInt8Linear.from_linear(lin, packed=packed, reduce_range=reduce_range)
        assert (layer._packed is not None) == packed
        got = layer(x).detach().double().numpy()
        if not packed:
            xq = np.round(xv / (mag / 127.0))
            assert np.abs(wq).max() <= 127 and np.abs(xq).max() <= 127
            want = (xq @ wq.T) * (mag / 127.0) * ws[None, :] + bias
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        # every entry within the quantisation bound: half an activation step of its row times the channel's
        # quantised weights, plus half a weight step of its channel times the row (and float32 rounding)
        half_step = mag / (126.0 if layer.reduce_range else 254.0)
        bound = half_step * (np.abs(wq) * ws[:, None]).sum(1)[None, :] + np.abs(xv).sum(1, keepdims=True) * ws / 2
        assert np.all(np.abs(got - exact) <= bound * 1.001 + 1e-5 * np.abs(exact).max())
        np.testing.assert_array_equal(got[5], lin.bias.detach().numpy())
        # one row alone is bit for bit the row inside a batch (and inside a 3-d batch)
        for i in range(7):
            assert torch.equal(layer(x[i:i + 1])[0], layer(x)[i])
        assert torch.equal(layer(x.reshape(1, 7, 24))[0], layer(x))
    # rowwise_int8 replaces every Linear of a module, nested ones included
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(4, 2)))
    net = rowwise_int8(net)
    assert [type(m).__name__ for m in net.modules() if "Linear" in type(m).__name__] == ["RowwiseInt8Linear"] * 2
