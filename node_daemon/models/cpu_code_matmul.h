// x @ W^T straight from GGUF block codes on every x86 tier (models/quantized.py TiledCodes); included by
// cpu_decode.cpp inside its anonymous namespace (it uses f2bf and bf16_ptr from there).
//
// One layout, three kernels, chosen when the extension is compiled for a tier (models/cpu_tier.py):
//   AVX512-VNNI  cpu_vnni_matmul.h: VPDPWSSD, two codes times two activations a lane, 16 columns a register;
//   AVX2         here: VPMADDWD + VPADDD, the same products 8 columns a register (Haswell .. Zen 3);
//   portable     here: the same integer sums in plain loops (any other CPU; the compiler vectorizes what it can).
// Each 32-wide block of a row's activations is quantized to int16 once per call (xscale = max|x| / 32767) and
//   sum_k w x = scale * xscale * sum(u * xq) + zero * sum(x)
// for a weight w = scale * u + zero (u the unsigned code: 0..15, or 0..255 for Q8_0); the integer sums stay exact in
// int32 within a block (255 * 32767 * 32 < 2^31), float32 across blocks. So every tier computes the same sums, up to
// the order of the float32 additions across blocks. From code_matmul's int8_min_rows rows (many-row iterations,
// compute-bound) the VNNI and AVX2 bodies take int8 activations instead (xscale = max|x| / 127; sum(x) then the
// rounded activations' sum): VPDPBUSD and VPMADDUBSW, twice the products an instruction.
//
// Layout: 16 output columns a tile; per tile and block one record: 8 chunks of 32 bytes of codes (4-bit; 16 chunks
// 8-bit), then the 16 columns' scales and zeros (RecordForm below says how). Chunk q's byte pair 2c, 2c + 1 holds
// column c's codes at k = 2q, 2q + 1; with 4-bit codes those are the low nibbles, and the high nibbles hold k = 2q + 16, 2q + 17.
// 5-bit codes (Q5_0, Q5_1, Q5_K: 6 bits a weight with scale and zero, where 8-bit codes took 9) are the 4-bit record
// with 64 bytes more before the scales: per chunk q two little-endian uint32 masks, the low nibbles' fifth bits then
// the high nibbles', bit i for byte i of the chunk.
//
// On AVX2 and portable CPUs the same kernel also takes many-row iterations (prefill chunks): there is no oneDNN
// bfloat16 GEMM below AVX-512, and codes read once per tile serve up to kMaxRowsAtOnce rows from registers.
#pragma once

constexpr int64_t kQBlock = 32;
// A 4 KB page ahead: the stream prefetcher restarts at each page, and the one-row kernels run between short gaps (a
// layer's four projections, the head after them) that leave it cold. 1 KB ahead, one row of Gemma 3's 1.8 MB Q5_0
// gate/up projection took 39-40 us from memory, a page ahead 31-34 (the forward's step clock split by projection, one
// stream served by the engine, the two builds alternating on a 2-core AMD EPYC).
constexpr int64_t kPrefetchBytes = 4096;

// How a record holds its 16 columns' scale and zero (w = scale * u + zero):
//   kZeros      float16 scales, then float16 zeros (Q4_1, Q5_1, mixed parts, re-coded types);
//   kSymmetric  float16 scales alone: a symmetric type (Q4_0, Q5_0, Q8_0, IQ4, Q3_K, Q6_K re-coded: zero =
//               -2^(BITS-1) scale in every block), the file's own bytes (8.5 bits a Q8_0 weight, not 9);
//   kSuper      Q4_K's and Q5_K's own integers, a 256-weight super-block's 8 records grouped: their 8 codes (each
//               on whole 64-byte lines), then their 8 x 32 bytes of 16 uint8 sub-block scales sc and 16 uint8 mins
//               m, then the super-block's header, 16 float16 d and 16 float16 dmin; scale = d * sc, zero = -dmin *
//               m, both exact in float32 (the file's values, as llama.cpp's dequantization gives them). 4.625 bits
//               a Q4_K weight where float16 scales and zeros took 5 (the file: 4.5); codes_offset and
//               affine_offset say where a block's parts lie.
//   kHalves     Q6_K's own integers, grouped as kSuper's: 6-bit codes u = q + 32 (the 4-bit record's nibbles,
//               then per pair of chunks 2m, 2m + 1 32 bytes of their codes' high two bits: byte i holds those of
//               chunk 2m's byte i's low nibble in bits 0-1, chunk 2m + 1's in 2-3, and of their high nibbles in
//               4-5 and 6-7, so that a shift and a masked merge make a code), each block's 16 int8 scales of its
//               first 16 k (the low nibbles) and 16 of its last 16, the header's 16 float16 d (its dmin half
//               zero); w = (d * sc) * (u - 32), exactly gguf's. 6.625 bits a weight, the file's 6.5625,
//               where the 8-bit re-coding took 8.5. Q3_K's own integers take the same form with 3-bit codes
//               u = q + 4 in the 4-bit record's nibbles (no plane of high bits), its int8 scales sc - 32 and a
//               header of its 16 float16 d alone (32 bytes a super-block): w = (d * sc) * (u - 4), 4.5625 bits a
//               weight (the file: 3.4375) where the 8-bit codes took 8.5. The offset is 2^(BITS-1) either way.
//               Run by the AVX512-VNNI kernel (the other tiers' tilers keep the 8-bit codes:
//               models/kquant_tiles.py halves_records).
enum RecordForm : int { kZeros = 0, kSymmetric = 1, kSuper = 2, kHalves = 3 };

// kSuper and kHalves: a super-block's 8 records stored grouped (codes, integers, header).
constexpr bool grouped(int form) { return form == kSuper || form == kHalves; }

// A record's bytes of codes (and fifth, sixth bits): 3-bit codes (kHalves) sit in the 4-bit record's nibbles.
constexpr int64_t code_bytes(int bits) { return (bits == 3 ? 4 : bits) * kQBlock * 16 / 8; }

constexpr int64_t record_size(int bits, int form) {  // codes, then scales and zeros (grouped: a header's share)
  return code_bytes(bits) + (form == kZeros ? 64 : form == kSymmetric ? 32 : bits == 3 ? 36 : 40);
}
template <int BITS, int FORM = kZeros>
constexpr int64_t record_bytes() {
  return record_size(BITS, FORM);
}

// How far ahead the one-row kernels prefetch: grouped records a super-block (8 records) ahead, so that a
// super-block's header, stored after its 8 records' codes and integers, has arrived when its first block is read
// (with 1 KB the header's load stalled the kernel: one row of a 64k x 2k Q4_K matrix took 1.43 ms against 1.26).
template <int BITS, int FORM>
constexpr int64_t kSuperAhead() {
  return grouped(FORM) ? 8 * record_bytes<BITS, FORM>() : kPrefetchBytes;
}

// A record's size says its codes' bits and its form (every size differs).
struct RecordKind {
  int bits;
  int form;
};
inline std::optional<RecordKind> record_kind(int64_t bytes) {
  if (bytes == record_bytes<4>()) return RecordKind{4, kZeros};
  if (bytes == record_bytes<5>()) return RecordKind{5, kZeros};
  if (bytes == record_bytes<8>()) return RecordKind{8, kZeros};
  if (bytes == record_bytes<4, kSymmetric>()) return RecordKind{4, kSymmetric};
  if (bytes == record_bytes<5, kSymmetric>()) return RecordKind{5, kSymmetric};
  if (bytes == record_bytes<8, kSymmetric>()) return RecordKind{8, kSymmetric};
  if (bytes == record_bytes<4, kSuper>()) return RecordKind{4, kSuper};
  if (bytes == record_bytes<5, kSuper>()) return RecordKind{5, kSuper};
  if (bytes == record_bytes<6, kHalves>()) return RecordKind{6, kHalves};
  if (bytes == record_bytes<3, kHalves>()) return RecordKind{3, kHalves};
  return std::nullopt;
}

// Where block b's codes and its scales (or sc and m) lie from its tile's first record; grouped forms: its
// super-block's header too. The other forms keep a record whole: codes, then the affine part.
constexpr int64_t codes_offset(int bits, int form, int64_t b) {
  const int64_t rec = record_size(bits, form);
  return grouped(form) ? (b / 8) * 8 * rec + (b % 8) * code_bytes(bits) : b * rec;
}
constexpr int64_t affine_offset(int bits, int form, int64_t b) {
  const int64_t rec = record_size(bits, form);
  return grouped(form) ? (b / 8) * 8 * rec + 8 * code_bytes(bits) + (b % 8) * 32 : b * rec + code_bytes(bits);
}
constexpr int64_t header_offset(int bits, int64_t b) {  // kSuper's and kHalves' records are the same size
  return (b / 8) * 8 * record_size(bits, kSuper) + 8 * (code_bytes(bits) + 32);
}

// Each row's blocks of 32 as int16 codes with their scale and exact sum.
struct QuantizedRows {
  std::vector<int16_t> codes;  // [rows, K]
  std::vector<float> scale, sum;  // [rows, K / 32]
  std::vector<int32_t> half_sum;  // [rows, K / 32, 2]: each block's first and last 16 codes summed (kHalves, VNNI)
  int64_t rows = 0, k = 0;
};

// The same with int8 codes (the AVX512-VNNI kernel's many-row form: cpu_vnni_matmul.h).
struct QuantizedRows8 {
  std::vector<int8_t> codes;  // [rows, K]
  std::vector<float> scale, sum;  // [rows, K / 32]
  std::vector<int32_t> half_sum;  // [rows, K / 32, 2]: each block's first and last 16 codes summed (kHalves, VNNI)
  int64_t rows = 0, k = 0;
};

// Portable quantization (round to nearest even, as the AVX-512 one): rows * K values, small beside the matmul.
inline void quantize_rows_portable(const uint16_t* x, int64_t rows, int64_t k, QuantizedRows& q) {
  const int64_t blocks = k / kQBlock;
  q.rows = rows, q.k = k;
  q.codes.resize(rows * k), q.scale.resize(rows * blocks), q.sum.resize(rows * blocks);
  at::parallel_for(0, rows * blocks, 256, [&](int64_t begin, int64_t end) {
    float v[kQBlock];
    for (int64_t i = begin; i < end; ++i) {
      float amax = 0.f, sum = 0.f;
      for (int64_t j = 0; j < kQBlock; ++j) {
        v[j] = bf2f(x[i * kQBlock + j]);
        amax = std::max(amax, std::fabs(v[j]));
        sum += v[j];
      }
      const float m = amax > 0.f ? 32767.f / amax : 0.f;
      int16_t* dst = q.codes.data() + i * kQBlock;
      for (int64_t j = 0; j < kQBlock; ++j) dst[j] = static_cast<int16_t>(std::nearbyint(v[j] * m));
      q.scale[i] = amax / 32767.f;
      q.sum[i] = sum;
    }
  });
}

// The same to int8 (xscale = max|x| / 127), and the sum the zero term multiplies taken over the rounded values
// (cpu_vnni_matmul.h's quantize_rows_int8 says why).
inline void quantize_rows_int8_portable(const uint16_t* x, int64_t rows, int64_t k, QuantizedRows8& q) {
  const int64_t blocks = k / kQBlock;
  q.rows = rows, q.k = k;
  q.codes.resize(rows * k), q.scale.resize(rows * blocks), q.sum.resize(rows * blocks);
  at::parallel_for(0, rows * blocks, 256, [&](int64_t begin, int64_t end) {
    float v[kQBlock];
    for (int64_t i = begin; i < end; ++i) {
      float amax = 0.f;
      for (int64_t j = 0; j < kQBlock; ++j) {
        v[j] = bf2f(x[i * kQBlock + j]);
        amax = std::max(amax, std::fabs(v[j]));
      }
      const float m = amax > 0.f ? 127.f / amax : 0.f;
      int8_t* dst = q.codes.data() + i * kQBlock;
      int32_t total = 0;
      for (int64_t j = 0; j < kQBlock; ++j) {
        dst[j] = static_cast<int8_t>(std::max(-127.f, std::min(127.f, std::nearbyint(v[j] * m))));
        total += dst[j];
      }
      q.scale[i] = amax / 127.f;
      q.sum[i] = static_cast<float>(total) * q.scale[i];
    }
  });
}

inline float half_to_float(uint16_t h) {
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

// One record's code u of column c at k = 2p + j (the layout above; bits 3, 4, 5, 6 or 8), and column c's scale and
// zero (w = scale * u + zero): what code_rows and the portable dequantization read, one value at a time.
inline int record_code(const uint8_t* rb, int bits, int p, int c, int j) {
  if (bits == 8) return rb[32 * p + 2 * c + j];
  const uint8_t byte = rb[32 * (p % 8) + 2 * c + j];
  int u = p < 8 ? byte & 15 : byte >> 4;
  if (bits == 5) {
    uint32_t mask;
    std::memcpy(&mask, rb + 256 + 4 * (2 * (p % 8) + (p >= 8)), 4);
    u += 16 * static_cast<int>((mask >> (2 * c + j)) & 1);
  }
  if (bits == 6) {  // the chunk pair's byte of high bits (kHalves above)
    const int q = p % 8, high = rb[256 + 32 * (q / 2) + 2 * c + j];
    u += 16 * ((high >> (2 * (q % 2) + 4 * (p >= 8))) & 3);
  }
  return u;
}

struct Affine {
  float scale, zero;
};
// Column c's scale and zero in block b of the tile whose first record is `tile`; kHalves: of the block's first
// (half 0: k < 16) or last 16 k, zero = -2^(bits-1) scale (exact: the float16 d times an int8 scale has 18 bits).
inline Affine record_affine(const uint8_t* tile, int bits, int form, int c, int64_t b, int half = 0) {
  const uint8_t* a = tile + affine_offset(bits, form, b);
  if (form == kHalves) {
    const uint16_t* header = reinterpret_cast<const uint16_t*>(tile + header_offset(bits, b));
    const float scale = half_to_float(header[c]) * static_cast<float>(static_cast<int8_t>(a[16 * half + c]));
    return {scale, -static_cast<float>(1 << (bits - 1)) * scale};
  }
  if (form == kSuper) {
    const uint16_t* header = reinterpret_cast<const uint16_t*>(tile + header_offset(bits, b));
    return {half_to_float(header[c]) * static_cast<float>(a[c]),
            -(half_to_float(header[16 + c]) * static_cast<float>(a[16 + c]))};
  }
  const uint16_t* sz = reinterpret_cast<const uint16_t*>(a);
  const float scale = half_to_float(sz[c]);
  return {scale, form == kZeros ? half_to_float(sz[16 + c]) : -static_cast<float>(1 << (bits - 1)) * scale};
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// The 16 columns' scale and zero of a block whose scales (or sc and m) are at `affine`; kSuper: under its
// super-block's d and dmin; kHalves: s the first 16 k's scale d * sc, z the last 16's (the kernels take u - 2^(BITS-1)).
// What the VNNI kernel and the AVX-512 dequantization both read.
template <int BITS, int FORM>
inline void affine16(const uint8_t* affine, __m512 d, __m512 dmin, __m512& s, __m512& z) {
  if constexpr (FORM == kHalves) {
    const auto bytes = [](const uint8_t* p) {
      return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    };
    s = _mm512_mul_ps(d, bytes(affine));
    z = _mm512_mul_ps(d, bytes(affine + 16));
  } else if constexpr (FORM == kSuper) {
    const auto bytes = [](const uint8_t* p) {
      return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    };
    s = _mm512_mul_ps(d, bytes(affine));
    z = _mm512_xor_ps(_mm512_mul_ps(dmin, bytes(affine + 16)), _mm512_set1_ps(-0.0f));  // -(dmin m)
  } else {
    s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(affine)));
    z = FORM == kZeros ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(affine + 32)))
                       : _mm512_mul_ps(s, _mm512_set1_ps(-static_cast<float>(1 << (BITS - 1))));
  }
}

// kHalves: a 4-bit code in each byte of `low` with the high two bits that `high` holds at bits 4-5 of the same byte
// (one ternary-logic op: low | (high & 0x30)). Bytes or int16 lanes alike: only bits 4-5 of each byte are taken.
inline __m512i with_high_bits(__m512i low, __m512i high) {
  constexpr int kOrMasked = 0xf8;  // a | (b & c)
  return _mm512_ternarylogic_epi32(low, high, _mm512_set1_epi8(0x30), kOrMasked);
}

// kHalves: chunk q's 6-bit codes as int16 lanes from its bytes v (16-bit lanes, one byte each) and its pair's plane
// of high bits h (the same lanes): the low nibbles' codes (k = 2q, 2q + 1) in lo, the high nibbles' in hi.
inline void six_bit_lanes16(__m512i v, __m512i h, int q, __m512i& lo, __m512i& hi) {
  if (q % 2) h = _mm512_srli_epi16(h, 2);  // chunk 2m + 1's bits to where chunk 2m's are
  lo = with_high_bits(_mm512_and_si512(v, _mm512_set1_epi16(0x0f)), _mm512_slli_epi16(h, 4));
  hi = with_high_bits(_mm512_srli_epi16(v, 4), h);
}

// kHalves: a chunk pair's plane of high bits (32 bytes at `plane`) as int16 lanes, one byte each.
inline __m512i high_bits16(const uint8_t* plane) {
  return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(plane)));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include "cpu_vnni_matmul.h"  // quantize_rows, code_tile_rows and kMaxRowsAtOnce for AVX512-VNNI

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int kMaxRowsAtOnce = 4;  // rows sharing one pass over a tile's codes (3: no faster at 16 or 256 rows)

// The 16 columns' scales and zeros of the records along one tile's K, block by block (s[0], z[0]: columns 0-7;
// s[1], z[1]: 8-15): read from each record, or made from a super-block's header (read at its first block and kept
// for its 8) and each block's integer scales and mins.
template <int BITS, int FORM>
struct BlockAffine {
  __m256 d[2], dmin[2];  // kSuper: the current super-block's header
  __m256 s[2], z[2];

  static __m256 bytes_as_float(const uint8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }

  // Block b of the tile whose first record is `tile`, the blocks taken in order along K.
  inline void at(const uint8_t* tile, int64_t b) {
    const uint8_t* affine = tile + affine_offset(BITS, FORM, b);
    if constexpr (FORM == kSuper) {
      if (b % 8 == 0) {
        const __m128i* header = reinterpret_cast<const __m128i*>(tile + header_offset(BITS, b));
        for (int h = 0; h < 2; ++h) {
          d[h] = _mm256_cvtph_ps(_mm_loadu_si128(header + h));
          dmin[h] = _mm256_cvtph_ps(_mm_loadu_si128(header + 2 + h));
        }
      }
      const __m256 sign = _mm256_set1_ps(-0.0f);
      for (int h = 0; h < 2; ++h) {
        s[h] = _mm256_mul_ps(d[h], bytes_as_float(affine + 8 * h));
        z[h] = _mm256_xor_ps(_mm256_mul_ps(dmin[h], bytes_as_float(affine + 16 + 8 * h)), sign);  // -(dmin m)
      }
    } else {
      const __m128i* sp = reinterpret_cast<const __m128i*>(affine);
      const __m256 implicit = _mm256_set1_ps(-static_cast<float>(1 << (BITS - 1)));
      for (int h = 0; h < 2; ++h) {
        s[h] = _mm256_cvtph_ps(_mm_loadu_si128(sp + h));
        z[h] = FORM == kZeros ? _mm256_cvtph_ps(_mm_loadu_si128(sp + 2 + h)) : _mm256_mul_ps(s[h], implicit);
      }
    }
  }
};

// One record's integer sums (columns 0-7 in dot[r][0], 8-15 in dot[r][1]) added into R rows of `out`: the codes'
// scale times each row's activation scale, plus the zero times the row's activation sum. `first`: row r0's index
// into x's per-block scale and sum, `stride` the next row's distance. Both activation forms (int16:
// QuantizedRows, int8: QuantizedRows8) end a block here.
template <int BITS, int FORM, int R, typename Rows>
inline void fold_block(const BlockAffine<BITS, FORM>& a, const __m256i (*dot)[2], const Rows& x, int64_t first,
                       int64_t stride, float* out) {
  for (int r = 0; r < R; ++r) {
    const int64_t i = first + r * stride;
    const __m256 xs = _mm256_set1_ps(x.scale[i]), xsum = _mm256_set1_ps(x.sum[i]);
    float* o = out + 16 * r;
    const __m256 a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][0]), _mm256_mul_ps(a.s[0], xs), _mm256_loadu_ps(o));
    const __m256 a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][1]), _mm256_mul_ps(a.s[1], xs), _mm256_loadu_ps(o + 8));
    _mm256_storeu_ps(o, _mm256_fmadd_ps(a.z[0], xsum, a0));
    _mm256_storeu_ps(o + 8, _mm256_fmadd_ps(a.z[1], xsum, a1));
  }
}

// One tile's 16 columns for rows r0 .. r0 + R - 1 -> out[r][c] (float32, 16 a row). The float32 sums live in `out`
// (read and written once a block), so the 2R int32 sums, the codes and the broadcast activations keep AVX2's 16
// registers: held in registers too they spilled, and the int32 sums went through the stack at every product (1.6x
// slower at 16 rows). (A block in two halves of 8 columns, one sum a row: 1.4x slower at one row.)
template <int BITS, int FORM, int R>
inline void code_tile(const uint8_t* w, const QuantizedRows& x, int64_t r0, int64_t blocks, float* out) {
  constexpr int64_t block_bytes = record_bytes<BITS, FORM>();
  constexpr int chunks = BITS == 8 ? 16 : 8;
  const int64_t blocks_per_row = x.k / kQBlock;
  BlockAffine<BITS, FORM> affine;
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + 16 * r, _mm256_setzero_ps());
    _mm256_storeu_ps(out + 16 * r + 8, _mm256_setzero_ps());
  }
  const __m256i nibble = _mm256_set1_epi16(0x0f);
  // 5-bit codes: 16 where bit i of a 16-bit mask is set, in int16 lane i
  const __m256i lane_bit = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                                             static_cast<int16_t>(0x8000));
  const auto fifth_bits = [&](uint32_t mask) {
    const __m256i hit = _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16(static_cast<int16_t>(mask)), lane_bit),
                                           lane_bit);
    return _mm256_and_si256(hit, _mm256_set1_epi16(16));
  };
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = w + codes_offset(BITS, FORM, b);
    for (int64_t line = 0; line < block_bytes; line += 64)  // the records' bytes as a stream, a block's worth a block
      _mm_prefetch(reinterpret_cast<const char*>(w + b * block_bytes + kSuperAhead<BITS, FORM>() + line), _MM_HINT_T0);
    __m256i dot[R][2];
    for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
    const int32_t* xq = reinterpret_cast<const int32_t*>(x.codes.data() + r0 * x.k + b * kQBlock);
    const int64_t row_pairs = x.k / 2;  // int16 pairs from one row's block to the next row's

    for (int q = 0; q < chunks; ++q) {
      const __m128i* chunk = reinterpret_cast<const __m128i*>(wb + 32 * q);
      // columns 0-7 and 8-15, each lane pair one column's two codes
      const __m256i v0 = _mm256_cvtepu8_epi16(_mm_loadu_si128(chunk));
      const __m256i v1 = _mm256_cvtepu8_epi16(_mm_loadu_si128(chunk + 1));
      if constexpr (BITS != 8) {
        __m256i lo0 = _mm256_and_si256(v0, nibble), hi0 = _mm256_srli_epi16(v0, 4);
        __m256i lo1 = _mm256_and_si256(v1, nibble), hi1 = _mm256_srli_epi16(v1, 4);
        if constexpr (BITS == 5) {
          const uint32_t* fifth = reinterpret_cast<const uint32_t*>(wb + 256) + 2 * q;
          lo0 = _mm256_add_epi16(lo0, fifth_bits(fifth[0])), lo1 = _mm256_add_epi16(lo1, fifth_bits(fifth[0] >> 16));
          hi0 = _mm256_add_epi16(hi0, fifth_bits(fifth[1])), hi1 = _mm256_add_epi16(hi1, fifth_bits(fifth[1] >> 16));
        }
        for (int r = 0; r < R; ++r) {
          const __m256i xa = _mm256_set1_epi32(xq[r * row_pairs + q]), xb = _mm256_set1_epi32(xq[r * row_pairs + q + 8]);
          dot[r][0] = _mm256_add_epi32(dot[r][0], _mm256_add_epi32(_mm256_madd_epi16(lo0, xa), _mm256_madd_epi16(hi0, xb)));
          dot[r][1] = _mm256_add_epi32(dot[r][1], _mm256_add_epi32(_mm256_madd_epi16(lo1, xa), _mm256_madd_epi16(hi1, xb)));
        }
      } else {
        for (int r = 0; r < R; ++r) {
          const __m256i xa = _mm256_set1_epi32(xq[r * row_pairs + q]);
          dot[r][0] = _mm256_add_epi32(dot[r][0], _mm256_madd_epi16(v0, xa));
          dot[r][1] = _mm256_add_epi32(dot[r][1], _mm256_madd_epi16(v1, xa));
        }
      }
    }
    affine.at(w, b);
    fold_block<BITS, FORM, R>(affine, dot, x, r0 * blocks_per_row + b, blocks_per_row, out);
  }
}

template <int BITS, int FORM>
void code_tile_rows(const uint8_t* w, const QuantizedRows& x, int64_t r0, int rows, int64_t blocks, float* out) {
  switch (rows) {
    case 1: return code_tile<BITS, FORM, 1>(w, x, r0, blocks, out);
    case 2: return code_tile<BITS, FORM, 2>(w, x, r0, blocks, out);
    case 3: return code_tile<BITS, FORM, 3>(w, x, r0, blocks, out);
    default: return code_tile<BITS, FORM, 4>(w, x, r0, blocks, out);
  }
}
constexpr const char* kCodeKernel = "avx2";
inline void quantize_rows(const uint16_t* x, int64_t rows, int64_t k, QuantizedRows& q) {
  quantize_rows_portable(x, rows, k, q);
}

// int8 activations for 4- and 5-bit codes (many-row iterations: code_matmul's int8_min_rows): VPMADDUBSW multiplies
// a column's two unsigned codes by two int8 activations into one int16, 16 columns a register, where VPMADDWD's
// int16 products took two registers of 8; the int16 sums are widened to int32 every 4 chunks (4-bit: 4 x 2 x 15 x
// 127 fits int16) or 2 (5-bit). 8-bit codes keep int16 (their products overflow VPMADDUBSW's int16 pairs).
#define STALLFREE_INT8_MATMUL 1
constexpr bool int8_takes(int bits) { return bits != 8; }
inline void quantize_rows_int8(const uint16_t* x, int64_t rows, int64_t k, QuantizedRows8& q) {
  quantize_rows_int8_portable(x, rows, k, q);
}

// A 32-bit mask as 32 bytes of 16 (bit set) or 0: a 5-bit code's fifth bit on the bytes of its chunk.
inline __m256i fifth_bit_bytes(uint32_t mask) {
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,  // bytes 0, 1 of the mask
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);  // bytes 2, 3
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  const __m256i hit = _mm256_cmpeq_epi8(
      _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(mask)), spread), bit), bit);
  return _mm256_and_si256(hit, _mm256_set1_epi8(16));
}

template <int BITS, int FORM, int R>
inline void code_tile8(const uint8_t* w, const QuantizedRows8& x, int64_t r0, int64_t blocks, float* out) {
  static_assert(BITS == 4 || BITS == 5, "int8 activations on AVX2 take 4- and 5-bit codes");
  constexpr int64_t block_bytes = record_bytes<BITS, FORM>();
  constexpr int flush = BITS == 4 ? 4 : 2;  // chunks summed in int16 before widening
  const int64_t blocks_per_row = x.k / kQBlock;
  BlockAffine<BITS, FORM> affine;
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + 16 * r, _mm256_setzero_ps());
    _mm256_storeu_ps(out + 16 * r + 8, _mm256_setzero_ps());
  }
  const __m256i nibble = _mm256_set1_epi8(0x0f);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = w + codes_offset(BITS, FORM, b);
    for (int64_t line = 0; line < block_bytes; line += 64)  // the records' bytes as a stream, a block's worth a block
      _mm_prefetch(reinterpret_cast<const char*>(w + b * block_bytes + kSuperAhead<BITS, FORM>() + line), _MM_HINT_T0);
    __m256i dot[R][2], part[R];
    for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = part[r] = _mm256_setzero_si256();
    const int16_t* xp = reinterpret_cast<const int16_t*>(x.codes.data() + r0 * x.k + b * kQBlock);
    const int64_t row_pairs = x.k / 2;  // int8 pairs from one row's block to the next row's
    for (int q = 0; q < 8; ++q) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * q));
      __m256i lo = _mm256_and_si256(v, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
      if constexpr (BITS == 5) {
        const uint32_t* fifth = reinterpret_cast<const uint32_t*>(wb + 256) + 2 * q;
        lo = _mm256_add_epi8(lo, fifth_bit_bytes(fifth[0]));
        hi = _mm256_add_epi8(hi, fifth_bit_bytes(fifth[1]));
      }
      for (int r = 0; r < R; ++r) {
        const __m256i xa = _mm256_set1_epi16(xp[r * row_pairs + q]), xb = _mm256_set1_epi16(xp[r * row_pairs + q + 8]);
        part[r] = _mm256_add_epi16(part[r], _mm256_add_epi16(_mm256_maddubs_epi16(lo, xa), _mm256_maddubs_epi16(hi, xb)));
      }
      if ((q + 1) % flush == 0) {
        for (int r = 0; r < R; ++r) {  // column c's int16 sum is lane c: columns 0-7 low, 8-15 high
          dot[r][0] = _mm256_add_epi32(dot[r][0], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(part[r])));
          dot[r][1] = _mm256_add_epi32(dot[r][1], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(part[r], 1)));
          part[r] = _mm256_setzero_si256();
        }
      }
    }
    affine.at(w, b);
    fold_block<BITS, FORM, R>(affine, dot, x, r0 * blocks_per_row + b, blocks_per_row, out);
  }
}

template <int BITS, int FORM>
void code_tile_rows8(const uint8_t* w, const QuantizedRows8& x, int64_t r0, int rows, int64_t blocks, float* out) {
  if constexpr (BITS == 8) {
    TORCH_CHECK(false, "code_matmul: no int8 activations for 8-bit codes on AVX2");
  } else {
    switch (rows) {
      case 1: return code_tile8<BITS, FORM, 1>(w, x, r0, blocks, out);
      case 2: return code_tile8<BITS, FORM, 2>(w, x, r0, blocks, out);
      case 3: return code_tile8<BITS, FORM, 3>(w, x, r0, blocks, out);
      default: return code_tile8<BITS, FORM, 4>(w, x, r0, blocks, out);
    }
  }
}

#else
constexpr int kMaxRowsAtOnce = 4;

// The same sums in plain loops: column c's codes of pair p are bytes 2c, 2c + 1 of chunk p (4-bit: low nibbles for
// pairs 0-7, high nibbles for pairs 8-15).
template <int BITS, int FORM>
void code_tile_rows(const uint8_t* w, const QuantizedRows& x, int64_t r0, int rows, int64_t blocks, float* out) {
  const int64_t blocks_per_row = x.k / kQBlock;
  float acc[kMaxRowsAtOnce][16] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = w + codes_offset(BITS, FORM, b);
    int32_t dot[kMaxRowsAtOnce][16] = {};
    for (int p = 0; p < 16; ++p) {
      const uint8_t* chunk = wb + 32 * (BITS == 8 ? p : p % 8);
      uint32_t fifth = 0;  // 5-bit codes: this half chunk's mask
      if (BITS == 5) std::memcpy(&fifth, wb + 256 + 4 * (2 * (p % 8) + (p >= 8)), 4);
      for (int r = 0; r < rows; ++r) {
        const int16_t* xq = x.codes.data() + (r0 + r) * x.k + b * kQBlock + 2 * p;
        for (int c = 0; c < 16; ++c) {
          int32_t u0 = chunk[2 * c], u1 = chunk[2 * c + 1];
          if (BITS != 8) u0 = p < 8 ? u0 & 15 : u0 >> 4, u1 = p < 8 ? u1 & 15 : u1 >> 4;
          if (BITS == 5) u0 += 16 * ((fifth >> (2 * c)) & 1), u1 += 16 * ((fifth >> (2 * c + 1)) & 1);
          dot[r][c] += u0 * xq[0] + u1 * xq[1];
        }
      }
    }
    Affine a[16];
    for (int c = 0; c < 16; ++c) a[c] = record_affine(w, BITS, FORM, c, b);
    for (int r = 0; r < rows; ++r) {
      const int64_t i = (r0 + r) * blocks_per_row + b;
      for (int c = 0; c < 16; ++c)
        acc[r][c] += static_cast<float>(dot[r][c]) * (a[c].scale * x.scale[i]) + a[c].zero * x.sum[i];
    }
  }
  for (int r = 0; r < rows; ++r) std::memcpy(out + 16 * r, acc[r], 16 * sizeof(float));
}
constexpr const char* kCodeKernel = "portable";
inline void quantize_rows(const uint16_t* x, int64_t rows, int64_t k, QuantizedRows& q) {
  quantize_rows_portable(x, rows, k, q);
}
#endif

// f(bits, form) with the record kind's bits and form as compile-time constants (std::integral_constant): the
// kernels are templates on both. kSuper records hold 4- and 5-bit codes only (Q4_K, Q5_K), kHalves 6- and 3-bit
// ones (Q6_K, Q3_K), run where the tier has AVX512-VNNI.
template <typename F>
inline void with_record_kind(const RecordKind& kind, F&& f) {
  using std::integral_constant;
  if (kind.form == kHalves) {
#ifdef STALLFREE_VNNI_MATMUL
    if (kind.bits == 3) return f(integral_constant<int, 3>{}, integral_constant<int, kHalves>{});
    return f(integral_constant<int, 6>{}, integral_constant<int, kHalves>{});
#else
    TORCH_CHECK(false, "code kernel: 6- and 3-bit records (Q6_K's and Q3_K's own) run on AVX512-VNNI only");
#endif
  }
  const auto forms = [&](auto bits_c) {
    if (kind.form == kZeros) return f(bits_c, integral_constant<int, kZeros>{});
    if (kind.form == kSymmetric) return f(bits_c, integral_constant<int, kSymmetric>{});
    if constexpr (decltype(bits_c)::value != 8) return f(bits_c, integral_constant<int, kSuper>{});
    TORCH_CHECK(false, "code kernel: no super-block records of 8-bit codes");
  };
  if (kind.bits == 4) return forms(integral_constant<int, 4>{});
  if (kind.bits == 5) return forms(integral_constant<int, 5>{});
  return forms(integral_constant<int, 8>{});
}

// x [rows, K] bfloat16 @ W^T -> [rows, N] bfloat16 (rounded once, from the float32 sum), or the float32 sums when
// float_out (an LM head's logits). blocks: uint8 [N / 16, K / 32, record bytes]. From int8_min_rows rows (0: never)
// the activations are quantized to int8 where the tier has an int8 kernel (AVX512-VNNI): past a few rows the int16
// products are compute-bound and int8 doubles the products an instruction; a few rows are memory-bound, and keep
// int16's finer rounding.
at::Tensor code_matmul(const at::Tensor& x, const at::Tensor& blocks_t, int64_t bits, bool float_out,
                       int64_t int8_min_rows) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "code_matmul: x [rows, K] bfloat16");
  TORCH_CHECK(bits == 3 || bits == 4 || bits == 5 || bits == 6 || bits == 8, "code_matmul: 3-, 4-, 5-, 6- or 8-bit codes");
  const std::optional<RecordKind> kind = record_kind(blocks_t.dim() == 3 ? blocks_t.size(2) : 0);
  TORCH_CHECK(blocks_t.dim() == 3 && blocks_t.scalar_type() == at::kByte && blocks_t.is_contiguous(),
              "code_matmul: weight blocks [N / 16, K / 32, bytes] uint8, contiguous");
  const at::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0), k = xc.size(1), tiles = blocks_t.size(0), blocks = k / kQBlock;
  TORCH_CHECK(k % kQBlock == 0 && blocks_t.size(1) == blocks && kind && kind->bits == bits,
              "code_matmul: weight blocks do not match x's width");
  TORCH_CHECK(!grouped(kind->form) || blocks % 8 == 0, "code_matmul: super-block records in whole super-blocks");
  at::Tensor out = at::empty({rows, tiles * 16}, xc.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  if (rows == 0) return out;
  QuantizedRows q;
#ifdef STALLFREE_INT8_MATMUL
  QuantizedRows8 q8;
  const bool int8 = int8_min_rows > 0 && rows >= int8_min_rows && int8_takes(static_cast<int>(bits));
  int8 ? quantize_rows_int8(bf16_ptr(xc), rows, k, q8) : quantize_rows(bf16_ptr(xc), rows, k, q);
#else
  (void)int8_min_rows;
  constexpr bool int8 = false;
  quantize_rows(bf16_ptr(xc), rows, k, q);
#endif
  const uint8_t* w = blocks_t.data_ptr<uint8_t>();
  uint16_t* o = float_out ? nullptr : bf16_mut(out);
  float* of = float_out ? out.data_ptr<float>() : nullptr;
  const int64_t n = tiles * 16, tile_bytes = blocks_t.stride(0);
  at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
    float partial[16 * kMaxRowsAtOnce];
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t r0 = 0; r0 < rows; r0 += kMaxRowsAtOnce) {
        const int r = static_cast<int>(std::min<int64_t>(kMaxRowsAtOnce, rows - r0));
        const uint8_t* tile = w + t * tile_bytes;
        with_record_kind(*kind, [&](auto bits_c, auto form_c) {
          constexpr int kBits = decltype(bits_c)::value, kForm = decltype(form_c)::value;
#ifdef STALLFREE_INT8_MATMUL
          if (int8) return code_tile_rows8<kBits, kForm>(tile, q8, r0, r, blocks, partial);
#endif
          code_tile_rows<kBits, kForm>(tile, q, r0, r, blocks, partial);
        });
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

// Rows of a coded matrix as bfloat16 (an embedding looked up in its GGUF codes, rounded once from the float32
// value scale * u + zero): out [n, K] for the token ids. The record size says the bits and zeros (record_kind).
at::Tensor code_rows(const at::Tensor& blocks_t, const at::Tensor& ids_t) {
  TORCH_CHECK(blocks_t.dim() == 3 && blocks_t.scalar_type() == at::kByte && blocks_t.is_contiguous(),
              "code_rows: weight blocks [N / 16, K / 32, bytes] uint8, contiguous");
  const int64_t rec = blocks_t.size(2), blocks = blocks_t.size(1), k = blocks * kQBlock, n_rows = blocks_t.size(0) * 16;
  const std::optional<RecordKind> kind = record_kind(rec);
  TORCH_CHECK(kind.has_value(), "code_rows: unknown record size");
  TORCH_CHECK(!grouped(kind->form) || blocks % 8 == 0, "code_rows: super-block records in whole super-blocks");
  const int bits = kind->bits;
  const int form = kind->form;
  const at::Tensor ids = ids_t.to(at::kLong).contiguous();
  const int64_t n = ids.numel();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(id[i] >= 0 && id[i] < n_rows, "code_rows: token id out of range");
  at::Tensor out = at::empty({n, k}, at::TensorOptions().dtype(at::kBFloat16));
  uint16_t* o = bf16_mut(out);
  const uint8_t* w = blocks_t.data_ptr<uint8_t>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = id[i] / 16, c = id[i] % 16;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* tile = w + t * blocks * rec;
        const uint8_t* rb = tile + codes_offset(bits, form, b);
        const int col = static_cast<int>(c);
        const Affine halves[2] = {record_affine(tile, bits, form, col, b, 0),
                                  record_affine(tile, bits, form, col, b, 1)};
        uint16_t* dst = o + i * k + b * kQBlock;
        for (int p = 0; p < 16; ++p) {  // k = 2p + j
          const Affine& a = halves[p >= 8 && form == kHalves];
          for (int j = 0; j < 2; ++j)
            dst[2 * p + j] = f2bf(a.scale * static_cast<float>(record_code(rb, bits, p, col, j)) + a.zero);
        }
      }
    }
  });
  return out;
}
