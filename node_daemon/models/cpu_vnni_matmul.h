// The AVX512-VNNI kernel of cpu_code_matmul.h (which says the math and the layout): VPDPWSSD multiplies two codes
// by two int16 activations a lane and adds, 16 columns to a register, up to 8 rows a pass over a tile's codes.
// 5-bit codes add their fifth bit from a 32-bit mask per half chunk (one masked add).
// Included by cpu_code_matmul.h where the compiler targets AVX512-VNNI.
//
// int16 activations, not llama.cpp's int8: int8 moved SmolLM2's logits 7% off the float32 reference and changed a
// greedy answer; int16's rounding (1/65534 of a block's largest value) does not show beside bfloat16's.
// One stream per thread: the hardware prefetcher follows one stream better than three.
#pragma once
#define STALLFREE_VNNI_MATMUL 1
constexpr int kMaxRowsAtOnce = 8;  // rows sharing one pass over a tile's weights: 8 int32 + 8 float accumulators
constexpr const char* kCodeKernel = "avx512_vnni";

inline __m512 load_bf16x16(const uint16_t* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

inline void quantize_rows(const uint16_t* x, int64_t rows, int64_t k, QuantizedRows& q) {
  const int64_t blocks = k / kQBlock;
  q.rows = rows, q.k = k;
  q.codes.resize(rows * k), q.scale.resize(rows * blocks), q.sum.resize(rows * blocks);
  at::parallel_for(0, rows * blocks, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {  // block i of the flattened [rows, K]
      const __m512 lo = load_bf16x16(x + i * kQBlock), hi = load_bf16x16(x + i * kQBlock + 16);
      const float amax = std::max(_mm512_reduce_max_ps(_mm512_abs_ps(lo)), _mm512_reduce_max_ps(_mm512_abs_ps(hi)));
      const __m512 m = _mm512_set1_ps(amax > 0.f ? 32767.f / amax : 0.f);
      const __m512i qlo = _mm512_cvt_roundps_epi32(_mm512_mul_ps(lo, m), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512i qhi = _mm512_cvt_roundps_epi32(_mm512_mul_ps(hi, m), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      int16_t* dst = q.codes.data() + i * kQBlock;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtsepi32_epi16(qlo));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16), _mm512_cvtsepi32_epi16(qhi));
      q.scale[i] = amax / 32767.f;
      q.sum[i] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
    }
  });
}

// One tile's 16 columns for rows r0 .. r0 + R - 1: out[r][c] (float32, 16 a row).
template <int BITS, bool ZERO, int R>
inline void vnni_tile(const uint8_t* w, const QuantizedRows& x, int64_t r0, int64_t blocks, float* out) {
  constexpr int64_t code_bytes = BITS * kQBlock * 16 / 8, block_bytes = record_bytes<BITS, ZERO>();
  const int64_t blocks_per_row = x.k / kQBlock;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi16(0x0f), sixteen = _mm512_set1_epi16(16);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = w + b * block_bytes;
    for (int64_t line = 0; line < block_bytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(wb + kPrefetchBytes + line), _MM_HINT_T0);
    __m512i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
    const int32_t* xq[R];  // the rows' block as int16 pairs
    for (int r = 0; r < R; ++r) xq[r] = reinterpret_cast<const int32_t*>(x.codes.data() + (r0 + r) * x.k + b * kQBlock);
    if constexpr (BITS != 8) {
      const uint32_t* fifth = reinterpret_cast<const uint32_t*>(wb + 256);  // BITS 5: the codes' fifth bits
      for (int q = 0; q < 8; ++q) {
        const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * q)));
        __m512i lo = _mm512_and_si512(v, nibble), hi = _mm512_srli_epi16(v, 4);
        if constexpr (BITS == 5) {  // lane i's code gains 16 where bit i of its half's mask is set
          lo = _mm512_mask_add_epi16(lo, fifth[2 * q], lo, sixteen);
          hi = _mm512_mask_add_epi16(hi, fifth[2 * q + 1], hi, sixteen);
        }
        for (int r = 0; r < R; ++r) {
          dot[r] = _mm512_dpwssd_epi32(dot[r], lo, _mm512_set1_epi32(xq[r][q]));
          dot[r] = _mm512_dpwssd_epi32(dot[r], hi, _mm512_set1_epi32(xq[r][q + 8]));
        }
      }
    } else {
      for (int q = 0; q < 16; ++q) {
        const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * q)));
        for (int r = 0; r < R; ++r) dot[r] = _mm512_dpwssd_epi32(dot[r], v, _mm512_set1_epi32(xq[r][q]));
      }
    }
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + code_bytes)));
    const __m512 z = ZERO ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + code_bytes + 32)))
                          : _mm512_mul_ps(s, _mm512_set1_ps(-static_cast<float>(1 << (BITS - 1))));
    for (int r = 0; r < R; ++r) {
      const int64_t i = (r0 + r) * blocks_per_row + b;
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(s, _mm512_set1_ps(x.scale[i])), acc[r]);
      acc[r] = _mm512_fmadd_ps(z, _mm512_set1_ps(x.sum[i]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + 16 * r, acc[r]);
}

template <int BITS, bool ZERO>
void code_tile_rows(const uint8_t* w, const QuantizedRows& x, int64_t r0, int rows, int64_t blocks, float* out) {
  switch (rows) {
    case 1: return vnni_tile<BITS, ZERO, 1>(w, x, r0, blocks, out);
    case 2: return vnni_tile<BITS, ZERO, 2>(w, x, r0, blocks, out);
    case 3: return vnni_tile<BITS, ZERO, 3>(w, x, r0, blocks, out);
    case 4: return vnni_tile<BITS, ZERO, 4>(w, x, r0, blocks, out);
    case 5: return vnni_tile<BITS, ZERO, 5>(w, x, r0, blocks, out);
    case 6: return vnni_tile<BITS, ZERO, 6>(w, x, r0, blocks, out);
    case 7: return vnni_tile<BITS, ZERO, 7>(w, x, r0, blocks, out);
    default: return vnni_tile<BITS, ZERO, 8>(w, x, r0, blocks, out);
  }
}
