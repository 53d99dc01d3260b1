// Decode attention (one query row per sequence) over the paged KV cache with AVX512-BF16 dot products (and an AVX2
// form of the same below, for the tiers without them); included by
// cpu_decode.cpp inside its anonymous namespace (it uses f2bf and softmax_part from there).
//
// Why: scoring key by key with a float dot product ends every key in a 16-lane horizontal sum, and those sums were
// most of a 16-stream step (10 ms of 35 at 128 cached tokens, `stallfree bench iteration --breakdown`). Here 16
// keys' dot products accumulate side by side (VDPBF16PS over bfloat16 pairs: q is already rounded to bfloat16
// after RoPE, so the products are those of the float loop) and one transpose-and-add tree sums all 16 at once.
// The softmax and the product with V stay in float32, as in the scalar loop this replaces.
#pragma once

#if defined(__AVX512BF16__)
#define STALLFREE_DECODE_ATTENTION_KERNEL 1
constexpr const char* kDecodeAttentionKernel = "avx512_bf16";

// [sum of v[0]'s lanes, ..., sum of v[15]'s]: four levels of shuffles and adds instead of 16 horizontal sums.
// The tree leaves key k in lane kTreeOrder[k] (a 4x4 transpose, its own inverse): the inputs are taken in that order.
inline __m512 sum16(const __m512* v) {
  static constexpr int kTreeOrder[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};
  __m512 c[8], e[4], f[2];
  for (int i = 0; i < 8; ++i) {  // 16 vectors -> 8: each 256-bit half holds one vector's partial sums
    const __m512 a = v[kTreeOrder[2 * i]], b = v[kTreeOrder[2 * i + 1]];
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  for (int i = 0; i < 4; ++i)  // -> 4: each 128-bit lane one vector's
    e[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // -> 2: two lanes a vector
    f[i] = _mm512_add_ps(_mm512_shuffle_ps(e[2 * i], e[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(e[2 * i], e[2 * i + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(f[0], f[1], 0x88), _mm512_shuffle_ps(f[0], f[1], 0xDD));
}

// One decode row's `group` query heads (q: bfloat16 [group, D]) against one kv head's cached keys and values at
// positions start .. end - 1 (kh, vh: that head's [slots, D] planes; table: the sequence's block table; start > 0: a
// sliding layer's window, or a later part of the keys); out [group, D] bfloat16. scores: scratch of
// group * (end - start) floats. DV = D / 16 (the float32 accumulators of one output row: 4, 8 or 16 for head_dim
// 64, 128 or 256). With `partial`, a part of the keys (decode_attention splits one sequence's keys across threads):
// per head D float32 sums of exp(score - top) * v, then top and the sum of exp(score - top), unnormalised
// (softmax_part), for merge_parts; out is not written.
template <int DV>
void decode_attention_bf16(const uint16_t* q, const uint16_t* kh, const uint16_t* vh, const int32_t* table,
                           int64_t block_size, int64_t start, int64_t end, int64_t group, float scale, float* scores,
                           uint16_t* out, float* partial) {
  constexpr int64_t D = 16 * DV, QV = D / 32;
  const int64_t keys = end - start;
  for (int64_t j = 0; j < group; ++j) {
    __m512bh qv[QV];
    for (int64_t c = 0; c < QV; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + j * D + 32 * c);
    float* sj = scores + j * keys;
    for (int64_t i0 = 0; i0 < keys; i0 += 16) {
      const int64_t n = std::min<int64_t>(16, keys - i0), t0 = start + i0;
      __m512 acc[16];
      int64_t block = t0 / block_size, offset = t0 % block_size;  // stepped, not divided, key by key
      for (int64_t tt = 0; tt < 16; ++tt) {
        acc[tt] = _mm512_setzero_ps();
        if (tt >= n) continue;
        const int64_t slot = static_cast<int64_t>(table[block]) * block_size + offset;
        const uint16_t* k = kh + slot * D;
        if (j == 0) {  // the cache's blocks are scattered: fetch this key's value and the key 16 on ahead of use
          for (int64_t line = 0; line < D * 2; line += 64)
            _mm_prefetch(reinterpret_cast<const char*>(vh + slot * D) + line, _MM_HINT_T0);
          const int64_t ahead = t0 + tt + 16;
          if (ahead < end) {
            const int64_t far = static_cast<int64_t>(table[ahead / block_size]) * block_size + ahead % block_size;
            for (int64_t line = 0; line < D * 2; line += 64)
              _mm_prefetch(reinterpret_cast<const char*>(kh + far * D) + line, _MM_HINT_T0);
          }
        }
        for (int64_t c = 0; c < QV; ++c)
          acc[tt] = _mm512_dpbf16_ps(acc[tt], qv[c], (__m512bh)_mm512_loadu_si512(k + 32 * c));
        if (++offset == block_size) offset = 0, ++block;
      }
      _mm512_mask_storeu_ps(sj + i0, static_cast<__mmask16>((1u << n) - 1),
                            _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale)));
    }
    const SoftmaxPart part = softmax_part(sj, keys);
    const float inv = partial != nullptr ? 1.f : 1.f / part.total;
    __m512 o[DV];
    for (int d = 0; d < DV; ++d) o[d] = _mm512_setzero_ps();
    for (int64_t t0 = start; t0 < end;) {  // block by block: the table read once a block
      const int64_t offset = t0 % block_size, n = std::min(block_size - offset, end - t0);
      const uint16_t* v = vh + (static_cast<int64_t>(table[t0 / block_size]) * block_size + offset) * D;
      const float* p_row = sj + (t0 - start);
      t0 += n;
      for (int64_t tt = 0; tt < n; ++tt, v += D) {
        const __m512 p = _mm512_set1_ps(p_row[tt] * inv);
        for (int d = 0; d < DV; ++d) {
          const __m512 vf = _mm512_castsi512_ps(_mm512_slli_epi32(
              _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 16 * d))), 16));
          o[d] = _mm512_fmadd_ps(p, vf, o[d]);
        }
      }
    }
    if (partial != nullptr) {
      float* pj = partial + j * (D + 2);
      for (int d = 0; d < DV; ++d) _mm512_storeu_ps(pj + 16 * d, o[d]);
      pj[D] = part.top, pj[D + 1] = part.total;
      continue;
    }
    float row[D];
    for (int d = 0; d < DV; ++d) _mm512_storeu_ps(row + 16 * d, o[d]);
    for (int64_t i = 0; i < D; ++i) out[j * D + i] = f2bf(row[i]);
  }
}

#elif defined(__AVX2__) && defined(__FMA__)
#define STALLFREE_DECODE_ATTENTION_KERNEL 1
constexpr const char* kDecodeAttentionKernel = "avx2";

// [sum of v[0]'s lanes, ..., sum of v[7]'s]: three levels of horizontal adds and one cross-half add instead of
// eight horizontal sums.
inline __m256 sum8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // [0 1 2 3 | 0 1 2 3], [4 5 6 7 | ...]
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

inline __m256 load_bf16x8(const uint16_t* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// The AVX2 form of the kernel above: the same products in float32 (q widened once a row), 8 keys' dot products side
// by side and summed by one tree (sum8); the softmax and the product with V in float32. DV = D / 16.
template <int DV>
void decode_attention_bf16(const uint16_t* q, const uint16_t* kh, const uint16_t* vh, const int32_t* table,
                           int64_t block_size, int64_t start, int64_t end, int64_t group, float scale, float* scores,
                           uint16_t* out, float* partial) {
  constexpr int64_t D = 16 * DV, QV = D / 8;
  const int64_t keys = end - start;
  for (int64_t j = 0; j < group; ++j) {
    __m256 qv[QV];
    for (int64_t c = 0; c < QV; ++c) qv[c] = load_bf16x8(q + j * D + 8 * c);
    float* sj = scores + j * keys;
    for (int64_t i0 = 0; i0 < keys; i0 += 8) {
      const int64_t n = std::min<int64_t>(8, keys - i0), t0 = start + i0;
      __m256 acc[8];
      int64_t block = t0 / block_size, offset = t0 % block_size;  // stepped, not divided, key by key
      for (int64_t tt = 0; tt < 8; ++tt) {
        acc[tt] = _mm256_setzero_ps();
        if (tt >= n) continue;
        const uint16_t* k = kh + (static_cast<int64_t>(table[block]) * block_size + offset) * D;
        for (int64_t c = 0; c < QV; ++c) acc[tt] = _mm256_fmadd_ps(qv[c], load_bf16x8(k + 8 * c), acc[tt]);
        if (++offset == block_size) offset = 0, ++block;
      }
      float dots[8];
      _mm256_storeu_ps(dots, _mm256_mul_ps(sum8(acc), _mm256_set1_ps(scale)));
      std::memcpy(sj + i0, dots, n * sizeof(float));
    }
    const SoftmaxPart part = softmax_part(sj, keys);
    const float inv = partial != nullptr ? 1.f : 1.f / part.total;
    __m256 o[2 * DV];
    for (int d = 0; d < 2 * DV; ++d) o[d] = _mm256_setzero_ps();
    for (int64_t t0 = start; t0 < end;) {  // block by block: the table read once a block
      const int64_t offset = t0 % block_size, n = std::min(block_size - offset, end - t0);
      const uint16_t* v = vh + (static_cast<int64_t>(table[t0 / block_size]) * block_size + offset) * D;
      const float* p_row = sj + (t0 - start);
      t0 += n;
      for (int64_t tt = 0; tt < n; ++tt, v += D) {
        const __m256 p = _mm256_set1_ps(p_row[tt] * inv);
        for (int d = 0; d < 2 * DV; ++d) o[d] = _mm256_fmadd_ps(p, load_bf16x8(v + 8 * d), o[d]);
      }
    }
    if (partial != nullptr) {
      float* pj = partial + j * (D + 2);
      for (int d = 0; d < 2 * DV; ++d) _mm256_storeu_ps(pj + 8 * d, o[d]);
      pj[D] = part.top, pj[D + 1] = part.total;
      continue;
    }
    float row[D];
    for (int d = 0; d < 2 * DV; ++d) _mm256_storeu_ps(row + 8 * d, o[d]);
    for (int64_t i = 0; i < D; ++i) out[j * D + i] = f2bf(row[i]);
  }
}

#endif  // AVX512-BF16, AVX2
