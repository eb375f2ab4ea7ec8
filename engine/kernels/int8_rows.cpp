// The two passes around an int8 matmul of many rows (engine/prefill_int8.py): torch._int_mm multiplies int8 by
// int8 into int32 sums (oneDNN; vpdpbusd where the CPU has VNNI), and these put the rows into int8 and the sums
// back into the model's dtype, each in one pass over memory (torch's elementwise ops took ~6 passes to round and
// 3 to scale back, as long as the matmul itself for the MLP's wide matrices).
// - quantize_rows: x [M, K] (bf16 or fp32) -> q int8 [M, K], scale fp32 [M]: scale = max|x_m| / 127,
//   q = round-to-nearest-even(x / scale), so |x - scale * q| <= scale / 2 (a zero row: scale 0, q 0).
// - dequantize_rows: sums int32 [M, N], row scales [M], column scales [N], bias [N] or empty ->
//   out [M, N] = sums * row_scale * column_scale (+ bias), rounded once to out's dtype (bf16 or fp32).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <tuple>

namespace {

// 8 values as fp32 (bf16 is fp32's upper half).
inline __m256 load8(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

// Written out for AVX2 (the compiler keeps a float max and rounding scalar without -ffast-math): 32 values at a
// time, rounded by cvtps (the default rounding, to nearest even) and packed to int8 as llama.cpp's
// quantize_row_q8_0 packs them; the tail of a row (K % 32) in scalar code, with the same rounding.
template <typename T>
void quantize(const T* x, int8_t* q, float* scale, int64_t M, int64_t K) {
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const int64_t whole = K - K % 32;
    for (int64_t m = begin; m < end; ++m) {
      const T* row = x + m * K;
      __m256 top8 = _mm256_setzero_ps();
      int64_t k = 0;
      for (; k + 8 <= K; k += 8) top8 = _mm256_max_ps(top8, _mm256_andnot_ps(sign, load8(row + k)));
      float lanes[8];
      _mm256_storeu_ps(lanes, top8);
      float top = 0.f;
      for (float v : lanes) top = std::max(top, v);
      for (; k < K; ++k) top = std::max(top, std::fabs(static_cast<float>(row[k])));
      const float inverse = top > 0.f ? 127.f / top : 0.f;
      scale[m] = top / 127.f;
      const __m256 inv = _mm256_set1_ps(inverse);
      int8_t* out = q + m * K;
      for (k = 0; k < whole; k += 32) {
        const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(load8(row + k), inv));
        const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(load8(row + k + 8), inv));
        const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(load8(row + k + 16), inv));
        const __m256i d = _mm256_cvtps_epi32(_mm256_mul_ps(load8(row + k + 24), inv));
        const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), _mm256_permutevar8x32_epi32(packed, order));
      }
      for (; k < K; ++k) out[k] = static_cast<int8_t>(std::nearbyint(static_cast<float>(row[k]) * inverse));
    }
  });
}

std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "quantize_rows: x must be a contiguous [M, K] matrix");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "quantize_rows: x must be bf16 or fp32");
  const int64_t M = x.size(0), K = x.size(1);
  auto q = at::empty({M, K}, x.options().dtype(at::kChar));
  auto scale = at::empty({M}, x.options().dtype(at::kFloat));
  if (x.scalar_type() == at::kBFloat16)
    quantize(x.data_ptr<at::BFloat16>(), q.data_ptr<int8_t>(), scale.data_ptr<float>(), M, K);
  else
    quantize(x.data_ptr<float>(), q.data_ptr<int8_t>(), scale.data_ptr<float>(), M, K);
  return {q, scale};
}

template <typename T>
void dequantize(const int32_t* sums, const float* row_scale, const float* column_scale, const float* bias, T* out,
                int64_t M, int64_t N) {
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float r = row_scale[m];
      const int32_t* in = sums + m * N;
      T* o = out + m * N;
      if (bias != nullptr) {
        for (int64_t n = 0; n < N; ++n) o[n] = static_cast<T>(static_cast<float>(in[n]) * r * column_scale[n] + bias[n]);
      } else {
        for (int64_t n = 0; n < N; ++n) o[n] = static_cast<T>(static_cast<float>(in[n]) * r * column_scale[n]);
      }
    }
  });
}

at::Tensor dequantize_rows(const at::Tensor& sums, const at::Tensor& row_scale, const at::Tensor& column_scale,
                           const at::Tensor& bias, at::ScalarType dtype) {
  TORCH_CHECK(sums.dim() == 2 && sums.is_contiguous() && sums.scalar_type() == at::kInt,
              "dequantize_rows: sums must be a contiguous int32 [M, N] matrix");
  const int64_t M = sums.size(0), N = sums.size(1);
  TORCH_CHECK(row_scale.scalar_type() == at::kFloat && row_scale.is_contiguous() && row_scale.numel() == M,
              "dequantize_rows: row_scale must be fp32 [M]");
  TORCH_CHECK(column_scale.scalar_type() == at::kFloat && column_scale.is_contiguous() && column_scale.numel() == N,
              "dequantize_rows: column_scale must be fp32 [N]");
  TORCH_CHECK(bias.numel() == 0 || (bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.numel() == N),
              "dequantize_rows: bias must be empty or fp32 [N]");
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "dequantize_rows: dtype must be bf16 or fp32");
  auto out = at::empty({M, N}, sums.options().dtype(dtype));
  const float* b = bias.numel() ? bias.data_ptr<float>() : nullptr;
  if (dtype == at::kBFloat16)
    dequantize(sums.data_ptr<int32_t>(), row_scale.data_ptr<float>(), column_scale.data_ptr<float>(), b,
               out.data_ptr<at::BFloat16>(), M, N);
  else
    dequantize(sums.data_ptr<int32_t>(), row_scale.data_ptr<float>(), column_scale.data_ptr<float>(), b,
               out.data_ptr<float>(), M, N);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(marginalia_gemv, m) {
  m.def("quantize_rows(Tensor x) -> (Tensor, Tensor)");
  m.def("dequantize_rows(Tensor sums, Tensor row_scale, Tensor column_scale, Tensor bias, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(marginalia_gemv, CPU, m) {
  m.impl("quantize_rows", &quantize_rows);
  m.impl("dequantize_rows", &dequantize_rows);
}
