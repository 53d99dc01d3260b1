// GGUF K-quant blocks (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) straight into the code kernel's tiles (cpu_code_matmul.h says
// the layout), at load: the bytes models/kquant_codes.py and TiledCodes.from_codes make (kquant_tiles.py for
// super-block records), without their intermediate arrays.
// Included by cpu_decode.cpp after cpu_code_matmul.h (record_kind).
//
// Why: a first start on a new 1B Q4_K_M file spent 8 s decoding 1.2 billion weights through numpy (3 s of K-quant
// unpacking, 2 s of tiling, 1.2 s joining q/k/v and gate/up, the rest copies); this is one pass over the file's
// bytes on the process's threads. The Python decode stays the reference (and the path before this library is
// built): tests/test_gguf_tiles.py holds the two to the same bytes.
//
// A matrix whose parts are all Q4_K or Q5_K takes kSuper records: the file's own integers (sc, m) and float16 (d,
// dmin), nothing computed; one that is all Q6_K or all Q3_K, on a tier that runs them, kHalves records (its codes,
// int8 scales and d); models/kquant_tiles.py is the reference of both. Elsewhere the values are computed as numpy
// computes them, in float32 and in the same order, so that both paths round to the same float16 scales and zeros:
// d * sc and dmin * m are each rounded before they are added (rounded_product keeps the compiler from fusing them
// into a multiply-add), and a block's zero takes the path its matrix's planes give it:
//   Q4_K, Q5_K parts beside 8-bit ones:                zero = (((8s - dm) - 8s) + 128s) - 128s
//   Q6_K (re-coded to an 8-bit code u per 32, kquant_codes.py says how): zero = -128s
//   Q3_K (u = 128 - sc * q under s = -d) and Q2_K (re-coded per 32): as 8-bit tiles, from z = -128s and z = min
#pragma once

// A float32 product rounded on its own, never fused into the addition that follows (numpy rounds it first).
inline float rounded_product(float a, float b) {
  volatile float p = a * b;
  return p;
}

// One 256-weight super-block decoded: codes u (0..15, 0..31 or 0..255) and per 32-weight block scale and zero.
struct SuperBlock {
  uint8_t u[256];
  float scale[8], zero[8];
  uint8_t sc[8], m[8];  // Q4_K/Q5_K: the integer sub-block scales and mins
  uint16_t d, dmin;     // and the float16 super-block scales, as bits
};

// Q4_K/Q5_K's packed 6-bit scale and min of sub-block j (gguf's get_scale_min).
inline void kquant_scale_min(const uint8_t* q, int j, int& sc, int& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Q4_K (144 bytes: d, dmin, 12 bytes of scales, 128 of nibbles) or Q5_K (176: the same with 32 bytes of fifth bits
// before the nibbles). Sub-block 2c holds the low nibbles of the 32-byte chunk c, 2c + 1 its high ones.
inline void decode_q45_k(const uint8_t* b, bool five, bool one_plane, SuperBlock& out) {
  out.d = static_cast<uint16_t>(b[0] | (b[1] << 8)), out.dmin = static_cast<uint16_t>(b[2] | (b[3] << 8));
  const float d = half_to_float(out.d), dmin = half_to_float(out.dmin);
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + (five ? 48 : 16);
  for (int j = 0; j < 8; ++j) {
    int sc, m;
    kquant_scale_min(b + 4, j, sc, m);
    out.sc[j] = static_cast<uint8_t>(sc), out.m[j] = static_cast<uint8_t>(m);
    const float s = rounded_product(d, static_cast<float>(sc)), dm = rounded_product(dmin, static_cast<float>(m));
    const float lo_zero = 8.0f * s - dm;
    out.scale[j] = s;
    out.zero[j] = one_plane ? lo_zero - 8.0f * s : ((lo_zero - 8.0f * s) + 128.0f * s) - 128.0f * s;
    const uint8_t* chunk = qs + 32 * (j / 2);
    const int shift = 4 * (j % 2);
    for (int l = 0; l < 32; ++l) {
      int u = (chunk[l] >> shift) & 15;
      if (five) u |= ((qh[l] >> j) & 1) << 4;
      out.u[32 * j + l] = static_cast<uint8_t>(u);
    }
  }
}

// Q6_K (210 bytes: 128 of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, d): q in -32..31, w = d * sc * q,
// one sc per 16 weights, re-coded per 32 as kquant_codes._q6_k does.
inline void decode_q6_k(const uint8_t* b, SuperBlock& out) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half_to_float(b[208] | (b[209] << 8));
  for (int blk = 0; blk < 8; ++blk) {
    const int first = sc[2 * blk], second = sc[2 * blk + 1];
    const int a = std::abs(first), c = std::abs(second);
    const int big = a >= c ? first : second;
    const float step = a == c ? static_cast<float>(std::max(a, 1)) : static_cast<float>(big) / 4.0f;
    for (int l = 0; l < 32; ++l) {
      const int w = 32 * blk + l, h = w / 128, r = w % 128;
      const int low = (ql[64 * h + r % 64] >> (4 * (r / 64))) & 15;
      const int high = (qh[32 * h + r % 32] >> (2 * (r / 32))) & 3;
      const float p = static_cast<float>(((low | (high << 4)) - 32) * sc[w / 16]);
      out.u[w] = static_cast<uint8_t>(static_cast<int>(std::nearbyint(p / step)) + 128);
    }
    const float s = rounded_product(d, step);
    out.scale[blk] = s;
    out.zero[blk] = 0.0f - 8.0f * (16.0f * s);  // +0 where s is 0, as numpy's sum
  }
}

// Q6_K's own integers (kHalves records): u = q + 32 (0..63), its 16 int8 scales, its float16 d as bits.
inline void decode_q6_k_codes(const uint8_t* b, SuperBlock& out, int8_t* scales) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  for (int w = 0; w < 256; ++w) {
    const int h = w / 128, r = w % 128;
    const int low = (ql[64 * h + r % 64] >> (4 * (r / 64))) & 15;
    const int high = (qh[32 * h + r % 32] >> (2 * (r / 32))) & 3;
    out.u[w] = static_cast<uint8_t>(low | (high << 4));
  }
  std::memcpy(scales, b + 192, 16);
  out.d = static_cast<uint16_t>(b[208] | (b[209] << 8));
}

// Q3_K's own integers (3-bit kHalves records): u = q + 4 (0..7: the two low bits, and 4 where the mask bit is set),
// its 16 scales sc - 32 (-32..31) as int8, its float16 d as bits.
inline void decode_q3_k_codes(const uint8_t* b, SuperBlock& out, int8_t* scales) {
  const uint8_t* mask = b;
  const uint8_t* qs = b + 32;
  const uint8_t* packed = b + 96;
  for (int i = 0; i < 16; ++i)
    scales[i] = static_cast<int8_t>(
        (((packed[i % 8] >> (4 * (i / 8))) & 15) | (((packed[8 + i % 4] >> (2 * (i / 4))) & 3) << 4)) - 32);
  for (int w = 0; w < 256; ++w) {
    const int low = (qs[32 * (w / 128) + w % 32] >> (2 * ((w % 128) / 32))) & 3;
    out.u[w] = static_cast<uint8_t>(low | (((mask[w % 32] >> (w / 32)) & 1) << 2));
  }
  out.d = static_cast<uint16_t>(b[108] | (b[109] << 8));
}

// The zero of an 8-bit block w = s * u + z as TiledCodes.from_codes joins its two planes (lo zero z + 8s, hi 128s).
inline float eight_bit_zero(float s, float z) {
  return (((z + 8.0f * s) - 8.0f * s) + 128.0f * s) - 128.0f * s;
}

// Q3_K (110 bytes: 32 of high-bit masks, 64 of 2-bit lows, 12 of packed 6-bit scales, d): w = d * sc * q, q in
// -4..3, sc in -32..31 per 16 weights; exactly the 8-bit code u = 128 - sc * q (0..252) under the scale -d.
inline void decode_q3_k(const uint8_t* b, SuperBlock& out) {
  const uint8_t* mask = b;
  const uint8_t* qs = b + 32;
  const uint8_t* packed = b + 96;
  const float s = -half_to_float(b[108] | (b[109] << 8));
  int sc[16];
  for (int i = 0; i < 16; ++i)
    sc[i] = (((packed[i % 8] >> (4 * (i / 8))) & 15) | (((packed[8 + i % 4] >> (2 * (i / 4))) & 3) << 4)) - 32;
  for (int w = 0; w < 256; ++w) {
    const int low = (qs[32 * (w / 128) + w % 32] >> (2 * ((w % 128) / 32))) & 3;
    const int q = low - 4 * (1 - ((mask[w % 32] >> (w / 32)) & 1));  // a clear mask bit: 4 below
    out.u[w] = static_cast<uint8_t>(128 - sc[w / 16] * q);
  }
  for (int blk = 0; blk < 8; ++blk) {
    out.scale[blk] = s;
    out.zero[blk] = eight_bit_zero(s, -128.0f * s);
  }
}

// Q2_K (84 bytes: 16 of packed 4-bit (sc, m), 64 of 2-bit codes, d, dmin): w = d * sc * q - dmin * m per 16 weights,
// computed as gguf computes it, re-coded per 32 on an 8-bit grid over the block's range (kquant_codes._q2_k).
inline void decode_q2_k(const uint8_t* b, SuperBlock& out) {
  const uint8_t* packed = b;
  const uint8_t* qs = b + 16;
  const float d = half_to_float(b[80] | (b[81] << 8)), dmin = half_to_float(b[82] | (b[83] << 8));
  float dl[16], ml[16];  // each 16 weights' scale d * sc and offset dmin * m
  for (int sub = 0; sub < 16; ++sub) {
    dl[sub] = rounded_product(d, static_cast<float>(packed[sub] & 15));
    ml[sub] = rounded_product(dmin, static_cast<float>(packed[sub] >> 4));
  }
  for (int blk = 0; blk < 8; ++blk) {
    float w[32];
    float low = 0.0f, high = 0.0f;
    for (int l = 0; l < 32; ++l) {
      const int i = 32 * blk + l;
      const int q = (qs[32 * (i / 128) + i % 32] >> (2 * ((i % 128) / 32))) & 3;
      w[l] = rounded_product(dl[i / 16], static_cast<float>(q)) - ml[i / 16];
      low = l == 0 ? w[l] : std::min(low, w[l]);
      high = l == 0 ? w[l] : std::max(high, w[l]);
    }
    const float s = (high - low) / 255.0f;
    const float step = s > 0.0f ? s : 1.0f;
    for (int l = 0; l < 32; ++l) {
      const float u = std::nearbyint((w[l] - low) / step);
      out.u[32 * blk + l] = static_cast<uint8_t>(std::min(255.0f, std::max(0.0f, u)));
    }
    out.scale[blk] = s;
    out.zero[blk] = eight_bit_zero(s, low);
  }
}

// 16 rows' Q4_K/Q5_K integers for kSuper records: sc, m [16][K / 32], and d, dmin [16][K / 256] (float16 bits);
// Q6_K's and Q3_K's for kHalves: halves [16][K / 16] (an int8 scale per 16 weights) and d.
struct SuperInts {
  std::vector<uint8_t> sc, m;
  std::vector<uint16_t> d, dmin;
  std::vector<int8_t> halves;
};

// 16 rows' codes [16][K] and affine [16][K / 32] (or, kSuper, their integers) into one tile's records at `tile`
// (bits 3, 4, 5, 6 or 8, in `form`: codes_offset and affine_offset place each block's parts). False where a record
// without zeros cannot hold a block (its zero is not -2^(bits-1) times its float16 scale).
inline bool write_tile(const uint8_t* u, const float* scale, const float* zero, const SuperInts& ints, int64_t k,
                       int bits, int form, uint8_t* tile) {
  const int64_t blocks = k / kQBlock;
  for (int64_t g = 0; g < blocks; ++g) {
    uint8_t* rb = tile + codes_offset(bits, form, g);
    uint8_t* affine = tile + affine_offset(bits, form, g);
    const auto code = [&](int c, int kk) { return u[c * k + g * kQBlock + kk]; };
    if (bits == 8) {
      for (int p = 0; p < 16; ++p)
        for (int c = 0; c < 16; ++c)
          for (int j = 0; j < 2; ++j) rb[32 * p + 2 * c + j] = code(c, 2 * p + j);
    } else {
      for (int q = 0; q < 8; ++q)
        for (int c = 0; c < 16; ++c)
          for (int j = 0; j < 2; ++j)
            rb[32 * q + 2 * c + j] =
                static_cast<uint8_t>((code(c, 2 * q + j) & 15) | ((code(c, 2 * (q + 8) + j) & 15) << 4));
      if (bits == 5) {
        for (int p = 0; p < 16; ++p) {
          uint32_t mask = 0;
          for (int c = 0; c < 16; ++c)
            for (int j = 0; j < 2; ++j) mask |= static_cast<uint32_t>((code(c, 2 * p + j) >> 4) & 1) << (2 * c + j);
          std::memcpy(rb + 256 + 4 * (2 * (p % 8) + (p >= 8)), &mask, 4);
        }
      }
      if (bits == 6)  // per chunk pair, byte i: the high two bits of chunk 2m's and 2m + 1's low nibbles, then highs'
        for (int m = 0; m < 4; ++m)
          for (int c = 0; c < 16; ++c)
            for (int j = 0; j < 2; ++j) {
              const int q = 2 * m;
              rb[256 + 32 * m + 2 * c + j] = static_cast<uint8_t>(
                  (code(c, 2 * q + j) >> 4) | ((code(c, 2 * q + 2 + j) >> 4) << 2) |
                  ((code(c, 2 * q + 16 + j) >> 4) << 4) | ((code(c, 2 * q + 18 + j) >> 4) << 6));
            }
    }
    if (form == kHalves) {  // the halves' int8 scales; at a super-block's first block its header (16 d; 6-bit: 32
                            // zero bytes after them)
      const int64_t supers = k / 256, super = g / 8;
      for (int c = 0; c < 16; ++c) {
        affine[c] = static_cast<uint8_t>(ints.halves[c * 2 * blocks + 2 * g]);
        affine[16 + c] = static_cast<uint8_t>(ints.halves[c * 2 * blocks + 2 * g + 1]);
      }
      if (g % 8 == 0) {
        uint16_t* header = reinterpret_cast<uint16_t*>(tile + header_offset(bits, g));
        for (int c = 0; c < 16; ++c) {
          header[c] = ints.d[c * supers + super];
          if (bits == 6) header[16 + c] = 0;
        }
      }
      continue;
    }
    if (form == kSuper) {  // sc, m; at a super-block's first block its header (16 d, then 16 dmin)
      const int64_t supers = k / 256, super = g / 8;
      for (int c = 0; c < 16; ++c) affine[c] = ints.sc[c * blocks + g], affine[16 + c] = ints.m[c * blocks + g];
      if (g % 8 == 0) {
        uint16_t* header = reinterpret_cast<uint16_t*>(tile + header_offset(bits, g));
        for (int c = 0; c < 16; ++c)
          header[c] = ints.d[c * supers + super], header[16 + c] = ints.dmin[c * supers + super];
      }
      continue;
    }
    uint16_t* sz = reinterpret_cast<uint16_t*>(affine);
    for (int c = 0; c < 16; ++c) {
      const c10::Half s(scale[c * blocks + g]), z(zero[c * blocks + g]);
      sz[c] = s.x;
      if (form == kZeros)
        sz[16 + c] = z.x;
      else if (static_cast<float>(z) != -static_cast<float>(1 << (bits - 1)) * static_cast<float>(s))
        return false;
    }
  }
  return true;
}

// The op: rows [row_start, row_start + rows) of `out` (uint8 [N / 16, K / 32, record], its record size saying bits
// and zeros) from a part's GGUF blocks `raw` (uint8 [rows, K / 256 * block bytes]), part row i read from raw row
// order[i] where `order` is given (q/k rows unpermuted for RoPE). True once written; false where the record has no
// zeros and a block needs one (the caller lays the matrix out with zeros instead).
inline bool gguf_tiles(at::Tensor out, int64_t row_start, const at::Tensor& raw, const std::string& qtype,
                       const at::Tensor& order) {
  const std::optional<RecordKind> kind = record_kind(out.dim() == 3 ? out.size(2) : 0);
  TORCH_CHECK(kind && out.scalar_type() == at::kByte && out.is_contiguous(),
              "gguf_tiles: out [N / 16, K / 32, record] uint8, contiguous");
  const bool q2 = qtype == "Q2_K", q3 = qtype == "Q3_K", q4 = qtype == "Q4_K", q5 = qtype == "Q5_K",
             q6 = qtype == "Q6_K";
  TORCH_CHECK(q2 || q3 || q4 || q5 || q6, "gguf_tiles: Q2_K, Q3_K, Q4_K, Q5_K or Q6_K, not ", qtype);
  const int64_t block_bytes = q2 ? 84 : q3 ? 110 : q4 ? 144 : q5 ? 176 : 210;
  const bool eight_bit = q2 || q3 || q6;  // codes past 31
  const int64_t k = out.size(1) * kQBlock, rows = raw.size(0), supers = k / 256;
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.is_contiguous() && k % 256 == 0 &&
                  raw.size(1) == supers * block_bytes,
              "gguf_tiles: raw [rows, K / 256 * ", block_bytes, "] uint8 for K = ", k);
  TORCH_CHECK(row_start % 16 == 0 && rows % 16 == 0 && row_start + rows <= out.size(0) * 16,
              "gguf_tiles: rows ", row_start, "..", row_start + rows, " are not whole tiles of ", out.size(0) * 16);
  const bool ordered = order.numel() > 0;
  TORCH_CHECK(!ordered || (order.numel() == rows && order.scalar_type() == at::kLong),
              "gguf_tiles: order [rows] int64");
  TORCH_CHECK(kind->form == kHalves ? (q6 && kind->bits == 6) || (q3 && kind->bits == 3)
                                     : kind->bits == 8 || (!eight_bit && (kind->bits == 5 || !q5)),
              "gguf_tiles: ", qtype, " codes do not fit ", kind->bits, "-bit records");
  const int64_t* src = ordered ? order.data_ptr<int64_t>() : nullptr;
  for (int64_t i = 0; src && i < rows; ++i)
    TORCH_CHECK(src[i] >= 0 && src[i] < rows, "gguf_tiles: order names row ", src[i], " of ", rows);
  const uint8_t* in = raw.data_ptr<uint8_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  const int64_t record = out.size(2), blocks = k / kQBlock;
  std::atomic<bool> held{true};
  at::parallel_for(0, rows / 16, 4, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> u(16 * k);
    std::vector<float> scale(16 * blocks), zero(16 * blocks);
    SuperInts ints{std::vector<uint8_t>(16 * blocks), std::vector<uint8_t>(16 * blocks),
                   std::vector<uint16_t>(16 * supers), std::vector<uint16_t>(16 * supers),
                   std::vector<int8_t>(kind->form == kHalves ? 16 * 2 * blocks : 0)};
    SuperBlock sb;
    for (int64_t t = begin; t < end; ++t) {
      for (int c = 0; c < 16; ++c) {
        const int64_t r = 16 * t + c, from = src ? src[r] : r;
        for (int64_t i = 0; i < supers; ++i) {
          const uint8_t* b = in + from * supers * block_bytes + i * block_bytes;
          if (kind->form == kHalves) {
            if (q3)
              decode_q3_k_codes(b, sb, &ints.halves[c * 2 * blocks + 16 * i]);
            else
              decode_q6_k_codes(b, sb, &ints.halves[c * 2 * blocks + 16 * i]);
            std::memcpy(&u[c * k + 256 * i], sb.u, 256);
            ints.d[c * supers + i] = sb.d;
            continue;
          }
          if (q6)
            decode_q6_k(b, sb);
          else if (q3)
            decode_q3_k(b, sb);
          else if (q2)
            decode_q2_k(b, sb);
          else
            decode_q45_k(b, q5, kind->bits == 4, sb);
          std::memcpy(&u[c * k + 256 * i], sb.u, 256);
          std::memcpy(&scale[c * blocks + 8 * i], sb.scale, sizeof sb.scale);
          std::memcpy(&zero[c * blocks + 8 * i], sb.zero, sizeof sb.zero);
          std::memcpy(&ints.sc[c * blocks + 8 * i], sb.sc, 8);
          std::memcpy(&ints.m[c * blocks + 8 * i], sb.m, 8);
          ints.d[c * supers + i] = sb.d, ints.dmin[c * supers + i] = sb.dmin;
        }
      }
      if (!write_tile(u.data(), scale.data(), zero.data(), ints, k, kind->bits, kind->form,
                      o + (row_start / 16 + t) * blocks * record))
        held = false;
    }
  });
  return held;
}
