// Batch-invariant CPU kernels for the compiled engine: a linear layer (float32, bfloat16 or weight-only int8
// weights), an int8 x int8 linear layer (int8 weights, inputs quantized in blocks of 32) and attention over a KV cache,
// registered as the torch ops draftsmith::linear, draftsmith::linear_i8 and draftsmith::attention. Each output
// element is reduced in one fixed order whatever the number of rows (a decode step, a verify of 64 tokens), so a
// speculative verify computes exactly what one-token steps compute.
// The instruction set (AVX-512 with AMX tiles, AVX-512 with BF16, AVX-512, AVX2 + FMA, scalar) is chosen once at load
// time from the CPU, or from DRAFTSMITH_KERNEL_ISA; the kernels are written once (invariant_impl.h) and compiled per
// set. With AMX, bfloat16 weights go through its tiles (isa_amx below), everything else as with AVX-512 BF16.
#include <torch/extension.h>
#include <cpuid.h>
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

constexpr float MASKED_BELOW = -1e30f;  // an additive mask entry below this hides the key

inline float bf16_to_float(uint16_t h) {
  uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, NaN kept quiet
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return uint16_t(bits >> 16);
}

// Whether an AVX-512 float32 linear layer of more rows than one pass of the tile takes runs its passes over chunks of
// each panel held in L1 (invariant_impl.h's chunked_passes_kernel) rather than over whole panels: where the kernels
// run with AMX (defined with the dispatch below). The same bits either way; only the speed differs by CPU.
bool float32_chunked_passes();
// How many rows of a verify AVX-512 attention takes a task at most, each key and value read once for all of them (AVX2
// always takes two): defined with the dispatch below.
int avx512_attention_rows();
// Whether attention requests each key's value, and the key KEY_AHEAD keys on, while it scores a key (else the
// hardware's prefetchers alone fetch them): defined with the dispatch below. The same bits either way.
bool attention_requests_ahead();

// Cephes' single-precision exp polynomial, shared by every instruction set.
constexpr float EXP_HI = 88.3f, EXP_LO = -87.3f, LOG2E = 1.44269504088896341f;
constexpr float EXP_C1 = 0.693359375f, EXP_C2 = -2.12194440e-4f;
constexpr float EXP_P[6] = {1.9875691500E-4f, 1.3981999507E-3f, 8.3334519073E-3f,
                            4.1665795894E-2f, 1.6666665459E-1f, 5.0000001201E-1f};

}  // namespace

// ---- scalar ----------------------------------------------------------------------------------------------------
namespace isa_scalar {
constexpr int VL = 1;
using V = float;
#define DPBF16 0
inline V vzero() { return 0.0f; }
inline V vset1(float a) { return a; }
inline V vload(const float* p) { return *p; }
inline V vload_partial(const float* p, int n) { return n > 0 ? *p : 0.0f; }
inline V vmask_tail(V v, int n) { return n > 0 ? v : 0.0f; }
inline void vstore(float* p, V v) { *p = v; }
inline V vfma(V a, V b, V c) { return std::fma(a, b, c); }
inline V vmul(V a, V b) { return a * b; }
inline V vadd(V a, V b) { return a + b; }
inline V vmax(V a, V b) { return std::max(a, b); }
inline float vreduce_max(V v) { return v; }
inline float vreduce_add(V v) { return v; }
inline V vreduce_each(const V* a) { return a[0]; }
inline uint32_t vvisible_bits(V v) { return v > MASKED_BELOW ? 1u : 0u; }
inline uint32_t vat_least_bits(V a, V b) { return a >= b ? 1u : 0u; }
inline V vload_i8(const int8_t* p) { return float(*p); }
using VI = int32_t;
using XQ = uint32_t;
constexpr int WEIGHT_BIAS = 0;
inline void vquantize(int8_t* q, V v, int n) {
  if (n > 0) *q = int8_t(std::max(-127L, std::min(127L, std::lrint(v))));
}
inline VI vizero() { return 0; }
inline VI viload(const int8_t* p) { int32_t v; std::memcpy(&v, p, 4); return v; }
inline XQ vquad(uint32_t q) { return q; }
inline VI vdp_i8(VI acc, XQ x, VI w) {
  for (int j = 0; j < 4; ++j) acc += int32_t(int8_t(x >> (8 * j))) * int32_t(int8_t(uint32_t(w) >> (8 * j)));
  return acc;
}
inline V vblock_float(VI acc, int32_t correction) { return float(acc - correction); }
inline V vload_bf16_partial(const uint16_t* p, int n) { return n > 0 ? bf16_to_float(*p) : 0.0f; }
inline void vload_bf16_pairs(const uint16_t* p, V* w0, V* w1) { *w0 = bf16_to_float(p[0]); *w1 = bf16_to_float(p[1]); }
inline void vstore_out(float* p, V v, int n) { if (n > 0) *p = v; }
inline void vstore_out(uint16_t* p, V v, int n) { if (n > 0) *p = float_to_bf16(v); }
inline V vexp(V x) {
  x = std::min(std::max(x, EXP_LO), EXP_HI);
  float n = std::nearbyint(x * LOG2E);
  x = std::fma(-n, EXP_C1, x);
  x = std::fma(-n, EXP_C2, x);
  float y = EXP_P[0];
  for (int i = 1; i < 6; ++i) y = std::fma(y, x, EXP_P[i]);
  y = std::fma(y, x * x, x) + 1.0f;
  return std::ldexp(y, int(n));
}
#include "invariant_impl.h"
#undef DPBF16
}  // namespace isa_scalar

// ---- AVX2 + FMA ------------------------------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace isa_avx2 {
constexpr int VL = 8;
using V = __m256;
#define DPBF16 0
inline V vzero() { return _mm256_setzero_ps(); }
inline V vset1(float a) { return _mm256_set1_ps(a); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline __m256i tail_mask(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline V vload_partial(const float* p, int n) { return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, tail_mask(n)); }
inline V vmask_tail(V v, int n) { return _mm256_and_ps(v, _mm256_castsi256_ps(tail_mask(n))); }
inline void vstore(float* p, V v) { _mm256_storeu_ps(p, v); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline V vmax(V a, V b) { return _mm256_max_ps(a, b); }
inline float vreduce_max(V v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline uint32_t vvisible_bits(V v) {
  return uint32_t(_mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(MASKED_BELOW), _CMP_GT_OQ)));
}
inline uint32_t vat_least_bits(V a, V b) { return uint32_t(_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GE_OQ))); }
inline float vreduce_add(V v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// vreduce_add of each of a[0..7] at once, lane t = vreduce_add(a[t]) bit for bit: the same pairs summed in the
// same tree (i + 4, then i + 2, then i + 1), eight vectors at a time instead of one.
inline V vreduce_each(const V* a) {
  V y[4], x[2];
  for (int r = 0; r < 4; ++r)
    y[r] = _mm256_add_ps(_mm256_permute2f128_ps(a[r], a[r + 4], 0x20), _mm256_permute2f128_ps(a[r], a[r + 4], 0x31));
  for (int u = 0; u < 2; ++u)
    x[u] = _mm256_add_ps(_mm256_shuffle_ps(y[u], y[u + 2], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(y[u], y[u + 2], _MM_SHUFFLE(3, 2, 3, 2)));
  V r = _mm256_add_ps(_mm256_shuffle_ps(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                      _mm256_shuffle_ps(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 2, 1, 3, 4, 6, 5, 7));  // lanes back in key order
}
inline V vload_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// int8 x int8 without VNNI: |x| (unsigned) times w with x's sign, in pairs (at most 2 x 127 x 127: no saturation),
// then the pairs summed into int32 lanes.
using VI = __m256i;
struct XQ {
  __m256i magnitude, sign;
};
constexpr int WEIGHT_BIAS = 0;
inline void vquantize(int8_t* q, V v, int n) {  // (the rounding is MXCSR's: to nearest even, as lrint)
  const __m256i i = _mm256_max_epi32(_mm256_set1_epi32(-127),
                                     _mm256_min_epi32(_mm256_set1_epi32(127), _mm256_cvtps_epi32(v)));
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), i);
  for (int t = 0; t < n && t < 8; ++t) q[t] = int8_t(lanes[t]);
}
inline VI vizero() { return _mm256_setzero_si256(); }
inline VI viload(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline XQ vquad(uint32_t q) {
  const __m256i x = _mm256_set1_epi32(int(q));
  return {_mm256_abs_epi8(x), x};
}
inline VI vdp_i8(VI acc, const XQ& x, VI w) {
  const __m256i pairs = _mm256_maddubs_epi16(x.magnitude, _mm256_sign_epi8(w, x.sign));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
inline V vblock_float(VI acc, int32_t correction) {
  return _mm256_cvtepi32_ps(_mm256_sub_epi32(acc, _mm256_set1_epi32(correction)));
}
inline V bf16x8(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
inline V vload_bf16_partial(const uint16_t* p, int n) {
  if (n >= 8) return bf16x8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  uint16_t tmp[8] = {0};
  std::memcpy(tmp, p, sizeof(uint16_t) * n);
  return bf16x8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tmp)));
}
inline void vload_bf16_pairs(const uint16_t* p, V* w0, V* w1) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  *w0 = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
  *w1 = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(int(0xffff0000u))));
}
inline void vstore_out(float* p, V v, int n) {
  if (n >= 8) { _mm256_storeu_ps(p, v); return; }
  _mm256_maskstore_ps(p, tail_mask(n), v);
}
inline void vstore_out(uint16_t* p, V v, int n) {
  float tmp[8];
  _mm256_storeu_ps(tmp, v);
  for (int i = 0; i < n && i < 8; ++i) p[i] = float_to_bf16(tmp[i]);
}
inline V vexp(V x) {
  x = _mm256_min_ps(_mm256_max_ps(x, vset1(EXP_LO)), vset1(EXP_HI));
  V n = _mm256_round_ps(_mm256_mul_ps(x, vset1(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, vset1(EXP_C1), x);
  x = _mm256_fnmadd_ps(n, vset1(EXP_C2), x);
  V y = vset1(EXP_P[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, x, vset1(EXP_P[i]));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), vset1(1.0f));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#include "invariant_impl.h"
#undef DPBF16
}  // namespace isa_avx2
#pragma GCC pop_options

// ---- AVX-512 (F, BW, VL), with and without BF16 dot products -----------------------------------------------------
#define AVX512_VOCABULARY                                                                                          \
  constexpr int VL = 16;                                                                                           \
  using V = __m512;                                                                                                \
  inline __mmask16 tail(int n) { return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1u); }                 \
  inline V vzero() { return _mm512_setzero_ps(); }                                                                 \
  inline V vset1(float a) { return _mm512_set1_ps(a); }                                                            \
  inline V vload(const float* p) { return _mm512_loadu_ps(p); }                                                   \
  inline V vload_partial(const float* p, int n) { return _mm512_maskz_loadu_ps(tail(n), p); }                     \
  inline V vmask_tail(V v, int n) { return _mm512_maskz_mov_ps(tail(n), v); }                                     \
  inline void vstore(float* p, V v) { _mm512_storeu_ps(p, v); }                                                   \
  inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }                                               \
  inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }                                                         \
  inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }                                                         \
  inline V vmax(V a, V b) { return _mm512_max_ps(a, b); }                                                         \
  inline float vreduce_max(V v) { return _mm512_reduce_max_ps(v); }                                               \
  inline uint32_t vvisible_bits(V v) { return _mm512_cmp_ps_mask(v, _mm512_set1_ps(MASKED_BELOW), _CMP_GT_OQ); }   \
  inline uint32_t vat_least_bits(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }                        \
  inline float vreduce_add(V v) {                                                                                  \
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v),                                                            \
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));                    \
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));                                 \
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                                                        \
    s = _mm_add_ss(s, _mm_movehdup_ps(s));                                                                         \
    return _mm_cvtss_f32(s);                                                                                       \
  }                                                                                                                \
  /* vreduce_add of each of a[0..15] at once, lane t = vreduce_add(a[t]) bit for bit (the same tree: i + 8,     */ \
  /* i + 4, i + 2, i + 1), sixteen vectors at a time.                                                           */ \
  inline V vreduce_each(const V* a) {                                                                              \
    V z[8], y[4], x[2];                                                                                            \
    for (int p = 0; p < 8; ++p)                                                                                    \
      z[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[p], a[p + 8], _MM_SHUFFLE(1, 0, 1, 0)),                          \
                           _mm512_shuffle_f32x4(a[p], a[p + 8], _MM_SHUFFLE(3, 2, 3, 2)));                         \
    for (int r = 0; r < 4; ++r)                                                                                    \
      y[r] = _mm512_add_ps(_mm512_shuffle_f32x4(z[r], z[r + 4], _MM_SHUFFLE(2, 0, 2, 0)),                          \
                           _mm512_shuffle_f32x4(z[r], z[r + 4], _MM_SHUFFLE(3, 1, 3, 1)));                         \
    for (int u = 0; u < 2; ++u)                                                                                    \
      x[u] = _mm512_add_ps(_mm512_shuffle_ps(y[u], y[u + 2], _MM_SHUFFLE(1, 0, 1, 0)),                             \
                           _mm512_shuffle_ps(y[u], y[u + 2], _MM_SHUFFLE(3, 2, 3, 2)));                            \
    V r = _mm512_add_ps(_mm512_shuffle_ps(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),                                    \
                        _mm512_shuffle_ps(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));                                   \
    const __m512i order = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);                 \
    return _mm512_permutexvar_ps(order, r); /* lanes back in key order */                                          \
  }                                                                                                                \
  inline V vload_i8(const int8_t* p) {                                                                             \
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));         \
  }                                                                                                                \
  using VI = __m512i;                                                                                              \
  inline VI vizero() { return _mm512_setzero_si512(); }                                                            \
  inline VI viload(const int8_t* p) { /* + WEIGHT_BIAS: 0 or 128, a flip of each byte's top bit */                 \
    const __m512i w = _mm512_loadu_si512(p);                                                                       \
    return WEIGHT_BIAS ? _mm512_xor_si512(w, _mm512_set1_epi8(char(0x80))) : w;                                   \
  }                                                                                                                \
  inline void vquantize(int8_t* q, V v, int n) {                                                                   \
    const __m512i i = _mm512_min_epi32(_mm512_set1_epi32(127), _mm512_cvtps_epi32(v));                             \
    _mm512_mask_cvtepi32_storeu_epi8(q, tail(n), _mm512_max_epi32(_mm512_set1_epi32(-127), i));                    \
  }                                                                                                                \
  inline V vblock_float(VI acc, int32_t correction) {                                                              \
    return _mm512_cvtepi32_ps(_mm512_sub_epi32(acc, _mm512_set1_epi32(correction)));                               \
  }                                                                                                                \
  inline V vload_bf16_partial(const uint16_t* p, int n) {                                                          \
    __m256i h = _mm256_maskz_loadu_epi16(tail(n), p);                                                              \
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));                                   \
  }                                                                                                                \
  inline void vload_bf16_pairs(const uint16_t* p, V* w0, V* w1) {                                                  \
    __m512i raw = _mm512_loadu_si512(p);                                                                           \
    *w0 = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));                                                         \
    *w1 = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(int(0xffff0000u))));                          \
  }                                                                                                                \
  inline void vstore_out(float* p, V v, int n) { _mm512_mask_storeu_ps(p, tail(n), v); }                          \
  inline void vstore_out(uint16_t* p, V v, int n) {                                                                \
    __m512i bits = _mm512_castps_si512(v);                                                                         \
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));                             \
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16); \
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);                                                        \
    rounded = _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));            \
    _mm256_mask_storeu_epi16(p, tail(n), _mm512_cvtepi32_epi16(rounded));                                          \
  }                                                                                                                \
  inline V vexp(V x) {                                                                                             \
    x = _mm512_min_ps(_mm512_max_ps(x, vset1(EXP_LO)), vset1(EXP_HI));                                             \
    V n = _mm512_roundscale_ps(_mm512_mul_ps(x, vset1(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);     \
    x = _mm512_fnmadd_ps(n, vset1(EXP_C1), x);                                                                     \
    x = _mm512_fnmadd_ps(n, vset1(EXP_C2), x);                                                                     \
    V y = vset1(EXP_P[0]);                                                                                         \
    for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, x, vset1(EXP_P[i]));                                        \
    y = _mm512_add_ps(_mm512_fmadd_ps(y, _mm512_mul_ps(x, x), x), vset1(1.0f));                                    \
    return _mm512_scalef_ps(y, n);                                                                                 \
  }

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
namespace isa_avx512 {
constexpr int WEIGHT_BIAS = 0;
AVX512_VOCABULARY
#define DPBF16 0
// int8 x int8 without VNNI, as AVX2's: |x| times w negated where x is negative, in pairs, then into int32 lanes.
struct XQ {
  __m512i magnitude;
  __mmask64 negative;
};
inline XQ vquad(uint32_t q) {
  const __m512i x = _mm512_set1_epi32(int(q));
  return {_mm512_abs_epi8(x), _mm512_movepi8_mask(x)};
}
inline VI vdp_i8(VI acc, const XQ& x, VI w) {
  const __m512i signed_w = _mm512_mask_sub_epi8(w, x.negative, _mm512_setzero_si512(), w);
  const __m512i pairs = _mm512_maddubs_epi16(x.magnitude, signed_w);
  return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
}
#include "invariant_impl.h"
#undef DPBF16
}  // namespace isa_avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni,avx2,fma,f16c")
namespace isa_avx512_bf16 {
// int8 x int8 with VNNI (every CPU with AVX-512 BF16 has it): vpdpbusd takes one operand unsigned, so the weights
// go in as w + 128 and 128 x the block's sum of inputs comes off, exactly.
constexpr int WEIGHT_BIAS = 128;
AVX512_VOCABULARY
#define DPBF16 1
using XQ = __m512i;
inline XQ vquad(uint32_t q) { return _mm512_set1_epi32(int(q)); }
inline VI vdp_i8(VI acc, XQ x, VI w) {  // acc += (w + 128) . x per lane: w unsigned, x signed
  // (inline assembly: with the intrinsic GCC copies and spills the accumulators of a tile every input quad)
  asm("vpdpbusd %[x], %[w], %[acc]" : [acc] "+v"(acc) : [w] "v"(w), [x] "vm"(x));
  return acc;
}
inline V vdpbf16(V acc, uint32_t pair, const uint16_t* w) {
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(int(pair)), (__m512bh)_mm512_loadu_si512(w));
}
#include "invariant_impl.h"
#undef DPBF16
}  // namespace isa_avx512_bf16
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
namespace isa_amx {
// A linear layer with bfloat16 weights and inputs on AMX: tdpbf16ps accumulates each element of a (up to) 16 x 16
// float32 tile from its own row of inputs and column of weights, 32 inputs (16 pairs) an instruction, whatever the
// tile's other rows hold or how many it has. Every call pads its inputs to a multiple of 32 with zeros and sweeps them
// in order, so each output element is reduced by the same instructions in the same order at any row count. The weights
// are the bf16 panels every instruction set reads (PANEL columns, inputs in pairs): a tile of 16 pairs x 16 columns is
// 16 rows of 64 bytes, 192 bytes apart. Three tiles of columns make a panel; a task is a panel, its rows in blocks
// of 16 (a verify of up to 16 tokens reads each weight once).
constexpr int64_t ROWS = 16, PAIRS = 16, COLUMNS = 16;
constexpr int64_t PANEL = isa_scalar::PANEL, PANEL_TILES = PANEL / COLUMNS;
static_assert(PANEL_TILES == 3, "three column tiles a panel (tiles 0-2 accumulate, 3 the inputs, 4-6 the weights)");
// One row's tile products take ~50 cycles a step against ~400 for its 3 KB of weights from memory, and the tile loads
// alone keep too few lines in flight: each step requests the weights this many bytes (4 steps of bf16) ahead.
constexpr int64_t AHEAD_BYTES = 12288;

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

constexpr int LOW_INPUTS = 7;  // the tile of a split linear layer's low input halves (linear_split)

// Tiles of `rows` rows of inputs and sums (0-3 and 7; the weights' 4-6 always 16 pairs): a tile row holds one row's
// products whatever the tile's other rows, so fewer rows only skip loading and multiplying rows of zeros. Each thread
// loads the shapes on every call (and where a call's last block has fewer rows): other libraries (oneDNN's bf16
// matmuls) load their own on the same threads in between.
inline void configure_tiles(int rows) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = uint8_t(t < 4 || t == LOW_INPUTS ? rows : 16);
    config.bytes_per_row[t] = 64;
  }
  _tile_loadconfig(&config);
}

// A step's weights as the tiles read them: bf16 pairs as stored, or int8 pairs (the greedy head's int8 copy in pairs)
// widened to bf16 in `buffer` first: exact, |q| <= 127 needs 7 significand bits.
inline const uint16_t* step_weights(const uint16_t* stored, uint16_t*) { return stored; }
inline const uint16_t* step_weights(const int8_t* stored, uint16_t* buffer) {
  for (int64_t i = 0; i < PAIRS * PANEL * 2; i += 32) {
    const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(stored + i))));
    const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(stored + i + 16))));
    _mm512_store_si512(buffer + i, (__m512i)_mm512_cvtne2ps_pbh(high, low));
  }
  return buffer;
}

// Rows b*16 .. b*16+15 of a panel's three column tiles: inputs `a` (the block's rows of `padded` inputs), weights
// `panel` (its whole tiles of pairs, then `tail`: the last part-tile zero-padded), the sums stored to `sums` (3 x 16
// x 16).
// With `low` (linear_split's low input halves, laid out as `a`), each weight tile is multiplied by both, `a` first.
template <typename WT>
inline void panel_rows(const uint16_t* a, const uint16_t* low, int64_t padded, const WT* panel, const WT* tail,
                       int64_t whole, int64_t steps, float* sums) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  constexpr int64_t stride = PANEL * 2 * sizeof(uint16_t);  // bytes from one pair row of the tiles' weights to the next
  constexpr int64_t step_bytes = PAIRS * PANEL * 2 * sizeof(WT), ahead_steps = AHEAD_BYTES / step_bytes;
  alignas(64) uint16_t widened[std::is_same_v<WT, uint16_t> ? 1 : PAIRS * PANEL * 2];
  const int64_t row_bytes = padded * int64_t(sizeof(uint16_t));
  for (int64_t s = 0; s < steps; ++s) {
    // the weights AHEAD_BYTES on requested into L2 (past the panel: the next panel, the thread's next task)
    const char* ahead = reinterpret_cast<const char*>(panel + (s + ahead_steps) * PAIRS * PANEL * 2);
    for (int64_t line = 0; line < step_bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T1);
    const uint16_t* w = step_weights(s < whole ? panel + s * PAIRS * PANEL * 2 : tail, widened);
    _tile_loadd(3, a + s * PAIRS * 2, row_bytes);
    _tile_loadd(4, w, stride);
    _tile_loadd(5, w + COLUMNS * 2, stride);
    _tile_loadd(6, w + 2 * COLUMNS * 2, stride);
    _tile_dpbf16ps(0, 3, 4);
    _tile_dpbf16ps(1, 3, 5);
    _tile_dpbf16ps(2, 3, 6);
    if (low) {
      _tile_loadd(7, low + s * PAIRS * 2, row_bytes);  // (tile 7: LOW_INPUTS; the intrinsics take literals)
      _tile_dpbf16ps(0, 7, 4);
      _tile_dpbf16ps(1, 7, 5);
      _tile_dpbf16ps(2, 7, 6);
    }
  }
  _tile_stored(0, sums, COLUMNS * sizeof(float));
  _tile_stored(1, sums + ROWS * COLUMNS, COLUMNS * sizeof(float));
  _tile_stored(2, sums + 2 * ROWS * COLUMNS, COLUMNS * sizeof(float));
}

// bf16 elements of an input row laid out for the tiles over `pairs` input pairs: whole steps of PAIRS pairs, the last
// zero-padded. A call's rows are M such rows (a block's tiles load only its own rows: none past the last).
inline int64_t padded_row(int64_t pairs) { return (pairs + PAIRS - 1) / PAIRS * PAIRS * 2; }

// Every panel's rows through the tiles: `a` (and `low`: linear_split) the inputs laid out for them (M rows of
// padded_row(pairs)), `store(row, panel, sums of its tile row with the column stride COLUMNS, columns)` writes one
// row's outputs of a panel.
template <typename WT, typename Store>
void tile_panels(const uint16_t* a, const uint16_t* low, int64_t M, int64_t pairs, const WT* packed, int64_t N,
                 Store store) {
  const int64_t steps = (pairs + PAIRS - 1) / PAIRS, whole = pairs / PAIRS, blocks = (M + ROWS - 1) / ROWS;
  const int64_t padded = padded_row(pairs);
  const int64_t panels = (N + PANEL - 1) / PANEL, panel_size = pairs * PANEL * 2;
#pragma omp parallel if (panels > 1)
  {
    int configured = 0;  // the rows the tiles are shaped for (0: not yet on this call)
    alignas(64) WT tail[PAIRS * PANEL * 2];
    alignas(64) float sums[PANEL_TILES * ROWS * COLUMNS];
#pragma omp for schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
      const WT* panel = packed + p * panel_size;
      if (whole < steps) {
        std::memset(tail, 0, sizeof(tail));
        std::memcpy(tail, panel + whole * PAIRS * PANEL * 2,
                    size_t((pairs - whole * PAIRS) * PANEL * 2) * sizeof(WT));
      }
      const int64_t columns = std::min<int64_t>(PANEL, N - p * PANEL);
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t rows = std::min<int64_t>(ROWS, M - b * ROWS);
        if (rows != configured) configure_tiles(configured = int(rows));
        panel_rows(a + b * ROWS * padded, low ? low + b * ROWS * padded : nullptr, padded, panel, tail, whole, steps,
                   sums);
        for (int64_t r = 0; r < rows; ++r) store(b * ROWS + r, p, sums + r * COLUMNS, columns);
      }
    }
    _tile_release();  // the tiles' state back to its initial one (a cheaper context switch)
  }
}

// Output column c of a panel's tile row (its sums start at `row_sums`; the column tiles ROWS x COLUMNS apart).
inline float tile_sum(const float* row_sums, int64_t c) {
  return row_sums[(c / COLUMNS) * ROWS * COLUMNS + c % COLUMNS];
}

inline void store_output(float* p, float value) { *p = value; }
inline void store_output(uint16_t* p, float value) { *p = float_to_bf16(value); }

// y (M, N) = x (M, K) . W^T (+ bias), bf16 inputs, W packed in bf16 panels; out bf16 (a bf16 model's linear layer) or
// float32 (the greedy head's bf16 copy). With int8 weights in pairs (WT int8_t: the greedy head's int8 copy as the
// tiles take it), each output times its `scale`.
template <typename WT, typename OT>
void linear_bf16(const uint16_t* x, int64_t M, int64_t K, const WT* packed, int64_t N, const float* scale,
                 const float* bias, OT* out) {
  const int64_t pairs = (K + 1) / 2, padded = padded_row(pairs);
  std::vector<uint16_t> a(size_t(M * padded), 0);
  for (int64_t m = 0; m < M; ++m) std::memcpy(a.data() + m * padded, x + m * K, size_t(K) * sizeof(uint16_t));
  tile_panels(a.data(), nullptr, M, pairs, packed, N, [&](int64_t m, int64_t p, const float* sums, int64_t n) {
    OT* row = out + m * N + p * PANEL;
    for (int64_t c = 0; c < n; ++c) {
      float value = tile_sum(sums, c);
      if (scale) value *= scale[p * PANEL + c];
      if (bias) value += bias[p * PANEL + c];
      store_output(row + c, value);
    }
  });
}

// y (M, N) = x (M, K) . W^T (+ bias) in float32 from split bfloat16 products: each weight is stored as the pair
// (hi, lo), hi = bf16(w), lo = bf16(w - hi) (kernels.py's split_bf16, 4 bytes: fp32's stream), and each input as it
// arrives as (hi, hi) and (lo, lo), so the two tile products of a pair add x_hi (w_hi + w_lo) + x_lo (w_hi + w_lo):
// every product of (16-bit-significand x) (16-bit-significand w), exact, summed in float32 (JAX's bf16_3x keeps three
// of these four). Each element reduced in one order at any row count, as linear_bf16; 16 rows cost a tile's pass,
// about as one row does (the weights stream once; results/roofline/intel_xeon_split_bf16).
void linear_split(const float* x, int64_t M, int64_t K, const uint16_t* packed, int64_t N, const float* bias,
                  float* out) {
  const int64_t padded = padded_row(K);
  std::vector<uint16_t> high(size_t(M * padded), 0), low(size_t(M * padded), 0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) {
      const float value = x[m * K + k];
      const uint16_t h = float_to_bf16(value);
      const float rounded = bf16_to_float(h);  // (inf where x is, or rounds up to it: no low half then)
      const uint16_t l = std::isfinite(rounded) ? float_to_bf16(value - rounded) : 0;
      high[m * padded + 2 * k] = high[m * padded + 2 * k + 1] = h;
      low[m * padded + 2 * k] = low[m * padded + 2 * k + 1] = l;
    }
  auto store = [&](int64_t m, int64_t p, const float* sums, int64_t n) {
    float* row = out + m * N + p * PANEL;
    for (int64_t c = 0; c < n; ++c) {
      row[c] = tile_sum(sums, c);
      if (bias) row[c] += bias[p * PANEL + c];
    }
  };
  tile_panels(high.data(), low.data(), M, K, packed, N, store);
}

// The greedy head's approximate logits on AMX int8 tiles, nothing widened: each input row quantized to X = round(x /
// s_x) with s_x = max|x| / QUAD_SPAN, split X = 128 hi + lo (hi in [-127, 127], lo in [-64, 64]), and both int8
// halves multiplied by the int8 weights with tdpbssd, summed in int32 exactly: a[j] = scale[j] s_x (128 H_j + L_j), in
// float64 and rounded once. Integer sums have no order: a row's logits are the same at any row count. The weights are
// in column tiles (ceil(N / 16), K' / 4, 16, 4), K' = K padded to 64 with zeros: one tile's stream is contiguous.
// |x - s_x X| <= 0.503 s_x (the rounding; x times 1 / s_x in float32: 3 x 16256 x 2^-24), so |exact - a[j]| <=
// scale[j] (sum|x| / 2 + 0.503 s_x sum_k |q_jk|) <= scale[j] (sum|x| / 2 + 64 K s_x) (127 x 0.503 < 64): greedy_head
// adds the second term per row. The int32 sums hold K up to 2^31 / 127^2 (133,000 inputs).
constexpr float QUAD_SPAN = 127.0f * 128.0f;
constexpr int64_t QUAD_STEP = 64;  // inputs a tile step takes (16 quads)
constexpr int64_t QUAD_AHEAD = 8;  // steps (1 KB each) a column tile's weights are requested ahead, into L2

inline int64_t quad_padded(int64_t K) { return (K + QUAD_STEP - 1) / QUAD_STEP * QUAD_STEP; }
// The int8 bytes of the column tiles of N outputs over K inputs (kernels.py's pack_quads).
inline int64_t quad_elements(int64_t K, int64_t N) { return (N + COLUMNS - 1) / COLUMNS * COLUMNS * quad_padded(K); }

// Row x (K) as its hi and lo int8 halves (`padded` bytes each, zero past K); returns s_x.
inline float quantize_quad_row(const float* x, int64_t K, int64_t padded, int8_t* hi, int8_t* lo) {
  __m512 largest = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 valid = __mmask16((1u << std::min<int64_t>(16, K - k)) - 1);
    largest = _mm512_max_ps(largest, _mm512_abs_ps(_mm512_maskz_loadu_ps(valid, x + k)));
  }
  const float most = _mm512_reduce_max_ps(largest);
  const float step = most > 0.0f && std::isfinite(most) ? most / QUAD_SPAN : 1.0f;
  const __m512 inverse = _mm512_set1_ps(1.0f / step), span = _mm512_set1_ps(QUAD_SPAN);
  const __m512 eighth = _mm512_set1_ps(1.0f / 128.0f), scale128 = _mm512_set1_ps(128.0f);
  for (int64_t k = 0; k < padded; k += 16) {
    const __mmask16 valid = __mmask16(k < K ? (1u << std::min<int64_t>(16, K - k)) - 1 : 0);
    __m512 whole = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(valid, x + k), inverse),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    whole = _mm512_min_ps(_mm512_max_ps(whole, _mm512_sub_ps(_mm512_setzero_ps(), span)), span);
    const __m512 high = _mm512_roundscale_ps(_mm512_mul_ps(whole, eighth), _MM_FROUND_TO_NEAREST_INT |
                                                                           _MM_FROUND_NO_EXC);
    const __m512 low = _mm512_sub_ps(whole, _mm512_mul_ps(high, scale128));  // exact: integers below 2^24
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + k), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(high)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + k), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(low)));
  }
  return step;
}

// out[r * N + c] = scale[c] * steps[r] * (128 high + low) for a column tile's `columns` columns and `rows` rows.
inline void quad_logits(const int32_t* high, const int32_t* low, int64_t rows, const float* steps, const float* scale,
                        int64_t columns, float* out, int64_t N) {
  const __mmask16 valid = __mmask16((1u << columns) - 1);
  const __m512 scales = _mm512_maskz_loadu_ps(valid, scale);
  const __m512d scales_low = _mm512_cvtps_pd(_mm512_castps512_ps256(scales));
  const __m512d scales_high = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(scales), 1)));
  const __m512d times = _mm512_set1_pd(128.0);
  for (int64_t r = 0; r < rows; ++r) {
    const __m512i h = _mm512_loadu_si512(high + r * COLUMNS), l = _mm512_loadu_si512(low + r * COLUMNS);
    const __m512d row_step = _mm512_set1_pd(double(steps[r]));
    const __m512d first = _mm512_fmadd_pd(_mm512_cvtepi32_pd(_mm512_castsi512_si256(h)), times,
                                          _mm512_cvtepi32_pd(_mm512_castsi512_si256(l)));  // exact integers
    const __m512d second = _mm512_fmadd_pd(_mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(h, 1)), times,
                                           _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(l, 1)));
    const __m256 a = _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_mul_pd(first, scales_low), row_step));
    const __m256 b = _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_mul_pd(second, scales_high), row_step));
    _mm512_mask_storeu_ps(out + r * N, valid, _mm512_insertf32x8(_mm512_castps256_ps512(a), b, 1));
  }
}

// out (M, N): the approximate logits of x (M, K) float32 from the int8 column tiles; `steps` gets each row's s_x.
void greedy_quads(const float* x, int64_t M, int64_t K, const int8_t* packed, int64_t N, const float* scale,
                  float* out, float* steps) {
  const int64_t padded = quad_padded(K), tile_steps = padded / QUAD_STEP, blocks = (M + ROWS - 1) / ROWS;
  const int64_t tiles = (N + COLUMNS - 1) / COLUMNS, tile_size = padded * COLUMNS, step_size = QUAD_STEP * COLUMNS;
  std::vector<int8_t> high(size_t(M * padded)), low(size_t(M * padded));
  for (int64_t m = 0; m < M; ++m)
    steps[m] = quantize_quad_row(x + m * K, K, padded, high.data() + m * padded, low.data() + m * padded);
#pragma omp parallel if (tiles > 1)
  {
    int configured = 0;
    alignas(64) int32_t sums[2][ROWS * COLUMNS];
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; ++t) {
      const int8_t* weights = packed + t * tile_size;
      const int64_t column = t * COLUMNS;
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t rows = std::min<int64_t>(ROWS, M - b * ROWS);
        if (rows != configured) configure_tiles(configured = int(rows));
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t s = 0; s < tile_steps; ++s) {
          const char* ahead = reinterpret_cast<const char*>(weights + (s + QUAD_AHEAD) * step_size);
          for (int64_t line = 0; b == 0 && line < step_size; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T1);
          _tile_loadd(2, high.data() + b * ROWS * padded + s * QUAD_STEP, padded);
          _tile_loadd(3, low.data() + b * ROWS * padded + s * QUAD_STEP, padded);
          _tile_loadd(4, weights + s * step_size, COLUMNS * 4);
          _tile_dpbssd(0, 2, 4);
          _tile_dpbssd(1, 3, 4);
        }
        _tile_stored(0, sums[0], COLUMNS * sizeof(int32_t));
        _tile_stored(1, sums[1], COLUMNS * sizeof(int32_t));
        quad_logits(sums[0], sums[1], rows, steps + b * ROWS, scale + column, std::min<int64_t>(COLUMNS, N - column),
                    out + b * ROWS * N + column, N);
      }
    }
    _tile_release();
  }
}

// AMX tiles with bf16 and int8 products, and this process allowed to use them (Linux asks each process to request
// the tiles' state: arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA).
bool usable() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool tiles = edx & (1u << 24), bf16 = edx & (1u << 22), int8 = edx & (1u << 25);
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return tiles && bf16 && int8 && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}
}  // namespace isa_amx
#pragma GCC pop_options

// ---- dispatch and registration ----------------------------------------------------------------------------------
namespace {

enum class Isa { Scalar = 0, Avx2 = 1, Avx512 = 2, Avx512Bf16 = 3, Avx512Amx = 4 };
const char* ISA_NAMES[] = {"scalar", "avx2", "avx512", "avx512_bf16", "avx512_amx"};

// The most this CPU runs (AMX where the process may use its tiles).
Isa supported_isa() {
  __builtin_cpu_init();
  bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  const bool bf16 = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vnni");
  return avx512 ? (bf16 ? (isa_amx::usable() ? Isa::Avx512Amx : Isa::Avx512Bf16) : Isa::Avx512)
                : (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? Isa::Avx2 : Isa::Scalar);
}

// The default is the best this CPU runs, AMX included: on the Xeon a bf16 target's plain decoding on the tiles was
// level with the pair dot products' in the goal bench that timed both interleaved (0.990x per prompt turn, 0.94-1.05;
// the kernel A/Bs of noisier hours had its one-row step 0-25% slower), and its verify costs a third of theirs at 8-9
// rows, so its best method ran 1.75x over the faster plain (results/engine_kernels_xeon/README.md).
// DRAFTSMITH_KERNEL_ISA=avx512_bf16 keeps the pair dot products.
// The set `name` names, refused in one line (`what`: where the name came from) where this CPU does not run it.
Isa named_isa(const std::string& name, const char* what) {
  const Isa best = supported_isa();
  for (int i = 0; i <= int(best); ++i)
    if (name == ISA_NAMES[i]) return Isa(i);
  TORCH_CHECK(false, what, name, ": this CPU runs at most ", ISA_NAMES[int(best)]);
}

Isa detect_isa() {
  const char* forced = std::getenv("DRAFTSMITH_KERNEL_ISA");
  return forced && *forced ? named_isa(forced, "DRAFTSMITH_KERNEL_ISA=") : supported_isa();
}

// The instruction set the kernels run with: detect_isa()'s until set_kernel_isa picks another (a bench timing a
// baseline on other kernels in the same run). Every set reads the same packed weights (int8 ones are flipped at load
// where a set takes them unsigned), so a switch between calls changes only which code computes them.
std::atomic<int> chosen_isa{-1};

Isa isa() {
  int chosen = chosen_isa.load(std::memory_order_relaxed);
  if (chosen < 0) {
    chosen = int(detect_isa());
    chosen_isa.store(chosen, std::memory_order_relaxed);
  }
  return Isa(chosen);
}

// On the Xeon (AMX) the chunks made a verify of 10 / 16 rows 8-10% / 4-12% cheaper in every alternation of
// eval.kernel_ab (results/engine_kernels_xeon/kernel_ab/float32_chunked_passes); on the Zen 4 (AVX-512 BF16, no AMX),
// FMA-bound at 14-16 rows, their loop cost 0.5-2 ms a step there and no width gained in both of its stream's modes
// (results/engine_kernels_zen4/README.md, kernel_ab_two_pass_chunks).
bool float32_chunked_passes() { return isa() == Isa::Avx512Amx; }

// With AMX (the Xeon) four: 30 layers' attention of 4 / 8 / 16 rows over 2,000 cached keys 1.2-1.4x faster than one row
// a task, over 256 keys 1.1x, the settings interleaved in one process (results/engine_kernels_xeon/kernel_ab/README.md;
// eight no better than four, two in between). One on the Zen 4, where four rows a task were slower in two of three
// alternations of eval.kernel_ab (results/engine_kernels_zen4/kernel_ab/attention_four_rows), and without requests
// ahead, with the scoring unrolled, slower still (8 rows 2.50-2.55 against 2.15-2.37 ms at one thread; over 2,000 keys
// no better: results/engine_kernels_zen4/README.md).
int avx512_attention_rows() { return isa() == Isa::Avx512Amx ? 4 : 1; }

// Everywhere but the Zen 4 (AVX-512 BF16 without AMX): the requests made the Xeon's attention over 2,000 keys 5-12%
// cheaper; on the Zen 4 one row over 2,000 keys cached on huge pages was 13-22% cheaper without them, in every
// alternation (results/engine_kernels_zen4/kernel_ab/attention_no_requests_context_2000); the AVX2 EPYC level either way.
bool attention_requests_ahead() { return isa() != Isa::Avx512Bf16; }

#define DISPATCH_ISA(...)                                          \
  switch (isa()) {                                                  \
    case Isa::Avx512Amx:  /* AMX: bf16 linear layers in isa_amx, the rest as AVX-512 BF16 */ \
    case Isa::Avx512Bf16: { using namespace isa_avx512_bf16; __VA_ARGS__; break; } \
    case Isa::Avx512: { using namespace isa_avx512; __VA_ARGS__; break; }  \
    case Isa::Avx2: { using namespace isa_avx2; __VA_ARGS__; break; }      \
    default: { using namespace isa_scalar; __VA_ARGS__; break; }           \
  }

template <typename XT, typename WT, typename OT>
void run_linear(const XT* x, int64_t M, int64_t K, const WT* w, int64_t N, const float* scale, const float* bias,
                OT* out) {
  DISPATCH_ISA(linear_kernel<XT, WT, OT>(x, M, K, w, N, scale, bias, out))
}

// A linear layer of bf16 weights and inputs: on AMX tiles where the kernels run them, else the pair dot products.
template <typename OT>
void run_linear_bf16(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, const float* bias,
                     OT* out) {
  if (isa() == Isa::Avx512Amx)
    isa_amx::linear_bf16(x, M, K, w, N, nullptr, bias, out);
  else
    run_linear(x, M, K, w, N, nullptr, bias, out);
}

// Elements of a weight packed in panels of PANEL columns, K in groups of `group` inputs (1; bf16 pairs: 2; int8 x int8
// quads: QUAD), padded with zeros (kernels.py's pack_weight).
int64_t packed_elements(int64_t K, int64_t N, int64_t group) {
  constexpr int64_t panel = isa_scalar::PANEL;  // one panel width for every instruction set (kernels.py packs it)
  return (N + panel - 1) / panel * ((K + group - 1) / group) * panel * group;
}

// (x contiguous, the output: x's shape with N last and x's dtype, the rows M) of a linear layer's call.
std::tuple<at::Tensor, at::Tensor, int64_t> linear_io(const at::Tensor& x, int64_t N) {
  at::Tensor xc = x.contiguous();
  const int64_t K = x.size(-1);
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = N;
  return {xc, at::empty(sizes, x.options()), K ? xc.numel() / K : 0};
}

// An optional scale or bias as contiguous float32 (undefined when absent).
at::Tensor floats_of(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? t->to(at::kFloat).contiguous() : at::Tensor();
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& scale,
                  const c10::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "draftsmith::linear runs on the CPU");
  const int64_t K = x.size(-1), N = out_features;
  const auto wt = packed.scalar_type(), xt = x.scalar_type();
  TORCH_CHECK(xt == at::kFloat || xt == at::kBFloat16, "draftsmith::linear: inputs must be float32 or bfloat16");
  TORCH_CHECK(wt == at::kFloat || wt == at::kBFloat16 || wt == at::kChar, "draftsmith::linear: weights must be "
              "float32, bfloat16 or int8");
  TORCH_CHECK(wt != at::kBFloat16 || xt == at::kBFloat16, "draftsmith::linear: bfloat16 weights need bfloat16 inputs");
  TORCH_CHECK(packed.is_contiguous() && packed.numel() == packed_elements(K, N, wt == at::kBFloat16 ? 2 : 1),
              "draftsmith::linear: the packed weight does not match ", K, " inputs and ", N, " outputs");
  TORCH_CHECK((wt == at::kChar) == scale.has_value(), "draftsmith::linear: int8 weights and only they take scales");
  at::Tensor xc, out;
  int64_t M;
  std::tie(xc, out, M) = linear_io(x, N);  // (not a structured binding: the lambdas below capture xc)
  if (M == 0) return out;
  const at::Tensor scale_f = floats_of(scale), bias_f = floats_of(bias);
  const float* s = scale_f.defined() ? scale_f.data_ptr<float>() : nullptr;
  const float* b = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  auto xb = [&] { return reinterpret_cast<const uint16_t*>(xc.data_ptr()); };
  auto ob = [&] { return reinterpret_cast<uint16_t*>(out.data_ptr()); };
  if (wt == at::kFloat && xt == at::kFloat)
    run_linear(xc.data_ptr<float>(), M, K, packed.data_ptr<float>(), N, s, b, out.data_ptr<float>());
  else if (wt == at::kFloat)
    run_linear(xb(), M, K, packed.data_ptr<float>(), N, s, b, ob());
  else if (wt == at::kChar && xt == at::kFloat)
    run_linear(xc.data_ptr<float>(), M, K, packed.data_ptr<int8_t>(), N, s, b, out.data_ptr<float>());
  else if (wt == at::kChar)
    run_linear(xb(), M, K, packed.data_ptr<int8_t>(), N, s, b, ob());
  else
    run_linear_bf16(xb(), M, K, reinterpret_cast<const uint16_t*>(packed.data_ptr()), N, b, ob());
  return out;
}

// A float32 linear layer from split bfloat16 products on AMX tiles (isa_amx::linear_split); `packed` holds each
// weight as its (hi, lo) bf16 pair, in bf16 panels of 2K inputs.
at::Tensor linear_split(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                        int64_t out_features) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "draftsmith::linear_split runs on the CPU");
  TORCH_CHECK(isa() == Isa::Avx512Amx, "draftsmith::linear_split runs on AMX tiles and the kernels run ",
              ISA_NAMES[int(isa())]);
  TORCH_CHECK(x.scalar_type() == at::kFloat, "draftsmith::linear_split: inputs must be float32");
  const int64_t K = x.size(-1), N = out_features;
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
              packed.numel() == packed_elements(2 * K, N, 2),
              "draftsmith::linear_split: the packed (hi, lo) weight does not match ", K, " inputs and ", N, " outputs");
  at::Tensor xc, out;
  int64_t M;
  std::tie(xc, out, M) = linear_io(x, N);
  if (M == 0) return out;
  const at::Tensor bias_f = floats_of(bias);
  isa_amx::linear_split(xc.data_ptr<float>(), M, K, reinterpret_cast<const uint16_t*>(packed.data_ptr()), N,
                        bias_f.defined() ? bias_f.data_ptr<float>() : nullptr, out.data_ptr<float>());
  return out;
}

at::Tensor linear_i8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                     const c10::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "draftsmith::linear_i8 runs on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "draftsmith::linear_i8: inputs must be float32");
  const int64_t K = x.size(-1), N = out_features;
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous() &&
              packed.numel() == packed_elements(K, N, isa_scalar::QUAD),
              "draftsmith::linear_i8: the packed int8 weight does not match ", K, " inputs and ", N, " outputs");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == N,
              "draftsmith::linear_i8: a float32 scale per output");
  at::Tensor xc, out;
  int64_t M;
  std::tie(xc, out, M) = linear_io(x, N);
  if (M == 0) return out;
  const at::Tensor bias_f = floats_of(bias);
  const float* b = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  DISPATCH_ISA(linear_i8_kernel(xc.data_ptr<float>(), M, K, packed.data_ptr<int8_t>(), N, scale.data_ptr<float>(), b,
                                out.data_ptr<float>()))
  return out;
}

// The greedy head (invariant_impl.h's greedy_head_rows): approximate logits from int8 weights (`scale` their scale per
// row), from bfloat16 weights and inputs (on AMX tiles where the kernels run them), or on AMX tiles from int8 weights
// in pairs (packed 4-D: (panels, K / 2, PANEL, 2)) widened to bf16 times inputs rounded to bf16, or in quads of
// column tiles ((ceil(N / 16), K' / 4, 16, 4)) times float32 inputs split into two int8 halves (isa_amx::greedy_quads);
// then the columns that could be the largest recomputed exactly.
at::Tensor greedy_head(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                       const at::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu() && weight.device().is_cpu(),
              "draftsmith::greedy_head runs on the CPU");
  const auto xt = x.scalar_type(), pt = packed.scalar_type();
  TORCH_CHECK((xt == at::kFloat || xt == at::kBFloat16) && weight.scalar_type() == xt,
              "draftsmith::greedy_head: inputs and weight share one dtype, float32 or bfloat16");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(1) == x.size(-1),
              "draftsmith::greedy_head: the weight must be a contiguous (N, K) matrix over the inputs");
  const int64_t K = x.size(-1), N = weight.size(0);
  // 4-D int8: the tiles' copies, (panels, K / 2, PANEL, 2) in pairs or (ceil(N / 16), K' / 4, 16, 4) in quads
  const int64_t tile_group = pt == at::kChar && packed.dim() == 4 ? packed.size(3) : 0;
  const bool int8_pairs = tile_group == 2, int8_quads = tile_group == 4;
  const int64_t elements = int8_quads ? isa_amx::quad_elements(K, N)
                                      : packed_elements(K, N, pt == at::kBFloat16 || int8_pairs ? 2 : 1);
  TORCH_CHECK((pt == at::kChar || pt == at::kBFloat16) && packed.is_contiguous() &&
              (tile_group == 0 || int8_pairs || int8_quads) && packed.numel() == elements,
              "draftsmith::greedy_head: the packed int8 or bfloat16 weight does not match ", K, " inputs and ", N,
              " outputs");
  TORCH_CHECK(tile_group == 0 || isa() == Isa::Avx512Amx,
              "draftsmith::greedy_head: int8 weights in pairs or quads run on AMX tiles and the kernels here run ",
              ISA_NAMES[int(isa())]);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == N,
              "draftsmith::greedy_head: the int8 scale per output (max |w| / 127)");
  at::Tensor xc = x.contiguous();
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = N;
  at::Tensor out = at::empty(sizes, x.options().dtype(at::kFloat));
  const int64_t M = K ? xc.numel() / K : 0;
  if (M == 0) return out;
  const float* s = scale.data_ptr<float>();
  float* o = out.data_ptr<float>();
  std::vector<float> extra;  // per row, a reach added to sum|x| times the error constant (the quads' inputs)
  if (int8_quads) {
    std::vector<float> steps(static_cast<size_t>(M));
    const at::Tensor inputs = xc.to(at::kFloat);  // (bfloat16 ones exactly)
    isa_amx::greedy_quads(inputs.data_ptr<float>(), M, K, packed.data_ptr<int8_t>(), N, s, o, steps.data());
    extra.resize(static_cast<size_t>(M));  // 64 K s_x (isa_amx's QUAD_SPAN says why), a factor 1 + 2^-16 of room
    for (int64_t m = 0; m < M; ++m) extra[m] = float(64.0 * double(K) * double(steps[m]) * (1.0 + 1.0 / (1 << 16)));
  } else if (pt == at::kBFloat16 || int8_pairs) {
    const at::Tensor rounded = xc.to(at::kBFloat16);
    const uint16_t* xb = reinterpret_cast<const uint16_t*>(rounded.data_ptr());
    if (int8_pairs)
      isa_amx::linear_bf16(xb, M, K, packed.data_ptr<int8_t>(), N, s, nullptr, o);
    else
      run_linear_bf16(xb, M, K, reinterpret_cast<const uint16_t*>(packed.data_ptr()), N, nullptr, o);
  } else if (xt == at::kFloat) {
    run_linear(xc.data_ptr<float>(), M, K, packed.data_ptr<int8_t>(), N, s, nullptr, o);
  } else {
    run_linear(reinterpret_cast<const uint16_t*>(xc.data_ptr()), M, K, packed.data_ptr<int8_t>(), N, s, nullptr, o);
  }
  // |exact - a[j]| <= scale[j] * sum|x| * (1/2 + 127 (K + 2) u), u = 2^-24: int8 weights are within scale / 2 of the
  // exact ones; bfloat16 weights and inputs within 2^-9 of each, so a product within 2^-8 |x w| <= 2^-8 127 scale |x|
  // (< 1/2); the rest is the float32 sums and the scale's product. Int8 weights times bf16 inputs (the tiles' int8
  // pairs): scale / 2 from the weight and 2^-9 |x| 127 scale from the input, both. Taken with room: 130 for 127, a
  // factor 1 + 2^-16, and each sum's rounding counted twice (2u: AMX tiles sum in an order of their own, rounding as
  // they do). The quads sum in integers (exact): scale / 2 from the weight, plus `extra` from the inputs' halves.
  const double rounded_inputs = int8_pairs ? 130.0 / 512.0 : 0.0;
  const double error = (0.5 + rounded_inputs + 260.0 * double(K + 2) / double(1 << 24)) * (1.0 + 1.0 / (1 << 16));
  const float* more = extra.empty() ? nullptr : extra.data();
  if (xt == at::kFloat)
    DISPATCH_ISA(greedy_head_rows(xc.data_ptr<float>(), M, K, weight.data_ptr<float>(), N, s, error, more, o))
  else
    DISPATCH_ISA(greedy_head_rows(reinterpret_cast<const uint16_t*>(xc.data_ptr()), M, K,
                                  reinterpret_cast<const uint16_t*>(weight.data_ptr()), N, s, error, more, o))
  return out;
}

// Each row's torch.argmax over the last axis of float32 x, as int64 (x's shape without its last axis).
at::Tensor argmax(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1 && x.size(-1) > 0,
              "draftsmith::argmax: float32 values with a non-empty last axis");
  const at::Tensor xc = x.contiguous();
  const int64_t N = x.size(-1), M = xc.numel() / N;
  at::Tensor out = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kLong));
  DISPATCH_ISA(argmax_rows(xc.data_ptr<float>(), M, N, out.data_ptr<int64_t>()))
  return out;
}

// Each row's k most likely tokens as log-probabilities, best first, their indices and the log of their total
// probability (invariant_impl.h's top_log_probs_rows): float32 logits (M, N), 1 <= k <= N.
std::tuple<at::Tensor, at::Tensor, at::Tensor> top_log_probs(const at::Tensor& logits, int64_t k) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && k >= 1 && k <= logits.size(1),
              "draftsmith::top_log_probs: float32 logits (rows, vocabulary) and 1 <= k <= vocabulary");
  const at::Tensor xc = logits.contiguous();
  const int64_t M = xc.size(0), N = xc.size(1);
  at::Tensor values = at::empty({M, k}, xc.options());
  at::Tensor indices = at::empty({M, k}, xc.options().dtype(at::kLong));
  at::Tensor share = at::empty({M}, xc.options().dtype(at::kDouble));
  DISPATCH_ISA(top_log_probs_rows(xc.data_ptr<float>(), M, N, int(k), values.data_ptr<float>(),
                                  indices.data_ptr<int64_t>(), share.data_ptr<double>()))
  return {values, indices, share};
}

template <typename T>
void run_attention(const T* q, const int64_t* qs, const T* k, const T* v, const int64_t* kvs, const float* mask,
                   const int64_t* ms, int64_t B, int64_t Hq, int64_t Hkv, int64_t W, int64_t C, int64_t D,
                   float scaling, T* out) {
  DISPATCH_ISA(attention_kernel<T>(q, qs, k, v, kvs, mask, ms, B, Hq, Hkv, W, C, D, scaling, out))
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                     double scaling) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && mask.dim() == 4,
              "draftsmith::attention: q, k, v and mask are 4-D");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type() &&
              (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "draftsmith::attention: q, k and v share one dtype, float32 or bfloat16");
  const int64_t B = q.size(0), Hq = q.size(1), W = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), C = k.size(2);
  TORCH_CHECK(Hq % Hkv == 0 && v.size(2) == C && k.size(3) == D && v.size(3) == D && D <= 128,
              "draftsmith::attention: shapes do not fit (head_dim <= 128, heads a multiple of kv heads)");
  TORCH_CHECK(mask.size(2) == W && mask.size(3) >= C && (mask.size(0) == 1 || mask.size(0) == B),
              "draftsmith::attention: the mask must be (1 or B, 1, W, >= keys)");
  at::Tensor qc = q.stride(3) == 1 ? q : q.contiguous();
  at::Tensor kc = k.stride(3) == 1 ? k : k.contiguous();
  at::Tensor vc = v.stride(3) == 1 ? v : v.contiguous();
  at::Tensor mc = mask.to(at::kFloat);
  if (mc.stride(3) != 1) mc = mc.contiguous();
  at::Tensor out = at::empty({B, W, Hq, D}, q.options());
  const int64_t qs[3] = {qc.stride(0), qc.stride(1), qc.stride(2)};
  const int64_t kvs[8] = {kc.stride(0), kc.stride(1), kc.stride(2), 1, vc.stride(0), vc.stride(1), vc.stride(2), 1};
  const int64_t ms[3] = {mask.size(0) == 1 ? 0 : mc.stride(0), 0, mc.stride(2)};
  if (q.scalar_type() == at::kFloat)
    run_attention(qc.data_ptr<float>(), qs, kc.data_ptr<float>(), vc.data_ptr<float>(), kvs, mc.data_ptr<float>(),
                  ms, B, Hq, Hkv, W, C, D, float(scaling), out.data_ptr<float>());
  else
    run_attention(reinterpret_cast<const uint16_t*>(qc.data_ptr()), qs,
                  reinterpret_cast<const uint16_t*>(kc.data_ptr()), reinterpret_cast<const uint16_t*>(vc.data_ptr()),
                  kvs, mc.data_ptr<float>(), ms, B, Hq, Hkv, W, C, D, float(scaling),
                  reinterpret_cast<uint16_t*>(out.data_ptr()));
  return out;
}

std::string kernel_isa() { return ISA_NAMES[int(isa())]; }

// Run the kernels with `name` (one of available_isas) from the next call on; returns the set they ran with.
std::string set_kernel_isa(const std::string& name) {
  const Isa chosen = named_isa(name, "kernels ");
  const std::string previous = kernel_isa();
  chosen_isa.store(int(chosen), std::memory_order_relaxed);
  return previous;
}
std::vector<std::string> available_isas() {  // every set DRAFTSMITH_KERNEL_ISA may name here, lowest first
  std::vector<std::string> names;
  for (int i = 0; i <= int(supported_isa()); ++i) names.push_back(ISA_NAMES[i]);
  return names;
}

}  // namespace

TORCH_LIBRARY(draftsmith, m) {
  m.def("linear(Tensor x, Tensor packed, Tensor? scale, Tensor? bias, int out_features) -> Tensor");
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor mask, float scaling) -> Tensor");
  m.def("linear_i8(Tensor x, Tensor packed, Tensor scale, Tensor? bias, int out_features) -> Tensor");
  m.def("greedy_head(Tensor x, Tensor packed, Tensor scale, Tensor weight) -> Tensor");
  m.def("linear_split(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("argmax(Tensor x) -> Tensor");
  m.def("top_log_probs(Tensor logits, int k) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(draftsmith, CPU, m) {
  m.impl("linear", &linear);
  m.impl("attention", &attention);
  m.impl("linear_i8", &linear_i8);
  m.impl("greedy_head", &greedy_head);
  m.impl("linear_split", &linear_split);
  m.impl("argmax", &argmax);
  m.impl("top_log_probs", &top_log_probs);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("kernel_isa", &kernel_isa);
  module.def("available_isas", &available_isas);
  module.def("set_kernel_isa", &set_kernel_isa);
}
