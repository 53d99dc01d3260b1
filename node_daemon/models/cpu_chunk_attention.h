// Prefill-chunk attention over the paged KV cache with AVX512-BF16 dot products (and an AVX2 form below, in float32,
// for the tiers without them); included by cpu_decode.cpp inside
// its anonymous namespace (it uses bf2f, f2bf and exp_inplace from there, and the headers it includes).
//
// Why: ATen's flash attention for the CPU ran a chunk at 55-100 GFLOP/s here (a 256-token chunk over a 1,024-token
// prefix: 9 ms a layer, as long as the chunk's projections), and it computes every (query, key) pair of a causal
// chunk, masked ones too. This kernel gathers each kv head's keys and values once per layer into the pair-
// interleaved layout vdpbf16ps reads (so the group's query heads share them), lets each block of query rows stop at
// its last visible key, and rounds as the flash kernel does: scores and the softmax in float32, the unnormalised
// probabilities rounded to bfloat16 for the product with V (accumulated in float32), divided by their float32 sum
// at the end.
#pragma once

#if defined(__AVX512BF16__)
#define STALLFREE_CHUNK_KERNEL 1
constexpr const char* kChunkAttentionKernel = "avx512_bf16";

constexpr int64_t kKeyBlock = 16;   // keys per zmm of scores
constexpr int64_t kKeyPad = 32;     // keys are padded to this: the score loop takes two key blocks at a time
constexpr int64_t kQueryRows = 16;  // query rows per task (times the group's heads)
constexpr int64_t kVecs = 4;        // query vectors per pass (their accumulators stay in registers)

// Keys of one kv head, [key block][dim pair][16 keys] as bf16 pairs; values [key pair][dim] as bf16 pairs
// (keys 2s and 2s + 1); keys past the sequence zero.
struct PackedKV {
  std::vector<uint32_t> k, v;
  int64_t padded = 0;  // keys rounded up to kKeyBlock
};

inline void pack_kv(const uint16_t* kh, const uint16_t* vh, const int64_t* gather, int64_t keys, int64_t D,
                    PackedKV& out) {
  const int64_t pairs = D / 2, padded = (keys + kKeyPad - 1) / kKeyPad * kKeyPad;
  out.padded = padded;
  out.k.resize(padded * pairs);
  out.v.resize(padded / 2 * D);
  for (int64_t t = 0; t < padded; ++t) {
    uint32_t* dst = out.k.data() + (t / kKeyBlock) * pairs * kKeyBlock + t % kKeyBlock;
    if (t < keys) {
      const uint32_t* row = reinterpret_cast<const uint32_t*>(kh + gather[t] * D);
      for (int64_t p = 0; p < pairs; ++p) dst[p * kKeyBlock] = row[p];
    } else {
      for (int64_t p = 0; p < pairs; ++p) dst[p * kKeyBlock] = 0;
    }
  }
  for (int64_t s = 0; s < padded / 2; ++s) {
    uint32_t* dst = out.v.data() + s * D;
    const int64_t t0 = 2 * s, t1 = 2 * s + 1;
    const uint16_t* a = t0 < keys ? vh + gather[t0] * D : nullptr;
    const uint16_t* b = t1 < keys ? vh + gather[t1] * D : nullptr;
    for (int64_t i = 0; i < D; ++i)
      dst[i] = static_cast<uint32_t>(a ? a[i] : 0) | (static_cast<uint32_t>(b ? b[i] : 0) << 16);
  }
}

// s[0 .. limit - 1] -> exp(s - max s), rounded to bfloat16 into pr (zeros up to width); returns their float32 sum.
// Vectorized: scalar loops over the scores cost more than the dot products that made them.
inline float softmax_numerators(float* s, uint16_t* pr, int64_t limit, int64_t width) {
  const int64_t whole = limit / 16 * 16;
  __m512 top16 = _mm512_set1_ps(-INFINITY);
  for (int64_t t = 0; t < whole; t += 16) top16 = _mm512_max_ps(top16, _mm512_loadu_ps(s + t));
  float top = _mm512_reduce_max_ps(top16);
  for (int64_t t = whole; t < limit; ++t) top = std::max(top, s[t]);
  const __m512 shift = _mm512_set1_ps(top);
  for (int64_t t = 0; t < whole; t += 16) _mm512_storeu_ps(s + t, _mm512_sub_ps(_mm512_loadu_ps(s + t), shift));
  for (int64_t t = whole; t < limit; ++t) s[t] -= top;
  exp_inplace(s, limit);
  __m512 sum16 = _mm512_setzero_ps();
  for (int64_t t = 0; t < whole; t += 16) {
    const __m512 e = _mm512_loadu_ps(s + t);
    sum16 = _mm512_add_ps(sum16, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + t), (__m256i)_mm512_cvtneps_pbh(e));  // round to nearest even
  }
  float total = _mm512_reduce_add_ps(sum16);
  for (int64_t t = whole; t < limit; ++t) {
    total += s[t];
    pr[t] = f2bf(s[t]);
  }
  std::fill(pr + limit, pr + width, static_cast<uint16_t>(0));
  return total;
}

// One chunk of `len` query rows starting at row `first`, over a sequence of `keys` cached tokens (its own last):
// query j sees keys 0 .. keys - len + j, or under a sliding `window` (> 0) its last `window` of them. q and out:
// [rows, heads * D] bfloat16; packed: one PackedKV per kv head. A block of rows starts its scores at the key block
// of its first row's first visible key: a sliding layer's cost stays the window's, however long the sequence.
inline void chunk_attention_bf16(const uint16_t* q, const std::vector<PackedKV>& packed, int64_t first, int64_t len,
                                 int64_t keys, uint16_t* out, int64_t heads, int64_t kv_heads, int64_t D, float scale,
                                 int64_t window) {
  const int64_t group = heads / kv_heads, pairs = D / 2, blocks = (len + kQueryRows - 1) / kQueryRows;
  TORCH_CHECK(D % 64 == 0, "chunk attention: head_dim a multiple of 64");
  at::parallel_for(0, kv_heads * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<uint16_t> probs;
    std::vector<float> inv;
    std::vector<int64_t> limits;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t g = task / blocks, i0 = (task % blocks) * kQueryRows;
      const int64_t i1 = std::min(len, i0 + kQueryRows), vecs = (i1 - i0) * group;
      const int64_t visible = keys - len + i1;  // keys the block's last row sees
      // the first row's first visible key, down to a whole key pad: scores [u][t - base] for keys base .. visible
      const int64_t base = window > 0 ? std::max<int64_t>(0, keys - len + i0 + 1 - window) / kKeyPad * kKeyPad : 0;
      const int64_t width = (visible - base + kKeyPad - 1) / kKeyPad * kKeyPad;  // base + width <= kv.padded
      const PackedKV& kv = packed[g];
      // Query vector u: row i0 + u / group, head g * group + u % group; padded to whole passes by repeating the
      // last one (its results are dropped).
      const int64_t padded_vecs = (vecs + kVecs - 1) / kVecs * kVecs;
      scores.resize(padded_vecs * width);
      probs.resize(padded_vecs * width);
      inv.resize(padded_vecs);
      limits.resize(padded_vecs);
      auto query = [&](int64_t u) {
        u = std::min(u, vecs - 1);
        return reinterpret_cast<const uint32_t*>(q + ((first + i0 + u / group) * heads + g * group + u % group) * D);
      };
      const __m512 sc = _mm512_set1_ps(scale);
      for (int64_t u0 = 0; u0 < padded_vecs; u0 += kVecs) {
        const uint32_t* qv[kVecs];
        for (int64_t u = 0; u < kVecs; ++u) qv[u] = query(u0 + u);
        for (int64_t kb = base / kKeyBlock; kb < (base + width) / kKeyBlock; kb += 2) {  // 8 accumulators
          const uint32_t* kp = kv.k.data() + kb * pairs * kKeyBlock;
          __m512 acc[kVecs][2];
          for (auto& row : acc) row[0] = row[1] = _mm512_setzero_ps();
          for (int64_t p = 0; p < pairs; ++p) {
            const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kp + p * kKeyBlock);
            const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kp + (pairs + p) * kKeyBlock);
            for (int64_t u = 0; u < kVecs; ++u) {
              const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(qv[u][p]));
              acc[u][0] = _mm512_dpbf16_ps(acc[u][0], b, k0);
              acc[u][1] = _mm512_dpbf16_ps(acc[u][1], b, k1);
            }
          }
          for (int64_t u = 0; u < kVecs; ++u) {
            float* s = scores.data() + (u0 + u) * width + kb * kKeyBlock - base;
            _mm512_storeu_ps(s, _mm512_mul_ps(acc[u][0], sc));
            _mm512_storeu_ps(s + kKeyBlock, _mm512_mul_ps(acc[u][1], sc));
          }
        }
      }
      for (int64_t u = 0; u < padded_vecs; ++u) {
        const int64_t limit = keys - len + i0 + std::min(u, vecs - 1) / group + 1;  // causal: keys .. limit - 1
        const int64_t skip = (window > 0 ? std::max<int64_t>(0, limit - window) : 0) - base;  // before its window
        limits[u] = limit;
        uint16_t* pr = probs.data() + u * width;
        std::fill(pr, pr + skip, static_cast<uint16_t>(0));
        inv[u] = 1.f / softmax_numerators(scores.data() + u * width + skip, pr + skip, limit - base - skip,
                                          width - skip);
      }
      for (int64_t u0 = 0; u0 < padded_vecs; u0 += kVecs) {
        int64_t reach = 0;  // key pairs any of the pass's vectors sees
        for (int64_t u = 0; u < kVecs; ++u) reach = std::max(reach, (limits[u0 + u] + 1) / 2);
        const uint32_t* pv[kVecs];
        for (int64_t u = 0; u < kVecs; ++u)
          pv[u] = reinterpret_cast<const uint32_t*>(probs.data() + (u0 + u) * width) - base / 2;
        for (int64_t c = 0; c < D; c += 64) {  // 64 dims (4 zmm) of the output at a time: 16 accumulators
          __m512 acc[kVecs][4];
          for (auto& row : acc)
            for (auto& a : row) a = _mm512_setzero_ps();
          for (int64_t sp = base / 2; sp < reach; ++sp) {
            const uint32_t* vp = kv.v.data() + sp * D + c;
            const __m512bh v0 = (__m512bh)_mm512_loadu_si512(vp), v1 = (__m512bh)_mm512_loadu_si512(vp + 16);
            const __m512bh v2 = (__m512bh)_mm512_loadu_si512(vp + 32), v3 = (__m512bh)_mm512_loadu_si512(vp + 48);
            for (int64_t u = 0; u < kVecs; ++u) {
              const __m512bh pb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pv[u][sp]));
              acc[u][0] = _mm512_dpbf16_ps(acc[u][0], pb, v0);
              acc[u][1] = _mm512_dpbf16_ps(acc[u][1], pb, v1);
              acc[u][2] = _mm512_dpbf16_ps(acc[u][2], pb, v2);
              acc[u][3] = _mm512_dpbf16_ps(acc[u][3], pb, v3);
            }
          }
          for (int64_t u = 0; u < kVecs && u0 + u < vecs; ++u) {
            const int64_t row = first + i0 + (u0 + u) / group, head = g * group + (u0 + u) % group;
            uint16_t* o = out + (row * heads + head) * D + c;
            alignas(64) float tmp[16];
            for (int64_t j = 0; j < 4; ++j) {
              _mm512_store_ps(tmp, _mm512_mul_ps(acc[u][j], _mm512_set1_ps(inv[u0 + u])));
              for (int64_t i = 0; i < 16; ++i) o[j * 16 + i] = f2bf(tmp[i]);
            }
          }
        }
      }
    }
  });
}

#elif defined(__AVX2__) && defined(__FMA__)
#define STALLFREE_CHUNK_KERNEL 1
constexpr const char* kChunkAttentionKernel = "avx2";

// The AVX2 form: the same blocking (a task is a kv head and 16 query rows, its rows stop at their last visible key,
// the group's heads share one packing of the keys and values), in float32: AVX2 has no bfloat16 dot product, so
// keys and values are widened once per layer as they are packed; the probabilities are rounded to bfloat16 values
// as the flash kernel rounds them (softmax_numerators). Keys and values are the outer loops: 16 keys' (or values')
// float32 rows stay in L1 while every pass of query vectors reads them (with the passes outer they were read from L2
// or L3 once a pass, 16 passes a task for Gemma 3's 4 heads a kv head). With the softmax vectorized, a 256-token chunk
// over a 1,024-token prefix (`stallfree bench iteration --chunk 256 --prefix 1024 --breakdown`, Zen 4 forced to
// AVX2, 2 threads) went from 122 to 59-64 ms a forward on Gemma 3, 235 to 112-116 on SmolLM2, 450 to 213-218 on
// the 1B.
constexpr int64_t kKeyBlock = 8;     // keys per ymm of scores
constexpr int64_t kKeyPad = 16;      // keys are padded to this: the score loop takes two key blocks at a time
constexpr int64_t kQueryRows = 16;   // query rows per task (times the group's heads)
constexpr int64_t kVecs = 4;         // query vectors per pass: 8 score accumulators, or 8 output ones (16 dims)
constexpr int64_t kValueBlock = 16;  // value rows the passes share (16 KB at head_dim 256)

// Keys of one kv head, [key block][dim][8 keys] float32; values [key][dim] float32; keys past the sequence zero.
struct PackedKV {
  std::vector<float> k, v;
  int64_t padded = 0;
};

inline void pack_kv(const uint16_t* kh, const uint16_t* vh, const int64_t* gather, int64_t keys, int64_t D,
                    PackedKV& out) {
  const int64_t padded = (keys + kKeyPad - 1) / kKeyPad * kKeyPad;
  out.padded = padded;
  out.k.assign(padded * D, 0.f);
  out.v.assign(padded * D, 0.f);
  for (int64_t t = 0; t < keys; ++t) {
    const uint16_t* krow = kh + gather[t] * D;
    const uint16_t* vrow = vh + gather[t] * D;
    float* kdst = out.k.data() + (t / kKeyBlock) * D * kKeyBlock + t % kKeyBlock;
    float* vdst = out.v.data() + t * D;
    for (int64_t d = 0; d < D; ++d) kdst[d * kKeyBlock] = bf2f(krow[d]);
    for (int64_t d = 0; d < D; ++d) vdst[d] = bf2f(vrow[d]);
  }
}

// x rounded to the nearest bfloat16 (ties to even), kept in float32: finite x only (probabilities here).
inline __m256 round_to_bf16(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i up = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
  return _mm256_castsi256_ps(_mm256_and_si256(up, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// s[0 .. limit - 1] -> exp(s - max s), rounded to bfloat16 as the flash kernel and the AVX-512 form round them (so
// this tier follows the Python path's attention as closely as the others: with float32 probabilities a random-weight
// SmolLM2's logits drifted 12% from it over 30 layers), zeros up to width; returns the float32 sum of the unrounded
// values. Vectorized (the scalar max and sum were a dependency chain a score).
inline float softmax_numerators(float* s, int64_t limit, int64_t width) {
  const int64_t whole = limit / 8 * 8;
  __m256 top8 = _mm256_set1_ps(-INFINITY);
  for (int64_t t = 0; t < whole; t += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(s + t));
  float lanes[8];
  _mm256_storeu_ps(lanes, top8);
  float top = *std::max_element(lanes, lanes + 8);
  for (int64_t t = whole; t < limit; ++t) top = std::max(top, s[t]);
  const __m256 shift = _mm256_set1_ps(top);
  for (int64_t t = 0; t < whole; t += 8) _mm256_storeu_ps(s + t, _mm256_sub_ps(_mm256_loadu_ps(s + t), shift));
  for (int64_t t = whole; t < limit; ++t) s[t] -= top;
  exp_inplace(s, limit);
  __m256 sum8 = _mm256_setzero_ps();
  for (int64_t t = 0; t < whole; t += 8) {
    const __m256 e = _mm256_loadu_ps(s + t);
    sum8 = _mm256_add_ps(sum8, e);
    _mm256_storeu_ps(s + t, round_to_bf16(e));
  }
  _mm256_storeu_ps(lanes, sum8);
  float total = 0.f;
  for (float lane : lanes) total += lane;
  for (int64_t t = whole; t < limit; ++t) {
    total += s[t];
    s[t] = bf2f(f2bf(s[t]));
  }
  std::fill(s + limit, s + width, 0.f);
  return total;
}

inline void chunk_attention_bf16(const uint16_t* q, const std::vector<PackedKV>& packed, int64_t first, int64_t len,
                                 int64_t keys, uint16_t* out, int64_t heads, int64_t kv_heads, int64_t D, float scale,
                                 int64_t window) {
  const int64_t group = heads / kv_heads, blocks = (len + kQueryRows - 1) / kQueryRows;
  TORCH_CHECK(D % 16 == 0, "chunk attention: head_dim a multiple of 16");
  at::parallel_for(0, kv_heads * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qf, inv, sums;
    std::vector<int64_t> limits, reach;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t g = task / blocks, i0 = (task % blocks) * kQueryRows;
      const int64_t i1 = std::min(len, i0 + kQueryRows), vecs = (i1 - i0) * group;
      const int64_t visible = keys - len + i1;  // keys the block's last row sees
      // the first row's first visible key, down to a whole key pad: scores [u][t - base] for keys base .. visible
      const int64_t base = window > 0 ? std::max<int64_t>(0, keys - len + i0 + 1 - window) / kKeyPad * kKeyPad : 0;
      const int64_t width = (visible - base + kKeyPad - 1) / kKeyPad * kKeyPad;  // base + width <= kv.padded
      const PackedKV& kv = packed[g];
      // Query vector u: row i0 + u / group, head g * group + u % group, widened to float32; padded to whole passes
      // by repeating the last one (its results are dropped).
      const int64_t padded_vecs = (vecs + kVecs - 1) / kVecs * kVecs;
      scores.resize(padded_vecs * width);
      qf.resize(padded_vecs * D);
      inv.resize(padded_vecs);
      limits.resize(padded_vecs);
      for (int64_t u = 0; u < padded_vecs; ++u) {
        const int64_t v = std::min(u, vecs - 1);
        const uint16_t* src = q + ((first + i0 + v / group) * heads + g * group + v % group) * D;
        for (int64_t d = 0; d < D; ++d) qf[u * D + d] = bf2f(src[d]);
      }
      const __m256 sc = _mm256_set1_ps(scale);
      for (int64_t kb = base / kKeyBlock; kb < (base + width) / kKeyBlock; kb += 2) {  // 8 accumulators
        const float* kp = kv.k.data() + kb * D * kKeyBlock;
        for (int64_t u0 = 0; u0 < padded_vecs; u0 += kVecs) {
          const float* qv = qf.data() + u0 * D;
          __m256 acc[kVecs][2];
          for (auto& row : acc) row[0] = row[1] = _mm256_setzero_ps();
          for (int64_t d = 0; d < D; ++d) {
            const __m256 k0 = _mm256_loadu_ps(kp + d * kKeyBlock), k1 = _mm256_loadu_ps(kp + (D + d) * kKeyBlock);
            for (int64_t u = 0; u < kVecs; ++u) {
              const __m256 b = _mm256_broadcast_ss(qv + u * D + d);
              acc[u][0] = _mm256_fmadd_ps(b, k0, acc[u][0]);
              acc[u][1] = _mm256_fmadd_ps(b, k1, acc[u][1]);
            }
          }
          for (int64_t u = 0; u < kVecs; ++u) {
            float* s = scores.data() + (u0 + u) * width + kb * kKeyBlock - base;
            _mm256_storeu_ps(s, _mm256_mul_ps(acc[u][0], sc));
            _mm256_storeu_ps(s + kKeyBlock, _mm256_mul_ps(acc[u][1], sc));
          }
        }
      }
      for (int64_t u = 0; u < padded_vecs; ++u) {
        const int64_t limit = keys - len + i0 + std::min(u, vecs - 1) / group + 1;  // causal: keys .. limit - 1
        const int64_t skip = (window > 0 ? std::max<int64_t>(0, limit - window) : 0) - base;  // before its window
        limits[u] = limit;
        float* su = scores.data() + u * width;
        std::fill(su, su + skip, 0.f);
        inv[u] = 1.f / softmax_numerators(su + skip, limit - base - skip, width - skip);
      }
      // probabilities times values, summed in float32 in `sums` [vector][D]: a block of value rows outer
      reach.resize(padded_vecs / kVecs);
      for (int64_t u0 = 0; u0 < padded_vecs; u0 += kVecs) {  // keys any of the pass's vectors sees
        reach[u0 / kVecs] = *std::max_element(limits.begin() + u0, limits.begin() + u0 + kVecs);
      }
      sums.assign(padded_vecs * D, 0.f);
      for (int64_t t0 = base; t0 < base + width; t0 += kValueBlock) {
        for (int64_t u0 = 0; u0 < padded_vecs; u0 += kVecs) {
          const int64_t t1 = std::min(t0 + kValueBlock, reach[u0 / kVecs]);
          const float* pv[kVecs];
          for (int64_t u = 0; u < kVecs; ++u) pv[u] = scores.data() + (u0 + u) * width - base;
          for (int64_t c = 0; c < D && t0 < t1; c += 16) {  // 16 dims (2 ymm) of the output at a time: 8 accumulators
            __m256 acc[kVecs][2];
            for (int64_t u = 0; u < kVecs; ++u) {
              acc[u][0] = _mm256_loadu_ps(sums.data() + (u0 + u) * D + c);
              acc[u][1] = _mm256_loadu_ps(sums.data() + (u0 + u) * D + c + 8);
            }
            for (int64_t t = t0; t < t1; ++t) {
              const float* vp = kv.v.data() + t * D + c;
              const __m256 v0 = _mm256_loadu_ps(vp), v1 = _mm256_loadu_ps(vp + 8);
              for (int64_t u = 0; u < kVecs; ++u) {
                const __m256 p = _mm256_broadcast_ss(pv[u] + t);
                acc[u][0] = _mm256_fmadd_ps(p, v0, acc[u][0]);
                acc[u][1] = _mm256_fmadd_ps(p, v1, acc[u][1]);
              }
            }
            for (int64_t u = 0; u < kVecs; ++u) {
              _mm256_storeu_ps(sums.data() + (u0 + u) * D + c, acc[u][0]);
              _mm256_storeu_ps(sums.data() + (u0 + u) * D + c + 8, acc[u][1]);
            }
          }
        }
      }
      for (int64_t u = 0; u < vecs; ++u) {
        const int64_t row = first + i0 + u / group, head = g * group + u % group;
        uint16_t* o = out + (row * heads + head) * D;
        const float* su = sums.data() + u * D;
        for (int64_t d = 0; d < D; ++d) o[d] = f2bf(su[d] * inv[u]);
      }
    }
  });
}

#endif  // __AVX512BF16__, AVX2
