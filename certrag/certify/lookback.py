"""Lookback ratios recorded during generation, without attention matrices and without output_attentions.

Definitions (Lookback Lens, Chuang et al. 2024; chunk-wise variant of the certification paper; DESIGN.md): at a
decode step, for layer l and head h with attention weights a_j over the cached positions, A(S) = mean_{j in S} a_j.
  full-context ratio   LR = A(prompt) / (A(prompt) + A(new))
  chunk-wise ratio     A(chunks) / (A(chunks) + A(new))   (the retrieved chunks' tokens only: the system prompt and
                       the question are left out)
  per chunk i          A(chunk_i) / (A(chunk_i) + A(new))
where `new` is the generated tokens so far. Steps are the decode calls (query length 1), whose input is a generated
token, so `new` always holds at least that token; a T-token answer gives T - 1 steps. Features are the ratios
averaged over the steps, one per (layer, head).

How: an attention function registered with transformers' AttentionInterface under the name "certrag_lookback"
receives every attention call of generate(). It delegates the output to transformers' SDPA function (so recording
changes no token) and, on decode calls, computes the span masses sum_{j in S} a_j for the spans [prompt, new,
chunk_1..chunk_n]: on the CPU with one grouped-query matmul, a softmax and a sum per span (span_masses); on CUDA
with the Triton kernel (certrag.kernels.lookback); with recording(fused_output=True) the output comes from the same
pass as the masses instead of from SDPA. On CUDA the masses stay on the device until read; graph_decode decodes with
a static cache and replays each step from a CUDA graph, recording inside it.
"""

from __future__ import annotations

import contextlib
import re
import threading
from dataclasses import dataclass

import numpy as np

ATTENTION_NAME = "certrag_lookback"
_state = threading.local()
_registered = False


def span_masses(q, k, starts, ends, scale: float, attention_mask=None, v=None):
    """sum of softmax weights over each span, for one query row per head: float32 (B, Hq, S); with v (B, Hkv, L, D)
    also the attention output from the same weights, (masses, out (B, Hq, D) in q's dtype).

    q: (B, Hq, D); k: (B, Hkv, L, D) with Hq % Hkv == 0; starts / ends: (S,) or (B, S) with 0 <= start <= end <= L;
    attention_mask: optional additive float or boolean (keep = True) mask broadcastable to (B, 1, L).

    One grouped matmul (the scale folded into q), one fused softmax, then each span summed over its own slice: a
    span's mass is added up from its own weights only (torch's pairwise summation), so a short span late in a long
    cache keeps its precision without the float64 cumulative sum an earlier version needed (and at a third of the
    time: it is what recording costs per layer)."""
    import torch

    B, HQ, D = q.shape
    HKV, L = k.shape[1], k.shape[2]
    group = HQ // HKV
    s = torch.matmul(q.reshape(B, HKV, group, D).float() * scale, k.float().transpose(-1, -2))  # (B, Hkv, G, L)
    s = s.reshape(B, HQ, L)
    if attention_mask is not None:
        m = attention_mask.reshape(B, -1, attention_mask.shape[-1])[..., :L]
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.float()
    w = torch.softmax(s, dim=-1)
    starts = torch.as_tensor(starts).cpu()
    ends = torch.as_tensor(ends).cpu()
    if starts.numel() == 0:
        masses = w.new_zeros(B, HQ, 0)
    else:
        if starts.dim() == 2 and bool((starts == starts[:1]).all() and (ends == ends[:1]).all()):
            starts, ends = starts[0], ends[0]  # the same spans for every sequence
        if starts.dim() == 1:
            masses = torch.stack([w[..., a:b].sum(-1) for a, b in zip(starts.tolist(), ends.tolist())], dim=-1)
        else:
            masses = torch.stack([torch.stack([w[i, :, a:b].sum(-1) for a, b in zip(starts[i].tolist(),
                                                                                  ends[i].tolist())], -1)
                                  for i in range(B)])
    if v is None:
        return masses
    out = torch.matmul(w.reshape(B, HKV, group, L), v.float())  # (B, Hkv, G, D)
    return masses, out.reshape(B, HQ, D).to(q.dtype)


def _lookback_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rec = getattr(_state, "recording", None)
    if rec is None or query.shape[2] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.shape[0] != 1:  # a Recording holds one sequence's steps: never keep one row and drop the others
        raise ValueError(f"recording lookback ratios needs one sequence per generation; got a batch of "
                         f"{query.shape[0]}")
    L = key.shape[2]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q = query[:, :, 0, :]
    # The kernel takes the valid cache length from rec.kv_len (a static cache, where the mask only hides the
    # buffer's unfilled end) or attends to the whole cache (no mask); any other mask goes the torch way.
    if query.is_cuda and rec.use_kernel and (attention_mask is None or rec.kv_len is not None):
        from certrag.kernels.lookback import lookback_attention

        starts, ends = rec.device_spans(query.device)  # valid by construction: no check, no device sync
        out, _ = lookback_attention(q, key, value, starts, ends, scale, check_spans=False,
                                    with_output=rec.fused_output, kv_len=rec.kv_len,
                                    mass=rec.slot(module.layer_idx, query.shape[1]), workspace=rec.workspace)
        if out is not None:
            return out[:, None, :, :], None  # (B, 1, Hq, D): transformers' (batch, q_len, heads, dim)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    starts, ends = rec.spans(L, None if not query.is_cuda else query.device)
    if rec.fused_output and dropout == 0.0:  # one pass: the output from the weights the masses come from
        mass, out = span_masses(q, key, starts, ends, scale, attention_mask, v=value)
        rec.add(module.layer_idx, mass)
        return out[:, None, :, :], None  # (B, 1, Hq, D): transformers' (batch, q_len, heads, dim)
    out = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                 **kwargs)
    rec.add(module.layer_idx, span_masses(q, key, starts, ends, scale, attention_mask))
    return out


def register() -> str:
    """Registers the recording attention with transformers (once) and returns its name."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTENTION_NAME, _lookback_attention)
        try:  # the causal-mask builder for a custom name: the same masks SDPA gets
            from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

            AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
        except ImportError:
            pass
        _registered = True
    return ATTENTION_NAME


class Recording:
    """Span masses per decode step: masses[step] is float32 (layers, Hq, 2 + n_chunks) for the spans
    [prompt, new, chunk_1 .. chunk_n], and kv_lengths[step] the cache length at that step.

    On CUDA with the kernel, each layer's masses are written by the kernel straight into a slot of a device buffer
    (blocks of STEPS_PER_BLOCK steps), and nothing reaches the host until masses or finish() is read: no
    synchronisation per step, so the host runs ahead of the GPU as in plain decoding. For a decode step captured in a
    CUDA graph (graph_decode), the driver sets kv_len (the valid cache length, on the device) and static (one
    step's slots at fixed addresses), and calls commit() after each replay."""

    STEPS_PER_BLOCK = 64

    def __init__(self, prompt_len: int, chunk_spans: list[tuple[int, int]], num_layers: int,
                 use_kernel: bool = True, fused_output: bool = False) -> None:
        import torch

        for a, b in chunk_spans:
            if not 0 <= a <= b <= prompt_len:
                raise ValueError(f"chunk span ({a}, {b}) must lie inside the prompt (0..{prompt_len})")
        self.prompt_len = prompt_len
        self.chunk_spans = list(chunk_spans)
        self.num_layers = num_layers
        self.use_kernel = use_kernel
        self.fused_output = fused_output
        self._starts = torch.tensor([0, prompt_len] + [a for a, _ in chunk_spans], dtype=torch.long)
        self._ends_fixed = torch.tensor([prompt_len, 0] + [b for _, b in chunk_spans], dtype=torch.long)
        self._step: dict[int, object] = {}
        self._spans_at = (-1, None)
        self._host: list[np.ndarray] = []  # steps recorded on the host (the torch path)
        self._device_spans = None
        self._blocks: list = []  # device steps: (STEPS_PER_BLOCK, layers, 1, Hq, S) float32 each
        self._device_steps = 0
        self._seen: set[int] = set()
        self._pulled: list[np.ndarray] = []  # device steps already copied to the host
        self.workspace = None  # certrag.kernels.lookback.Workspace, made on the first kernel call
        self.kv_len = None  # int32 (1,) on the device: the valid cache length, set by a graph-capturing driver
        self.static = None  # (layers, 1, Hq, S) float32 on the device: a captured step's slots, set by that driver

    def spans(self, kv_len: int, device=None):
        """(starts, ends) at a cache length, on a device (default: the CPU); built once per decode step, shared by
        its layers."""
        if self._spans_at[0] != (kv_len, device):
            import torch

            ends = self._ends_fixed.clone()
            ends[1] = kv_len
            starts = self._starts
            if device is not None:
                starts = starts.to(device, torch.int32)
                ends = ends.to(device, torch.int32)
            self._spans_at = ((kv_len, device), (starts, ends))
        return self._spans_at[1]

    def device_spans(self, device):
        """int32 (1, S) spans on the device for the kernel, made once: the span of new tokens ends at 2^31 - 1,
        since the kernel never reads past the valid cache length anyway."""
        if self._device_spans is None:
            import torch

            ends = self._ends_fixed.clone()
            ends[1] = 2**31 - 1
            self._device_spans = (self._starts.to(device, torch.int32)[None].contiguous(),
                                  ends.to(device, torch.int32)[None].contiguous())
            from certrag.kernels.lookback import Workspace

            self.workspace = Workspace()
        return self._device_spans

    def slot(self, layer: int, heads: int):
        """Where the kernel writes this layer's masses for the current step: float32 (1, heads, S) on the device."""
        if self.static is not None:
            return self.static[layer]
        if layer in self._seen:  # a layer seen twice: the previous step is complete
            self._advance()
        view = self._current(heads)[layer]
        self._seen.add(layer)
        if len(self._seen) == self.num_layers:
            self._advance()
        return view

    def _current(self, heads: int):
        """The current device step's (layers, 1, heads, S) slots, a new block of steps when the last is full."""
        if self._device_steps == len(self._blocks) * self.STEPS_PER_BLOCK:
            import torch

            starts = self._device_spans[0]
            self._blocks.append(torch.empty(self.STEPS_PER_BLOCK, self.num_layers, 1, heads, starts.shape[1],
                                            dtype=torch.float32, device=starts.device))
        return self._blocks[-1][self._device_steps % self.STEPS_PER_BLOCK]

    def _advance(self) -> None:
        self._device_steps += 1
        self._seen = set()

    def commit(self) -> None:
        """After a captured step's replay: its masses (in static) become the next recorded step (a device copy,
        queued like the replay: no synchronisation)."""
        self._current(self.static.shape[2]).copy_(self.static)
        self._advance()

    @property
    def steps(self) -> int:
        """Completed steps so far (none is copied to the host)."""
        self._flush()
        return len(self._host) + self._device_steps

    def truncate(self, steps: int) -> None:
        """Keeps the first `steps` completed steps (a decoder that ran past its end token drops the rest)."""
        self._flush()
        self._host = self._host[:steps]
        self._device_steps = min(self._device_steps, max(0, steps - len(self._host)))
        self._pulled = self._pulled[:self._device_steps]
        self._seen = set()

    def add(self, layer: int, mass) -> None:
        if layer in self._step:  # a layer seen twice: the previous step is complete
            self._flush()
        self._step[layer] = mass[0].detach()  # batch 1; to numpy once per step
        if len(self._step) == self.num_layers:
            self._flush()

    def _flush(self) -> None:
        if self._step:
            import torch

            layers = sorted(self._step)
            self._host.append(torch.stack([self._step[i] for i in layers]).float().cpu().numpy())
            self._step = {}

    @property
    def masses(self) -> list[np.ndarray]:
        """float32 (layers, Hq, S) per completed step (device steps are copied to the host here, once)."""
        self._flush()
        done = self._device_steps
        if len(self._pulled) < done:
            import torch

            flat = torch.cat(self._blocks)[len(self._pulled):done, :, 0].cpu().numpy()
            self._pulled.extend(list(flat))
        return self._host + self._pulled

    @property
    def kv_lengths(self) -> list[int]:
        return [self.prompt_len + i + 1 for i in range(len(self.masses))]

    def finish(self) -> "LookbackFeatures":
        return lookback_features(self.masses, self.prompt_len, self.chunk_spans)


@dataclass(frozen=True)
class LookbackFeatures:
    """Ratios averaged over the answer's decode steps. full, chunks: float32 (layers, heads); per_chunk:
    (n_chunks, layers, heads); NaN where undefined (no steps, or no chunk tokens)."""

    steps: int
    full: np.ndarray
    chunks: np.ndarray
    per_chunk: np.ndarray
    prompt_len: int
    chunk_spans: tuple[tuple[int, int], ...]

    def vector(self, kind: str = "chunks") -> np.ndarray:
        if kind not in ("full", "chunks"):
            raise ValueError(f"kind must be 'full' or 'chunks'; got {kind!r}")
        return getattr(self, kind).ravel()


def ratios_from_masses(masses: np.ndarray, prompt_len: int, chunk_spans: list[tuple[int, int]]) -> dict:
    """Per-step ratios from span masses (steps, layers, heads, 2 + n_chunks) in the [prompt, new, chunks...] order;
    step t (0-based) has prompt_len + t + 1 cached positions, so |new| = t + 1."""
    masses = np.asarray(masses, dtype=np.float64)
    steps = masses.shape[0]
    new_len = np.arange(1, steps + 1, dtype=np.float64)[:, None, None]
    a_new = masses[..., 1] / new_len
    a_prompt = masses[..., 0] / max(prompt_len, 1)
    lens = np.array([b - a for a, b in chunk_spans], dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        full = a_prompt / (a_prompt + a_new)
        if len(chunk_spans) and lens.sum() > 0:
            a_chunks = masses[..., 2:].sum(-1) / lens.sum()
            chunks = a_chunks / (a_chunks + a_new)
            a_each = masses[..., 2:] / np.where(lens > 0, lens, np.nan)
            per_chunk = a_each / (a_each + a_new[..., None])
        else:
            chunks = np.full_like(full, np.nan)
            per_chunk = np.full(full.shape + (len(chunk_spans),), np.nan)
    return {"full": full, "chunks": chunks, "per_chunk": per_chunk}


def lookback_features(masses: list[np.ndarray], prompt_len: int, chunk_spans: list[tuple[int, int]]
                      ) -> LookbackFeatures:
    if not masses:
        nan = np.full((0, 0), np.nan, dtype=np.float32)
        return LookbackFeatures(steps=0, full=nan, chunks=nan, per_chunk=np.zeros((len(chunk_spans), 0, 0)),
                                prompt_len=prompt_len, chunk_spans=tuple(chunk_spans))
    r = ratios_from_masses(np.stack(masses), prompt_len, chunk_spans)
    with np.errstate(invalid="ignore"):
        per_chunk = np.moveaxis(r["per_chunk"].mean(0), -1, 0)
    return LookbackFeatures(steps=len(masses), full=r["full"].mean(0).astype(np.float32),
                            chunks=r["chunks"].mean(0).astype(np.float32), per_chunk=per_chunk.astype(np.float32),
                            prompt_len=prompt_len, chunk_spans=tuple(chunk_spans))


@contextlib.contextmanager
def record_into(rec: Recording):
    """Within the block, decode calls of any model whose attention implementation is the recorder's (register())
    and that run on this thread add their span masses to rec. Only this thread's state changes: a model that
    already uses the recorder needs nothing set or restored on it, and other threads' generations are untouched."""
    previous = getattr(_state, "recording", None)
    _state.recording = rec
    try:
        yield rec
    finally:
        _state.recording = previous


@contextlib.contextmanager
def recording(model, prompt_len: int, chunk_spans: list[tuple[int, int]], *, use_kernel: bool = True,
              fused_output: bool = False):
    """Within the block, model's attention records span masses on every decode step into the yielded Recording
    (this thread only). The model's attention implementation is restored afterwards.

    The output comes from SDPA, so the tokens are plain generation's, and the masses from a second read of the keys:
    the Triton kernel on CUDA (use_kernel=False: torch, as on the CPU), span_masses on the CPU. fused_output=True
    takes the output from the pass that computes the masses instead (the kernel's on CUDA, the same softmax
    weights times V on the CPU): one read of the cache instead of two, but its float rounding differs from SDPA's,
    so a near tie between two tokens can go the other way."""
    name = register()
    previous = model.config._attn_implementation
    rec = Recording(prompt_len, chunk_spans, model.config.num_hidden_layers, use_kernel=use_kernel,
                    fused_output=fused_output)
    model.set_attn_implementation(name)
    try:
        with record_into(rec):
            yield rec
    finally:
        model.set_attn_implementation(previous)


def graph_decode(model, input_ids, max_new_tokens: int, *, eos_token_id=None, check_every: int = 16,
                 rec: Recording | None = None, capture: bool = True, stats: dict | None = None):
    """Greedy decoding of up to max_new_tokens tokens for one sequence with a static KV cache,
    every decode step after the first replayed from one CUDA graph (capture=True on CUDA): the host launches one
    graph per token instead of every layer's kernels, so decoding runs at the GPU's speed rather than Python's.
    With rec (what recording() yields), the kernel records each step's span masses into rec's device buffers, inside
    the graph; the tokens are those of the same steps run eagerly (capture=False, any device: the reference).

    eos_token_id (an id or several): decoding stops at the first of them, kept as the last token, as generate
    does; the host looks for it every check_every tokens (one synchronisation each), so up to check_every - 1 steps
    past it are computed and dropped, with their recorded masses. rec defaults to the recording active on this
    thread (inside `with recording(model, ...)`), if any.
    Returns int64 (1, T) on the model's device, T <= max_new_tokens. stats, if given, receives "steps" and "seconds": the
    replayed (or, eagerly, the third and later) steps and their wall time, synchronised at both ends.
    Models with sliding-window layers are refused (their masks differ per layer)."""
    import inspect
    import time

    import torch
    from transformers import StaticCache

    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be a (1, prompt_len) tensor; got {getattr(input_ids, 'shape', input_ids)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1; got {max_new_tokens}")
    if check_every < 1:
        raise ValueError(f"check_every must be at least 1; got {check_every}")
    kinds = set(getattr(model.config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        raise ValueError(f"graph_decode needs full attention in every layer; this model has {sorted(kinds)}")
    if rec is None:
        rec = getattr(_state, "recording", None)
    dev = input_ids.device
    capture = capture and dev.type == "cuda"
    on_kernel = rec is not None and dev.type == "cuda" and rec.use_kernel
    if capture and rec is not None and not rec.use_kernel:
        raise ValueError("a captured graph records through the kernel only: use_kernel=False needs capture=False")
    P, total = input_ids.shape[1], input_ids.shape[1] + max_new_tokens
    cache = StaticCache(config=model.config, max_cache_len=total)
    # transformers 5.24 renamed the cache argument from past_key_values to cache
    cache_kw = {"cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values": cache}
    positions = torch.arange(total, device=dev)
    mask = torch.zeros(1, 1, 1, total, dtype=torch.bool, device=dev)  # the static buffer's valid prefix
    pos = torch.full((1,), P, dtype=torch.long, device=dev)
    kv_len = torch.full((1,), P + 1, dtype=torch.int32, device=dev)
    tokens = torch.empty(1, max_new_tokens, dtype=torch.long, device=dev)
    eos = None if eos_token_id is None else torch.tensor(
        [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id), dtype=torch.long, device=dev)
    checked = 0  # tokens[:, :checked] hold no end token
    recorded_before = rec.steps if rec is not None else 0

    def end_at(t: int):
        """The index of the first end token among tokens[:, :t + 1], None if none (a host synchronisation)."""
        nonlocal checked
        if eos is None:
            return None
        hits = torch.isin(tokens[0, checked:t + 1], eos).nonzero()
        if len(hits):
            return checked + int(hits[0, 0])
        checked = t + 1
        return None

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    with torch.inference_mode():
        logits = model(input_ids, use_cache=True, logits_to_keep=1, **cache_kw).logits
        tokens[:, 0] = logits[:, -1].argmax(-1)
        tok = tokens[:, :1].clone()
        if on_kernel:  # the kernel writes each layer's masses into static; keep() commits them as a step
            rec.device_spans(dev)
            rec.kv_len = kv_len
            rec.static = torch.empty(model.config.num_hidden_layers, 1, model.config.num_attention_heads,
                                     2 + len(rec.chunk_spans), dtype=torch.float32, device=dev)

        def step():  # everything on the device: a graph replays it as it is
            kv_len.copy_(pos + 1)
            torch.le(positions, pos, out=mask[0, 0, 0])
            out = model(tok, attention_mask={"full_attention": mask}, position_ids=pos[None], use_cache=True,
                        logits_to_keep=1, **cache_kw)
            tok.copy_(out.logits[:, -1].argmax(-1, keepdim=True))
            pos.add_(1)

        def keep(t):
            tokens[:, t:t + 1].copy_(tok)
            if on_kernel:
                rec.commit()  # (the torch path adds each step's masses itself)

        try:
            first, graph, end = 1, None, end_at(0)
            if end is not None:
                max_new_tokens = 1  # the first token ends it: no decode step
            if capture and max_new_tokens > 2:
                side = torch.cuda.Stream(dev)
                side.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(side):  # the first decode step, run for real: compiles, sizes the buffers
                    step()
                torch.cuda.current_stream(dev).wait_stream(side)
                keep(1)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):  # recorded, not run
                    step()
                first = 2
            t0, timed_from, done = None, max(first, 2), max_new_tokens
            for t in range(first, max_new_tokens):
                if t == timed_from:
                    sync()
                    t0 = time.perf_counter()
                graph.replay() if graph is not None else step()
                keep(t)
                if end is None and ((t + 1) % check_every == 0 or t == max_new_tokens - 1):
                    end = end_at(t)
                    if end is not None:
                        done = t + 1
                        break
            sync()
            if stats is not None:
                stats["steps"] = max(0, done - timed_from)
                stats["seconds"] = time.perf_counter() - t0 if t0 is not None else 0.0
        finally:
            if on_kernel:
                rec.kv_len = rec.static = None
    if end is None:
        return tokens
    if rec is not None:  # generate records a step per token after the first, up to the end token
        rec.truncate(recorded_before + end)
    return tokens[:, :end + 1]


_PASSAGE = re.compile(r"<passage[^>]*>\n(.*?)\n</passage>", re.DOTALL)


def passage_token_spans(text: str, offsets: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Token spans [start, end) of the contents of each <passage> element in a rendered prompt, from the tokenizer's
    character offsets: a token belongs to a passage when it overlaps the passage's characters."""
    spans = []
    for m in _PASSAGE.finditer(text):
        a, b = m.span(1)
        toks = [i for i, (s, e) in enumerate(offsets) if e > a and s < b]
        spans.append((toks[0], toks[-1] + 1) if toks else (0, 0))
    return spans
