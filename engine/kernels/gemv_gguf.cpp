// A few rows (a decode step) times a matrix held as the GGUF file holds it, so that a step reads about the file's
// bytes, not fp32's four a value:
// - gemv_int8_groups: int8 values with one fp32 scale per group along a row (Q6_K: groups of 16, scale =
//   d * sub-scale, values q - 32; Q8_0: groups of 32, scale = d). y[r, n] = sum_k (scale * q[n, k]) * x[r, k].
// - gemv_q4_groups: 4-bit values 0..15 with a scale and a low per group of 32 (Q4_0, Q4_1, Q4_K), two values a
//   byte (byte j of a group: value j in its low nibble, value j + 16 in its high one).
//   y[r, n] = sum_k (scale * q[n, k] + low) * x[r, k].
// Each weight is rebuilt in fp32 exactly as gguf-py's de-quantization computes it (a product, then a sum: the
// build turns off contraction into FMAs), so the values are the file's bit for bit and only the order of the
// sums differs from a matmul over the de-quantized matrix. AVX2 + FMA; output rows are split over threads, and
// one input row is spread over independent accumulator sets (an FMA's latency is 4-5 cycles).
// gemv_int8_q8 and gemv_q4_q8 (`gguf-q8`) take the same values with fp16 scales and round x to int8 blocks first
// (llama.cpp's way; see below). AVX2 + FMA + F16C; where the build has AVX-512 VNNI (engine/kernels/__init__.py
// adds its flags on such a CPU) they take two groups an instruction through vpdpbusd, with the same values bit for
// bit (see `wide`).
#include "gemv_gguf.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t MAX_ROWS = 4;
// Bytes ahead of the weight stream each kernel asks the cache for: the hardware prefetcher alone left a decode
// step at ~7-10 GB/s (2 threads, Intel Xeon); 1-2 KB ahead halved the output matrix's time (2048 measured best of
// 512, 1024 and 2048).
constexpr int64_t PREFETCH = 2048;
constexpr int64_t MAX_GROUPS = 4096;  // scales a row (the int8-input kernels' buffer, 64 KB at 4 rows): K <= 65536

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define GEMV_AVX512 1
// Whether the int8-input kernels take their 512-bit path (the `use_avx512` op turns it off, so that a test can
// compare the two paths on the same machine and a benchmark can time both).
bool wide = true;
#else
bool wide = false;
#endif

inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One 16-value chunk of row n into the accumulators of each of the ROWS input rows.
template <int ROWS>
inline void chunk_times(const float* x, const int8_t* qn, const float* sn, int64_t K, int64_t k, __m256 (&acc)[ROWS][2]) {
  const __m256 s = _mm256_broadcast_ss(sn);
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qn + k));
  const __m256 w0 = _mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
  const __m256 w1 = _mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))));
  for (int r = 0; r < ROWS; ++r) {
    acc[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * K + k), acc[r][0]);
    acc[r][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * K + k + 8), acc[r][1]);
  }
}

// Output rows n0..n1. SETS independent accumulator sets take consecutive chunks, so that the FMAs of one row
// do not wait on each other (an FMA's latency is 4-5 cycles): 4 sets for one input row, fewer for more rows,
// which are independent already. `shift`: chunk -> its scale (0: groups of 16, 1: groups of 32).
template <int ROWS>
void rows_times(const float* x, const int8_t* q, const float* scale, float* y, int64_t K, int64_t N,
                int shift, int64_t n0, int64_t n1) {
  constexpr int SETS = ROWS == 1 ? 4 : ROWS == 2 ? 2 : 1;
  const int64_t chunks = K / 16, groups = K / (16 << shift);
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* qn = q + n * K;
    const float* sn = scale + n * groups;
    __m256 acc[SETS][ROWS][2];
    for (int a = 0; a < SETS; ++a)
      for (int r = 0; r < ROWS; ++r) acc[a][r][0] = acc[a][r][1] = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + SETS <= chunks; c += SETS) {
      _mm_prefetch(reinterpret_cast<const char*>(qn + c * 16 + PREFETCH), _MM_HINT_T0);
      for (int a = 0; a < SETS; ++a) chunk_times<ROWS>(x, qn, sn + ((c + a) >> shift), K, (c + a) * 16, acc[a]);
    }
    for (; c < chunks; ++c) chunk_times<ROWS>(x, qn, sn + (c >> shift), K, c * 16, acc[0]);
    for (int r = 0; r < ROWS; ++r) {
      __m256 total = _mm256_add_ps(acc[0][r][0], acc[0][r][1]);
      for (int a = 1; a < SETS; ++a) total = _mm256_add_ps(total, _mm256_add_ps(acc[a][r][0], acc[a][r][1]));
      y[r * N + n] = sum8(total);
    }
  }
}

// `kernel(R, n0, n1)` over output rows 0..N split across threads, R the kernel's input-row count as a constant
// (std::integral_constant, so each count gets its own instantiation). Grains of 64 output rows: enough work per
// task (64 x K bytes) that scheduling is noise.
template <class Kernel>
void over_output_rows(int64_t rows, int64_t N, const Kernel& kernel) {
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    switch (rows) {
      case 1: kernel(std::integral_constant<int, 1>{}, n0, n1); break;
      case 2: kernel(std::integral_constant<int, 2>{}, n0, n1); break;
      case 3: kernel(std::integral_constant<int, 3>{}, n0, n1); break;
      default: kernel(std::integral_constant<int, 4>{}, n0, n1); break;
    }
  });
}

// The checks each op makes before it reads a byte: a refused call raises (the caller falls back to the full
// weight), never reads past a tensor. `scales`: the scales' (and lows') dtype, fp32 or fp16 by the kernel.
// Returns the values per scale (int8 ops: 16 or 32).
int64_t check_int8(const char* op, const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                   at::ScalarType scales) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && q.scalar_type() == at::kChar && scale.scalar_type() == scales,
              op, ": x float32, q int8, scale ", c10::toString(scales));
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && scale.dim() == 2, op, ": 2-d tensors");
  TORCH_CHECK(x.is_contiguous() && q.is_contiguous() && scale.is_contiguous(), op, ": contiguous");
  const int64_t rows = x.size(0), K = x.size(1), N = q.size(0);
  TORCH_CHECK(rows >= 1 && rows <= MAX_ROWS, op, ": 1 to 4 rows");
  TORCH_CHECK(K % 32 == 0 && q.size(1) == K && scale.size(0) == N && scale.size(1) > 0 && K % scale.size(1) == 0 &&
                  scale.size(1) <= MAX_GROUPS, op, ": shapes");
  const int64_t group = K / scale.size(1);
  TORCH_CHECK(group == 16 || group == 32, op, ": groups of 16 or 32 values");
  return group;
}

void check_q4(const char* op, const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
              const torch::Tensor& low, at::ScalarType scales) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kByte && scale.scalar_type() == scales &&
                  low.scalar_type() == scales, op, ": x float32, packed uint8, scale and low ", c10::toString(scales));
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 2 && scale.dim() == 2 && low.dim() == 2, op, ": 2-d");
  TORCH_CHECK(x.is_contiguous() && packed.is_contiguous() && scale.is_contiguous() && low.is_contiguous(),
              op, ": contiguous");
  const int64_t rows = x.size(0), K = x.size(1), N = packed.size(0);
  TORCH_CHECK(rows >= 1 && rows <= MAX_ROWS, op, ": 1 to 4 rows");
  TORCH_CHECK(K % 32 == 0 && packed.size(1) == K / 2 && scale.size(0) == N && scale.size(1) == K / 32 &&
                  low.sizes() == scale.sizes() && K / 32 <= MAX_GROUPS, op, ": shapes");
}

torch::Tensor gemv_int8_groups(torch::Tensor x, torch::Tensor q, torch::Tensor scale) {
  const int64_t group = check_int8("gemv_int8_groups", x, q, scale, at::kFloat);
  const int64_t rows = x.size(0), K = x.size(1), N = q.size(0);
  const int shift = group == 32 ? 1 : 0;
  auto y = torch::empty({rows, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  over_output_rows(rows, N, [&](auto R, int64_t n0, int64_t n1) {
    rows_times<decltype(R)::value>(xp, qp, sp, yp, K, N, shift, n0, n1);
  });
  return y;
}

// One group of 32 values of row n (16 bytes) into the accumulators of each input row.
template <int ROWS>
inline void q4_group_times(const float* x, const uint8_t* pn, const float* sn, const float* ln, int64_t K, int64_t k,
                           __m256 (&acc)[ROWS][2]) {
  const __m256 s = _mm256_broadcast_ss(sn), low = _mm256_broadcast_ss(ln);
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(pn));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
  const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  for (int p = 0; p < 4; ++p) {
    const __m256 w = _mm256_add_ps(_mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[p]))), low);
    for (int r = 0; r < ROWS; ++r)
      acc[r][p & 1] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + r * K + k + 8 * p), acc[r][p & 1]);
  }
}

template <int ROWS>
void q4_rows_times(const float* x, const uint8_t* packed, const float* scale, const float* low, float* y,
                   int64_t K, int64_t N, int64_t n0, int64_t n1) {
  constexpr int SETS = ROWS == 1 ? 4 : ROWS == 2 ? 2 : 1;
  const int64_t groups = K / 32;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* pn = packed + n * (K / 2);
    const float* sn = scale + n * groups;
    const float* ln = low + n * groups;
    __m256 acc[SETS][ROWS][2];
    for (int a = 0; a < SETS; ++a)
      for (int r = 0; r < ROWS; ++r) acc[a][r][0] = acc[a][r][1] = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + SETS <= groups; g += SETS) {
      _mm_prefetch(reinterpret_cast<const char*>(pn + g * 16 + PREFETCH), _MM_HINT_T0);
      for (int a = 0; a < SETS; ++a)
        q4_group_times<ROWS>(x, pn + (g + a) * 16, sn + g + a, ln + g + a, K, (g + a) * 32, acc[a]);
    }
    for (; g < groups; ++g) q4_group_times<ROWS>(x, pn + g * 16, sn + g, ln + g, K, g * 32, acc[0]);
    for (int r = 0; r < ROWS; ++r) {
      __m256 total = _mm256_add_ps(acc[0][r][0], acc[0][r][1]);
      for (int a = 1; a < SETS; ++a) total = _mm256_add_ps(total, _mm256_add_ps(acc[a][r][0], acc[a][r][1]));
      y[r * N + n] = sum8(total);
    }
  }
}

torch::Tensor gemv_q4_groups(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, torch::Tensor low) {
  check_q4("gemv_q4_groups", x, packed, scale, low, at::kFloat);
  const int64_t rows = x.size(0), K = x.size(1), N = packed.size(0);
  auto y = torch::empty({rows, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* lp = low.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  over_output_rows(rows, N, [&](auto R, int64_t n0, int64_t n1) {
    q4_rows_times<decltype(R)::value>(xp, pp, sp, lp, yp, K, N, n0, n1);
  });
  return y;
}

// ---- int8 activations (llama.cpp's way): x's rows rounded to int8 in blocks of 32 (d = max|x| / 127, as its
// Q8_0), so that a group's dot product is integer multiply-adds over 32 bytes (maddubs + madd), 3-4 instructions
// a group where the fp32 path above spends ~20. The weights' values are the file's; their group scales and lows
// come in fp16 (a step reads every byte once, and fp32 scales were a third of a 4-bit matrix's bytes; fp16's
// rounding, 2^-11, is small beside x's). What changes is x, each value within d / 2 (up to 1/254 of its block's
// largest), and the scales within 2^-11.

struct Q8Rows {
  std::vector<int8_t> q;    // [rows, K]
  std::vector<float> d;     // [rows, K / 32]: value = d * q
  std::vector<float> dsum;  // [rows, K / 32]: d * the block's sum of q (the 4-bit groups' low term)
  std::vector<int8_t> pairs;  // [rows, K], the AVX-512 path's order for the 4-bit kernels (q4_q8_pairs); else empty
};

Q8Rows quantize_rows(const float* x, int64_t rows, int64_t K) {
  const int64_t blocks = K / 32;
  Q8Rows out{std::vector<int8_t>(rows * K), std::vector<float>(rows * blocks), std::vector<float>(rows * blocks)};
  for (int64_t b = 0; b < rows * blocks; ++b) {
    const float* xb = x + b * 32;
    float amax = 0.f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
    int sum = 0;
    for (int i = 0; i < 32; ++i) {
      const int v = static_cast<int>(std::nearbyint(xb[i] * id));
      out.q[b * 32 + i] = static_cast<int8_t>(v);
      sum += v;
    }
    out.d[b] = d;
    out.dsum[b] = d * static_cast<float>(sum);
  }
  if (wide) {
    // Blocks 2p and 2p + 1 as [2p's values 0-15, 2p + 1's 0-15, 2p's 16-31, 2p + 1's 16-31]: the order in which
    // q4_q8_pairs unpacks the two groups' 32 bytes of 4-bit values.
    out.pairs.resize(rows * K);  // a row's odd last block, if any, is the AVX2 loop's (left out here)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t b = 0; b + 2 <= blocks; b += 2) {
        const int8_t* src = out.q.data() + r * K + b * 32;
        int8_t* dst = out.pairs.data() + r * K + b * 32;
        std::copy(src, src + 16, dst);
        std::copy(src + 32, src + 48, dst + 16);
        std::copy(src + 16, src + 32, dst + 32);
        std::copy(src + 48, src + 64, dst + 48);
      }
  }
  return out;
}

// The 8 int32 sums of 4 adjacent products of unsigned u and signed s bytes (u <= 128, |s| <= 127: the pairs'
// int16 sums stay below 2^15).
inline __m256i dot_u8_i8(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// f[r][g] = scale[g] * d[r][g] for one output row's groups, 8 at a time (fp16 -> fp32 in vectors), so that the
// inner loops broadcast each factor from memory (a load) instead of converting and broadcasting in registers: the
// shuffle port those need is the one the unpacking and the dot products already crowd.
template <int ROWS>
inline void group_factors(const uint16_t* sn, const float* d, int64_t groups, float (*f)[MAX_GROUPS]) {
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) {
    const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sn + g)));
    for (int r = 0; r < ROWS; ++r) _mm256_storeu_ps(f[r] + g, _mm256_mul_ps(s, _mm256_loadu_ps(d + r * groups + g)));
  }
  for (; g < groups; ++g)
    for (int r = 0; r < ROWS; ++r) f[r][g] = _cvtsh_ss(sn[g]) * d[r * groups + g];
}

#ifdef GEMV_AVX512
// ---- The same products two groups (or int8 blocks) at a time, for CPUs with AVX-512 VNNI. vpdpbusd sums 4
// adjacent u8 x s8 products into each int32 lane, which is what maddubs + madd compute (their int16 pair sums
// never saturate here), and lanes 0-7 of a 512-bit register hold the even group exactly as the AVX2 path's
// acc[r][0] does, lanes 8-15 the odd one as its acc[r][1]: each lane sees the same FMAs in the same order, so the
// accumulators handed back are the AVX2 path's bit for bit, and the caller finishes any odd group left over.

// 16 lanes of one factor per half: f[g] in lanes 0-7, f[g + 1] in lanes 8-15 (GROUP 32); f[2c] .. f[2c + 3]
// four lanes each (GROUP 16).
template <int GROUP>
inline __m512 pair_factors(const float* f) {
  if constexpr (GROUP == 32) {
    const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(f)))));
  } else {
    const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_loadu_ps(f)));
  }
}

template <int ROWS>
inline void split_into(const __m512 (&wide_acc)[ROWS], __m256 (&acc)[ROWS][2]) {
  for (int r = 0; r < ROWS; ++r) {
    acc[r][0] = _mm512_castps512_ps256(wide_acc[r]);
    acc[r][1] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(wide_acc[r]), 1));
  }
}

// The 4-bit groups of one output row, two at a time: their 32 packed bytes, loaded into both halves of a
// register, become [g low nibbles, g + 1 low, g high, g + 1 high] in the four 128-bit lanes with one masked shift
// (no shuffle: the shuffle port is the one these loops crowd), against x's values in that order (Q8Rows::pairs).
// Lanes 0-3 and 8-11 hold group g as the AVX2 path's acc[r][0] does, 4-7 and 12-15 group g + 1 as its acc[r][1],
// put back in that order at the end. Returns the first group not done (groups rounded down to even).
template <int ROWS>
inline int64_t q4_q8_pairs(const Q8Rows& xq, const uint8_t* pn, float (*f)[MAX_GROUPS], int64_t K,
                           int64_t groups, __m256 (&acc)[ROWS][2]) {
  const __m512i mask = _mm512_set1_epi8(0x0F);
  const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1);
  __m512 wide_acc[ROWS];
  for (int r = 0; r < ROWS; ++r) wide_acc[r] = _mm512_setzero_ps();
  int64_t g = 0;
  for (; g + 2 <= groups; g += 2) {
    if ((g & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(pn + g * 16 + PREFETCH), _MM_HINT_T0);
    const __m512i b = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pn + g * 16)));
    const __m512i w = _mm512_and_si512(_mm512_mask_srli_epi16(b, 0xFFFF0000, b, 4), mask);
    for (int r = 0; r < ROWS; ++r) {
      const __m512i xv = _mm512_loadu_si512(xq.pairs.data() + r * K + g * 32);
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xv);
      const __m512 s = _mm512_permutexvar_ps(
          idx, _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(f[r] + g)))));
      wide_acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, wide_acc[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r) wide_acc[r] = _mm512_shuffle_f32x4(wide_acc[r], wide_acc[r], _MM_SHUFFLE(3, 1, 2, 0));
  split_into<ROWS>(wide_acc, acc);
  return g;
}

// The int8 blocks of one output row, two at a time (64 bytes); |q| against x with q's sign, as the AVX2 path
// (where q is 0 the product is 0 either way). Returns the first block not done.
template <int ROWS, int GROUP>
inline int64_t int8_q8_pairs(const Q8Rows& xq, const int8_t* qn, float (*f)[MAX_GROUPS], int64_t K,
                             int64_t blocks, __m256 (&acc)[ROWS][2]) {
  __m512 wide_acc[ROWS];
  for (int r = 0; r < ROWS; ++r) wide_acc[r] = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 2 <= blocks; c += 2) {
    _mm_prefetch(reinterpret_cast<const char*>(qn + c * 32 + PREFETCH), _MM_HINT_T0);
    const __m512i w = _mm512_loadu_si512(qn + c * 32);
    const __m512i aw = _mm512_abs_epi8(w);
    const __mmask64 negative = _mm512_movepi8_mask(w);
    for (int r = 0; r < ROWS; ++r) {
      const __m512i xv = _mm512_loadu_si512(xq.q.data() + r * K + c * 32);
      const __m512i xs = _mm512_mask_sub_epi8(xv, negative, _mm512_setzero_si512(), xv);
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), aw, xs);
      const __m512 s = pair_factors<GROUP>(f[r] + (GROUP == 32 ? c : 2 * c));
      wide_acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, wide_acc[r]);
    }
  }
  split_into<ROWS>(wide_acc, acc);
  return c;
}
#endif

// The 4-bit groups of output rows n0..n1 times the int8 rows: per group, scale * d * (q . qx), plus the low
// term low * d * sum(qx) as one dot product over the groups afterwards. A group's 16 bytes are loaded into both
// halves of a register, the low nibbles kept in one half and the high ones in the other (a blend, not a shuffle).
template <int ROWS>
void q4_q8_rows_times(const Q8Rows& xq, const uint8_t* packed, const uint16_t* scale, const uint16_t* low, float* y,
                      int64_t K, int64_t N, int64_t n0, int64_t n1) {
  const int64_t groups = K / 32;
  const __m256i mask = _mm256_set1_epi8(0x0F);
  alignas(32) float f[ROWS][MAX_GROUPS];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* pn = packed + n * (K / 2);
    const uint16_t* ln = low + n * groups;
    group_factors<ROWS>(scale + n * groups, xq.d.data(), groups, f);
    __m256 acc[ROWS][2];
    for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    int64_t g = 0;
#ifdef GEMV_AVX512
    if (wide) g = q4_q8_pairs<ROWS>(xq, pn, f, K, groups, acc);
#endif
    for (; g < groups; ++g) {
      if ((g & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(pn + g * 16 + PREFETCH), _MM_HINT_T0);
      const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pn + g * 16)));
      const __m256i w = _mm256_and_si256(_mm256_blend_epi32(b, _mm256_srli_epi16(b, 4), 0xF0), mask);
      for (int r = 0; r < ROWS; ++r) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q.data() + r * K + g * 32));
        acc[r][g & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8_i8(w, xv)), _mm256_broadcast_ss(f[r] + g),
                                        acc[r][g & 1]);
      }
    }
    for (int r = 0; r < ROWS; ++r) {
      const float* ds = xq.dsum.data() + r * groups;
      __m256 lows = _mm256_setzero_ps();
      int64_t g = 0;
      for (; g + 8 <= groups; g += 8) {
        const __m256 l = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ln + g)));
        lows = _mm256_fmadd_ps(l, _mm256_loadu_ps(ds + g), lows);
      }
      float tail = 0.f;
      for (; g < groups; ++g) tail += _cvtsh_ss(ln[g]) * ds[g];
      y[r * N + n] = sum8(_mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]), lows)) + tail;
    }
  }
}

// The int8 groups (GROUP 16 or 32 values a scale) of output rows n0..n1 times the int8 rows; the signed weights
// go through maddubs as |q| against x with q's sign (llama.cpp's trick). Q8_0's -128 is 128 unsigned: still fits.
template <int ROWS, int GROUP>
void int8_q8_rows_times(const Q8Rows& xq, const int8_t* q, const uint16_t* scale, float* y, int64_t K, int64_t N,
                        int64_t n0, int64_t n1) {
  const int64_t blocks = K / 32, groups = K / GROUP;
  alignas(32) float f[ROWS][MAX_GROUPS];
  // d per group: the block's d, once per group of 16 when there are two a block
  std::vector<float> d(ROWS * groups);
  for (int r = 0; r < ROWS; ++r)
    for (int64_t g = 0; g < groups; ++g) d[r * groups + g] = xq.d[r * blocks + g * GROUP / 32];
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* qn = q + n * K;
    group_factors<ROWS>(scale + n * groups, d.data(), groups, f);
    __m256 acc[ROWS][2];
    for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    int64_t c = 0;
#ifdef GEMV_AVX512
    if (wide) c = int8_q8_pairs<ROWS, GROUP>(xq, qn, f, K, blocks, acc);
#endif
    for (; c < blocks; ++c) {
      if ((c & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(qn + c * 32 + PREFETCH), _MM_HINT_T0);
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qn + c * 32));
      const __m256i aw = _mm256_sign_epi8(w, w);
      for (int r = 0; r < ROWS; ++r) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q.data() + r * K + c * 32));
        // lanes 0-3 hold values 0-15 of the block, lanes 4-7 values 16-31: one factor, or one per half
        const __m256 s = GROUP == 32 ? _mm256_broadcast_ss(f[r] + c)
                                     : _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_broadcast_ss(f[r] + 2 * c)),
                                                            _mm_broadcast_ss(f[r] + 2 * c + 1), 1);
        acc[r][c & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8_i8(aw, _mm256_sign_epi8(xv, w))), s, acc[r][c & 1]);
      }
    }
    for (int r = 0; r < ROWS; ++r) y[r * N + n] = sum8(_mm256_add_ps(acc[r][0], acc[r][1]));
  }
}

torch::Tensor gemv_int8_q8(torch::Tensor x, torch::Tensor q, torch::Tensor scale) {
  const int64_t group = check_int8("gemv_int8_q8", x, q, scale, at::kHalf);
  const int64_t rows = x.size(0), K = x.size(1), N = q.size(0);
  const Q8Rows xq = quantize_rows(x.data_ptr<float>(), rows, K);
  auto y = torch::empty({rows, N}, x.options());
  const int8_t* qp = q.data_ptr<int8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::Half>());
  float* yp = y.data_ptr<float>();
  over_output_rows(rows, N, [&](auto R, int64_t n0, int64_t n1) {
    if (group == 16)
      int8_q8_rows_times<decltype(R)::value, 16>(xq, qp, sp, yp, K, N, n0, n1);
    else
      int8_q8_rows_times<decltype(R)::value, 32>(xq, qp, sp, yp, K, N, n0, n1);
  });
  return y;
}

torch::Tensor gemv_q4_q8(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, torch::Tensor low) {
  check_q4("gemv_q4_q8", x, packed, scale, low, at::kHalf);
  const int64_t rows = x.size(0), K = x.size(1), N = packed.size(0);
  const Q8Rows xq = quantize_rows(x.data_ptr<float>(), rows, K);
  auto y = torch::empty({rows, N}, x.options());
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::Half>());
  const uint16_t* lp = reinterpret_cast<const uint16_t*>(low.data_ptr<at::Half>());
  float* yp = y.data_ptr<float>();
  over_output_rows(rows, N, [&](auto R, int64_t n0, int64_t n1) {
    q4_q8_rows_times<decltype(R)::value>(xq, pp, sp, lp, yp, K, N, n0, n1);
  });
  return y;
}

}  // namespace

namespace marginalia {

// Several matrices that take the same input (a layer's q, k and v; its gate and up) in one call: x rounded to
// int8 blocks once, and one split of all their output rows over the threads, so that a small matrix (k's 256 rows)
// does not cost a round of thread start-up of its own. Matrix i is 4-bit (packed uint8 [N_i, K / 2], scale and low
// fp16 [N_i, K / 32]) or int8 (q int8 [N_i, K], scale fp16 [N_i, K / 16 or 32]; its low is an empty tensor).
// Each output row is computed by the same code as gemv_q4_q8's or gemv_int8_q8's, so the values are theirs bit
// for bit.
std::vector<torch::Tensor> gemv_q8_many(torch::Tensor x, std::vector<torch::Tensor> weights,
                                        std::vector<torch::Tensor> scales, std::vector<torch::Tensor> lows) {
  const size_t count = weights.size();
  TORCH_CHECK(count >= 1 && scales.size() == count && lows.size() == count, "gemv_q8_many: one scale and low a matrix");
  std::vector<int64_t> groups(count), first(count + 1, 0);  // first[i]: matrix i's first row among all of them
  for (size_t i = 0; i < count; ++i) {
    if (weights[i].scalar_type() == at::kByte) {
      check_q4("gemv_q8_many", x, weights[i], scales[i], lows[i], at::kHalf);
      groups[i] = 0;
    } else {
      groups[i] = check_int8("gemv_q8_many", x, weights[i], scales[i], at::kHalf);
    }
    first[i + 1] = first[i] + weights[i].size(0);
  }
  const int64_t rows = x.size(0), K = x.size(1);
  const Q8Rows xq = quantize_rows(x.data_ptr<float>(), rows, K);
  std::vector<torch::Tensor> ys(count);
  for (size_t i = 0; i < count; ++i) ys[i] = torch::empty({rows, weights[i].size(0)}, x.options());
  over_output_rows(rows, first[count], [&](auto R, int64_t n0, int64_t n1) {
    constexpr int ROWS = decltype(R)::value;
    for (size_t i = 0; i < count; ++i) {  // the part of n0..n1 that falls in matrix i, in its own row numbers
      const int64_t a = std::max(n0, first[i]) - first[i], b = std::min(n1, first[i + 1]) - first[i];
      if (a >= b) continue;
      const int64_t N = weights[i].size(0);
      const uint16_t* sp = reinterpret_cast<const uint16_t*>(scales[i].data_ptr<at::Half>());
      float* yp = ys[i].data_ptr<float>();
      if (groups[i] == 0)
        q4_q8_rows_times<ROWS>(xq, weights[i].data_ptr<uint8_t>(), sp,
                               reinterpret_cast<const uint16_t*>(lows[i].data_ptr<at::Half>()), yp, K, N, a, b);
      else if (groups[i] == 16)
        int8_q8_rows_times<ROWS, 16>(xq, weights[i].data_ptr<int8_t>(), sp, yp, K, N, a, b);
      else
        int8_q8_rows_times<ROWS, 32>(xq, weights[i].data_ptr<int8_t>(), sp, yp, K, N, a, b);
    }
  });
  return ys;
}

}  // namespace marginalia

namespace {

// Turns the int8-input kernels' AVX-512 path on or off; returns whether it is in use after the call (false where
// the build has no AVX-512 VNNI).
bool use_avx512(bool enable) {
#ifdef GEMV_AVX512
  wide = enable;
#endif
  return wide;
}

}  // namespace

TORCH_LIBRARY(marginalia_gemv, m) {
  m.def("gemv_int8_groups(Tensor x, Tensor q, Tensor scale) -> Tensor");
  m.def("gemv_q4_groups(Tensor x, Tensor packed, Tensor scale, Tensor low) -> Tensor");
  m.def("gemv_int8_q8(Tensor x, Tensor q, Tensor scale) -> Tensor");
  m.def("gemv_q4_q8(Tensor x, Tensor packed, Tensor scale, Tensor low) -> Tensor");
  m.def("gemv_q8_many(Tensor x, Tensor[] weights, Tensor[] scales, Tensor[] lows) -> Tensor[]");
  m.def("use_avx512(bool enable) -> bool", &use_avx512);  // no tensor: one kernel for every backend
}

TORCH_LIBRARY_IMPL(marginalia_gemv, CPU, m) {
  m.impl("gemv_int8_groups", &gemv_int8_groups);
  m.impl("gemv_q4_groups", &gemv_q4_groups);
  m.impl("gemv_int8_q8", &gemv_int8_q8);
  m.impl("gemv_q4_q8", &gemv_q4_q8);
  m.impl("gemv_q8_many", &marginalia::gemv_q8_many);
}
