"""A local causal LM through transformers: chat prompts in, text and exact token counts out.

Generation on a 2-core CPU runs fastest with one torch thread (spin-waiting OpenMP threads cost 3-7x, MODELS.md),
so generate() sets torch's thread count to `num_threads` (default 1) for its duration and restores it after.
Greedy decoding by default; temperature > 0 samples with a seeded generator.

Lookback recording is a per-call option: generate(..., record_lookback=True) returns the features in its
Generation. The model's attention is the recorder's from load time on (certrag.certify.lookback: it delegates to
SDPA, so tokens are plain generation's, and adds span masses only for a call that records), so no flag on the model
or on this object is set or restored per call.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from certrag.llm.models import BUNDLED_MODELS, DEFAULT_LLM, converted_model_dir


@dataclass(frozen=True)
class Generation:
    text: str
    input_tokens: int
    output_tokens: int
    seconds: float
    finish_reason: str  # "stop" (end of sequence) or "length" (max_new_tokens reached)
    lookback: object = None  # certrag.certify.lookback.LookbackFeatures when the call recorded lookback ratios
    mean_logprob: float = float("nan")  # mean log-probability of the generated tokens (under the sampling
    # distribution's logits after processing: the model's own for greedy decoding)
    token_ids: tuple[int, ...] = ()  # the generated tokens (a local model's; empty from a remote server)
    token_logprobs: tuple[float, ...] = ()  # each generated token's log-probability, as mean_logprob's


class TextStream:
    """The pieces of one generation as they are decoded (see LocalLLM.stream); iterate once."""

    def __init__(self, llm, messages, kwargs) -> None:
        import queue

        self.generation: Generation | None = None
        self._queue: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._args = (llm, messages, kwargs)
        self._started = False

    def _work(self) -> None:
        llm, messages, kwargs = self._args
        try:
            self.generation = llm.generate(messages, on_text=lambda piece: self._queue.put(("piece", piece)),
                                           cancelled=self._stop.is_set, **kwargs)
            self._queue.put(("done", None))
        except BaseException as exc:  # handed to the iterating thread
            self._queue.put(("error", exc))

    def __iter__(self):
        if self._started:
            raise RuntimeError("a TextStream is iterated once")
        self._started = True
        worker = threading.Thread(target=self._work, daemon=True, name="certrag-stream")
        worker.start()
        try:
            while True:
                kind, value = self._queue.get()
                if kind == "piece":
                    yield value
                elif kind == "error":
                    raise value
                else:
                    return
        finally:
            self._stop.set()
            worker.join()


class _Watcher:
    """A stopping criterion for one sequence that streams text deltas, ends at stop strings and honours
    cancellation. transformers calls it after every generated token with the whole sequence so far (any callable
    with StoppingCriteria's signature goes in a StoppingCriteriaList)."""

    def __init__(self, tokenizer, prompt_len: int, stop: tuple[str, ...], on_text, cancelled) -> None:
        self.tokenizer = tokenizer
        self.prompt_len = prompt_len
        self.stop = stop
        self.on_text = on_text
        self.cancelled = cancelled
        self.sent = 0  # characters of the decoded text already handed to on_text
        self.stopped_at: int | None = None  # character offset of the first stop string
        self.was_cancelled = False
        self.hold = max((len(x) for x in stop), default=1) - 1  # a stop string may be arriving: keep its length

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        if self.cancelled is not None and self.cancelled():
            self.was_cancelled = True
            return torch.ones(input_ids.shape[0], dtype=torch.bool)
        text = self.tokenizer.decode(input_ids[0, self.prompt_len:].tolist(), skip_special_tokens=True)
        done = False
        if self.stop:
            hits = [i for i in (text.find(x, max(0, self.sent - self.hold)) for x in self.stop) if i >= 0]
            if hits:
                self.stopped_at = min(hits)
                text, done = text[:self.stopped_at], True
        if self.on_text is not None:
            # a trailing U+FFFD is half of a multi-byte character: wait for the rest; hold back what may be the
            # start of a stop string
            ready = len(text) if done else len(text.rstrip("\ufffd")) - (self.hold if self.stop else 0)
            if ready > self.sent:
                self.on_text(text[self.sent:ready])
                self.sent = ready
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool)

    def finish(self, new: list[int], text: str, finish: str) -> tuple[str, str]:
        """The answer's text and finish reason, and the last delta for on_text."""
        if self.stopped_at is not None:
            text, finish = text[:self.stopped_at], "stop"
        elif self.was_cancelled:
            finish = "cancelled"
        if self.on_text is not None and len(text) > self.sent:
            self.on_text(text[self.sent:])
            self.sent = len(text)
        return text, finish


PREFILL_CHUNK = 512  # prompt tokens per prefill pass: cancellation and deadlines are checked between passes


class PromptTooLong(ValueError):
    """A prompt that, with the tokens asked for, does not fit the model's context: refused before any work."""

    def __init__(self, prompt_tokens: int, max_new_tokens: int, limit: int) -> None:
        super().__init__(f"the prompt ({prompt_tokens} tokens) plus max_new_tokens ({max_new_tokens}) exceeds the "
                         f"model's context of {limit} tokens")
        self.prompt_tokens, self.max_new_tokens, self.limit = prompt_tokens, max_new_tokens, limit


def _mean(values) -> float:
    return float(sum(values) / len(values)) if values else float("nan")


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a chat (list of {role, content}) under the tokenizer's chat template, the assistant turn opened."""
    if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


class LocalLLM:
    records_lookback = True  # a capability: generate(..., record_lookback=True) works on this backend
    streams_text = True  # generate(on_text=..., cancelled=...) streams pieces and stops per token
    def __init__(self, model: str | os.PathLike = DEFAULT_LLM, *, dtype: str = "float32",
                 num_threads: int = 1) -> None:
        from certrag.embed import _import_torch

        torch = _import_torch()
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16'; got {dtype!r}")
        if num_threads < 1:
            raise ValueError(f"num_threads must be at least 1; got {num_threads}")
        if isinstance(model, str) and model in BUNDLED_MODELS:
            path, self.name = converted_model_dir(model), model
        else:
            path = Path(model)
            if not (path / "config.json").exists():
                raise ValueError(f"model must be one of {sorted(BUNDLED_MODELS)} or a transformers model folder; "
                                 f"got {model!r}")
            self.name = path.name
        self.path = str(path)  # the transformers folder the weights and tokenizer came from
        self._torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        self.model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True,
                                                          dtype=getattr(torch, dtype)).eval()
        self.num_threads = num_threads
        self._lock = threading.Lock()
        self._use_recorder()

    def _use_recorder(self) -> None:
        """Routes the model's attention through the lookback recorder once, at load: it delegates to SDPA and
        records only inside a recording call on the same thread."""
        from certrag.certify.lookback import register

        if self.model.config._attn_implementation == "sdpa":
            self.model.set_attn_implementation(register())

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of a chat (list of {role, content}) with the model's chat template and the assistant turn
        opened."""
        return chat_prompt_ids(self.tokenizer, messages)

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def next_token_probs(self, prompts: list[list[int]], token_ids: list[int], *, batch_size: int = 16):
        """For each prompt (token ids), the probabilities of token_ids as the next token: float64 (n, len(token_ids)),
        read from the full softmax over the vocabulary of one forward pass (prompts left-padded and batched, with
        position ids that ignore the padding)."""
        import numpy as np

        torch = self._torch
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts must be a non-empty list of non-empty token id lists")
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"token_ids must lie in [0, {vocab})")
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        out = np.zeros((len(prompts), len(token_ids)))
        wanted = torch.tensor(list(token_ids), dtype=torch.long)
        for p in prompts:
            self.check_context(len(p), 0)
        with self._lock, torch.inference_mode(), self._threads():
            for start in range(0, len(prompts), batch_size):
                batch = prompts[start:start + batch_size]
                width = max(len(p) for p in batch)
                ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in batch])
                mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
                pos = (mask.cumsum(-1) - 1).clamp(min=0)
                logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos,
                                    logits_to_keep=1).logits[:, -1, :].float()
                logp = torch.log_softmax(logits, dim=-1)
                out[start:start + len(batch)] = logp[:, wanted].exp().double().numpy()
        return out

    @property
    def context_length(self) -> int:
        """The most tokens (prompt + generated) the model was trained to attend over."""
        return int(getattr(self.model.config, "max_position_embeddings", 0) or 2048)

    def generate(self, messages: list[dict], *, max_new_tokens: int = 128, temperature: float = 0.0,
                 seed: int | None = None, prefix: str = "", record_lookback: bool = False,
                 stop: list[str] | tuple[str, ...] = (), on_text=None, cancelled=None) -> Generation:
        """prefix: text the assistant has already written (its tokens count as input); the result continues it.
        record_lookback: record lookback ratios over the prompt's <passage>s into Generation.lookback.
        stop: strings that end the answer (not included; finish_reason "stop"). on_text(delta): called from the
        decoding thread with each new piece of text as it is decoded (streaming; the pieces join to the answer).
        cancelled(): polled before every token; when true, decoding stops there (finish_reason "cancelled")."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1; got {max_new_tokens}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0; got {temperature}")
        if isinstance(stop, str) or not all(isinstance(x, str) and x for x in stop):
            raise ValueError("stop must be a list of non-empty strings")
        torch = self._torch
        ids = self.prompt_ids(messages)
        spans = self._passage_spans(messages, ids) if record_lookback else None
        if prefix:
            ids = ids + self.tokenizer(prefix, add_special_tokens=False)["input_ids"]
        self.check_context(len(ids), max_new_tokens)
        watch = _Watcher(self.tokenizer, len(ids), tuple(stop), on_text, cancelled) \
            if (stop or on_text or cancelled) else None
        started = time.perf_counter()
        with self._lock, torch.inference_mode(), self._recording(len(ids), spans) as rec:
            prompt, mask = torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long)
            cache, stopped = self._prefill(prompt, mask, cancelled)
            if stopped:  # cancelled (or past its deadline) during the prompt's passes
                return Generation(text="", input_tokens=len(ids), output_tokens=0,
                                  seconds=time.perf_counter() - started, finish_reason="cancelled",
                                  lookback=rec.finish() if rec is not None else None)
            out = self._decode(prompt, mask, max_new_tokens, temperature, seed,
                               self.tokenizer.pad_token_id or self.tokenizer.eos_token_id, criteria=watch,
                               cache=cache)
        new = out.sequences[0, len(ids):].tolist()
        logprobs = self._token_logprobs(out.scores, 0, new)
        finish = "stop" if new and new[-1] in self._eos_ids() else "length"
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        if watch is not None:
            text, finish = watch.finish(new, text, finish)
        return Generation(text=text.strip(), input_tokens=len(ids), output_tokens=len(new),
                          seconds=time.perf_counter() - started, finish_reason=finish,
                          lookback=rec.finish() if rec is not None else None, mean_logprob=_mean(logprobs),
                          token_ids=tuple(new), token_logprobs=logprobs)

    def check_context(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """Raises PromptTooLong when prompt_tokens + max_new_tokens pass the model's context."""
        if prompt_tokens + max_new_tokens > self.context_length:
            raise PromptTooLong(prompt_tokens, max_new_tokens, self.context_length)

    def _prefill(self, ids, mask, cancelled):
        """The prompt's KV cache, filled PREFILL_CHUNK tokens a pass with cancelled() checked before each, so a
        request cancelled or past its deadline frees the model within one pass rather than after the whole prompt;
        the last 2 .. PREFILL_CHUNK + 1 tokens are left to generate(), whose first pass then reads them (never one
        token alone: a one-token pass is a decode step to the lookback recorder). Only the last position's logits
        are computed. Returns (cache, False); (None, False) for a prompt of one pass, which generate() prefills
        itself; (None, True) when cancelled."""
        from transformers import DynamicCache

        length = ids.shape[1]
        if length <= PREFILL_CHUNK:
            return None, bool(cancelled is not None and cancelled())
        tail = length % PREFILL_CHUNK or PREFILL_CHUNK
        if tail < 2:
            tail += PREFILL_CHUNK
        cache = DynamicCache(config=self.model.config)
        with self._threads():
            for start in range(0, length - tail, PREFILL_CHUNK):
                if cancelled is not None and cancelled():
                    return None, True
                end = start + PREFILL_CHUNK
                self.model(input_ids=ids[:, start:end], attention_mask=mask[:, :end], cache=cache,
                           use_cache=True, logits_to_keep=1)
        return cache, bool(cancelled is not None and cancelled())

    def stream(self, messages: list[dict], **kwargs) -> "TextStream":
        """generate() as an iterator of text pieces, decoded in a worker thread: `for piece in llm.stream(m): ...`;
        the finished Generation is then `stream.generation`. Leaving the loop early (break, an exception) stops the
        decoding at its next token. Takes generate()'s keywords except on_text and cancelled."""
        for name in ("on_text", "cancelled"):
            if name in kwargs:
                raise ValueError(f"stream() sets {name} itself")
        return TextStream(self, messages, kwargs)

    def generate_batch(self, messages_list: list[list[dict]], *, max_new_tokens: int = 128,
                       temperature: float = 0.0, seed: int | None = None, batch_size: int = 8,
                       record_lookback: bool = False) -> list[Generation]:
        """Several chats decoded together (left-padded, batch_size at a time): one Generation per chat, in order.

        Decoding reads the weights once per step for the whole batch, so on a CPU a batch of short answers costs
        little more than one. Greedy results are those of generate() up to float rounding (padding changes the
        shapes of the matrix products). Each Generation's seconds is its batch's wall time. With record_lookback,
        the chats are decoded one by one (the recorder follows one sequence)."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1; got {max_new_tokens}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0; got {temperature}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1; got {batch_size}")
        if record_lookback or len(messages_list) <= 1:
            return [self.generate(m, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                                  record_lookback=record_lookback) for m in messages_list]
        torch = self._torch
        eos = self._eos_ids()
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(eos, default=0)
        prompts = [self.prompt_ids(m) for m in messages_list]
        for p in prompts:
            self.check_context(len(p), max_new_tokens)
        results: list[Generation] = []
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start:start + batch_size]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            started = time.perf_counter()
            with self._lock, torch.inference_mode():
                out = self._decode(ids, mask, max_new_tokens, temperature, seed, pad)
            seconds = time.perf_counter() - started
            for row, prompt in enumerate(batch):
                new = out.sequences[row, width:].tolist()
                stop = next((i for i, t in enumerate(new) if t in eos), None)
                new = new if stop is None else new[:stop + 1]  # what follows the end of sequence is padding
                logprobs = self._token_logprobs(out.scores, row, new)
                results.append(Generation(
                    text=self.tokenizer.decode(new, skip_special_tokens=True).strip(), input_tokens=len(prompt),
                    output_tokens=len(new), seconds=seconds, finish_reason="stop" if stop is not None else "length",
                    mean_logprob=_mean(logprobs), token_ids=tuple(new), token_logprobs=logprobs))
        return results

    @contextlib.contextmanager
    def _threads(self):
        """torch on `num_threads` threads for the duration (restored after)."""
        previous = self._torch.get_num_threads()
        self._torch.set_num_threads(self.num_threads)
        try:
            yield
        finally:
            self._torch.set_num_threads(previous)

    def _decode(self, ids, mask, max_new_tokens: int, temperature: float, seed: int | None, pad: int,
                criteria=None, cache=None):
        """model.generate on `num_threads` threads (restored after): greedy, or seeded sampling when temperature >
        0; the caller holds the lock and inference mode. criteria: a StoppingCriteria checked after every token.
        cache: the KV cache of the prompt's first tokens (_prefill), or None."""
        torch = self._torch
        with self._threads():
            kwargs = {"max_new_tokens": max_new_tokens, "do_sample": temperature > 0, "pad_token_id": pad}
            if cache is not None:
                kwargs["cache"] = cache
            if temperature > 0:
                kwargs["temperature"] = temperature
                torch.manual_seed(0 if seed is None else seed)
            else:
                kwargs.update(temperature=None, top_p=None, top_k=None)
            if criteria is not None:
                from transformers import StoppingCriteriaList

                kwargs["stopping_criteria"] = StoppingCriteriaList([criteria])
            return self.model.generate(ids, attention_mask=mask, output_scores=True, return_dict_in_generate=True,
                                       **kwargs)

    def _eos_ids(self) -> set:
        eos = self.model.generation_config.eos_token_id
        return set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()

    def _token_logprobs(self, scores, row: int, new: list[int]) -> tuple[float, ...]:
        """Log-probability of each generated token of one row under generate()'s processed scores."""
        torch = self._torch
        return tuple(float(torch.log_softmax(s[row].float(), -1)[t]) for s, t in zip(scores, new))

    def prefix_tokens(self, token_ids, text: str) -> int:
        """How many of the leading generated tokens it takes to write `text` (a prefix of their decoded text, white
        space aside): the tokens a kept piece of a generation was written with."""
        want = len(text.strip())
        for n in range(len(token_ids) + 1):
            if len(self.tokenizer.decode(list(token_ids[:n]), skip_special_tokens=True).strip()) >= want:
                return n
        return len(token_ids)

    def _recording(self, prompt_len: int, spans):
        if spans is None:
            return contextlib.nullcontext()
        from certrag.certify.lookback import Recording, record_into, register

        if self.model.config._attn_implementation != register():
            raise RuntimeError(f"record_lookback needs the model's attention to be the recorder's; it is "
                               f"{self.model.config._attn_implementation!r} (load the model with SDPA attention)")
        return record_into(Recording(prompt_len, spans, self.model.config.num_hidden_layers))

    def _passage_spans(self, messages: list[dict], ids: list[int]) -> list[tuple[int, int]]:
        """Token spans of the <passage> contents in the prompt (see certrag.certify.lookback.passage_token_spans)."""
        from certrag.certify.lookback import passage_token_spans

        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        if list(enc["input_ids"]) != ids:
            raise RuntimeError("the chat template's tokens differ from the rendered prompt's: cannot place passages")
        return passage_token_spans(text, [tuple(o) for o in enc["offset_mapping"]])
