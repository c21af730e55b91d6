"""The local LLM backend with the real bundled SmolLM2-135M (the small model for tests, MODELS.md)."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")

from certrag.llm import LocalLLM  # noqa: E402
from certrag.llm.models import BUNDLED_MODELS  # noqa: E402

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def llm(smollm):
    return smollm


def test_the_float32_reference_is_the_gguf_exactly_and_q8_stays_close(llm):
    """The engine's float32 weights are the GGUF's blocks de-quantised exactly (oracle: transformers' own GGUF
    loader); the q8 cache it serves from stays within its rounding of them and picks the same next token."""
    from transformers import AutoModelForCausalLM

    from certrag.llm.decoder import Decoder, KVCache
    from certrag.llm.weights import bundled_gguf_weights, load_q8, q8_cache_dir

    part = BUNDLED_MODELS[MODEL].gguf_parts()[0]
    reference = AutoModelForCausalLM.from_pretrained(str(part.parent), gguf_file=part.name).eval()
    ids = llm.prompt_ids([{"role": "user", "content": "Name a colour."}])
    with torch.inference_mode():
        want = reference(torch.tensor([ids])).logits[0, -1]
        for weights, tol in ((bundled_gguf_weights(MODEL, "float32"), 1e-3), (load_q8(q8_cache_dir(MODEL)), 2.0)):
            decoder = Decoder(weights)
            cache = KVCache.allocate(weights, len(ids))
            got = decoder.logits(decoder.prefill(cache, ids))[0]
            assert float((got - want).abs().max()) < tol
            assert int(got.argmax()) == int(want.argmax())
    assert (q8_cache_dir(MODEL) / "weights.safetensors").exists()


def test_greedy_generation_is_deterministic_and_counts_tokens(llm):
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    a = llm.generate(messages, max_new_tokens=12)
    b = llm.generate(messages, max_new_tokens=12)
    assert a.text == b.text and "Paris" in a.text
    expected_in = len(llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                        return_dict=True)["input_ids"])
    assert a.input_tokens == expected_in
    assert 1 <= a.output_tokens <= 12
    short = llm.generate([{"role": "user", "content": "Count from one to twenty in words."}], max_new_tokens=3)
    assert short.output_tokens == 3 and short.finish_reason == "length"


def test_seeded_sampling_repeats_with_the_same_seed(llm):
    messages = [{"role": "user", "content": "Write a word."}]
    a = llm.generate(messages, max_new_tokens=8, temperature=1.0, seed=7)
    b = llm.generate(messages, max_new_tokens=8, temperature=1.0, seed=7)
    assert a.text == b.text


def test_bad_input(llm):
    with pytest.raises(ValueError, match="messages"):
        llm.generate([], max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        llm.generate([{"role": "user", "content": "x"}], max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        llm.generate([{"role": "user", "content": "x"}], temperature=-1)
    with pytest.raises(ValueError, match="unknown bundled model|transformers model folder"):
        LocalLLM("no-such-model")


def test_batched_generation_matches_one_by_one(llm):
    chats = [[{"role": "user", "content": c}] for c in (
        "What is the capital of France? Answer in one word.",
        "Name the largest planet of the solar system, then describe it in one long sentence please.",
        "Say yes.")]
    single = [llm.generate(c, max_new_tokens=10) for c in chats]
    batched = llm.generate_batch(chats, max_new_tokens=10, batch_size=2)  # two batches, left padding in each
    assert [b.text for b in batched] == [s.text for s in single]
    assert [b.input_tokens for b in batched] == [s.input_tokens for s in single]
    assert [b.output_tokens for b in batched] == [s.output_tokens for s in single]
    assert [b.finish_reason for b in batched] == [s.finish_reason for s in single]
    for b, s in zip(batched, single):
        assert b.mean_logprob == pytest.approx(s.mean_logprob, abs=1e-3)
    with pytest.raises(ValueError, match="batch_size"):
        llm.generate_batch(chats, batch_size=0)


def test_stream_yields_the_answer_as_it_is_decoded_and_stops_when_left(smollm):
    messages = [{"role": "user", "content": "Count from 1 to 30, separated by commas."}]
    whole = smollm.generate(messages, max_new_tokens=40)
    stream = smollm.stream(messages, max_new_tokens=40)
    pieces = list(stream)
    assert len(pieces) > 5 and "".join(pieces).strip() == whole.text == stream.generation.text
    early = smollm.stream(messages, max_new_tokens=200)
    for i, _ in enumerate(early):
        if i == 3:
            break
    assert early.generation.finish_reason == "cancelled" and early.generation.output_tokens < 20
    with pytest.raises(ValueError, match="on_text"):
        smollm.stream(messages, on_text=print)
    # stop strings end the text before them, streamed or not
    cut = smollm.generate(messages, max_new_tokens=40, stop=["5"])
    assert cut.finish_reason == "stop" and cut.text == whole.text[: whole.text.index("5")].strip()


def _long_messages(items: int) -> list[dict]:
    options = "\n".join(f"({i}) the colour of item {i} is blue, green or a shade of red between them" for i in range(items))
    return [{"role": "user", "content": "Which option names a colour?\n" + options}]


def _count_passes(llm, log):
    """Records the width of every prefill pass and every decode step of llm's engine (test-local wrappers on the
    decoder instance, removed by the caller)."""
    decoder = llm.engine.decoder
    prefill, decode = decoder.prefill, decoder.decode
    decoder.prefill = lambda cache, ids: (log.append(("prefill", len(ids))), prefill(cache, ids))[1]
    decoder.decode = lambda caches, ids, spans: (log.append(("decode", len(ids))), decode(caches, ids, spans))[1]
    return lambda: (delattr(decoder, "prefill"), delattr(decoder, "decode"))


def test_a_long_prompt_is_cancelled_within_one_prefill_pass(llm):
    """A deadline or a client that left must free the model within one prompt pass: the prompt is prefilled in
    passes of PREFILL_CHUNK tokens with cancellation checked before each (it used to be one pass over the whole
    prompt, which ran on for minutes after the request's 504). Uncancelled, the engine's prefill gives the greedy
    tokens of the decoder run by hand over the same PREFILL_CHUNK-token passes. (Not of one pass over the whole
    prompt: attention over a chunk and over the whole prompt may round differently in the last bits, and the int8
    activations of the products can turn such a difference into a different rounding step.)"""
    from certrag.llm.decoder import KVCache
    from certrag.llm.local import PREFILL_CHUNK

    messages = _long_messages(70)
    ids = llm.prompt_ids(messages)
    n = len(ids)
    assert n > 2 * PREFILL_CHUNK + 1
    log = []
    restore = _count_passes(llm, log)
    try:
        polls = []
        cut = llm.generate(messages, max_new_tokens=8, cancelled=lambda: polls.append(1) or len(polls) > 1)
    finally:
        restore()
    assert cut.finish_reason == "cancelled" and cut.output_tokens == 0
    assert log == [("prefill", PREFILL_CHUNK)]  # one pass, then the cancellation was seen

    whole = llm.generate(messages, max_new_tokens=6)
    decoder = llm.engine.decoder
    cache = KVCache.allocate(decoder.w, n + 6)
    with torch.inference_mode():
        for start in range(0, n, PREFILL_CHUNK):
            last = decoder.prefill(cache, ids[start:start + PREFILL_CHUNK])
        token = int(decoder.logits(last)[0].argmax())
        ref = [token]
        for _ in range(5):
            ref.append(int(decoder.decode([cache], [ref[-1]], [None])[0].argmax()))
    eos = set(decoder.c.eos_ids)
    stop = next((i for i, t in enumerate(ref) if t in eos), None)
    assert list(whole.token_ids) == (ref if stop is None else ref[:stop + 1])


def test_a_prompt_past_the_context_is_refused_before_any_work(llm):
    from certrag.llm.local import PromptTooLong

    calls = []
    restore = _count_passes(llm, calls)
    try:
        with pytest.raises(PromptTooLong, match=f"context of {llm.context_length} tokens"):
            llm.generate(_long_messages(900), max_new_tokens=8)
        fits = len(llm.prompt_ids(MESSAGES_SHORT))
        with pytest.raises(PromptTooLong, match="max_new_tokens"):
            llm.generate(MESSAGES_SHORT, max_new_tokens=llm.context_length - fits + 1)
        with pytest.raises(PromptTooLong):
            llm.generate_batch([MESSAGES_SHORT, _long_messages(900)], max_new_tokens=8)
    finally:
        restore()
    assert calls == []
    assert issubclass(PromptTooLong, ValueError)  # the service's 400


MESSAGES_SHORT = [{"role": "user", "content": "Name a colour."}]


def test_a_cache_converted_before_model_type_was_written_gets_it_without_reconverting(llm, tmp_path, monkeypatch):
    """Caches made before the q8 config named its model_type made transformers warn of an "incorrect regex
    pattern" at every load; opening one now adds the field in place and keeps the weights file as it is."""
    import json
    import shutil

    from certrag.llm.weights import q8_cache_dir

    home = tmp_path / "home"
    shutil.copytree(q8_cache_dir(MODEL), home / "models" / f"{MODEL}-q8")
    monkeypatch.setenv("CERTRAG_HOME", str(home))
    folder = home / "models" / f"{MODEL}-q8"
    meta = json.loads((folder / "config.json").read_text())
    old = {k: v for k, v in meta.items() if k != "model_type"}
    (folder / "config.json").write_text(json.dumps(old))
    weights_mtime = (folder / "weights.safetensors").stat().st_mtime_ns
    assert q8_cache_dir(MODEL) == folder
    assert json.loads((folder / "config.json").read_text()) == {**old, "model_type": meta["architecture"]}
    assert (folder / "weights.safetensors").stat().st_mtime_ns == weights_mtime
    assert sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name) == []
