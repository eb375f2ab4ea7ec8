// Flash-attention forward in bf16 for AVX-512 BF16 CPUs (no AMX): one pass of query rows over a key/value
// cache with grouped heads, online softmax in fp32, bf16 dot products (vdpbf16ps) into fp32 for Q.K^T and P.V.
// Loaded by engine/kernels/__init__.py as torch.ops.marginalia.flash_attention_bf16.
//
// Work unit (a "task"): one key/value head and a block of BQ query tokens; its rows are (token, head in group),
// so a tile of G rows is one token's G heads, which share one mask row, and every K/V block packed for the
// task serves all G*BQ rows. For each key block of BK keys the task packs K into the dword-pair layout that
// vdpbf16ps wants ([d/2][BK] pairs: lanes = keys) and V into key pairs ([BK/2][d][2]: lanes = dims), then for
// each tile of MR rows: S = Q.K^T (fp32), softmax update (running max m, sum l, rescale alpha), P rounded to
// bf16, O = alpha*O + P.V. Key blocks a tile cannot see are skipped (causal: from the offset; explicit mask:
// from the mask bits), so a causal pass costs its visible triangle only.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int BK = 64;   // keys per block: one S kernel call (4 vectors of 16 keys)
constexpr int MR = 6;    // rows per tile: 6x4 fp32 accumulators + 4 loads + 1 broadcast fit in 32 registers
constexpr int BQ = 64;   // query tokens per task at most (G*BQ rows reuse each packed K/V block; 64 measured
                         // a little faster than 16 or 32 on a 512-token pass, 128 no better)

using bf16 = uint16_t;

struct Args {
  const bf16* q; int64_t q_sh, q_si;   // query: head stride, token stride (elements); dims contiguous
  const bf16* k; int64_t k_sh, k_sn;   // key: head stride, key stride
  const bf16* v; int64_t v_sh, v_sn;
  const uint8_t* mask; int64_t m_si;   // explicit mask rows (nullptr: causal at offset)
  bf16* out;                           // [nq, hq, d]
  int64_t nq, ctx, hq, hkv, group, d, offset;
  float scale;
};

inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

// 2^x for x <= 0 (visible lanes); masked lanes come out 0 whatever x is (maskz on the last step).
inline __m512 exp2_maskz(__mmask16 k, __m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
  __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_sub_ps(x, n);  // [-0.5, 0.5]
  // Degree-5 Taylor series of 2^f on [-0.5, 0.5] (relative error < 3e-6, far below the bf16 rounding of P).
  __m512 p = _mm512_set1_ps(1.3333558146e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108665e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650696e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718056e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(k, p, n);
}

// 16x16 transpose of dwords in registers (r[i] = row i on entry, column i on exit).
inline void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int k = 0; k < 4; ++k) {  // u[4k + c], lane L: column 4L + c of rows 4k..4k+3
    u[4 * k + 0] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
    u[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // transpose the 4x4 grid of 128-bit lanes
    __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44);
    __m512i v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    __m512i v2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    __m512i v3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
}

// K block -> kp[p][n] = dword (K[n][2p], K[n][2p+1]), keys past n_valid zero.
void pack_k(const bf16* k, int64_t k_sn, int n_valid, int d, uint32_t* kp) {
  const __m512i zero = _mm512_setzero_si512();
  for (int ng = 0; ng < BK / 16; ++ng)
    for (int cg = 0; cg < d / 32; ++cg) {
      __m512i r[16];
      for (int t = 0; t < 16; ++t) {
        int n = ng * 16 + t;
        r[t] = n < n_valid ? _mm512_loadu_si512(k + n * k_sn + cg * 32) : zero;
      }
      transpose16(r);
      for (int t = 0; t < 16; ++t) _mm512_storeu_si512(kp + (cg * 16 + t) * BK + ng * 16, r[t]);
    }
}

// V block -> vp[j][c][2] = (V[2j][c], V[2j+1][c]), keys past n_valid zero.
void pack_v(const bf16* v, int64_t v_sn, int n_valid, int d, bf16* vp) {
  alignas(64) static const uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                  8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t hi_idx[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                  24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
  const __m512i zero = _mm512_setzero_si512();
  for (int j = 0; j < BK / 2; ++j) {
    const int n = 2 * j;
    for (int c = 0; c < d; c += 32) {
      __m512i a = n < n_valid ? _mm512_loadu_si512(v + n * v_sn + c) : zero;
      __m512i b = n + 1 < n_valid ? _mm512_loadu_si512(v + (n + 1) * v_sn + c) : zero;
      _mm512_storeu_si512(vp + (j * d + c) * 2, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_storeu_si512(vp + (j * d + c) * 2 + 32, _mm512_permutex2var_epi16(a, hi, b));
    }
  }
}

// s[r][0..BK) = q[r] . K[n] for the packed block.
template <int R>
void qk_tile(const bf16* q, int d, const uint32_t* kp, float* s) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int p = 0; p < d / 2; ++p) {
    const uint32_t* kr = kp + p * BK;
    __m512bh k0 = as_bh(_mm512_loadu_si512(kr)), k1 = as_bh(_mm512_loadu_si512(kr + 16));
    __m512bh k2 = as_bh(_mm512_loadu_si512(kr + 32)), k3 = as_bh(_mm512_loadu_si512(kr + 48));
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, q + r * d + 2 * p, 4);
      __m512bh qb = as_bh(_mm512_set1_epi32(pair));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qb, k0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qb, k1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], qb, k2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], qb, k3);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(s + r * BK + 16 * j, acc[r][j]);
}

// o[r] = alpha[r] * o[r] + p[r] . V over the first `pairs` key pairs of the packed block (the rest of P is 0).
template <int R>
void pv_tile(const bf16* p, const bf16* vp, int pairs, int d, const float* alpha, float* o) {
  for (int h = 0; h < d; h += 64) {
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r) {
      __m512 a = _mm512_set1_ps(alpha[r]);
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_mul_ps(_mm512_loadu_ps(o + r * d + h + 16 * j), a);
    }
    for (int jp = 0; jp < pairs; ++jp) {
      const bf16* vr = vp + (jp * d + h) * 2;
      __m512bh v0 = as_bh(_mm512_loadu_si512(vr)), v1 = as_bh(_mm512_loadu_si512(vr + 32));
      __m512bh v2 = as_bh(_mm512_loadu_si512(vr + 64)), v3 = as_bh(_mm512_loadu_si512(vr + 96));
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, p + r * BK + 2 * jp, 4);
        __m512bh pb = as_bh(_mm512_set1_epi32(pair));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], pb, v0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], pb, v1);
        acc[r][2] = _mm512_dpbf16_ps(acc[r][2], pb, v2);
        acc[r][3] = _mm512_dpbf16_ps(acc[r][3], pb, v3);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) _mm512_storeu_ps(o + r * d + h + 16 * j, acc[r][j]);
  }
}

// Online-softmax update of R rows from their scores s (fp32, unscaled) and visibility masks; writes P (bf16)
// and each row's rescale factor alpha, updates m (running max of scaled scores, log2 domain) and l (sum).
void softmax_tile(int R, const float* s, const __mmask16 (*mk)[BK / 16], float c, float* m, float* l,
                  float* alpha, bf16* p) {
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int r = 0; r < R; ++r) {
    const float* sr = s + r * BK;
    __m512 mx = _mm512_set1_ps(ninf);
    for (int v = 0; v < BK / 16; ++v) mx = _mm512_mask_max_ps(mx, mk[r][v], mx, _mm512_loadu_ps(sr + 16 * v));
    float rmax = _mm512_reduce_max_ps(mx);
    if (rmax == ninf) {  // nothing visible to this row in this block
      alpha[r] = 1.0f;
      std::memset(p + r * BK, 0, BK * sizeof(bf16));
      continue;
    }
    float mnew = std::max(m[r], rmax * c);
    alpha[r] = m[r] == ninf ? 0.0f : std::exp2(m[r] - mnew);
    m[r] = mnew;
    const __m512 cv = _mm512_set1_ps(c), neg = _mm512_set1_ps(-mnew);
    __m512 sum = _mm512_setzero_ps();
    for (int v = 0; v < BK / 16; v += 2) {
      __m512 p0 = exp2_maskz(mk[r][v], _mm512_fmadd_ps(_mm512_loadu_ps(sr + 16 * v), cv, neg));
      __m512 p1 = exp2_maskz(mk[r][v + 1], _mm512_fmadd_ps(_mm512_loadu_ps(sr + 16 * v + 16), cv, neg));
      sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
      _mm512_storeu_si512(p + r * BK + 16 * v, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    }
    l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(sum);
  }
}

inline __mmask16 prefix_mask(int n) { return n >= 16 ? 0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1); }

void run_task(const Args& a, int64_t kvh, int64_t i0, int64_t bq) {
  const int d = (int)a.d, G = (int)a.group;
  const int ntok = (int)std::min<int64_t>(bq, a.nq - i0);
  const int M = ntok * G;
  const float ninf = -std::numeric_limits<float>::infinity();
  const float c = a.scale * 1.4426950408889634f;  // scores to the log2 domain

  std::vector<bf16> qbuf((size_t)M * d);
  std::vector<float> obuf((size_t)M * d, 0.0f), m(M, ninf), l(M, 0.0f);
  alignas(64) uint32_t kp[BK * 256 / 2];  // d <= 256
  alignas(64) bf16 vp[BK * 256];
  alignas(64) float s[MR * BK];
  alignas(64) bf16 p[MR * BK];
  float alpha[MR];
  __mmask16 mk[MR][BK / 16];

  for (int r = 0; r < M; ++r) {  // rows (token, head in group), copied from the (possibly transposed) query
    const int64_t i = i0 + r / G, h = kvh * G + r % G;
    std::memcpy(&qbuf[(size_t)r * d], a.q + h * a.q_sh + i * a.q_si, d * sizeof(bf16));
  }
  const bf16* kh = a.k + kvh * a.k_sh;
  const bf16* vh = a.v + kvh * a.v_sh;
  // Causal: the last token of the block sees keys < offset + i0 + ntok; nothing after that is packed.
  const int64_t kend = a.mask ? a.ctx : std::min<int64_t>(a.ctx, a.offset + i0 + ntok);

  for (int64_t n0 = 0; n0 < kend; n0 += BK) {
    const int n_valid = (int)std::min<int64_t>(BK, kend - n0);
    bool packed = false;
    for (int t0 = 0; t0 < M; t0 += MR) {
      const int R = std::min(MR, M - t0);
      // Visibility of this block to each row of the tile.
      bool any = false;
      int most = 0;  // visible extent (keys) over the tile's rows, to stop P.V early on the diagonal
      for (int r = 0; r < R; ++r) {
        const int64_t i = i0 + (t0 + r) / G;
        if (!a.mask) {
          const int cnt = (int)std::max<int64_t>(0, std::min<int64_t>(n_valid, a.offset + i + 1 - n0));
          for (int v = 0; v < BK / 16; ++v) mk[r][v] = prefix_mask(cnt - 16 * v);
          most = std::max(most, cnt);
          any |= cnt > 0;
        } else {
          const uint8_t* mrow = a.mask + i * a.m_si + n0;
          for (int v = 0; v < BK / 16; ++v) {
            const int left = n_valid - 16 * v;
            __m128i bytes = left >= 16 ? _mm_loadu_si128((const __m128i*)(mrow + 16 * v))
                            : left > 0 ? _mm_maskz_loadu_epi8(prefix_mask(left), mrow + 16 * v)
                                       : _mm_setzero_si128();
            mk[r][v] = _mm_test_epi8_mask(bytes, bytes);
            if (mk[r][v]) { any = true; most = std::max(most, 16 * v + 32 - __builtin_clz((unsigned)mk[r][v])); }
          }
        }
      }
      if (!any) continue;
      if (!packed) {
        pack_k(kh + n0 * a.k_sn, a.k_sn, n_valid, d, kp);
        pack_v(vh + n0 * a.v_sn, a.v_sn, n_valid, d, vp);
        packed = true;
      }
      const bf16* qt = &qbuf[(size_t)t0 * d];
      float* ot = &obuf[(size_t)t0 * d];
      const int pairs = (most + 1) / 2;
      switch (R) {
#define TILE(RR)                                                          \
  case RR:                                                                \
    qk_tile<RR>(qt, d, kp, s);                                            \
    softmax_tile(RR, s, mk, c, &m[t0], &l[t0], alpha, p);                 \
    pv_tile<RR>(p, vp, pairs, d, alpha, ot);                              \
    break;
        TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6)
#undef TILE
      }
    }
  }
  for (int r = 0; r < M; ++r) {  // normalise; a row that saw nothing at all gets zeros
    const int64_t i = i0 + r / G, h = kvh * G + r % G;
    const __m512 inv = _mm512_set1_ps(l[r] > 0 ? 1.0f / l[r] : 0.0f);
    bf16* dst = a.out + (i * a.hq + h) * d;
    for (int x = 0; x < d; x += 16)
      _mm256_storeu_si256((__m256i*)(dst + x),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(&obuf[(size_t)r * d + x]), inv)));
  }
}

// query [1, hq, nq, d], key/value [1, hkv, ctx, d] (any head/row strides, dims contiguous), mask [1, 1, nq, ctx]
// bool (True = visible) or None for causal at offset ctx - nq -> [1, nq, hq, d] bf16.
at::Tensor flash_attention_bf16(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                const c10::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4, "4-d query/key/value");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && key.scalar_type() == at::kBFloat16 &&
              value.scalar_type() == at::kBFloat16, "bf16 only");
  TORCH_CHECK(query.size(0) == 1 && key.size(0) == 1 && value.size(0) == 1, "batch 1 only");
  const int64_t hq = query.size(1), nq = query.size(2), d = query.size(3);
  const int64_t hkv = key.size(1), ctx = key.size(2);
  TORCH_CHECK(d % 64 == 0 && d <= 256, "head_dim a multiple of 64, at most 256");
  TORCH_CHECK(key.size(3) == d && value.size(3) == d && value.size(1) == hkv && value.size(2) == ctx, "k/v shape");
  TORCH_CHECK(hkv > 0 && hq % hkv == 0, "query heads a multiple of key/value heads");
  TORCH_CHECK(ctx >= nq, "context at least the query rows");
  TORCH_CHECK(query.stride(3) == 1 && key.stride(3) == 1 && value.stride(3) == 1, "contiguous head_dim");
  Args a{};
  at::Tensor m;
  if (mask.has_value()) {
    m = *mask;
    TORCH_CHECK(m.scalar_type() == at::kBool && m.dim() == 4 && m.size(0) == 1 && m.size(1) == 1 &&
                m.size(2) == nq && m.size(3) == ctx, "bool mask [1, 1, q, ctx]");
    if (m.stride(3) != 1) m = m.contiguous();
    a.mask = (const uint8_t*)m.data_ptr<bool>();
    a.m_si = m.stride(2);
  }
  at::Tensor out = at::empty({1, nq, hq, d}, query.options().memory_format(at::MemoryFormat::Contiguous));
  a.q = (const bf16*)query.data_ptr<at::BFloat16>(); a.q_sh = query.stride(1); a.q_si = query.stride(2);
  a.k = (const bf16*)key.data_ptr<at::BFloat16>(); a.k_sh = key.stride(1); a.k_sn = key.stride(2);
  a.v = (const bf16*)value.data_ptr<at::BFloat16>(); a.v_sh = value.stride(1); a.v_sn = value.stride(2);
  a.out = (bf16*)out.data_ptr<at::BFloat16>();
  a.nq = nq; a.ctx = ctx; a.hq = hq; a.hkv = hkv; a.group = hq / hkv; a.d = d; a.offset = ctx - nq;
  a.scale = (float)scale;
  // Smaller blocks for a short pass, so that every thread gets at least two tasks where there are enough rows.
  int64_t bq = BQ;
  while (bq > 8 && hkv * ((nq + bq - 1) / bq) < 2 * at::get_num_threads()) bq /= 2;
  const int64_t nqb = (nq + bq - 1) / bq, tasks = hkv * nqb;
  // Tasks of a head alternate first and last query blocks, so torch's contiguous split of the task range gives
  // each thread a similar share of a causal triangle.
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t kvh = t / nqb, j = t % nqb;
      const int64_t qb = (j % 2 == 0) ? j / 2 : nqb - 1 - j / 2;
      run_task(a, kvh, qb * bq, bq);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(marginalia, lib) {
  lib.def("flash_attention_bf16(Tensor query, Tensor key, Tensor value, Tensor? mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(marginalia, CPU, lib) { lib.impl("flash_attention_bf16", flash_attention_bf16); }
