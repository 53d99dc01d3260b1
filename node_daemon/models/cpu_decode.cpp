// A forward of a Llama-family model (Qwen3's q/k head norms and Gemma 3's layers included) on the CPU in one call (node_daemon/models/cpu_decode.py): decode rows and
// prefill chunks over a cached prefix in one ragged batch, as the Python path takes them.
//
// Why: a step of a small model run op by op from Python is bound by the ops' count and Python around them
// (about 5,700 ATen calls a token for SmolLM2-135M), not by arithmetic. Here each layer is four weight matmuls
// (the code kernel of cpu_code_matmul.h, straight from the GGUF codes, for a few rows on AVX-512 and for every row
// count below it; oneDNN's bfloat16 GEMM for more rows on AVX-512) and four plain loops: add + RMSNorm, RoPE with
// the KV write, decode attention over the paged cache, SiLU-and-mul. The arithmetic and its rounding points
// follow models/llama.py's CPU path: a float32 residual stream, bfloat16 activations into every matmul,
// q and k rounded to bfloat16 after RoPE, attention in float32.
//
// Layouts: activations [rows, width] contiguous; the KV cache head-major [kv_heads, num_blocks, block_size,
// head_dim] per layer (kernels/cpu_attention.py); block tables [seqs, width] int32; sequence i owns rows
// query_start_loc[i] .. query_start_loc[i + 1] - 1. A one-row sequence (a decode) attends by the AVX512-BF16
// or AVX2 kernel of cpu_decode_attention.h, whichever the tier compiled in (else the float32 loop below); a chunk of
// more rows by the AVX512-BF16 or AVX2 kernel of cpu_chunk_attention.h, else through ATen's
// scaled_dot_product_attention over its gathered keys and values (the Python path's call,
// kernels/cpu_attention.py); its gather index and mask are built once for all layers. The tier is the compiler's
// target (models/cpu_tier.py): the same source builds each tier's library.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

// The ops' namespace names the tier the library was compiled for (models/cpu_decode.py), so one process can load
// the libraries of two tiers side by side (tests: the AVX2 kernels against the AVX-512 ones).
#ifndef STALLFREE_OPS_NS
#define STALLFREE_OPS_NS stallfree_cpu
#endif

namespace {

inline float bf2f(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Round to nearest even, as c10::BFloat16 does (branch-free, so loops of it vectorize).
inline uint16_t f2bf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t rounded = (u + 0x7fff + ((u >> 16) & 1)) >> 16;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);  // NaN: quiet NaN
}

// x[i] = exp(x[i]). AVX-512: Cephes' expf polynomial (about 1 ulp; every caller rounds further, to bfloat16 or
// through a softmax), since glibc's vector expf is only offered under -ffast-math.
inline void exp_inplace(float* x, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 hi = _mm512_set1_ps(88.3762626647949f), lo = _mm512_set1_ps(-88.3762626647949f);
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 c1 = _mm512_set1_ps(0.693359375f), c2 = _mm512_set1_ps(-2.12194440e-4f);
  for (; i + 16 <= n; i += 16) {
    __m512 v = _mm512_min_ps(_mm512_max_ps(_mm512_loadu_ps(x + i), lo), hi);
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(v, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm512_fnmadd_ps(k, c2, _mm512_fnmadd_ps(k, c1, v));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, v, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, v, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, v, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, v, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, v, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, v), v, _mm512_add_ps(v, _mm512_set1_ps(1.f)));
    _mm512_storeu_ps(x + i, _mm512_scalef_ps(p, k));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  // The same polynomial 8 lanes wide; 2^k is built in the exponent bits (AVX2 has no scalef).
  const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-87.3365478515625f);
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
  const __m256 c1 = _mm256_set1_ps(0.693359375f), c2 = _mm256_set1_ps(-2.12194440e-4f);
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_min_ps(_mm256_max_ps(_mm256_loadu_ps(x + i), lo), hi);
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(v, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm256_fnmadd_ps(k, c2, _mm256_fnmadd_ps(k, c1, v));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, v, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, v, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, v, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, v, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, v, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, v), v, _mm256_add_ps(v, _mm256_set1_ps(1.f)));
    // 2^k for k in [-126, 127]: the clamps above keep it there (exp(-87.3) is FLT_MIN)
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    _mm256_storeu_ps(x + i, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
  }
#endif
  for (; i < n; ++i) x[i] = std::exp(x[i]);
}

// A softmax over some scores before its normalisation: their max, and the sum of exp(score - top).
struct SoftmaxPart {
  float top, total;
};

// s[t] = exp(s[t] - max s) over t < n; returns the max and their sum (no scores: -inf and 0).
inline SoftmaxPart softmax_part(float* s, int64_t n) {
  if (n == 0) return {-INFINITY, 0.f};
  float top = s[0];
  for (int64_t t = 1; t < n; ++t) top = std::max(top, s[t]);
  for (int64_t t = 0; t < n; ++t) s[t] -= top;
  exp_inplace(s, n);
  float total = 0.f;
  for (int64_t t = 0; t < n; ++t) total += s[t];
  return {top, total};
}

// sum_i q[i] * k[i], q float, k bfloat16. AVX-512 (AVX2): 16 (8) lanes and one horizontal sum (the compiler's own
// reduction went through memory lane by lane, the attention's largest cost).
inline float dot_bf16(const float* q, const uint16_t* k, int64_t n) {
  int64_t i = 0;
  float sum = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k + i));
    const __m512 kf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), kf, acc);
  }
  sum = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(k + i));
    const __m256 kf = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), kf, acc);
  }
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
  sum = _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1)));
#endif
  for (; i < n; ++i) sum += q[i] * bf2f(k[i]);
  return sum;
}

inline const uint16_t* bf16_ptr(const at::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}
inline uint16_t* bf16_mut(at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

// Inside this namespace: they use the helpers above.
#include "cpu_argmax.h"
#include "cpu_chunk_attention.h"
#include "cpu_decode_attention.h"
#include "cpu_code_matmul.h"
#include "cpu_code_dequantize.h"
#include "cpu_gguf_tiles.h"

// The row-wise loops below split across threads only past this many rows: decode batches (up to MAX_ROWS = 64 in
// cpu_decode.py) run them on the calling thread, as before the loops were threaded.
constexpr int64_t kParallelRows = 65;

// residual += h (when given); out = bf16(rms_norm(residual) * w).
void add_rms_norm(float* residual, const uint16_t* h, const float* w, uint16_t* out, int64_t rows, int64_t width,
                  double eps) {
  // Rows are independent: split across threads only for a prefill chunk's rows (a decode batch's few rows stay on
  // the calling thread: a parallel region costs more than they do, and far more when a core is busy).
  at::parallel_for(0, rows, kParallelRows, [&](int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    float* x = residual + r * width;
    if (h != nullptr) {
      const uint16_t* hr = h + r * width;
      for (int64_t i = 0; i < width; ++i) x[i] += bf2f(hr[i]);
    }
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < width; ++i) ss += x[i] * x[i];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(width) + static_cast<float>(eps));
    uint16_t* o = out + r * width;
    for (int64_t i = 0; i < width; ++i) o[i] = f2bf(x[i] * inv * w[i]);
  }
  });
}

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t planes) {
  const at::Tensor input = planes == 2 ? at::cat({x, x}, 1) : x;
  return at::_weight_int4pack_mm_for_cpu(input, packed, 32, scales);
}

// x @ W^T with W prepacked for oneDNN (models/layers.py prepack_weight): the op the Python path calls past
// INT4_MAX_ROWS rows, where bfloat16 GEMMs beat the int4 kernel.
at::Tensor packed_mm(const at::Tensor& x, const at::Tensor& packed) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                         c10::string_view, c10::List<std::optional<at::Scalar>>,
                                         std::optional<c10::string_view>)>();
  c10::List<std::optional<at::Scalar>> none;
  none.push_back(std::nullopt);
  return op.call(x, packed, std::nullopt, "none", none, "");
}

// Which kernel takes a projection of how many rows.
struct RowLimits {
  int64_t int4, code;  // torch's int4 kernel up to this many rows; the code kernel (cpu_code_matmul.h) up to these
  // From this many rows a projection without a oneDNN copy is dequantized into a scratch for oneDNN's bfloat16
  // GEMM (cpu_code_dequantize.h); 0: never (tiers without that GEMM), the code kernel takes every row count.
  int64_t dequant;
  int64_t int8;  // from this many rows the code kernel takes int8 activations (0: never; code_matmul)
};

// One projection: the code kernel (where the weight has its tiles: bits 4, 5 or 8) for up to limits.code rows, and
// where there is no oneDNN copy for any number below limits.dequant (every number below AVX-512), the dequantized
// scratch past it; else torch's int4 for a few rows and the prepacked bfloat16 weight for more. w: packed int4, its
// scales, oneDNN (empty when the model was not prepacked), the code kernel's tiles (empty when bits is 0).
// planes 0: a float weight (F16, BF16, F32 files), w[1] the bfloat16 weight itself where there is no oneDNN copy.
// tail: the weight's last rows in records of their own kind (models/quantized.py TiledCodes.tail; empty where none):
// what the code kernel and the dequantized scratch give for them joins the tiles' columns.
at::Tensor project(const at::Tensor& x, const at::Tensor* w, int64_t planes, int64_t bits, const RowLimits& limits,
                   const at::Tensor& tail) {
  const int64_t rows = x.size(0);
  const auto with_tail = [&](at::Tensor head, auto&& of_tail) {
    return tail.numel() == 0 ? head : at::cat({head, of_tail()}, 1);
  };
  if (planes == 0) return w[2].numel() != 0 ? packed_mm(x, w[2]) : at::linear(x, w[1]);
  if (bits != 0 && w[2].numel() == 0 && limits.dequant > 0 && rows >= limits.dequant)
    return with_tail(dequantized_mm(x, w[3]), [&] { return dequantized_mm(x, tail); });
  if (bits != 0 && (rows <= limits.code || w[2].numel() == 0)) {
    const auto tail_bits = [&] { return static_cast<int64_t>(record_kind(tail.size(2))->bits); };
    return with_tail(code_matmul(x, w[3], bits, false, limits.int8),
                     [&] { return code_matmul(x, tail, tail_bits(), false, limits.int8); });
  }
  return rows <= limits.int4 || w[2].numel() == 0 ? int4_mm(x, w[0], w[1], planes) : packed_mm(x, w[2]);
}

// Seconds each kind of step of the compiled forward took since the last phase_seconds() call (`stallfree bench
// iteration --breakdown`): a clock read between steps, about 20 ns each.
enum Phase { kNorm, kMatmul, kRope, kDecodeAttention, kChunkAttention, kSiluMul, kPhases };
double g_phase_seconds[kPhases] = {};

struct PhaseClock {
  std::chrono::steady_clock::time_point last = std::chrono::steady_clock::now();
  void lap(Phase phase) {
    const auto now = std::chrono::steady_clock::now();
    g_phase_seconds[phase] += std::chrono::duration<double>(now - last).count();
    last = now;
  }
};

struct Dims {
  int64_t rows, heads, kv_heads, head_dim, block_size, num_slots, width;  // width: block-table columns
};

// Qwen3's per-head RMSNorm of q and k before RoPE (float32 weights [head_dim]; null for models without).
struct HeadNorms {
  const float* q = nullptr;
  const float* k = nullptr;
  float eps = 0.f;
};

// RoPE on q and k (rotate-half, cos|sin halves per position), q and k rounded to bfloat16; q goes to
// q_out [rows, heads * head_dim], k and v into the cache at the row's slot (rows write distinct slots). With head
// norms each head is RMS-normed first and rounded to bfloat16, as the Python path's norm returns it.
void rope_and_write(const uint16_t* qkv, const int64_t* positions, const int64_t* slots, const float* cos_sin,
                    uint16_t* q_out, uint16_t* k_cache, uint16_t* v_cache, const Dims& d, const HeadNorms& norms) {
  const int64_t D = d.head_dim, half = D / 2;
  const int64_t qkv_width = (d.heads + 2 * d.kv_heads) * D;
  at::parallel_for(0, d.rows, kParallelRows, [&](int64_t begin, int64_t end) {
  std::vector<float> rotated(D), normed(D);
  for (int64_t r = begin; r < end; ++r) {
    const uint16_t* row = qkv + r * qkv_width;
    const float* c = cos_sin + positions[r] * D;
    const float* s = c + half;
    const int64_t slot = slots[r];
    for (int64_t h = 0; h < d.heads + d.kv_heads; ++h) {
      const uint16_t* x = row + h * D;
      const float* w = h < d.heads ? norms.q : norms.k;
      if (w != nullptr) {
        float ss = 0.f;
        for (int64_t i = 0; i < D; ++i) {
          normed[i] = bf2f(x[i]);
          ss += normed[i] * normed[i];
        }
        const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + norms.eps);
        for (int64_t i = 0; i < D; ++i) normed[i] = bf2f(f2bf(normed[i] * inv * w[i]));
      } else {
        for (int64_t i = 0; i < D; ++i) normed[i] = bf2f(x[i]);
      }
      for (int64_t j = 0; j < half; ++j) {
        const float a = normed[j], b = normed[j + half];
        rotated[j] = a * c[j] - b * s[j];
        rotated[j + half] = b * c[j] + a * s[j];
      }
      if (h < d.heads) {
        uint16_t* q = q_out + (r * d.heads + h) * D;
        for (int64_t i = 0; i < D; ++i) q[i] = f2bf(rotated[i]);
      } else if (slot >= 0) {
        uint16_t* k = k_cache + ((h - d.heads) * d.num_slots + slot) * D;
        for (int64_t i = 0; i < D; ++i) k[i] = f2bf(rotated[i]);
      }
    }
    if (slot >= 0) {
      const uint16_t* v = row + (d.heads + d.kv_heads) * D;
      for (int64_t g = 0; g < d.kv_heads; ++g)
        std::memcpy(v_cache + (g * d.num_slots + slot) * D, v + g * D, D * sizeof(uint16_t));
    }
  }
  });
}

// How many parts to split each (decode, kv head) task's keys into, so that `threads` threads share the work evenly
// when there are few tasks: one stream of a model with one kv head (Gemma 3 270M) left a core idle, and three kv heads
// on two threads (SmolLM2) ran two against one. The smallest count that balances the parts across the threads (a
// part of at least kMinPartKeys keys); many tasks already balance, and stay whole.
constexpr int64_t kMinPartKeys = 64, kMaxParts = 8;
int64_t decode_parts(int64_t tasks, int64_t keys, int64_t threads) {
  if (threads <= 1 || tasks >= 4 * threads) return 1;
  int64_t best = 1;
  double best_share = 0.0;
  for (int64_t parts = 1; parts <= kMaxParts && (parts == 1 || keys / parts >= kMinPartKeys); ++parts) {
    const int64_t items = tasks * parts;
    const double share = static_cast<double>(items) / static_cast<double>(threads * ((items + threads - 1) / threads));
    if (share > best_share + 1e-9) best = parts, best_share = share;
    if (share >= 1.0) break;
  }
  return best;
}

// One task's parts (decode_attention_bf16's partial: per part and head D sums, top, total) rescaled to their largest
// top and summed: the task's normalised output, out [group, D] bfloat16.
void merge_parts(const float* partial, int64_t parts, int64_t group, int64_t D, uint16_t* out) {
  const int64_t stride = group * (D + 2);
  std::vector<float> sum(D), weight(parts);
  for (int64_t j = 0; j < group; ++j) {
    float top = -INFINITY, total = 0.f;
    for (int64_t p = 0; p < parts; ++p) top = std::max(top, partial[p * stride + j * (D + 2) + D]);
    for (int64_t p = 0; p < parts; ++p) {
      const float* pj = partial + p * stride + j * (D + 2);
      weight[p] = pj[D + 1] > 0.f ? std::exp(pj[D] - top) : 0.f;  // an empty part (a short sequence) weighs nothing
      total += pj[D + 1] * weight[p];
    }
    std::fill(sum.begin(), sum.end(), 0.f);
    for (int64_t p = 0; p < parts; ++p) {
      const float* pj = partial + p * stride + j * (D + 2);
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) sum[i] += pj[i] * weight[p];
    }
    const float inv = 1.f / total;
    for (int64_t i = 0; i < D; ++i) out[j * D + i] = f2bf(sum[i] * inv);
  }
}

// The decode rows' query heads against their sequences' cached keys and values (the row's own included),
// float32: decode k of the batch is row rows[k] of sequence seqs[k].
// window > 0 (a sliding layer): the row sees only its sequence's last `window` keys. Head sizes other than 64, 128
// and 256, or a tier without either kernel, take the float32 loop. parts 0: decode_parts decides; else the keys of
// every task in that many parts (tests).
void decode_attention(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache, const int32_t* tables,
                      const int32_t* seq_lens, const std::vector<int64_t>& rows, const std::vector<int64_t>& seqs,
                      uint16_t* out, const Dims& d, float scale, int64_t window, int64_t parts = 0) {
  const int64_t D = d.head_dim, group = d.heads / d.kv_heads, count = static_cast<int64_t>(rows.size());
  int64_t longest = 0;
  for (int64_t s : seqs) longest = std::max<int64_t>(longest, seq_lens[s]);
  const int64_t tasks = count * d.kv_heads, keys = window > 0 ? std::min(longest, window) : longest;
#ifdef STALLFREE_DECODE_ATTENTION_KERNEL
  const bool kernel = D == 64 || D == 128 || D == 256;
#else
  const bool kernel = false;
#endif
  if (!kernel)
    parts = 1;
  else if (parts <= 0)
    parts = decode_parts(tasks, keys, at::get_num_threads());
  // Split parts write their sums here; merged once every part is done.
  std::vector<float> partial(parts > 1 ? tasks * parts * group * (D + 2) : 0);
  const int64_t part_keys = (keys + parts - 1) / parts;
  // One item per (decode, kv head, part); split only when there is enough work to pay for the threads.
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, part_keys * D * group));
  at::parallel_for(0, tasks * parts, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(group * (parts > 1 ? part_keys : longest)), acc(group * D), qf(group * D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t task = item / parts, part = item % parts;
      const int64_t r = rows[task / d.kv_heads], s = seqs[task / d.kv_heads], g = task % d.kv_heads;
      const int64_t L = seq_lens[s], start = window > 0 ? std::max<int64_t>(0, L - window) : 0, n = L - start;
      const int32_t* table = tables + s * d.width;
      const uint16_t* kh = k_cache + g * d.num_slots * D;
      const uint16_t* vh = v_cache + g * d.num_slots * D;
      const uint16_t* qg = q + (r * d.heads + g * group) * D;
#ifdef STALLFREE_DECODE_ATTENTION_KERNEL
      if (kernel) {  // the AVX512-BF16 or AVX2 kernel (cpu_decode_attention.h)
        uint16_t* o = out + (r * d.heads + g * group) * D;
        // a part's keys: an even share of this sequence's (a shorter sequence's later parts may have none)
        const int64_t first = start + std::min(n, part * part_keys), last = start + std::min(n, (part + 1) * part_keys);
        float* sums = parts > 1 ? partial.data() + item * group * (D + 2) : nullptr;
        if (D == 64)
          decode_attention_bf16<4>(qg, kh, vh, table, d.block_size, first, last, group, scale, scores.data(), o, sums);
        else if (D == 128)
          decode_attention_bf16<8>(qg, kh, vh, table, d.block_size, first, last, group, scale, scores.data(), o, sums);
        else
          decode_attention_bf16<16>(qg, kh, vh, table, d.block_size, first, last, group, scale, scores.data(), o,
                                    sums);
        continue;
      }
#endif
      for (int64_t i = 0; i < group * D; ++i) qf[i] = bf2f(qg[i]);
      for (int64_t t = start; t < L; ++t) {
        const uint16_t* k = kh + (static_cast<int64_t>(table[t / d.block_size]) * d.block_size + t % d.block_size) * D;
        for (int64_t j = 0; j < group; ++j) scores[j * n + t - start] = dot_bf16(qf.data() + j * D, k, D) * scale;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < group; ++j) {
        float* sj = scores.data() + j * n;
        const float inv = 1.f / softmax_part(sj, n).total;
        for (int64_t t = 0; t < n; ++t) sj[t] *= inv;
      }
      for (int64_t t = start; t < L; ++t) {
        const uint16_t* v = vh + (static_cast<int64_t>(table[t / d.block_size]) * d.block_size + t % d.block_size) * D;
        for (int64_t j = 0; j < group; ++j) {
          const float p = scores[j * n + t - start];
          float* a = acc.data() + j * D;
#pragma omp simd
          for (int64_t i = 0; i < D; ++i) a[i] += p * bf2f(v[i]);
        }
      }
      for (int64_t j = 0; j < group; ++j) {
        uint16_t* o = out + (r * d.heads + g * group + j) * D;
        for (int64_t i = 0; i < D; ++i) o[i] = f2bf(acc[j * D + i]);
      }
    }
  });
  if (parts > 1)
    for (int64_t task = 0; task < tasks; ++task)
      merge_parts(partial.data() + task * parts * group * (D + 2), parts, group, D,
                  out + (rows[task / d.kv_heads] * d.heads + task % d.kv_heads * group) * D);
}

// A prefill chunk: rows first .. first + len - 1 of one sequence of seq_len cached tokens (the chunk's own
// last), its flat cache slots and, over a cached prefix, its bottom-right aligned causal mask.
struct Chunk {
  int64_t first, len;
  at::Tensor gather;  // [seq_len] int64
  std::optional<at::Tensor> mask;  // [len, seq_len] bool, true where visible; none: plain causal
};

// The rows' split into decodes and chunks, built once for all layers (the Python path's attention plan).
struct Plan {
  std::vector<int64_t> decode_rows, decode_seqs;
  std::vector<Chunk> chunks;
};

Plan plan_rows(const int32_t* query_start, const int32_t* tables, const int32_t* seq_lens, int64_t num_seqs,
               const Dims& d) {
  Plan plan;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t first = query_start[s], len = query_start[s + 1] - first, L = seq_lens[s];
    if (len == 1) {
      plan.decode_rows.push_back(first);
      plan.decode_seqs.push_back(s);
    } else if (len > 1) {
      at::Tensor gather = at::empty({L}, at::kLong);
      int64_t* g = gather.data_ptr<int64_t>();
      const int32_t* table = tables + s * d.width;
      for (int64_t t = 0; t < L; ++t)
        g[t] = static_cast<int64_t>(table[t / d.block_size]) * d.block_size + t % d.block_size;
      std::optional<at::Tensor> mask;
      if (len != L) {  // query j sees keys 0 .. L - len + j
        at::Tensor m = at::empty({len, L}, at::kBool);
        bool* mp = m.data_ptr<bool>();
        for (int64_t j = 0; j < len; ++j)
          for (int64_t t = 0; t < L; ++t) mp[j * L + t] = t <= L - len + j;
        mask = m;
      }
      plan.chunks.push_back({first, len, gather, mask});
    }
  }
  return plan;
}

// Every chunk's queries against its sequence's gathered keys and values: scaled_dot_product_attention with the
// arguments the Python path gives it (q [1, heads, len, D] a transposed view, k and v [1, kv_heads, L, D]).
// Whether chunks take the AVX512-BF16 or AVX2 kernel (cpu_chunk_attention.h) where it was compiled in (set_chunk_kernel).
bool g_chunk_kernel = true;

// window > 0 (a sliding layer): query j at position p sees keys p - window + 1 .. p; the kernel starts each block
// of rows at its window, ATen's attention (without the kernel) takes a chunk of a sequence longer than the window
// under a banded mask, every (query, key) pair computed. Gemma 3's 512-token chunk over a 512-token prefix spent
// 228 ms a forward in chunk attention that way (15 of its 18 layers sliding), 101 ms in the kernel (2 threads, Zen 4).
void chunk_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const Plan& plan,
                     at::Tensor& out, const Dims& d, double scale, int64_t window = 0) {
  if (plan.chunks.empty()) return;  // a decode-only iteration: not even the views below (a few us a layer)
  std::vector<const Chunk*> banded, whole;
  for (const Chunk& c : plan.chunks) (window > 0 && c.gather.size(0) > window ? banded : whole).push_back(&c);
#ifdef STALLFREE_CHUNK_KERNEL
  if (g_chunk_kernel && d.head_dim % 64 == 0) {  // the AVX512-BF16 or AVX2 kernel, banded chunks too
    whole.insert(whole.end(), banded.begin(), banded.end());
    banded.clear();
    std::vector<PackedKV> packed(d.kv_heads);
    for (const Chunk* chunk : whole) {
      const Chunk& c = *chunk;
      const int64_t keys = c.gather.size(0);
      const int64_t* gather = c.gather.data_ptr<int64_t>();
      at::parallel_for(0, d.kv_heads, 1, [&](int64_t begin, int64_t end) {
        for (int64_t g = begin; g < end; ++g)
          pack_kv(bf16_ptr(k_cache) + g * d.num_slots * d.head_dim, bf16_ptr(v_cache) + g * d.num_slots * d.head_dim,
                  gather, keys, d.head_dim, packed[g]);
      });
      chunk_attention_bf16(bf16_ptr(q), packed, c.first, c.len, keys, bf16_mut(out), d.heads, d.kv_heads,
                           d.head_dim, static_cast<float>(scale), window);
    }
    whole.clear();
  }
#endif
  const at::Tensor k_flat = k_cache.view({d.kv_heads, -1, d.head_dim});
  const at::Tensor v_flat = v_cache.view({d.kv_heads, -1, d.head_dim});
  const at::Tensor q3 = q.view({d.rows, d.heads, d.head_dim});
  at::Tensor out3 = out.view({d.rows, d.heads, d.head_dim});
  whole.insert(whole.end(), banded.begin(), banded.end());
  for (const Chunk* chunk : whole) {
    const Chunk& c = *chunk;
    const int64_t L = c.gather.size(0);
    std::optional<at::Tensor> mask = c.mask;
    if (window > 0 && L > window) {
      at::Tensor m = at::empty({c.len, L}, at::kBool);
      bool* mp = m.data_ptr<bool>();
      for (int64_t j = 0; j < c.len; ++j)
        for (int64_t t = 0; t < L; ++t) mp[j * L + t] = t <= L - c.len + j && t > L - c.len + j - window;
      mask = m;
    }
    const at::Tensor k = k_flat.index_select(1, c.gather).unsqueeze(0);
    const at::Tensor v = v_flat.index_select(1, c.gather).unsqueeze(0);
    const at::Tensor qc = q3.narrow(0, c.first, c.len).transpose(0, 1).unsqueeze(0);
    const at::Tensor o = at::scaled_dot_product_attention(qc, k, v, mask, 0.0, !mask.has_value(), scale, true);
    out3.narrow(0, c.first, c.len).copy_(o.squeeze(0).transpose(0, 1));
  }
}

// bf16(bf16(silu(gate)) * up), as torch's two bfloat16 ops round; the exponentials vectorized apart.
void silu_and_mul(const uint16_t* gu, uint16_t* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, kParallelRows, [&](int64_t begin, int64_t end) {
  std::vector<float> e(inter);
  for (int64_t r = begin; r < end; ++r) {
    const uint16_t* g = gu + r * 2 * inter;
    const uint16_t* u = g + inter;
    uint16_t* o = out + r * inter;
    for (int64_t i = 0; i < inter; ++i) e[i] = -bf2f(g[i]);
    exp_inplace(e.data(), inter);
    for (int64_t i = 0; i < inter; ++i) {
      const float x = bf2f(g[i]);
      o[i] = f2bf(bf2f(f2bf(x / (1.f + e[i]))) * bf2f(u[i]));
    }
  }
  });
}

// Gemma's MLP activation: bf16(bf16(gelu_tanh(gate)) * up), as torch's two bfloat16 ops round. tanh(t) is
// 1 - 2 / (exp(2t) + 1) with the vectorized exponential (std::tanh element by element took a quarter of a
// 16-row forward of Gemma 3 270M).
void gelu_tanh_and_mul(const uint16_t* gu, uint16_t* out, int64_t rows, int64_t inter) {
  constexpr float kAlpha = 0.7978845608028654f;  // sqrt(2 / pi)
  at::parallel_for(0, rows, kParallelRows, [&](int64_t begin, int64_t end) {
  std::vector<float> e(inter);
  for (int64_t r = begin; r < end; ++r) {
    const uint16_t* g = gu + r * 2 * inter;
    const uint16_t* u = g + inter;
    uint16_t* o = out + r * inter;
    for (int64_t i = 0; i < inter; ++i) {
      const float x = bf2f(g[i]);
      e[i] = 2.f * kAlpha * (x + 0.044715f * x * x * x);
    }
    exp_inplace(e.data(), inter);
    for (int64_t i = 0; i < inter; ++i) {
      const float x = bf2f(g[i]);
      const float gelu = 0.5f * x * (2.f - 2.f / (e[i] + 1.f));  // x (1 + tanh) / 2
      o[i] = f2bf(bf2f(f2bf(gelu)) * bf2f(u[i]));
    }
  }
  });
}

// Gemma's output norms: x = bf16(rms_norm(x) * w) in place, the mean square in float32 (no residual add).
void rms_norm_rows(uint16_t* x, const float* w, int64_t rows, int64_t width, double eps) {
  at::parallel_for(0, rows, kParallelRows, [&](int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    uint16_t* xr = x + r * width;
    float ss = 0.f;
    for (int64_t i = 0; i < width; ++i) ss += bf2f(xr[i]) * bf2f(xr[i]);
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(width) + static_cast<float>(eps));
    for (int64_t i = 0; i < width; ++i) xr[i] = f2bf(bf2f(xr[i]) * inv * w[i]);
  }
  });
}

// weights: per layer qkv, o, gate_up, down as (int4 packed, scales_and_zeros, oneDNN packed, code tiles)
// quadruples; planes and bits (0: no tiles), and tails (the tiles' last rows in records of their own kind, or an
// empty tensor: project()): per projection. Rows up to code_max_rows take the code kernel where
// there are tiles, else up to int4_max_rows torch's int4 kernel; more take the oneDNN copies, or without them the
// dequantized scratch from dequant_min_rows rows (0: never) and the code kernel below (project()), with int8
// activations from int8_min_rows rows (0: never).
// norms: per layer input and post-attention RMSNorm weights (float32), and for Qwen3 the q and k head norms after
// them (4 a layer), for Gemma 3 input, post-attention (the attention output's), pre- and post-feedforward, q and k
// (6 a layer: GELU-tanh then, and embeddings scaled by embed_scale); then the final norm's.
// sliding: per layer 1 where its attention is limited to the last `window` keys and its RoPE is cos_sin_local's.
// attn_scale: the queries' scale (0: 1 / sqrt(head_dim)).
// kv: per layer k cache, v cache; query_start_loc [seqs + 1] int32: each sequence's first row.
// Returns the final-norm hidden states [rows, hidden] bfloat16.
at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& positions, const at::Tensor& slot_mapping,
                   const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                   const at::Tensor& embed, const at::Tensor& cos_sin, at::TensorList norms, at::TensorList weights,
                   at::IntArrayRef planes, at::IntArrayRef bits, at::TensorList kv, int64_t num_heads,
                   int64_t num_kv_heads, int64_t head_dim, double eps, int64_t int4_max_rows, int64_t code_max_rows,
                   int64_t dequant_min_rows, int64_t int8_min_rows, const at::Tensor& cos_sin_local,
                   at::IntArrayRef sliding, int64_t window, double attn_scale, double embed_scale, at::TensorList qkv_bias,
                   at::TensorList tails) {
  at::NoGradGuard no_grad;
  const int64_t rows = input_ids.size(0), layers = static_cast<int64_t>(kv.size()) / 2;
  const int64_t hidden = embed.scalar_type() == at::kByte ? embed.size(1) * kQBlock : embed.size(1);
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK(embed.scalar_type() == at::kBFloat16 || embed.scalar_type() == at::kByte,
              "forward: bfloat16 weights only (or the embedding's code tiles)");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 16 * layers &&
                  static_cast<int64_t>(planes.size()) == 4 * layers && static_cast<int64_t>(bits.size()) == 4 * layers,
              "forward: 4 projections a layer");
  TORCH_CHECK(static_cast<int64_t>(tails.size()) == 4 * layers, "forward: a tail (or an empty tensor) a projection");
  const RowLimits limits{int4_max_rows, code_max_rows, dequant_min_rows, int8_min_rows};
  const int64_t norms_per_layer = (static_cast<int64_t>(norms.size()) - 1) / std::max<int64_t>(layers, 1);
  TORCH_CHECK((norms_per_layer == 2 || norms_per_layer == 4 || norms_per_layer == 6) &&
                  static_cast<int64_t>(norms.size()) == norms_per_layer * layers + 1,
              "forward: 2 norms a layer (4 with q/k head norms, 6 for Gemma 3) and a final one");
  const bool gemma = norms_per_layer == 6;
  TORCH_CHECK(sliding.empty() || (static_cast<int64_t>(sliding.size()) == layers && cos_sin_local.numel() > 0),
              "forward: a sliding flag a layer, with the local RoPE table");
  TORCH_CHECK(query_start_loc.size(0) == num_seqs + 1 && query_start_loc.data_ptr<int32_t>()[num_seqs] == rows,
              "forward: query_start_loc must cover every row");
  const at::Tensor& k0 = kv[0];
  Dims d{rows, num_heads, num_kv_heads, head_dim, k0.size(2), k0.size(1) * k0.size(2), block_tables.size(1)};
  const float scale = attn_scale > 0 ? static_cast<float>(attn_scale) : 1.f / std::sqrt(static_cast<float>(head_dim));
  // the Python path's (a Python float)
  const double chunk_scale = attn_scale > 0 ? attn_scale : 1.0 / std::sqrt(static_cast<double>(head_dim));
  const auto bf16 = at::TensorOptions().dtype(at::kBFloat16);
  // embed: the bfloat16 table, or the tied head's code tiles (uint8 [N / 16, K / 32, record]) where its dense copy
  // was released: rows looked up in the codes.
  at::Tensor embedded = embed.scalar_type() == at::kByte ? code_rows(embed, input_ids) : embed.index_select(0, input_ids);
  if (embed_scale > 0) embedded = embedded * at::scalar_tensor(embed_scale, bf16);  // rounded as the Python path's
  at::Tensor residual = embedded.to(at::kFloat);
  at::Tensor x = at::empty({rows, hidden}, bf16);
  at::Tensor q = at::empty({rows, num_heads * head_dim}, bf16);
  at::Tensor attn = at::empty({rows, num_heads * head_dim}, bf16);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const Plan plan = plan_rows(query_start_loc.data_ptr<int32_t>(), tables, lens, num_seqs, d);
  at::Tensor h;  // the previous layer's MLP output, added into the residual by the next norm
  PhaseClock clock;
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + 16 * l;
    const int64_t* p = planes.data() + 4 * l;
    const int64_t* b = bits.data() + 4 * l;
    const at::Tensor* layer_norms = norms.data() + norms_per_layer * l;
    add_rms_norm(residual.data_ptr<float>(), h.defined() ? bf16_ptr(h) : nullptr, layer_norms[0].data_ptr<float>(),
                 bf16_mut(x), rows, hidden, eps);
    clock.lap(kNorm);
    at::Tensor qkv = project(x, w, p[0], b[0], limits, tails[4 * l]);
    if (!qkv_bias.empty() && qkv_bias[l].numel()) qkv = qkv + qkv_bias[l];  // Qwen2's biases, rounded as Python's
    clock.lap(kMatmul);
    at::Tensor k_cache = kv[2 * l], v_cache = kv[2 * l + 1];
    HeadNorms head_norms;
    if (norms_per_layer >= 4) {
      const int64_t at = norms_per_layer - 2;
      head_norms = {layer_norms[at].data_ptr<float>(), layer_norms[at + 1].data_ptr<float>(), static_cast<float>(eps)};
    }
    const bool slides = !sliding.empty() && sliding[l] != 0;
    const int64_t layer_window = slides ? window : 0;
    rope_and_write(bf16_ptr(qkv), pos, slots, (slides ? cos_sin_local : cos_sin).data_ptr<float>(), bf16_mut(q),
                   bf16_mut(k_cache), bf16_mut(v_cache), d, head_norms);
    clock.lap(kRope);
    if (!plan.decode_rows.empty())
      decode_attention(bf16_ptr(q), bf16_ptr(k_cache), bf16_ptr(v_cache), tables, lens, plan.decode_rows,
                       plan.decode_seqs, bf16_mut(attn), d, scale, layer_window);
    clock.lap(kDecodeAttention);
    chunk_attention(q, k_cache, v_cache, plan, attn, d, chunk_scale, layer_window);
    clock.lap(kChunkAttention);
    at::Tensor o = project(attn, w + 4, p[1], b[1], limits, tails[4 * l + 1]);
    clock.lap(kMatmul);
    if (gemma) {  // the attention output's own norm before it joins the residual
      o = o.contiguous();
      rms_norm_rows(bf16_mut(o), layer_norms[1].data_ptr<float>(), rows, hidden, eps);
    }
    add_rms_norm(residual.data_ptr<float>(), bf16_ptr(o), layer_norms[gemma ? 2 : 1].data_ptr<float>(), bf16_mut(x),
                 rows, hidden, eps);
    clock.lap(kNorm);
    at::Tensor gu = project(x, w + 8, p[2], b[2], limits, tails[4 * l + 2]);
    clock.lap(kMatmul);
    const int64_t inter = gu.size(1) / 2;
    at::Tensor act = at::empty({rows, inter}, bf16);
    if (gemma)
      gelu_tanh_and_mul(bf16_ptr(gu), bf16_mut(act), rows, inter);
    else
      silu_and_mul(bf16_ptr(gu), bf16_mut(act), rows, inter);
    clock.lap(kSiluMul);
    h = project(act, w + 12, p[3], b[3], limits, tails[4 * l + 3]);
    clock.lap(kMatmul);
    if (gemma) {
      h = h.contiguous();
      rms_norm_rows(bf16_mut(h), layer_norms[3].data_ptr<float>(), rows, hidden, eps);
      clock.lap(kNorm);
    }
  }
  add_rms_norm(residual.data_ptr<float>(), bf16_ptr(h), norms[norms_per_layer * layers].data_ptr<float>(),
               bf16_mut(x), rows, hidden, eps);
  clock.lap(kNorm);
  return x;
}

}  // namespace

// A catch-all kernel: the oneDNN-packed weights among the arguments are MkldnnCPU tensors, so a CPU-keyed one
// would not be found for them.
// The prefill chunks' attention alone (tests: the kernel against scaled_dot_product_attention): q [rows, heads, D]
// bfloat16, the caches head-major; rows of one-token sequences come back zero.
at::Tensor chunk_attention_only(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& query_start_loc, const at::Tensor& block_tables,
                                const at::Tensor& seq_lens, double scale) {
  const int64_t rows = q.size(0), heads = q.size(1), D = q.size(2);
  Dims d{rows, heads, k_cache.size(0), D, k_cache.size(2), k_cache.size(1) * k_cache.size(2), block_tables.size(1)};
  const Plan plan = plan_rows(query_start_loc.data_ptr<int32_t>(), block_tables.data_ptr<int32_t>(),
                              seq_lens.data_ptr<int32_t>(), seq_lens.size(0), d);
  at::Tensor flat = q.contiguous().view({rows, heads * D});
  at::Tensor out = at::zeros_like(flat);
  chunk_attention(flat, k_cache, v_cache, plan, out, d, scale);
  return out.view({rows, heads, D});
}

// Decode attention alone (tests: split parts against whole tasks and a float64 reference): q [seqs, heads, D]
// bfloat16, one decode row a sequence; the caches head-major; parts 0: as the forward splits, else that many.
at::Tensor decode_attention_only(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                 int64_t window, int64_t parts) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "decode_attention: q [seqs, heads, D] and head-major caches, bfloat16");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  seq_lens.size(0) == q.size(0) && block_tables.size(0) == q.size(0),
              "decode_attention: int32 block tables and lengths, one a sequence");
  const int64_t seqs = q.size(0), heads = q.size(1), D = q.size(2);
  Dims d{seqs, heads, k_cache.size(0), D, k_cache.size(2), k_cache.size(1) * k_cache.size(2), block_tables.size(1)};
  std::vector<int64_t> rows(seqs);
  for (int64_t i = 0; i < seqs; ++i) rows[i] = i;
  const at::Tensor flat = q.contiguous().view({seqs, heads * D}), tables = block_tables.contiguous(),
                   lens = seq_lens.contiguous();
  at::Tensor out = at::empty_like(flat);
  decode_attention(bf16_ptr(flat), bf16_ptr(k_cache), bf16_ptr(v_cache), tables.data_ptr<int32_t>(),
                   lens.data_ptr<int32_t>(), rows, rows, bf16_mut(out), d, static_cast<float>(scale), window, parts);
  return out.view({seqs, heads, D});
}

// Chunks through the AVX512-BF16 or AVX2 kernel (true) or ATen's scaled_dot_product_attention; returns whether the
// kernel is in use (false where the tier has neither, whatever was asked).
bool set_chunk_kernel(bool on) {
#ifdef STALLFREE_CHUNK_KERNEL
  g_chunk_kernel = on;
  return on;
#else
  (void)on;
  return false;
#endif
}

// Whether the code kernel has an int8 form on this tier (AVX512-VNNI: cpu_vnni_matmul.h).
bool int8_kernel() {
#ifdef STALLFREE_INT8_MATMUL
  return true;
#else
  return false;
#endif
}

// The compiled forward's seconds per kind of step since the last call (norm, matmul, rope and KV write, decode
// attention, chunk attention, SiLU-and-mul), then zeroed.
std::vector<double> phase_seconds() {
  std::vector<double> out(g_phase_seconds, g_phase_seconds + kPhases);
  std::fill(g_phase_seconds, g_phase_seconds + kPhases, 0.0);
  return out;
}

// Which code kernel was compiled in: avx512_vnni, avx2 or portable (cpu_code_matmul.h).
std::string code_kernel() { return kCodeKernel; }

// Which decode-attention kernel was compiled in: AVX512-BF16, AVX2 or the portable loop (cpu_decode_attention.h).
std::string attention_kernel() {
#ifdef STALLFREE_DECODE_ATTENTION_KERNEL
  return kDecodeAttentionKernel;
#else
  return "portable";
#endif
}

// Which prefill-chunk attention kernel was compiled in: AVX512-BF16, AVX2 (cpu_chunk_attention.h) or none (ATen's
// scaled_dot_product_attention).
std::string chunk_attention_kernel() {
#ifdef STALLFREE_CHUNK_KERNEL
  return kChunkAttentionKernel;
#else
  return "aten";
#endif
}

TORCH_LIBRARY(STALLFREE_OPS_NS, m) {
  m.def("code_kernel() -> str", &code_kernel);
  m.def("attention_kernel() -> str", &attention_kernel);
  m.def("chunk_attention_kernel() -> str", &chunk_attention_kernel);
  m.def("phase_seconds() -> float[]", &phase_seconds);
  m.def("code_matmul(Tensor x, Tensor blocks, int bits, bool float_out=False, int int8_min_rows=0) -> Tensor",
        &code_matmul);
  m.def("code_rows(Tensor blocks, Tensor ids) -> Tensor", &code_rows);
  m.def("code_dequantize(Tensor blocks) -> Tensor", &code_dequantize);
  m.def("dequantized_mm(Tensor x, Tensor blocks) -> Tensor", &dequantized_mm);
  m.def("gguf_tiles(Tensor(a!) out, int row_start, Tensor raw, str qtype, Tensor order) -> bool", &gguf_tiles);
  m.def("set_chunk_kernel(bool on) -> bool", &set_chunk_kernel);
  m.def("int8_kernel() -> bool", &int8_kernel);
  m.def("chunk_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor query_start_loc, Tensor block_tables, "
        "Tensor seq_lens, float scale) -> Tensor", &chunk_attention_only);
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "float scale, int window=0, int parts=0) -> Tensor", &decode_attention_only);
  m.def("decode_parts(int tasks, int keys, int threads) -> int", &decode_parts);
  m.def("argmax_rows(Tensor logits) -> Tensor", &argmax_rows);
  m.def("forward(Tensor input_ids, Tensor positions, Tensor slot_mapping, Tensor block_tables, "
        "Tensor seq_lens, Tensor query_start_loc, Tensor embed, Tensor cos_sin, Tensor[] norms, Tensor[] weights, "
        "int[] planes, int[] bits, Tensor[] kv, int num_heads, int num_kv_heads, int head_dim, float eps, "
        "int int4_max_rows, int code_max_rows, int dequant_min_rows, int int8_min_rows, Tensor cos_sin_local, "
        "int[] sliding, "
        "int window, float attn_scale, "
        "float embed_scale, Tensor[] qkv_bias, Tensor[] tails) -> Tensor",
        &forward);
}
