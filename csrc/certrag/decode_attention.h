// One decode step's attention for a batch of sequences, each over its own KV cache, in one call per layer
// (grouped-query: heads / kv_heads query heads share a key-value head). It also writes the step's new key and value
// into each cache and, for recording rows, sums the attention weights over spans of positions (the lookback
// recorder's masses), from the very weights the output is made of.
//
// Batch invariance: a row's output depends on its own query and cache only, computed in a fixed order whatever
// rows share the call and however many threads run it.
#pragma once

#include <cstddef>
#include <cstdint>

namespace certrag {

struct AttentionRow {
  float* k;                           // this layer's keys of the sequence: (kv_heads, capacity, head_dim)
  float* v;                           // its values, the same shape
  std::size_t capacity = 0;           // the sequence's cache positions
  std::size_t length = 0;             // positions attended to, the new one (at length - 1) included
  const std::int64_t* spans = nullptr;  // n_spans [begin, end) pairs of positions, or null
  std::size_t n_spans = 0;
  float* masses = nullptr;            // (heads, n_spans): the weights summed over each span, when spans is set
};

struct AttentionShape {
  std::size_t heads, kv_heads, head_dim;
};

// q (B, heads, head_dim) and k_new, v_new (B, kv_heads, head_dim): row b's new key and value are written at
// position length - 1 of its cache first. out (B, heads * head_dim) = softmax(q k^T * scale) v per head.
void decode_attention(const AttentionShape& shape, std::size_t B, const float* q, const float* k_new,
                      const float* v_new, const AttentionRow* rows, float scale, float* out, int num_threads);

// The kernel decode_attention runs for this head size on this CPU (capped by CERTRAG_SIMD): "avx512" (head_dim a
// multiple of 16), "avx2" (a multiple of 8; AVX2 + FMA) or "scalar", each up to head_dim 256.
const char* decode_attention_kernel(std::size_t head_dim);

}  // namespace certrag
