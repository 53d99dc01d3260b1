// x @ W^T for GGUF block-quantized weights with AVX512-VNNI integer dot products (models/quantized.py VnniWeight);
// included by cpu_decode.cpp inside its anonymous namespace (it uses f2bf and bf16_ptr from there).
//
// Why: torch's int4 kernel turns every weight into a float before multiplying, and its 2-plane form of a Q8_0
// matrix (the tied LM head) does the work twice. Here the weights stay 4- or 8-bit codes from memory to the
// multiplier: each 32-wide block of a row's activations is quantized to int16 once per call, and VPDPWSSD takes two
// codes times two activations a lane. int16, not llama.cpp's int8: int8 activations moved SmolLM2's logits 7% off the
// float32 reference and changed a greedy answer; int16's rounding (1/65534 of a block's largest value) does not
// show beside bfloat16's.
//
// Math, per output column n and block b: w = scale[n,b] * u + zero[n,b], u the unsigned code (0..15, or 0..255 for
// Q8_0), and the row's block x ~= xscale[b] * xq (xq int16, xscale = max|x| / 32767), so
//   sum_k w x = scale * xscale * sum(u * xq) + zero * sum(x),
// sum(x) the block's exact float sum. Accumulated in int32 within a block (at most 255 * 32767 * 32 < 2^31),
// in float32 across blocks.
//
// Layout (VnniWeight.from_codes): 16 output columns a tile; per tile and block one record, read front to back:
// 8 chunks of 32 bytes of codes (4-bit; 16 chunks 8-bit), then the 16 columns' scales, then their zeros (float16).
// Chunk q widened to 16-bit lanes holds, in lanes 2c and 2c + 1, column c's codes at k = 2q and 2q + 1: the pair
// one VPDPWSSD lane multiplies. With 4-bit codes those are the low nibbles, and the high nibbles hold pair q + 8.
// One stream per thread: the hardware prefetcher follows one stream better than three.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define STALLFREE_VNNI_MATMUL 1

constexpr int64_t kQBlock = 32;
constexpr int kMaxRowsAtOnce = 8;  // rows sharing one pass over a tile's weights: 8 int32 + 8 float accumulators
constexpr int64_t kPrefetchBytes = 1024;  // about 4 blocks ahead: the stream prefetcher restarts at each 4 KB page

// Each row's blocks of 32 as int16 codes with their scale and exact sum.
struct QuantizedRows {
  std::vector<int16_t> codes;  // [rows, K]
  std::vector<float> scale, sum;  // [rows, K / 32]
  int64_t rows = 0, k = 0;
};

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
template <int BITS>
constexpr int64_t record_bytes() {
  return BITS * kQBlock * 16 / 8 + 2 * 16 * 2;  // codes, then 16 float16 scales and 16 zeros
}

template <int BITS, int R>
inline void vnni_tile(const uint8_t* w, const QuantizedRows& x, int64_t r0, int64_t blocks, float* out) {
  constexpr int64_t code_bytes = BITS * kQBlock * 16 / 8, block_bytes = record_bytes<BITS>();
  const int64_t blocks_per_row = x.k / kQBlock;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi16(0x0f);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = w + b * block_bytes;
    for (int64_t line = 0; line < block_bytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(wb + kPrefetchBytes + line), _MM_HINT_T0);
    __m512i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
    const int32_t* xq[R];  // the rows' block as int16 pairs
    for (int r = 0; r < R; ++r) xq[r] = reinterpret_cast<const int32_t*>(x.codes.data() + (r0 + r) * x.k + b * kQBlock);
    if constexpr (BITS == 4) {
      for (int q = 0; q < 8; ++q) {
        const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * q)));
        const __m512i lo = _mm512_and_si512(v, nibble), hi = _mm512_srli_epi16(v, 4);
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
    const __m512 z = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + code_bytes + 32)));
    for (int r = 0; r < R; ++r) {
      const int64_t i = (r0 + r) * blocks_per_row + b;
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(s, _mm512_set1_ps(x.scale[i])), acc[r]);
      acc[r] = _mm512_fmadd_ps(z, _mm512_set1_ps(x.sum[i]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + 16 * r, acc[r]);
}

template <int BITS>
void vnni_tile_rows(const uint8_t* w, const QuantizedRows& x, int64_t r0, int rows, int64_t blocks, float* out) {
  switch (rows) {
    case 1: return vnni_tile<BITS, 1>(w, x, r0, blocks, out);
    case 2: return vnni_tile<BITS, 2>(w, x, r0, blocks, out);
    case 3: return vnni_tile<BITS, 3>(w, x, r0, blocks, out);
    case 4: return vnni_tile<BITS, 4>(w, x, r0, blocks, out);
    case 5: return vnni_tile<BITS, 5>(w, x, r0, blocks, out);
    case 6: return vnni_tile<BITS, 6>(w, x, r0, blocks, out);
    case 7: return vnni_tile<BITS, 7>(w, x, r0, blocks, out);
    default: return vnni_tile<BITS, 8>(w, x, r0, blocks, out);
  }
}

// x [rows, K] bfloat16 @ W^T -> [rows, N] bfloat16 (rounded once, from the float32 sum), or the float32 sums
// themselves when float_out (an LM head's logits: no bfloat16 ties among the top tokens). blocks: uint8
// [N / 16, K / 32, record bytes], the layout above.
at::Tensor vnni_matmul(const at::Tensor& x, const at::Tensor& blocks_t, int64_t bits, bool float_out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "vnni_matmul: x [rows, K] bfloat16");
  TORCH_CHECK(bits == 4 || bits == 8, "vnni_matmul: 4- or 8-bit codes");
  TORCH_CHECK(blocks_t.dim() == 3 && blocks_t.scalar_type() == at::kByte && blocks_t.is_contiguous(),
              "vnni_matmul: weight blocks [N / 16, K / 32, bytes] uint8, contiguous");
  const at::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0), k = xc.size(1), tiles = blocks_t.size(0), blocks = k / kQBlock;
  TORCH_CHECK(k % kQBlock == 0 && blocks_t.size(1) == blocks &&
                  blocks_t.size(2) == (bits == 4 ? record_bytes<4>() : record_bytes<8>()),
              "vnni_matmul: weight blocks do not match x's width");
  at::Tensor out = at::empty({rows, tiles * 16}, xc.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  if (rows == 0) return out;
  QuantizedRows q;
  quantize_rows(bf16_ptr(xc), rows, k, q);
  const uint8_t* w = blocks_t.data_ptr<uint8_t>();
  uint16_t* o = float_out ? nullptr : bf16_mut(out);
  float* of = float_out ? out.data_ptr<float>() : nullptr;
  const int64_t n = tiles * 16, tile_bytes = blocks_t.stride(0);
  at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
    float partial[16 * kMaxRowsAtOnce];
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t r0 = 0; r0 < rows; r0 += kMaxRowsAtOnce) {
        const int r = static_cast<int>(std::min<int64_t>(kMaxRowsAtOnce, rows - r0));
        if (bits == 4)
          vnni_tile_rows<4>(w + t * tile_bytes, q, r0, r, blocks, partial);
        else
          vnni_tile_rows<8>(w + t * tile_bytes, q, r0, r, blocks, partial);
        for (int i = 0; i < r; ++i) {
          if (of != nullptr)
            std::memcpy(of + (r0 + i) * n + t * 16, partial + 16 * i, 16 * sizeof(float));
          else
            for (int c = 0; c < 16; ++c) o[(r0 + i) * n + t * 16 + c] = f2bf(partial[16 * i + c]);
        }
      }
    }
  });
  return out;
}

#else
at::Tensor vnni_matmul(const at::Tensor&, const at::Tensor&, int64_t, bool) {
  TORCH_CHECK(false, "vnni_matmul: this CPU has no AVX512-VNNI");
}
#endif  // AVX512-VNNI
