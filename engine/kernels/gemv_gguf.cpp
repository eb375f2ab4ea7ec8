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
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int64_t MAX_ROWS = 4;

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
    for (; c + SETS <= chunks; c += SETS)
      for (int a = 0; a < SETS; ++a) chunk_times<ROWS>(x, qn, sn + ((c + a) >> shift), K, (c + a) * 16, acc[a]);
    for (; c < chunks; ++c) chunk_times<ROWS>(x, qn, sn + (c >> shift), K, c * 16, acc[0]);
    for (int r = 0; r < ROWS; ++r) {
      __m256 total = _mm256_add_ps(acc[0][r][0], acc[0][r][1]);
      for (int a = 1; a < SETS; ++a) total = _mm256_add_ps(total, _mm256_add_ps(acc[a][r][0], acc[a][r][1]));
      y[r * N + n] = sum8(total);
    }
  }
}

torch::Tensor gemv_int8_groups(torch::Tensor x, torch::Tensor q, torch::Tensor scale) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && q.scalar_type() == at::kChar && scale.scalar_type() == at::kFloat,
              "gemv_int8_groups: x float32, q int8, scale float32");
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && scale.dim() == 2, "gemv_int8_groups: 2-d tensors");
  TORCH_CHECK(x.is_contiguous() && q.is_contiguous() && scale.is_contiguous(), "gemv_int8_groups: contiguous");
  const int64_t rows = x.size(0), K = x.size(1), N = q.size(0);
  TORCH_CHECK(rows >= 1 && rows <= MAX_ROWS, "gemv_int8_groups: 1 to 4 rows");
  TORCH_CHECK(q.size(1) == K && scale.size(0) == N && scale.size(1) > 0 && K % scale.size(1) == 0,
              "gemv_int8_groups: shapes");
  const int64_t group = K / scale.size(1);
  TORCH_CHECK(group == 16 || group == 32, "gemv_int8_groups: groups of 16 or 32 values");
  const int shift = group == 32 ? 1 : 0;
  auto y = torch::empty({rows, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Grains of 64 output rows: enough work per task (64 x K bytes) that scheduling is noise.
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    switch (rows) {
      case 1: rows_times<1>(xp, qp, sp, yp, K, N, shift, n0, n1); break;
      case 2: rows_times<2>(xp, qp, sp, yp, K, N, shift, n0, n1); break;
      case 3: rows_times<3>(xp, qp, sp, yp, K, N, shift, n0, n1); break;
      default: rows_times<4>(xp, qp, sp, yp, K, N, shift, n0, n1); break;
    }
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
    for (; g + SETS <= groups; g += SETS)
      for (int a = 0; a < SETS; ++a)
        q4_group_times<ROWS>(x, pn + (g + a) * 16, sn + g + a, ln + g + a, K, (g + a) * 32, acc[a]);
    for (; g < groups; ++g) q4_group_times<ROWS>(x, pn + g * 16, sn + g, ln + g, K, g * 32, acc[0]);
    for (int r = 0; r < ROWS; ++r) {
      __m256 total = _mm256_add_ps(acc[0][r][0], acc[0][r][1]);
      for (int a = 1; a < SETS; ++a) total = _mm256_add_ps(total, _mm256_add_ps(acc[a][r][0], acc[a][r][1]));
      y[r * N + n] = sum8(total);
    }
  }
}

torch::Tensor gemv_q4_groups(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, torch::Tensor low) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kByte &&
                  scale.scalar_type() == at::kFloat && low.scalar_type() == at::kFloat,
              "gemv_q4_groups: x float32, packed uint8, scale and low float32");
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 2 && scale.dim() == 2 && low.dim() == 2, "gemv_q4_groups: 2-d");
  TORCH_CHECK(x.is_contiguous() && packed.is_contiguous() && scale.is_contiguous() && low.is_contiguous(),
              "gemv_q4_groups: contiguous");
  const int64_t rows = x.size(0), K = x.size(1), N = packed.size(0);
  TORCH_CHECK(rows >= 1 && rows <= MAX_ROWS, "gemv_q4_groups: 1 to 4 rows");
  TORCH_CHECK(K % 32 == 0 && packed.size(1) == K / 2 && scale.size(0) == N && scale.size(1) == K / 32 &&
                  low.sizes() == scale.sizes(), "gemv_q4_groups: shapes");
  auto y = torch::empty({rows, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* lp = low.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    switch (rows) {
      case 1: q4_rows_times<1>(xp, pp, sp, lp, yp, K, N, n0, n1); break;
      case 2: q4_rows_times<2>(xp, pp, sp, lp, yp, K, N, n0, n1); break;
      case 3: q4_rows_times<3>(xp, pp, sp, lp, yp, K, N, n0, n1); break;
      default: q4_rows_times<4>(xp, pp, sp, lp, yp, K, N, n0, n1); break;
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(marginalia_gemv, m) {
  m.def("gemv_int8_groups(Tensor x, Tensor q, Tensor scale) -> Tensor");
  m.def("gemv_q4_groups(Tensor x, Tensor packed, Tensor scale, Tensor low) -> Tensor");
}

TORCH_LIBRARY_IMPL(marginalia_gemv, CPU, m) {
  m.impl("gemv_int8_groups", &gemv_int8_groups);
  m.impl("gemv_q4_groups", &gemv_q4_groups);
}
