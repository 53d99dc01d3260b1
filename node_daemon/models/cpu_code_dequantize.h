// A coded weight's values, transposed, in a scratch buffer: W^T [K, N] bfloat16 from the tiles of
// cpu_code_matmul.h (which says the layout), each value rounded once from the float32 scale * u + zero.
// Included by cpu_decode.cpp after cpu_code_matmul.h.
//
// Why: a many-row iteration (a prefill chunk) is compute-bound, and oneDNN's bfloat16 GEMM (AMX or AVX512-BF16)
// outruns the code kernel's integer sums there by 3-5x. Kept dense copies would cost 2 bytes a weight for the
// model's life beside the codes' 0.5-1; this scratch holds one projection for one matmul, made in a fraction of the
// GEMM's time (a pass over the codes that writes the values once, at memory speed).
//
// Transposed because the tiles hold, per chunk of 32 bytes, 16 columns' codes for two adjacent k: one permute splits
// them into two rows of W^T, each 16 columns wide, written as 32 contiguous bytes.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__)
inline __m256i bf16x16(__m512 v) {
#if defined(__AVX512BF16__)
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
#else  // round to nearest even by hand, as f2bf (no NaN can arise from finite codes and scales)
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
#endif
}

// The 16 columns' scale and zero of block b of the tile whose first record is `tile` (kSuper: from its super-block's
// header and the block's integer scales and mins; kHalves: each half's scale; cpu_code_matmul.h says the forms).
template <int BITS, int FORM>
inline void record_affine16(const uint8_t* tile, int64_t b, __m512& s, __m512& z) {
  __m512 d = _mm512_setzero_ps(), dmin = _mm512_setzero_ps();
  if constexpr (grouped(FORM)) {
    const __m256i* header = reinterpret_cast<const __m256i*>(tile + header_offset(BITS, b));
    d = _mm512_cvtph_ps(_mm256_loadu_si256(header));
    if constexpr (FORM == kSuper) dmin = _mm512_cvtph_ps(_mm256_loadu_si256(header + 1));  // (3-bit kHalves: none)
  }
  affine16<BITS, FORM>(tile + affine_offset(BITS, FORM, b), d, dmin, s, z);
}

// One record (16 columns, 32 k: block b's) into out[k][0..15] (row stride n).
template <int BITS, int FORM>
inline void dequantize_record(const uint8_t* tile, int64_t b, uint16_t* o, int64_t n) {
  const uint8_t* wb = tile + codes_offset(BITS, FORM, b);
  // lanes 2c (k even) to 0..15, lanes 2c + 1 (k odd) to 16..31
  static constexpr uint16_t kSplit[32] = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
                                          1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
  const __m512i split = _mm512_loadu_si512(kSplit);
  const __m512i nibble = _mm512_set1_epi16(0x0f), sixteen = _mm512_set1_epi16(16);
  __m512 s, z;
  record_affine16<BITS, FORM>(tile, b, s, z);
  // kHalves: w = s_half * u - 2^(BITS-1) s_half (one rounding of an exact value: 18-bit scales, 6-bit codes)
  __m512 scale[2] = {s, s}, zero[2] = {z, z};
  if constexpr (FORM == kHalves) {
    const __m512 minus_offset = _mm512_set1_ps(-static_cast<float>(1 << (BITS - 1)));
    scale[1] = z, zero[0] = _mm512_mul_ps(s, minus_offset), zero[1] = _mm512_mul_ps(z, minus_offset);
  }
  // codes u of k and k + 1 (32 lanes, column c's at 2c and 2c + 1) -> rows k, k + 1 of W^T
  const auto two_rows = [&](__m512i u, int64_t k) {
    const __m512 sk = scale[k >= 16], zk = zero[k >= 16];
    const __m512i cols = _mm512_permutexvar_epi16(split, u);
    const __m512 even = _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(cols)));
    const __m512 odd = _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(cols, 1)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + k * n), bf16x16(_mm512_fmadd_ps(even, sk, zk)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + (k + 1) * n), bf16x16(_mm512_fmadd_ps(odd, sk, zk)));
  };
  if constexpr (BITS == 8) {
    for (int q = 0; q < 16; ++q)
      two_rows(_mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * q))), 2 * q);
  } else {
    for (int q = 0; q < 8; ++q) {
      const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * q)));
      __m512i lo = _mm512_and_si512(v, nibble), hi = _mm512_srli_epi16(v, 4);
      if constexpr (BITS == 5) {  // the codes' fifth bits: chunk q's low nibbles' mask, then its high ones'
        uint32_t fifth[2];
        std::memcpy(fifth, wb + 256 + 8 * q, 8);
        lo = _mm512_mask_add_epi16(lo, fifth[0], lo, sixteen);
        hi = _mm512_mask_add_epi16(hi, fifth[1], hi, sixteen);
      }
      if constexpr (BITS == 6) six_bit_lanes16(v, high_bits16(wb + 256 + 32 * (q / 2)), q, lo, hi);
      two_rows(lo, 2 * q);
      two_rows(hi, 2 * q + 16);
    }
  }
}
#else
// The same values in plain loops (record_code and record_affine, as code_rows reads them).
template <int BITS, int FORM>
inline void dequantize_record(const uint8_t* tile, int64_t b, uint16_t* out, int64_t n) {
  const uint8_t* wb = tile + codes_offset(BITS, FORM, b);
  Affine a[2][16];  // kHalves: each half's; the other forms' one pair twice
  for (int c = 0; c < 16; ++c)
    for (int half = 0; half < 2; ++half) a[half][c] = record_affine(tile, BITS, FORM, c, b, FORM == kHalves && half);
  for (int p = 0; p < 16; ++p)
    for (int j = 0; j < 2; ++j) {
      uint16_t* o = out + (2 * p + j) * n;
      const Affine* ah = a[p >= 8];
      for (int c = 0; c < 16; ++c)
        o[c] = f2bf(ah[c].scale * static_cast<float>(record_code(wb, BITS, p, c, j)) + ah[c].zero);
    }
}
#endif

template <int BITS, int FORM>
inline void dequantize_tiles(const uint8_t* w, int64_t t0, int64_t t1, int64_t blocks, uint16_t* out, int64_t n) {
  constexpr int64_t rec = record_bytes<BITS, FORM>();
  // k-block outer: each of the 32 rows of W^T a block fills is written as one run over the thread's tiles (tile
  // by tile, a row apart, every store would touch another page of a large W^T)
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t t = t0; t < t1; ++t)
      dequantize_record<BITS, FORM>(w + t * blocks * rec, b, out + b * kQBlock * n + t * 16, n);
}

// W^T [K, N] bfloat16 of blocks [N / 16, K / 32, record] into `out` (resized; its storage kept across calls).
inline void code_dequantize_into(const at::Tensor& blocks_t, at::Tensor& out) {
  const std::optional<RecordKind> kind = record_kind(blocks_t.dim() == 3 ? blocks_t.size(2) : 0);
  TORCH_CHECK(kind && blocks_t.scalar_type() == at::kByte && blocks_t.is_contiguous(),
              "code_dequantize: weight blocks [N / 16, K / 32, bytes] uint8, contiguous");
  const int64_t tiles = blocks_t.size(0), blocks = blocks_t.size(1), n = tiles * 16, k = blocks * kQBlock;
  out.resize_({k, n});
  uint16_t* o = bf16_mut(out);
  const uint8_t* w = blocks_t.data_ptr<uint8_t>();
  TORCH_CHECK(!grouped(kind->form) || blocks % 8 == 0, "code_dequantize: super-block records in whole super-blocks");
  at::parallel_for(0, tiles, 8, [&](int64_t begin, int64_t end) {
    with_record_kind(*kind, [&](auto bits_c, auto form_c) {
      dequantize_tiles<decltype(bits_c)::value, decltype(form_c)::value>(w, begin, end, blocks, o, n);
    });
  });
}

// The op: a fresh W^T (the tests' view of what dequantized_mm multiplies).
inline at::Tensor code_dequantize(const at::Tensor& blocks_t) {
  at::Tensor out = at::empty({0}, at::TensorOptions().dtype(at::kBFloat16));
  code_dequantize_into(blocks_t, out);
  return out;
}

// x [rows, K] bfloat16 @ W^T -> [rows, N] bfloat16 through a per-thread scratch of W^T and oneDNN's bfloat16 GEMM:
// the many-row projections where no dense copy is kept (the compiled forward's, and the Python path's op).
inline at::Tensor dequantized_mm(const at::Tensor& x, const at::Tensor& blocks_t) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.size(1) == blocks_t.size(1) * kQBlock,
              "dequantized_mm: x [rows, K] bfloat16 against blocks [N / 16, K / 32, bytes]");
  thread_local at::Tensor scratch = at::empty({0}, at::TensorOptions().dtype(at::kBFloat16));
  code_dequantize_into(blocks_t, scratch);
  return at::mm(x, scratch);
}
