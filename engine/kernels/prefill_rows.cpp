// The elementwise work of a prefill pass in bf16 (engine/prefill_step.py), one pass over memory each, rows split
// over the threads. torch runs each of these as several ops (RMSNorm alone is 8: two casts, pow, mean, add,
// rsqrt, two multiplies), each a pass over the pass's rows with a bf16 round trip: ~13% of a 512-token pass of
// the 1.5B on a CPU whose matmuls run on AMX. The values are transformers' up to the order of a sum and the
// exp's last bits: each result is rounded to bf16 where transformers rounds it.
// - rms_norm_rows(x, weight, eps): weight * bf16(x * rsqrt(mean(x^2) + eps)), statistics in fp32;
// - add_rms_norm_rows(hidden, delta, weight, eps): hidden += delta (in place, rounded), then its norm;
// - silu_mul_rows(gate, up): gate = bf16(bf16(silu(gate)) * up), in place;
// - rotary_rows(x, cos, sin, out): out = x * cos + rotate_half(x) * sin (GPT-NeoX halves; cos and sin given
//   for one half, [n, dim / 2]), each product and the sum rounded; x and out [n, heads, dim] with any strides
//   but the last (out may be the cache's slots).
// Written with GCC's vector extensions: 16 floats a vector, AVX-512 where the build has it, two AVX2 halves
// otherwise.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include <immintrin.h>

namespace {

typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));
constexpr int W = 16;

inline vf load(const at::BFloat16* p) {
  vh h;
  std::memcpy(&h, p, sizeof h);
  return (vf)(__builtin_convertvector(h, vu) << 16);
}
inline vh round_bits(vf x) {  // to bf16, nearest even (as torch's conversion)
  vu u = (vu)x;
  u += 0x7FFFu + ((u >> 16) & 1u);
  return __builtin_convertvector(u >> 16, vh);
}
inline void store(at::BFloat16* p, vf x) {
  vh h = round_bits(x);
  std::memcpy(p, &h, sizeof h);
}
inline vf rounded(vf x) { return (vf)(__builtin_convertvector(round_bits(x), vu) << 16); }

inline float load1(const at::BFloat16* p) { return static_cast<float>(*p); }
inline float rounded1(float x) { return static_cast<float>(static_cast<at::BFloat16>(x)); }

inline vf splat(float x) { return vf{} + x; }

#ifdef __AVX512F__  // single instructions where GCC's generic vectors would take several (or scalarize)
inline vf fma(vf a, vf b, vf c) { return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
inline vf nearest(vf x) { return (vf)_mm512_roundscale_ps((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf times_2_to(vf p, vf n) { return (vf)_mm512_scalef_ps((__m512)p, (__m512)n); }
#else
inline vf fma(vf a, vf b, vf c) { return a * b + c; }
inline vf nearest(vf x) {
  const vf big = splat(12582912.f);  // 1.5 * 2^23: adding and taking it away rounds to the nearest integer
  return (x + big) - big;
}
inline vf times_2_to(vf p, vf n) { return (vf)((vi)p + (__builtin_convertvector(n, vi) << 23)); }
#endif

// exp(x): 2^n * 2^f with n the nearest integer to x / ln 2 and 2^f (|f| <= 1/2) by its Taylor series to the 6th
// power (relative error < 2e-7); 0 below -87.3 and infinity above 88.7, as expf's underflow and overflow (silu's
// x / (1 + exp(-x)) is then -0 for x < -88.7, as torch's).
inline vf exp_clamped(vf x) {
  const vf low = splat(-87.3f), high = splat(88.7f);
  const vf c = x < low ? low : x > high ? high : x;
  const vf t = c * 1.44269504f;
  const vf n = nearest(t);
  const vf f = t - n;
  vf p = fma(splat(1.5403530e-4f), f, splat(1.3333558e-3f));
  p = fma(p, f, splat(9.6181291e-3f));
  p = fma(p, f, splat(5.5504109e-2f));
  p = fma(p, f, splat(2.4022651e-1f));
  p = fma(p, f, splat(6.9314718e-1f));
  p = fma(p, f, splat(1.0f));
  const vf e = times_2_to(p, n);
  return x < low ? vf{} : x > high ? splat(__builtin_inff()) : e;
}

inline vf silu_times(vf x, vf u) { return rounded(x / (1.f + exp_clamped(-x))) * u; }

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(), name,
              ": expected a contiguous bf16 [rows, columns] tensor");
}

// One row: the norm of h into out.
inline void norm_row(const at::BFloat16* h, const at::BFloat16* w, at::BFloat16* out, int64_t H, float eps) {
  vf acc = vf{};
  int64_t k = 0;
  for (; k + W <= H; k += W) {
    const vf v = load(h + k);
    acc += v * v;
  }
  float sum = 0.f;
  for (int i = 0; i < W; ++i) sum += acc[i];
  for (; k < H; ++k) sum += load1(h + k) * load1(h + k);
  const float r = 1.f / std::sqrt(sum / static_cast<float>(H) + eps);
  for (k = 0; k + W <= H; k += W) store(out + k, load(w + k) * rounded(load(h + k) * r));
  for (; k < H; ++k) out[k] = static_cast<at::BFloat16>(load1(w + k) * rounded1(load1(h + k) * r));
}

at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm_rows");
  const int64_t n = x.size(0), H = x.size(1);
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() && weight.numel() == H,
              "rms_norm_rows: weight must be bf16 [columns]");
  auto out = at::empty_like(x);
  const auto* xp = x.data_ptr<at::BFloat16>();
  const auto* wp = weight.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) norm_row(xp + m * H, wp, op + m * H, H, static_cast<float>(eps));
  });
  return out;
}

at::Tensor add_rms_norm_rows(at::Tensor hidden, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  check_rows(hidden, "add_rms_norm_rows");
  check_rows(delta, "add_rms_norm_rows");
  TORCH_CHECK(hidden.sizes() == delta.sizes(), "add_rms_norm_rows: hidden and delta differ in shape");
  const int64_t n = hidden.size(0), H = hidden.size(1);
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() && weight.numel() == H,
              "add_rms_norm_rows: weight must be bf16 [columns]");
  auto out = at::empty_like(hidden);
  auto* hp = hidden.data_ptr<at::BFloat16>();
  const auto* dp = delta.data_ptr<at::BFloat16>();
  const auto* wp = weight.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      at::BFloat16* h = hp + m * H;
      const at::BFloat16* d = dp + m * H;
      int64_t k = 0;
      for (; k + W <= H; k += W) store(h + k, load(h + k) + load(d + k));
      for (; k < H; ++k) h[k] = static_cast<at::BFloat16>(load1(h + k) + load1(d + k));
      norm_row(h, wp, op + m * H, H, static_cast<float>(eps));
    }
  });
  return out;
}

void silu_mul_rows(at::Tensor gate, const at::Tensor& up) {
  check_rows(gate, "silu_mul_rows");
  check_rows(up, "silu_mul_rows");
  TORCH_CHECK(gate.sizes() == up.sizes(), "silu_mul_rows: gate and up differ in shape");
  const int64_t n = gate.size(0), I = gate.size(1);
  auto* gp = gate.data_ptr<at::BFloat16>();
  const auto* up_ = up.data_ptr<at::BFloat16>();
  at::parallel_for(0, n, 4, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      at::BFloat16* g = gp + m * I;
      const at::BFloat16* u = up_ + m * I;
      int64_t k = 0;
      for (; k + 2 * W <= I; k += 2 * W) {  // two at a time: the exp's chain of dependent steps overlaps
        const vf a = silu_times(load(g + k), load(u + k)), b = silu_times(load(g + k + W), load(u + k + W));
        store(g + k, a);
        store(g + k + W, b);
      }
      for (; k + W <= I; k += W) store(g + k, silu_times(load(g + k), load(u + k)));
      for (; k < I; ++k) {
        const float x = load1(g + k);
        g[k] = static_cast<at::BFloat16>(rounded1(x / (1.f + std::exp(-x))) * load1(u + k));
      }
    }
  });
}

void rotary_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor out) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16 && x.dim() == 3 &&
                  out.sizes() == x.sizes() && x.stride(2) == 1 && out.stride(2) == 1,
              "rotary_rows: x and out must be bf16 [rows, heads, dim] with unit last strides");
  const int64_t n = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  TORCH_CHECK(dim % 2 == 0 && cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16 &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.numel() == n * half && sin.numel() == n * half,
              "rotary_rows: cos and sin must be contiguous bf16 [rows, dim / 2]");
  const auto* xp = x.data_ptr<at::BFloat16>();
  const auto* cp = cos.data_ptr<at::BFloat16>();
  const auto* sp = sin.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const at::BFloat16* c = cp + t * half;
      const at::BFloat16* s = sp + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        const at::BFloat16* a = xp + t * xs0 + h * xs1;
        at::BFloat16* o = op + t * os0 + h * os1;
        int64_t j = 0;
        for (; j + W <= half; j += W) {
          const vf x1 = load(a + j), x2 = load(a + half + j), cj = load(c + j), sj = load(s + j);
          store(o + j, rounded(x1 * cj) - rounded(x2 * sj));        // rotate_half's first half is -x2
          store(o + half + j, rounded(x2 * cj) + rounded(x1 * sj));
        }
        for (; j < half; ++j) {
          const float x1 = load1(a + j), x2 = load1(a + half + j), cj = load1(c + j), sj = load1(s + j);
          o[j] = static_cast<at::BFloat16>(rounded1(x1 * cj) - rounded1(x2 * sj));
          o[half + j] = static_cast<at::BFloat16>(rounded1(x2 * cj) + rounded1(x1 * sj));
        }
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(marginalia_gemv, m) {
  m.def("rms_norm_rows(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_rows(Tensor(a!) hidden, Tensor delta, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul_rows(Tensor(a!) gate, Tensor up) -> ()");
  m.def("rotary_rows(Tensor x, Tensor cos, Tensor sin, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(marginalia_gemv, CPU, m) {
  m.impl("rms_norm_rows", &rms_norm_rows);
  m.impl("add_rms_norm_rows", &add_rms_norm_rows);
  m.impl("silu_mul_rows", &silu_mul_rows);
  m.impl("rotary_rows", &rotary_rows);
}
