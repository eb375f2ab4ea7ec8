// Flash-attention forward in bf16 for AVX-512 BF16 CPUs: one pass of query rows over a key/value cache with
// grouped heads, online softmax in fp32, bf16 dot products (vdpbf16ps, or AMX's tiles) into fp32 for Q.K^T and P.V.
// Loaded by engine/kernels/__init__.py as torch.ops.marginalia.flash_attention_bf16.
//
// Work unit (a "task"): one key/value head and a block of BQ query tokens; its rows are (token, head in group),
// so a tile of G rows is one token's G heads, which share one mask row, and every K/V block packed for the
// task serves all G*BQ rows. For each key block of BK keys the task packs K into the dword-pair layout that
// vdpbf16ps wants ([d/2][BK] pairs: lanes = keys) and V into key pairs ([BK/2][d][2]: lanes = dims), then for
// each tile of MR rows: S = Q.K^T (fp32), softmax update (running max m, sum l, rescale alpha), P rounded to
// bf16, O = alpha*O + P.V. Key blocks a tile cannot see are skipped (causal: from the offset; explicit mask:
// from the mask bits), so a causal pass costs its visible triangle only.
//
// Built with AMX's flags (where the CPU has AMX), the same steps run on the tile unit (run_task_amx): Q.K^T and
// P.V as tdpbf16ps on 16-row tiles, two of them (MA rows) sharing each K and V tile loaded (the packed K and V
// blocks above are already AMX's B layout), SB blocks (256 keys) a step so that O (fp32, in memory between
// steps) is rescaled, loaded and stored once for them; the online softmax as above with a shorter exp. Its values
// equal the AVX-512 path's within the exp's 7.5e-5 and the order of the fp32 sums inside a product (tests).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#ifdef __AMX_BF16__
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int BK = 64;   // keys per block: one S kernel call (4 vectors of 16 keys)
constexpr int MR = 6;    // rows per tile: 6x4 fp32 accumulators + 4 loads + 1 broadcast fit in 32 registers
constexpr int MA = 32;   // rows a step of the AMX path: two 16-row tiles, sharing each K and V tile loaded
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

// The same, to 7.5e-5 relative error (a degree-3 minimax polynomial, no clamp: a masked lane's -inf or NaN comes
// out 0 all the same), for the AMX path, where the softmax is most of a step's time: 4 instructions a vector
// fewer made its attention 1.2x faster (16k tokens of context). The error is 1/25 of P's rounding to bf16; the
// AVX-512 path keeps the longer series, with which its answers were measured.
inline __m512 exp2_maskz_short(__mmask16 k, __m512 x) {
  __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(5.5171132088e-2f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4261008203e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9326096773e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.9992811680e-1f));
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

// Online-softmax update of R rows from their scores s (fp32, unscaled, W keys a row) and visibility masks (W / 16
// a row); writes P (bf16, W a row) and each row's rescale factor alpha, updates m (running max of scaled scores,
// log2 domain) and l (sum). Exp: exp2_maskz or exp2_maskz_short.
template <int W, __m512 (*Exp)(__mmask16, __m512)>
void softmax_tile(int R, const float* s, const __mmask16* mk, float c, float* m, float* l, float* alpha, bf16* p) {
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int r = 0; r < R; ++r) {
    const float* sr = s + r * W;
    const __mmask16* mr = mk + r * (W / 16);
    __m512 mx = _mm512_set1_ps(ninf);
    for (int v = 0; v < W / 16; ++v) mx = _mm512_mask_max_ps(mx, mr[v], mx, _mm512_loadu_ps(sr + 16 * v));
    float rmax = _mm512_reduce_max_ps(mx);
    if (rmax == ninf) {  // nothing visible to this row in this block
      alpha[r] = 1.0f;
      std::memset(p + r * W, 0, W * sizeof(bf16));
      continue;
    }
    float mnew = std::max(m[r], rmax * c);
    alpha[r] = m[r] == ninf ? 0.0f : std::exp2(m[r] - mnew);
    m[r] = mnew;
    const __m512 cv = _mm512_set1_ps(c), neg = _mm512_set1_ps(-mnew);
    __m512 sum = _mm512_setzero_ps();
    for (int v = 0; v < W / 16; v += 2) {
      __m512 p0 = Exp(mr[v], _mm512_fmadd_ps(_mm512_loadu_ps(sr + 16 * v), cv, neg));
      __m512 p1 = Exp(mr[v + 1], _mm512_fmadd_ps(_mm512_loadu_ps(sr + 16 * v + 16), cv, neg));
      sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
      _mm512_storeu_si512(p + r * W + 16 * v, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    }
    l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(sum);
  }
}

inline __mmask16 prefix_mask(int n) { return n >= 16 ? 0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1); }

// Which keys of block [n0, n0 + n_valid) (n_valid <= BK) rows t0 .. t0 + R of the task see: mk[r * stride + v]
// for the 16 keys from n0 + 16 v; the furthest extent any of them sees (`most`, keys from n0); false if none.
bool visibility(const Args& a, int64_t i0, int G, int t0, int R, int64_t n0, int n_valid, __mmask16* mk,
                int stride, int& most) {
  bool any = false;
  most = 0;
  for (int r = 0; r < R; ++r) {
    const int64_t i = i0 + (t0 + r) / G;
    __mmask16* mr = mk + r * stride;
    if (!a.mask) {
      const int cnt = (int)std::max<int64_t>(0, std::min<int64_t>(n_valid, a.offset + i + 1 - n0));
      for (int v = 0; v < BK / 16; ++v) mr[v] = prefix_mask(cnt - 16 * v);
      most = std::max(most, cnt);
      any |= cnt > 0;
    } else {
      const uint8_t* mrow = a.mask + i * a.m_si + n0;
      for (int v = 0; v < BK / 16; ++v) {
        const int left = n_valid - 16 * v;
        __m128i bytes = left >= 16 ? _mm_loadu_si128((const __m128i*)(mrow + 16 * v))
                        : left > 0 ? _mm_maskz_loadu_epi8(prefix_mask(left), mrow + 16 * v)
                                   : _mm_setzero_si128();
        mr[v] = _mm_test_epi8_mask(bytes, bytes);
        if (mr[v]) { any = true; most = std::max(most, 16 * v + 32 - __builtin_clz((unsigned)mr[v])); }
      }
    }
  }
  return any;
}

// The task's M rows (token, head in group) copied from the (possibly transposed) query into qbuf; qbuf's rows
// past M (padding) are zeroed by its owner.
void gather_rows(const Args& a, int64_t kvh, int64_t i0, int M, bf16* qbuf) {
  const int d = (int)a.d, G = (int)a.group;
  for (int r = 0; r < M; ++r) {
    const int64_t i = i0 + r / G, h = kvh * G + r % G;
    std::memcpy(qbuf + (size_t)r * d, a.q + h * a.q_sh + i * a.q_si, d * sizeof(bf16));
  }
}

// A zeroed, 64-byte aligned array.
template <typename T>
struct Aligned {
  T* data;
  explicit Aligned(size_t n) : data((T*)std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64)) {
    TORCH_CHECK(data != nullptr, "out of memory");
    std::memset(data, 0, n * sizeof(T));
  }
  ~Aligned() { std::free(data); }
  Aligned(const Aligned&) = delete;
  Aligned& operator=(const Aligned&) = delete;
  T* get() const { return data; }
  T& operator[](size_t i) const { return data[i]; }
};

// O / l into the output rows; a row that saw nothing at all gets zeros.
void write_rows(const Args& a, int64_t kvh, int64_t i0, int M, const float* obuf, const float* l) {
  const int d = (int)a.d, G = (int)a.group;
  for (int r = 0; r < M; ++r) {
    const int64_t i = i0 + r / G, h = kvh * G + r % G;
    const __m512 inv = _mm512_set1_ps(l[r] > 0 ? 1.0f / l[r] : 0.0f);
    bf16* dst = a.out + (i * a.hq + h) * d;
    for (int x = 0; x < d; x += 16)
      _mm256_storeu_si256((__m256i*)(dst + x),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(obuf + (size_t)r * d + x), inv)));
  }
}

// One task with AVX-512 BF16 dot products: tiles of MR rows, key blocks of BK.
void run_task(const Args& a, int64_t kvh, int64_t i0, int64_t bq) {
  const int d = (int)a.d, G = (int)a.group;
  const int ntok = (int)std::min<int64_t>(bq, a.nq - i0);
  const int M = ntok * G;
  const float ninf = -std::numeric_limits<float>::infinity();
  const float c = a.scale * 1.4426950408889634f;  // scores to the log2 domain

  Aligned<bf16> qbuf((size_t)M * d);
  gather_rows(a, kvh, i0, M, qbuf.get());
  Aligned<float> obuf((size_t)M * d);
  std::vector<float> m(M, ninf), l(M, 0.0f);
  alignas(64) uint32_t kp[BK * 256 / 2];  // d <= 256
  alignas(64) bf16 vp[BK * 256];
  alignas(64) float s[MR * BK];
  alignas(64) bf16 p[MR * BK];
  float alpha[MR];
  __mmask16 mk[MR * (BK / 16)];

  const bf16* kh = a.k + kvh * a.k_sh;
  const bf16* vh = a.v + kvh * a.v_sh;
  // Causal: the last token of the block sees keys < offset + i0 + ntok; nothing after that is packed.
  const int64_t kend = a.mask ? a.ctx : std::min<int64_t>(a.ctx, a.offset + i0 + ntok);

  for (int64_t n0 = 0; n0 < kend; n0 += BK) {
    const int n_valid = (int)std::min<int64_t>(BK, kend - n0);
    bool packed = false;
    for (int t0 = 0; t0 < M; t0 += MR) {
      const int R = std::min(MR, M - t0);
      int most;
      if (!visibility(a, i0, G, t0, R, n0, n_valid, mk, BK / 16, most)) continue;
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
    softmax_tile<BK, exp2_maskz>(RR, s, mk, c, &m[t0], &l[t0], alpha, p);             \
    pv_tile<RR>(p, vp, pairs, d, alpha, ot);                              \
    break;
        TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6)
#undef TILE
      }
    }
  }
  write_rows(a, kvh, i0, M, obuf.get(), l.data());
}

#ifdef __AMX_BF16__
// Linux hands a process AMX's tile state only once asked (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); torch's
// oneDNN asks too, so this is usually already granted. Asked once; false means the AVX-512 path.
bool amx_permitted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Every tile 16 rows of 64 bytes: C tiles 16x16 fp32, A tiles 16 rows x 32 bf16, B tiles 16 pairs x 16 columns.
// The configuration is per thread, so each task loads it.
inline void amx_configure() {
  TileConfig cfg{};
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) { cfg.colsb[t] = 64; cfg.rows[t] = 16; }
  _tile_loadconfig(&cfg);
}

constexpr int SB = 4;         // key blocks of BK a step of the AMX path: O is loaded, rescaled and stored once
constexpr int BKA = SB * BK;  // for 256 keys, and each row's softmax reductions run once for them

// s[MA][32] (row stride BKA) = q[MA rows] . 32 keys of a packed K block (kp at their first key pair column: rows of
// key pairs, BK keys wide, is tdpbf16ps's B as it is). Tiles 0-3 hold S for (row tile r, 16 keys c) as 2 r + c;
// 4, 5 the two row tiles' 32-dim slices of Q; 6, 7 two 16-key slices of K, each used by both row tiles.
void qk_amx(const bf16* q, int d, const uint32_t* kp, float* s) {
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int cg = 0; cg < d / 32; ++cg) {
    const uint32_t* kr = kp + cg * 16 * BK;
    _tile_loadd(4, q + cg * 32, d * 2);
    _tile_loadd(5, q + 16 * d + cg * 32, d * 2);
    _tile_loadd(6, kr, BK * 4);
    _tile_loadd(7, kr + 16, BK * 4);
    _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, s, BKA * 4); _tile_stored(1, s + 16, BKA * 4);
  _tile_stored(2, s + 16 * BKA, BKA * 4); _tile_stored(3, s + 16 * BKA + 16, BKA * 4);
}

// o[MA][d] = alpha * o + p[MA][BKA] . V over its first `halves` 32-key halves (P is 0 past them; vp: the packed
// blocks one after the other, each [BK / 2][d][2], tdpbf16ps's B). O rescaled in memory (rows whose alpha is 1
// untouched), then 32 columns at a time held in tiles 0-3 (2 r + c as above) across all the halves; P's two row
// tiles in 4 and 5, V's pair rows for two 16-column slices in 6 and 7, each used by both row tiles.
void pv_amx(const bf16* p, const bf16* vp, int halves, int d, const float* alpha, float* o) {
  for (int r = 0; r < MA; ++r) {
    if (alpha[r] == 1.0f) continue;
    const __m512 a = _mm512_set1_ps(alpha[r]);
    for (int x = 0; x < d; x += 16) _mm512_storeu_ps(o + r * d + x, _mm512_mul_ps(_mm512_loadu_ps(o + r * d + x), a));
  }
  float* o1 = o + 16 * d;
  for (int h = 0; h < d; h += 32) {
    _tile_loadd(0, o + h, d * 4); _tile_loadd(1, o + h + 16, d * 4);
    _tile_loadd(2, o1 + h, d * 4); _tile_loadd(3, o1 + h + 16, d * 4);
    for (int k = 0; k < halves; ++k) {
      const bf16* vk = vp + (size_t)k * 16 * d * 2;  // key pairs 16 k .. 16 k + 15
      _tile_loadd(4, p + 32 * k, BKA * 2);
      _tile_loadd(5, p + 16 * BKA + 32 * k, BKA * 2);
      _tile_loadd(6, vk + h * 2, d * 4);
      _tile_loadd(7, vk + (h + 16) * 2, d * 4);
      _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, o + h, d * 4); _tile_stored(1, o + h + 16, d * 4);
    _tile_stored(2, o1 + h, d * 4); _tile_stored(3, o1 + h + 16, d * 4);
  }
}
static_assert(BK % 32 == 0, "qk_amx and pv_amx take keys 32 at a time");

// One task on AMX: steps of MA rows (the last padded with zero rows, which see nothing: P 0, alpha 1, O
// untouched) over SB key blocks at a time. (Slipping the next pair's Q.K^T products in between the softmax's rows,
// for the tile unit to work while the vector units do, measured no faster.)
void run_task_amx(const Args& a, int64_t kvh, int64_t i0, int64_t bq) {
  const int d = (int)a.d, G = (int)a.group;
  const int ntok = (int)std::min<int64_t>(bq, a.nq - i0);
  const int M = ntok * G, Mpad = (M + MA - 1) / MA * MA;
  const float ninf = -std::numeric_limits<float>::infinity();
  const float c = a.scale * 1.4426950408889634f;

  // Tile loads and 512-bit loads from 64-byte aligned rows: each one cache line, not two.
  Aligned<bf16> qbuf((size_t)Mpad * d);
  gather_rows(a, kvh, i0, M, qbuf.get());
  Aligned<float> obuf((size_t)Mpad * d);
  Aligned<uint32_t> kp((size_t)SB * BK * d / 2);  // block j at j * BK * d / 2
  Aligned<bf16> vp((size_t)SB * BK * d);          // block j at j * BK * d
  std::vector<float> m(Mpad, ninf), l(Mpad, 0.0f);
  alignas(64) float s[MA * BKA];
  alignas(64) bf16 p[MA * BKA];
  float alpha[MA];
  __mmask16 mk[MA * (BKA / 16)];
  bool full = false;  // mk holds all-visible masks

  const bf16* kh = a.k + kvh * a.k_sh;
  const bf16* vh = a.v + kvh * a.v_sh;
  const int64_t kend = a.mask ? a.ctx : std::min<int64_t>(a.ctx, a.offset + i0 + ntok);
  amx_configure();
  for (int64_t n0 = 0; n0 < kend; n0 += BKA) {
    int packed = 0;  // blocks of this step packed so far (later blocks are appended, never repacked in a step)
    for (int t0 = 0; t0 < M; t0 += MA) {
      const int R = std::min(MA, M - t0);
      int blocks = 0, extent = 0;  // blocks this pair sees any key of; keys from n0 to the furthest seen
      if (!a.mask && n0 + BKA <= a.offset + i0 + t0 / G + 1) {  // causal, and every row sees the whole step
        if (!full) std::fill(mk, mk + MA * (BKA / 16), (__mmask16)0xFFFF);
        full = true;
        blocks = SB;
        extent = BKA;
      } else {
        std::fill(mk, mk + MA * (BKA / 16), (__mmask16)0);
        full = false;
      }
      for (int j = blocks; j < SB && n0 + j * BK < kend; ++j) {
        const int n_valid = (int)std::min<int64_t>(BK, kend - n0 - j * BK);
        int most;
        if (visibility(a, i0, G, t0, R, n0 + j * BK, n_valid, mk + j * (BK / 16), BKA / 16, most)) {
          blocks = j + 1;
          extent = j * BK + most;
        }
      }
      if (blocks == 0) continue;
      for (; packed < blocks; ++packed) {
        const int64_t nb = n0 + packed * BK;
        const int n_valid = (int)std::min<int64_t>(BK, kend - nb);
        pack_k(kh + nb * a.k_sn, a.k_sn, n_valid, d, &kp[(size_t)packed * BK * d / 2]);
        pack_v(vh + nb * a.v_sn, a.v_sn, n_valid, d, &vp[(size_t)packed * BK * d]);
      }
      // Scores 32 keys a product; columns of blocks this pair does not reach stay masked off (mk 0).
      const bf16* qt = &qbuf[(size_t)t0 * d];
      for (int j = 0; j < blocks; ++j)
        for (int half = 0; half < BK; half += 32)
          qk_amx(qt, d, &kp[(size_t)j * BK * d / 2] + half, s + j * BK + half);
      softmax_tile<BKA, exp2_maskz_short>(MA, s, mk, c, &m[t0], &l[t0], alpha, p);
      pv_amx(p, vp.get(), (extent + 31) / 32, d, alpha, &obuf[(size_t)t0 * d]);
    }
  }
  _tile_release();
  write_rows(a, kvh, i0, M, obuf.get(), l.data());
}
#endif

// Whether the kernel runs its tiles on AMX (built with its flags, permitted, and not switched off for a test).
bool g_amx_enabled = true;

bool amx_in_use() {
#ifdef __AMX_BF16__
  return g_amx_enabled && amx_permitted();
#else
  return false;
#endif
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
  const bool amx = amx_in_use();
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t kvh = t / nqb, j = t % nqb;
      const int64_t qb = (j % 2 == 0) ? j / 2 : nqb - 1 - j / 2;
#ifdef __AMX_BF16__
      if (amx) { run_task_amx(a, kvh, qb * bq, bq); continue; }
#endif
      run_task(a, kvh, qb * bq, bq);
    }
  });
  return out;
}

}  // namespace

// Turns the AMX tiles on or off (on where built and permitted); returns whether they are in use. For comparing
// the two paths: tests and bench.prefill.
bool attention_use_amx(bool enable) {
  g_amx_enabled = enable;
  return amx_in_use();
}

TORCH_LIBRARY(marginalia, lib) {
  lib.def("flash_attention_bf16(Tensor query, Tensor key, Tensor value, Tensor? mask, float scale) -> Tensor");
  lib.def("attention_use_amx(bool enable) -> bool", attention_use_amx);
}

TORCH_LIBRARY_IMPL(marginalia, CPU, lib) { lib.impl("flash_attention_bf16", flash_attention_bf16); }
