// The AVX512-VNNI kernel of cpu_code_matmul.h (which says the math and the layout): VPDPWSSD multiplies two codes
// by two int16 activations a lane and adds, 16 columns to a register, up to 8 rows a pass over a tile's codes.
// 5-bit codes add their fifth bit from a 32-bit mask per half chunk (one masked add); 6-bit ones (Q6_K's kHalves)
// merge their high two bits from a plane of them (six_bit_lanes16); kHalves records (Q6_K's, Q3_K's) sum each half
// of a block apart (its own scale), then take the offset 2^(BITS-1) off with the half's activation sum.
// Included by cpu_code_matmul.h where the compiler targets AVX512-VNNI.
//
// int16 activations for a few rows, not llama.cpp's int8: int16's rounding (1/65534 of a block's largest value) does
// not show beside bfloat16's, and a few rows are memory-bound anyway. Many rows are compute-bound: there int8
// (vnni8_tile below, from code_matmul's int8_min_rows).
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
  q.half_sum.resize(2 * rows * blocks);
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
      // the rounded codes' sums (no code saturates: |x| / amax * 32767 <= 32767)
      q.half_sum[2 * i] = _mm512_reduce_add_epi32(qlo), q.half_sum[2 * i + 1] = _mm512_reduce_add_epi32(qhi);
      q.scale[i] = amax / 32767.f;
      q.sum[i] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
    }
  });
}

// The 16 columns' scales and zeros of the records along one tile's K, block by block: read from each record, or
// made from a super-block's header (read at its first block and kept for its 8) and each block's integer scales
// and mins (cpu_code_matmul.h's kSuper; kHalves: s and z the scales of a block's two halves).
template <int BITS, int FORM>
struct BlockAffine {
  __m512 d = _mm512_setzero_ps(), dmin = _mm512_setzero_ps();  // grouped forms: the current super-block's header
  __m512 s, z;

  // Block b of the tile whose first record is `tile`, the blocks taken in order along K (a super-block's header
  // read at its first block).
  inline void at(const uint8_t* tile, int64_t b) {
    if constexpr (grouped(FORM)) {
      if (b % 8 == 0) {
        const __m256i* header = reinterpret_cast<const __m256i*>(tile + header_offset(BITS, b));
        d = _mm512_cvtph_ps(_mm256_loadu_si256(header));
        if constexpr (FORM == kSuper) dmin = _mm512_cvtph_ps(_mm256_loadu_si256(header + 1));  // (3-bit kHalves: none)
      }
    }
    scales(tile + affine_offset(BITS, FORM, b));
  }

  // s and z of the block whose scales (or sc and m) are at `affine` (kSuper: under the header last read).
  inline void scales(const uint8_t* affine) { affine16<BITS, FORM>(affine, d, dmin, s, z); }
};

// One record's integer sums into R rows' 16 columns: the codes' scale times each row's activation scale, plus the
// zero times the row's activation sum. `first`: row r0's index into x's per-block scale and sum, `stride` the next
// row's distance. Both activation forms (int16: QuantizedRows, int8: QuantizedRows8) end a block here.
template <int BITS, int FORM, int R, typename Rows>
inline void fold_block(const BlockAffine<BITS, FORM>& a, const __m512i* dot, const Rows& x, int64_t first,
                       int64_t stride, __m512* acc) {
  for (int r = 0; r < R; ++r) {
    const int64_t i = first + r * stride;
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(a.s, _mm512_set1_ps(x.scale[i])), acc[r]);
    acc[r] = _mm512_fmadd_ps(a.z, _mm512_set1_ps(x.sum[i]), acc[r]);
  }
}

// kHalves: each half's integer sums of unsigned codes u, the offset o = 2^(BITS-1) taken off with the half's
// activation sum (exact in int32: sum (u - o) x = sum u x - o sum x), then under the half's own scale, no zero. Both
// activation forms keep each block's half sums (half_sum).
template <int BITS, int FORM, int R, typename Rows>
inline void fold_halves(const BlockAffine<BITS, FORM>& a, const __m512i* first_half, const __m512i* last_half,
                        const Rows& x, int64_t first, int64_t stride, __m512* acc) {
  for (int r = 0; r < R; ++r) {
    const int64_t i = first + r * stride;
    const int32_t* half = x.half_sum.data() + 2 * i;
    const __m512 xs = _mm512_set1_ps(x.scale[i]);
    constexpr int offset = 1 << (BITS - 1);
    const __m512i lo = _mm512_sub_epi32(first_half[r], _mm512_set1_epi32(offset * half[0]));
    const __m512i hi = _mm512_sub_epi32(last_half[r], _mm512_set1_epi32(offset * half[1]));
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_mul_ps(a.s, xs), acc[r]);
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_mul_ps(a.z, xs), acc[r]);
  }
}

// One tile's 16 columns for rows r0 .. r0 + R - 1: out[r][c] (float32, 16 a row).
// Each row's int32 sums of a block go to C accumulators in turn, summed before the fold: VPDPWSSD adds into its own
// destination, so with one accumulator a row's 16 products of a block wait on each other (a chain of the
// instruction's latency). Hot in cache, one row of Gemma 3's 1.8 MB Q5_0 gate/up took 29 us on one, 24 on four; from
// memory the page of prefetch (cpu_code_matmul.h) is what moved it. Four rows or more are four chains already.
template <int BITS, int FORM, int R>
inline void vnni_tile(const uint8_t* w, const QuantizedRows& x, int64_t r0, int64_t blocks, float* out) {
  constexpr int64_t block_bytes = record_bytes<BITS, FORM>();
  // kHalves keeps at least two: the low nibbles' sums (k < 16) on the even ones, the high nibbles' on the odd
  constexpr int C = R == 1 ? 4 : R < 4 || FORM == kHalves ? 2 : 1;
  const int64_t blocks_per_row = x.k / kQBlock;
  BlockAffine<BITS, FORM> affine;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi16(0x0f), sixteen = _mm512_set1_epi16(16);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = w + codes_offset(BITS, FORM, b);
    for (int64_t line = 0; line < block_bytes; line += 64)  // the records' bytes as a stream, a block's worth a block
      _mm_prefetch(reinterpret_cast<const char*>(w + b * block_bytes + kSuperAhead<BITS, FORM>() + line), _MM_HINT_T0);
    __m512i dot[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) dot[r][c] = _mm512_setzero_si512();
    const int32_t* xq[R];  // the rows' block as int16 pairs
    for (int r = 0; r < R; ++r) xq[r] = reinterpret_cast<const int32_t*>(x.codes.data() + (r0 + r) * x.k + b * kQBlock);
    if constexpr (BITS != 8) {
      const uint32_t* fifth = reinterpret_cast<const uint32_t*>(wb + 256);  // BITS 5: the codes' fifth bits
      __m512i high = _mm512_setzero_si512();  // BITS 6: the chunk pair's plane of high bits
      for (int q = 0; q < 8; ++q) {
        const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * q)));
        __m512i lo, hi;
        if constexpr (BITS == 6) {
          if (q % 2 == 0) high = high_bits16(wb + 256 + 16 * q);
          six_bit_lanes16(v, high, q, lo, hi);
        } else {
          lo = _mm512_and_si512(v, nibble), hi = _mm512_srli_epi16(v, 4);
        }
        if constexpr (BITS == 5) {  // lane i's code gains 16 where bit i of its half's mask is set
          lo = _mm512_mask_add_epi16(lo, fifth[2 * q], lo, sixteen);
          hi = _mm512_mask_add_epi16(hi, fifth[2 * q + 1], hi, sixteen);
        }
        for (int r = 0; r < R; ++r) {
          __m512i& lo_sum = dot[r][(2 * q) % C];
          lo_sum = _mm512_dpwssd_epi32(lo_sum, lo, _mm512_set1_epi32(xq[r][q]));
          __m512i& hi_sum = dot[r][(2 * q + 1) % C];
          hi_sum = _mm512_dpwssd_epi32(hi_sum, hi, _mm512_set1_epi32(xq[r][q + 8]));
        }
      }
    } else {
      for (int q = 0; q < 16; ++q) {
        const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * q)));
        for (int r = 0; r < R; ++r) dot[r][q % C] = _mm512_dpwssd_epi32(dot[r][q % C], v, _mm512_set1_epi32(xq[r][q]));
      }
    }
    affine.at(w, b);
    if constexpr (FORM == kHalves) {
      __m512i even[R], odd[R];
      for (int r = 0; r < R; ++r) {
        even[r] = dot[r][0], odd[r] = dot[r][1];
        for (int c = 2; c < C; c += 2)
          even[r] = _mm512_add_epi32(even[r], dot[r][c]), odd[r] = _mm512_add_epi32(odd[r], dot[r][c + 1]);
      }
      fold_halves<BITS, FORM, R>(affine, even, odd, x, r0 * blocks_per_row + b, blocks_per_row, acc);
      continue;
    }
    __m512i sums[R];
    for (int r = 0; r < R; ++r) {
      sums[r] = dot[r][0];
      for (int c = 1; c < C; ++c) sums[r] = _mm512_add_epi32(sums[r], dot[r][c]);
    }
    fold_block<BITS, FORM, R>(affine, sums, x, r0 * blocks_per_row + b, blocks_per_row, acc);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + 16 * r, acc[r]);
}

// int8 activations (many-row iterations, where the int16 products are compute-bound; models/cpu_code_matmul.h
// says when): each 32-wide block quantized to int8 (xscale = max|x| / 127), and VPDPBUSD multiplies four unsigned
// codes by four int8 activations a lane, twice VPDPWSSD's products an instruction. Two chunks of a record (64
// bytes: k = 4m .. 4m + 3 of 16 columns, as 16-bit pairs) become one lane of four codes per column by one word
// permute; 4- and 5-bit codes are split on bytes, never widened.
inline void quantize_rows_int8(const uint16_t* x, int64_t rows, int64_t k, QuantizedRows8& q) {
  const int64_t blocks = k / kQBlock;
  q.rows = rows, q.k = k;
  q.codes.resize(rows * k), q.scale.resize(rows * blocks), q.sum.resize(rows * blocks);
  q.half_sum.resize(2 * rows * blocks);
  at::parallel_for(0, rows * blocks, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const __m512 lo = load_bf16x16(x + i * kQBlock), hi = load_bf16x16(x + i * kQBlock + 16);
      const float amax = std::max(_mm512_reduce_max_ps(_mm512_abs_ps(lo)), _mm512_reduce_max_ps(_mm512_abs_ps(hi)));
      const __m512 m = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      const __m512i qlo = _mm512_cvt_roundps_epi32(_mm512_mul_ps(lo, m), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512i qhi = _mm512_cvt_roundps_epi32(_mm512_mul_ps(hi, m), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      int8_t* dst = q.codes.data() + i * kQBlock;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(qlo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtsepi32_epi8(qhi));
      q.scale[i] = amax / 127.f;
      // the zero term multiplies the quantized activations' sum, not the exact one: sum_k (s u + z) x^ is then the
      // weights times the rounded activations, whose error follows the weights; with the exact sum, the codes'
      // offset (u averages 7.5 for 4-bit codes) times the rounding error would stay uncancelled (3x the error)
      q.half_sum[2 * i] = _mm512_reduce_add_epi32(qlo), q.half_sum[2 * i + 1] = _mm512_reduce_add_epi32(qhi);
      q.sum[i] = static_cast<float>(q.half_sum[2 * i] + q.half_sum[2 * i + 1]) * q.scale[i];
    }
  });
}

// Prefetched further ahead and into L2 only, unlike the memory-bound int16 body: at 16 rows a block's products take
// long enough that 1 KB ahead arrived late, and lines pulled into L1 early pushed out the rows' activations. Gemma 3's
// 262k x 640 head at 16 rows: 13.1 -> 10.6 ms in a standalone copy of this kernel (2 threads); 16-row decode steps
// in the model runner: Gemma 3 27-28 -> 22-23 ms, the 1B 81-90 -> 69-75 ms. (AVX2's int8 body: no change.)
constexpr int64_t kInt8PrefetchBytes = 4096;

template <int BITS, int FORM, int R>
inline void vnni8_tile(const uint8_t* w, const QuantizedRows8& x, int64_t r0, int64_t blocks, float* out) {
  constexpr int64_t block_bytes = record_bytes<BITS, FORM>();
  const int64_t blocks_per_row = x.k / kQBlock;
  BlockAffine<BITS, FORM> affine;
  // word c of the first chunk, then word c of the second: column c's four codes in dword c
  static constexpr uint16_t kPairs[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                          8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i pairs = _mm512_loadu_si512(kPairs);
  const __m512i nibble = _mm512_set1_epi8(0x0f), sixteen = _mm512_set1_epi8(16);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = w + codes_offset(BITS, FORM, b);
    for (int64_t line = 0; line < block_bytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(w + b * block_bytes + kInt8PrefetchBytes + line), _MM_HINT_T1);
    __m512i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
    const int32_t* xq[R];  // the rows' block as int8 quads
    for (int r = 0; r < R; ++r) xq[r] = reinterpret_cast<const int32_t*>(x.codes.data() + (r0 + r) * x.k + b * kQBlock);
    if constexpr (FORM == kHalves) {  // unsigned codes, each half summed apart; u - 2^(BITS-1) by the half's sum
      __m512i last[R];
      for (int r = 0; r < R; ++r) last[r] = _mm512_setzero_si512();
      for (int m = 0; m < 4; ++m) {
        const __m512i v = _mm512_loadu_si512(wb + 64 * m);
        __m512i lo = _mm512_and_si512(v, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        if constexpr (BITS == 6) {
          // the pair's plane of high bits for chunk 2m's bytes, then (shifted to the same bits) for chunk 2m + 1's
          const __m256i plane = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 256 + 32 * m));
          const __m512i h = _mm512_inserti64x4(_mm512_castsi256_si512(plane), _mm256_srli_epi16(plane, 2), 1);
          lo = with_high_bits(lo, _mm512_slli_epi16(h, 4));
          hi = with_high_bits(hi, h);
        }
        const __m512i lo4 = _mm512_permutexvar_epi16(pairs, lo), hi4 = _mm512_permutexvar_epi16(pairs, hi);
        for (int r = 0; r < R; ++r) {
          dot[r] = _mm512_dpbusd_epi32(dot[r], lo4, _mm512_set1_epi32(xq[r][m]));
          last[r] = _mm512_dpbusd_epi32(last[r], hi4, _mm512_set1_epi32(xq[r][m + 4]));
        }
      }
      affine.at(w, b);
      fold_halves<BITS, FORM, R>(affine, dot, last, x, r0 * blocks_per_row + b, blocks_per_row, acc);
      continue;
    } else if constexpr (BITS != 8) {
      for (int m = 0; m < 4; ++m) {
        const __m512i v = _mm512_loadu_si512(wb + 64 * m);
        __m512i lo = _mm512_and_si512(v, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        if constexpr (BITS == 5) {  // chunks 2m and 2m + 1: their low nibbles' masks, then their high ones'
          const uint32_t* fifth = reinterpret_cast<const uint32_t*>(wb + 256) + 4 * m;
          const __mmask64 lo_bits = fifth[0] | (static_cast<uint64_t>(fifth[2]) << 32);
          const __mmask64 hi_bits = fifth[1] | (static_cast<uint64_t>(fifth[3]) << 32);
          lo = _mm512_mask_add_epi8(lo, lo_bits, lo, sixteen);
          hi = _mm512_mask_add_epi8(hi, hi_bits, hi, sixteen);
        }
        lo = _mm512_permutexvar_epi16(pairs, lo), hi = _mm512_permutexvar_epi16(pairs, hi);
        for (int r = 0; r < R; ++r) {
          dot[r] = _mm512_dpbusd_epi32(dot[r], lo, _mm512_set1_epi32(xq[r][m]));
          dot[r] = _mm512_dpbusd_epi32(dot[r], hi, _mm512_set1_epi32(xq[r][m + 4]));
        }
      }
    } else {
      for (int m = 0; m < 8; ++m) {
        const __m512i v = _mm512_permutexvar_epi16(pairs, _mm512_loadu_si512(wb + 64 * m));
        for (int r = 0; r < R; ++r) dot[r] = _mm512_dpbusd_epi32(dot[r], v, _mm512_set1_epi32(xq[r][m]));
      }
    }
    affine.at(w, b);
    fold_block<BITS, FORM, R>(affine, dot, x, r0 * blocks_per_row + b, blocks_per_row, acc);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + 16 * r, acc[r]);
}

#define STALLFREE_INT8_MATMUL 1
constexpr bool int8_takes(int) { return true; }
template <int BITS, int FORM>
void code_tile_rows8(const uint8_t* w, const QuantizedRows8& x, int64_t r0, int rows, int64_t blocks, float* out) {
  switch (rows) {
    case 1: return vnni8_tile<BITS, FORM, 1>(w, x, r0, blocks, out);
    case 2: return vnni8_tile<BITS, FORM, 2>(w, x, r0, blocks, out);
    case 3: return vnni8_tile<BITS, FORM, 3>(w, x, r0, blocks, out);
    case 4: return vnni8_tile<BITS, FORM, 4>(w, x, r0, blocks, out);
    case 5: return vnni8_tile<BITS, FORM, 5>(w, x, r0, blocks, out);
    case 6: return vnni8_tile<BITS, FORM, 6>(w, x, r0, blocks, out);
    case 7: return vnni8_tile<BITS, FORM, 7>(w, x, r0, blocks, out);
    default: return vnni8_tile<BITS, FORM, 8>(w, x, r0, blocks, out);
  }
}

template <int BITS, int FORM>
void code_tile_rows(const uint8_t* w, const QuantizedRows& x, int64_t r0, int rows, int64_t blocks, float* out) {
  switch (rows) {
    case 1: return vnni_tile<BITS, FORM, 1>(w, x, r0, blocks, out);
    case 2: return vnni_tile<BITS, FORM, 2>(w, x, r0, blocks, out);
    case 3: return vnni_tile<BITS, FORM, 3>(w, x, r0, blocks, out);
    case 4: return vnni_tile<BITS, FORM, 4>(w, x, r0, blocks, out);
    case 5: return vnni_tile<BITS, FORM, 5>(w, x, r0, blocks, out);
    case 6: return vnni_tile<BITS, FORM, 6>(w, x, r0, blocks, out);
    case 7: return vnni_tile<BITS, FORM, 7>(w, x, r0, blocks, out);
    default: return vnni_tile<BITS, FORM, 8>(w, x, r0, blocks, out);
  }
}
