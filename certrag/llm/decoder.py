"""The forward passes of a Qwen2 / Llama decoder, owned by certrag: prefill of one sequence's prompt chunk, and one
decode step for a batch of sequences, each with its own KV cache.

Batch invariance is by construction, not by tolerance: the matrix products go through the q8 kernel, whose outputs
are computed the same way whatever rows share a call; norms, rotary embeddings and activations are row-wise; and
attention runs per sequence over that sequence's own cache. So a sequence's logits do not depend on what it is
decoded beside (tests/llm/test_decode_engine.py checks tokens and logits bit for bit). The float32 format's products
go through torch's GEMM, which promises no such thing: it is the quality reference, not the served path.

Attention at decode is one native call per layer for the whole batch (certrag._core.decode_attention: scores,
softmax, weights times values, per sequence over its own cache), so the lookback recorder reads the very weights
the output is made from: a recording row's weights are summed over its spans inside the same call, which changes no
token and costs a pass over the weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from certrag.llm.weights import DecoderWeights


@dataclass
class KVCache:
    """One sequence's keys and values: (layers, kv_heads, capacity, head_dim) float32 each, filled to `length`."""

    k: object
    v: object
    length: int = 0

    @classmethod
    def allocate(cls, weights: DecoderWeights, capacity: int) -> "KVCache":
        import torch

        c = weights.config
        shape = (c.layers, c.kv_heads, capacity, c.head_dim)
        return cls(k=torch.empty(shape), v=torch.empty(shape))

    @property
    def capacity(self) -> int:
        return self.k.shape[2]


@dataclass
class Spans:
    """What a recording sequence's decode steps measure: the masses of [prompt, new, chunk_1..n] per (layer, head).
    masses[step] is float32 (layers, heads, 2 + n_chunks), as certrag.certify.lookback.Recording keeps them."""

    prompt_len: int
    chunks: list[tuple[int, int]]
    masses: list[np.ndarray] = field(default_factory=list)

    def bounds(self, length: int) -> np.ndarray:
        """int64 (2 + n_chunks, 2): span s covers positions [begin, end) at this cache length (the prompt, the new
        tokens, each chunk)."""
        rows = [(0, self.prompt_len), (self.prompt_len, length)] + [(a, b) for a, b in self.chunks]
        return np.asarray(rows, dtype=np.int64).reshape(-1, 2)


class Decoder:
    """The model's arithmetic over DecoderWeights; holds no per-sequence state (that is each sequence's KVCache)."""

    def __init__(self, weights: DecoderWeights, *, num_threads: int = 1) -> None:
        import torch

        self.w = weights
        self.c = weights.config
        self.num_threads = num_threads
        self._torch = torch
        half = self.c.head_dim // 2
        inv = 1.0 / (self.c.rope_theta ** (torch.arange(0, half, dtype=torch.float64) / half))
        self._inv_freq = inv  # angles are made per position in float64, then rounded once, as transformers does
        self._rope_cache: tuple[int, object, object] = (0, None, None)

    # -- building blocks ------------------------------------------------------------------------------------------

    def _rms(self, x, weight):
        torch = self._torch
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + self.c.rms_eps) * weight

    def _cos_sin(self, positions):
        """cos, sin (len(positions), head_dim / 2) float32 for integer positions."""
        torch = self._torch
        need = int(positions.max()) + 1
        n, cos, sin = self._rope_cache
        if need > n:
            n = max(need, 2 * n, 512)
            ang = torch.arange(n, dtype=torch.float64)[:, None] * self._inv_freq[None, :]
            cos, sin = ang.cos().float(), ang.sin().float()
            self._rope_cache = (n, cos, sin)
        return cos[positions], sin[positions]

    def _rope(self, x, cos, sin):
        """x (T, heads, head_dim) rotated at its rows' positions (cos / sin: (T, head_dim / 2))."""
        torch = self._torch
        cos, sin = cos[:, None, :], sin[:, None, :]
        if self.c.rope_pairs == "halves":
            h = x.shape[-1] // 2
            a, b = x[..., :h], x[..., h:]
            return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)

    def _qkv(self, layer, h, cos, sin):
        c = self.c
        qkv = layer.qkv(h, self.num_threads)
        if layer.qkv_bias is not None:
            qkv = qkv + layer.qkv_bias
        nq, nk = c.heads * c.head_dim, c.kv_heads * c.head_dim
        T = h.shape[0]
        q = qkv[:, :nq].reshape(T, c.heads, c.head_dim)
        k = qkv[:, nq:nq + nk].reshape(T, c.kv_heads, c.head_dim)
        v = qkv[:, nq + nk:].reshape(T, c.kv_heads, c.head_dim)
        return self._rope(q, cos, sin), self._rope(k, cos, sin), v

    def _mlp(self, layer, x):
        torch = self._torch
        h = self._rms(x, layer.ffn_norm)
        gu = layer.gate_up(h.contiguous(), self.num_threads)
        gate, up = gu[:, :self.c.ffn], gu[:, self.c.ffn:]
        return x + layer.down((torch.nn.functional.silu(gate) * up).contiguous(), self.num_threads)

    def logits(self, hidden):
        """hidden (M, hidden) after the last layer -> float32 logits (M, vocab)."""
        return self.w.head(self._rms(hidden, self.w.final_norm).contiguous(), self.num_threads)

    # -- prefill ------------------------------------------------------------------------------------------------

    def prefill(self, cache: KVCache, ids: list[int]):
        """Appends ids (one chunk of one sequence's prompt) to its cache; returns the last position's hidden state
        (1, hidden). Positions continue from cache.length."""
        torch = self._torch
        c = self.c
        start, T = cache.length, len(ids)
        end = start + T
        if end > cache.capacity:
            raise ValueError(f"the cache holds {cache.capacity} positions; {end} asked for")
        positions = torch.arange(start, end)
        x = self.w.embed.rows(ids)
        group = c.heads // c.kv_heads
        # query t (absolute position start + t) sees keys 0 .. start + t
        mask = torch.ones(T, end, dtype=torch.bool).tril(diagonal=start)
        cos, sin = self._cos_sin(positions)  # the rotation of every position, once for all layers
        for i, layer in enumerate(self.w.layers):
            h = self._rms(x, layer.attn_norm).contiguous()
            q, k, v = self._qkv(layer, h, cos, sin)
            cache.k[i, :, start:end] = k.transpose(0, 1)
            cache.v[i, :, start:end] = v.transpose(0, 1)
            # grouped-query attention over the cache as it is (no copy of the keys per query head)
            att = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1)[None], cache.k[i, :, :end][None], cache.v[i, :, :end][None], attn_mask=mask,
                enable_gqa=group > 1)
            att = att[0].transpose(0, 1).reshape(T, c.heads * c.head_dim).contiguous()
            x = x + layer.o(att, self.num_threads)
            x = self._mlp(layer, x)
        cache.length = end
        return x[-1:]

    # -- decode ---------------------------------------------------------------------------------------------------

    def decode(self, caches: list[KVCache], ids: list[int], spans: list[Spans | None]):
        """One step for a batch: sequence r's token ids[r] goes in at position caches[r].length. Returns float32
        logits (B, vocab). For a row with spans, the step's span masses are appended to spans[r].masses."""
        from certrag import _core

        torch = self._torch
        c = self.c
        positions = torch.tensor([cache.length for cache in caches])
        if any(cache.length >= cache.capacity for cache in caches):
            raise ValueError("a sequence's cache is full")
        x = self.w.embed.rows(ids)
        scale = 1.0 / math.sqrt(c.head_dim)
        lengths = [cache.length + 1 for cache in caches]
        k_caches = [cache.k.numpy() for cache in caches]
        v_caches = [cache.v.numpy() for cache in caches]
        bounds = [s.bounds(n) if s is not None else None for s, n in zip(spans, lengths)]
        step_masses = [[] if s is not None else None for s in spans]
        cos, sin = self._cos_sin(positions)
        for i, layer in enumerate(self.w.layers):
            h = self._rms(x, layer.attn_norm).contiguous()
            q, k, v = self._qkv(layer, h, cos, sin)
            # every sequence's attention over its own cache in one native call (which also writes the new key and
            # value, and sums the recording rows' weights over their spans)
            out, masses = _core.decode_attention(
                q.contiguous().numpy(), k.contiguous().numpy(), v.contiguous().numpy(), k_caches, v_caches, i,
                lengths, bounds, scale, self.num_threads)
            for r, m in enumerate(masses):
                if m is not None:
                    step_masses[r].append(m)
            x = x + layer.o(torch.from_numpy(out), self.num_threads)
            x = self._mlp(layer, x)
        for r, cache in enumerate(caches):
            cache.length = lengths[r]
            if step_masses[r] is not None:
                spans[r].masses.append(np.stack(step_masses[r]))
        return self.logits(x)
