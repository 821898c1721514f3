// Int8 codes to float32 rows (Problem::int8): a key tile's keys and values as the forward's float
// products take them.
#pragma once

#include "packing.h"

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace {

// n rows of d int8 codes (row stride d) as float32 rows of out (row stride d): code * scale (+
// mean[c]), scale the row's own for its group of `group` channels (d / group scales a row, rows
// of stride d / group); mean null: none. Each product and sum rounded once, in this order, as
// attnscale.QuantizedKV.dequantize computes them (the build keeps FMAs out: -ffp-contract=off),
// so every vector width gives the same floats. Whole groups of a vector's lanes in vectors, the
// rest lane by lane.
inline void dequantize_rows(const int8_t* codes, const float* scales, const float* mean, int64_t n, int64_t d, int64_t group,
                            float* out) {
  const int64_t groups = d / group;
  for (int64_t j = 0; j < n; ++j) {
    const int8_t* cr = codes + j * d;
    const float* sr = scales + j * groups;
    float* o = out + j * d;
    int64_t c = 0;
#if defined(CPU_CAPABILITY_AVX512)
    if (group % 16 == 0) {
      for (int64_t g = 0; g < groups; ++g) {
        const __m512 s = _mm512_set1_ps(sr[g]);
        for (const int64_t end = c + group; c < end; c += 16) {
          const __m512 x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(cr + c))));
          _mm512_storeu_ps(o + c, mean ? _mm512_add_ps(_mm512_mul_ps(x, s), _mm512_loadu_ps(mean + c)) : _mm512_mul_ps(x, s));
        }
      }
    }
#elif defined(CPU_CAPABILITY_AVX2)
    if (group % 8 == 0) {
      for (int64_t g = 0; g < groups; ++g) {
        const __m256 s = _mm256_set1_ps(sr[g]);
        for (const int64_t end = c + group; c < end; c += 8) {
          const __m256 x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(cr + c))));
          _mm256_storeu_ps(o + c, mean ? _mm256_add_ps(_mm256_mul_ps(x, s), _mm256_loadu_ps(mean + c)) : _mm256_mul_ps(x, s));
        }
      }
    }
#endif
    for (; c < d; ++c) {
      const float scaled = static_cast<float>(cr[c]) * sr[c / group];
      o[c] = mean ? scaled + mean[c] : scaled;
    }
  }
}

// Decoding's products straight from the codes (Problem::int8_direct: a block of at most
// kDirectRows rows, D, Dv and the group whole vectors): each key's codes are dequantized in
// registers, to the floats dequantize_rows gives, and multiplied there, so a tile's keys and
// values never pass through scratch (at a few query rows a key, writing and reading back the
// float32 tile cost more than the products). Rows four at a time, each key's codes read once per
// four rows; keys kKeys at a time (q's vectors loaded once for them).
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
namespace int8v {
#if defined(CPU_CAPABILITY_AVX512)
using F = __m512;
constexpr int64_t kLanes = 16, kKeys = 4, kChunks = 4;  // 16 accumulators of 32 registers
inline F codes_at(const int8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))); }
inline F load(const float* p) { return _mm512_loadu_ps(p); }
inline F splat(float x) { return _mm512_set1_ps(x); }
inline F mul(F a, F b) { return _mm512_mul_ps(a, b); }
inline F add(F a, F b) { return _mm512_add_ps(a, b); }
inline F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
inline F zero() { return _mm512_setzero_ps(); }
inline void store(float* p, F a) { _mm512_storeu_ps(p, a); }
inline float sum(F a) { return _mm512_reduce_add_ps(a); }
// The sums of 16 vectors at once, v[i]'s in lane i: pairs of lanes added in a tree of shuffles,
// 45 instructions where 16 reductions of one vector take 128.
inline F sums16(const F* v) {
  F a[8], b[4];
  for (int i = 0; i < 8; ++i) a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: its share of v[4i .. 4i + 3]'s sums
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const F d01 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x44), _mm512_shuffle_f32x4(b[0], b[1], 0xEE));
  const F d23 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x44), _mm512_shuffle_f32x4(b[2], b[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d01, d23, 0x88), _mm512_shuffle_f32x4(d01, d23, 0xDD));
}
#else
using F = __m256;
constexpr int64_t kLanes = 8, kKeys = 2, kChunks = 2;  // 8 accumulators of 16 registers
inline F codes_at(const int8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))); }
inline F load(const float* p) { return _mm256_loadu_ps(p); }
inline F splat(float x) { return _mm256_set1_ps(x); }
inline F mul(F a, F b) { return _mm256_mul_ps(a, b); }
inline F add(F a, F b) { return _mm256_add_ps(a, b); }
inline F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
inline F zero() { return _mm256_setzero_ps(); }
inline void store(float* p, F a) { _mm256_storeu_ps(p, a); }
inline float sum(F a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

// x[r][j] = alpha q_r . k_j for NR rows of q (row stride q_ld) and NK keys from key j.
template <int NR, int NK>
inline void scores_at(const float* q, int64_t q_ld, const int8_t* codes, const float* scales, const float* mean, int64_t j, int64_t D,
                      int64_t group, float alpha, float* x, int64_t x_ld) {
  const int64_t groups = D / group;
  F acc[NK][NR];
  for (int k = 0; k < NK; ++k)
    for (int r = 0; r < NR; ++r) acc[k][r] = zero();
  for (int64_t g = 0, c = 0; g < groups; ++g) {
    F s[NK];
    for (int k = 0; k < NK; ++k) s[k] = splat(scales[(j + k) * groups + g]);
    for (const int64_t end = c + group; c < end; c += kLanes) {
      const F m = load(mean + c);
      F qv[NR];
      for (int r = 0; r < NR; ++r) qv[r] = load(q + r * q_ld + c);
      for (int k = 0; k < NK; ++k) {
        const F key = add(mul(codes_at(codes + (j + k) * D + c), s[k]), m);  // as dequantize_rows
        for (int r = 0; r < NR; ++r) acc[k][r] = fmadd(key, qv[r], acc[k][r]);
      }
    }
  }
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (NK == 4 && NR == 4) {
    float s16[16];
    _mm512_storeu_ps(s16, sums16(&acc[0][0]));  // lane 4k + r: key k, row r
    for (int k = 0; k < NK; ++k)
      for (int r = 0; r < NR; ++r) x[r * x_ld + j + k] = alpha * s16[4 * k + r];
    return;
  }
#endif
  for (int k = 0; k < NK; ++k)
    for (int r = 0; r < NR; ++r) x[r * x_ld + j + k] = alpha * sum(acc[k][r]);
}

template <int NR>
inline void scores_rows(const float* q, int64_t q_ld, const Int8KV& Q, const int8_t* codes, const float* scales, const float* mean,
                        int64_t width, int64_t D, float alpha, float* x) {
  int64_t j = 0;
  for (; j + kKeys <= width; j += kKeys) scores_at<NR, kKeys>(q, q_ld, codes, scales, mean, j, D, Q.group, alpha, x, width);
  for (; j < width; ++j) scores_at<NR, 1>(q, q_ld, codes, scales, mean, j, D, Q.group, alpha, x, width);
}

// acc[r][c0 + .] += sum_j p[r][j] v_j[c0 + .] over NC vectors of columns from c0, NR rows.
template <int NR, int NC>
inline void values_at(const float* p, int64_t p_ld, const int8_t* codes, const float* scales, int64_t width, int64_t Dv, int64_t c0,
                      float* acc, int64_t acc_ld) {
  F a[NR][NC];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) a[r][c] = load(acc + r * acc_ld + c0 + c * kLanes);
  for (int64_t j = 0; j < width; ++j) {
    const F s = splat(scales[j]);
    F v[NC];
    for (int c = 0; c < NC; ++c) v[c] = mul(codes_at(codes + j * Dv + c0 + c * kLanes), s);  // as dequantize_rows
    for (int r = 0; r < NR; ++r) {
      const F w = splat(p[r * p_ld + j]);
      for (int c = 0; c < NC; ++c) a[r][c] = fmadd(w, v[c], a[r][c]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) store(acc + r * acc_ld + c0 + c * kLanes, a[r][c]);
}

template <int NR>
inline void values_rows(const float* p, int64_t p_ld, const int8_t* codes, const float* scales, int64_t width, int64_t Dv, float* acc,
                        int64_t acc_ld) {
  int64_t c0 = 0;
  for (; c0 + kChunks * kLanes <= Dv; c0 += kChunks * kLanes) values_at<NR, kChunks>(p, p_ld, codes, scales, width, Dv, c0, acc, acc_ld);
  for (; c0 < Dv; c0 += kLanes) values_at<NR, 1>(p, p_ld, codes, scales, width, Dv, c0, acc, acc_ld);
}

// Decoding's q.k products in integers, for a 16-bit query (Int8KV::q_int16: its output is
// rounded to 16 bits anyway). Each row of q is rounded to int16 codes at a step of its own,
// max |q_r| / 32767, where bfloat16's own spacing at that largest entry is at least 1/256 of it; each
// key's codes are widened to int16 and each group's sum of code products is exact in int32 (|sum|
// <= 32767 * 127 * group < 2^31 for group <= 512): vpdpwssd where the CPU has AVX512-VNNI, else
// vpmaddwd and an add, the same integers. Then, in float32 and in this order on every ISA, x =
// (sum over groups of scale_g * I_g) * (alpha step_r) + (alpha step_r) (codes_r . mean): the
// attention of q's rounded rows over the dequantized keys (VNNI's build and the others': the same
// integers, the same bits).
#if defined(CPU_CAPABILITY_AVX512)
using I = __m512i;
constexpr int64_t kPairs = 32;  // int16 lanes a vector
inline I widen_codes(const int8_t* p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline I load_codes(const int16_t* p) { return _mm512_loadu_si512(p); }
inline I izero() { return _mm512_setzero_si512(); }
inline I dot(I acc, I a, I b) {
#if defined(ATTNSCALE_AVX512_VNNI)
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}
inline int32_t isum(I a) { return _mm512_reduce_add_epi32(a); }
// sums16's tree on int32 lanes: v[i]'s sum in lane i, exact.
inline I isums16(const I* v) {
  I a[8], b[4];
  for (int i = 0; i < 8; ++i) a[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) b[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_epi64(a[2 * i], a[2 * i + 1]));
  const I d01 = _mm512_add_epi32(_mm512_shuffle_i32x4(b[0], b[1], 0x44), _mm512_shuffle_i32x4(b[0], b[1], 0xEE));
  const I d23 = _mm512_add_epi32(_mm512_shuffle_i32x4(b[2], b[3], 0x44), _mm512_shuffle_i32x4(b[2], b[3], 0xEE));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(d01, d23, 0x88), _mm512_shuffle_i32x4(d01, d23, 0xDD));
}
// iscores_at takes kTreeKeys keys at a time, and reduces them by four rows at once (lane 4k + r:
// key k, row r): the sums of acc[k][r], group g's scale of each key, each row's value of p, and
// the lanes stored.
constexpr int kTreeKeys = 4;
inline I tree_sums(const I* acc) { return isums16(acc); }
inline F tree_scales(const float* scales, int64_t j, int64_t groups, int64_t g) {
  const __m128 s4 = _mm_setr_ps(scales[j * groups + g], scales[(j + 1) * groups + g], scales[(j + 2) * groups + g], scales[(j + 3) * groups + g]);
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3), _mm512_castps128_ps512(s4));
}
inline F tree_rows(const float* p) { return _mm512_broadcast_f32x4(_mm_loadu_ps(p)); }
inline F tree_float(I v) { return _mm512_cvtepi32_ps(v); }
inline void tree_store(F v, float* x, int64_t x_ld, int64_t j) {
  const F by_row = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), v);  // lane 4r + k
  _mm_storeu_ps(x + j, _mm512_extractf32x4_ps(by_row, 0));
  _mm_storeu_ps(x + x_ld + j, _mm512_extractf32x4_ps(by_row, 1));
  _mm_storeu_ps(x + 2 * x_ld + j, _mm512_extractf32x4_ps(by_row, 2));
  _mm_storeu_ps(x + 3 * x_ld + j, _mm512_extractf32x4_ps(by_row, 3));
}
#else
using I = __m256i;
constexpr int64_t kPairs = 16;
inline I widen_codes(const int8_t* p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline I load_codes(const int16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline I izero() { return _mm256_setzero_si256(); }
inline I dot(I acc, I a, I b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
inline int32_t isum(I a) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}
constexpr int kTreeKeys = 2;
// The sums of 8 vectors, acc[i]'s in lane i: pairs added within each 128-bit half, then the halves.
inline I tree_sums(const I* v) {
  const I h01 = _mm256_hadd_epi32(v[0], v[1]), h23 = _mm256_hadd_epi32(v[2], v[3]);
  const I h45 = _mm256_hadd_epi32(v[4], v[5]), h67 = _mm256_hadd_epi32(v[6], v[7]);
  const I lo = _mm256_hadd_epi32(h01, h23), hi = _mm256_hadd_epi32(h45, h67);  // each half: a quarter of v[0..3]'s, v[4..7]'s sums
  return _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20), _mm256_permute2x128_si256(lo, hi, 0x31));
}
inline F tree_scales(const float* scales, int64_t j, int64_t groups, int64_t g) {
  return _mm256_set_m128(_mm_set1_ps(scales[(j + 1) * groups + g]), _mm_set1_ps(scales[j * groups + g]));
}
inline F tree_rows(const float* p) { return _mm256_broadcast_ps(reinterpret_cast<const __m128*>(p)); }
inline F tree_float(I v) { return _mm256_cvtepi32_ps(v); }
inline void tree_store(F v, float* x, int64_t x_ld, int64_t j) {
  alignas(32) float t[8];
  _mm256_store_ps(t, v);
  for (int r = 0; r < 4; ++r) x[r * x_ld + j] = t[r], x[r * x_ld + j + 1] = t[4 + r];
}
#endif

// x[r][j + k] for NR rows and NK keys from key j: qc the rows' int16 codes (row stride D), qs
// their alpha step_r, qm their mean's share (quantize_rows).
template <int NR, int NK>
inline void iscores_at(const int16_t* qc, const float* qs, const float* qm, const int8_t* codes, const float* scales, int64_t j, int64_t D,
                       int64_t group, float* x, int64_t x_ld) {
  const int64_t groups = D / group;
  float part[NK][NR] = {};
  constexpr bool tree = NK == kTreeKeys && NR == 4;  // lane 4k + r: key k, row r
  F total = zero();
  for (int64_t g = 0, c = 0; g < groups; ++g) {
    I acc[NK][NR];
    for (int k = 0; k < NK; ++k)
      for (int r = 0; r < NR; ++r) acc[k][r] = izero();
    for (const int64_t end = c + group; c < end; c += kPairs) {
      I qv[NR];
      for (int r = 0; r < NR; ++r) qv[r] = load_codes(qc + r * D + c);
      for (int k = 0; k < NK; ++k) {
        const I key = widen_codes(codes + (j + k) * D + c);
        for (int r = 0; r < NR; ++r) acc[k][r] = dot(acc[k][r], key, qv[r]);
      }
    }
    if constexpr (tree) {
      total = add(total, mul(tree_float(tree_sums(&acc[0][0])), tree_scales(scales, j, groups, g)));
    } else {
      for (int k = 0; k < NK; ++k)
        for (int r = 0; r < NR; ++r) part[k][r] += static_cast<float>(isum(acc[k][r])) * scales[(j + k) * groups + g];
    }
  }
  if constexpr (tree) {
    tree_store(add(mul(total, tree_rows(qs)), tree_rows(qm)), x, x_ld, j);
    return;
  }
  for (int k = 0; k < NK; ++k)
    for (int r = 0; r < NR; ++r) x[r * x_ld + j + k] = part[k][r] * qs[r] + qm[r];
}

// Row r of q (row stride q_ld) as int16 codes qc (row stride D), with qs[r] = alpha step_r and
// qm[r] = qs[r] (codes_r . mean): every product takes q's rounded row, the mean's share too. False
// where a row holds a NaN or an infinity (the float32 products then take the block, so that it
// spreads as it does there).
inline bool quantize_rows(const float* q, int64_t q_ld, int64_t rows, int64_t D, const float* mean, float alpha, int16_t* qc, float* qs, float* qm) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = q + r * q_ld;
    float top = 0.0f;
    bool finite = true;
    for (int64_t c = 0; c < D; ++c) {
      finite = finite && std::isfinite(row[c]);
      top = std::max(top, std::abs(row[c]));
    }
    if (!finite) return false;
    const float inv = top > 0.0f ? 32767.0f / top : 0.0f;
    float dot = 0.0f;
    for (int64_t c = 0; c < D; ++c) {
      qc[r * D + c] = static_cast<int16_t>(std::nearbyint(std::min(32767.0f, std::max(-32767.0f, row[c] * inv))));
      dot += static_cast<float>(qc[r * D + c]) * mean[c];
    }
    qs[r] = alpha * (top / 32767.0f), qm[r] = qs[r] * dot;
  }
  return true;
}

// Calls f.template operator()<NR>(r0) for row groups of four (the last NR = rows - r0 < 4).
template <typename F4>
inline void by_four_rows(int64_t rows, F4&& f) {
  int64_t r0 = 0;
  for (; r0 + 4 <= rows; r0 += 4) f(std::integral_constant<int, 4>{}, r0);
  switch (rows - r0) {
    case 3: f(std::integral_constant<int, 3>{}, r0); break;
    case 2: f(std::integral_constant<int, 2>{}, r0); break;
    case 1: f(std::integral_constant<int, 1>{}, r0); break;
    default: break;
  }
}
}  // namespace int8v

constexpr bool kInt8Direct = true;
constexpr int64_t kInt8DirectRows = 16;  // a block's rows up to which the codes are multiplied in registers
constexpr int64_t kInt8Lanes = int8v::kLanes;

// A block's rows of q as int16 codes for int8_scores' integer products (int8v::quantize_rows),
// where Q.q_int16 and the groups take whole int16 vectors: false where they do not, or a row is
// not finite (the float32 products then take the block).
inline bool int8_quantize_q(const Int8KV& Q, int64_t head, const float* q, int64_t q_ld, int64_t rows, float alpha, int16_t* qc, float* qs,
                            float* qm) {
  return Q.q_int16 && Q.group % int8v::kPairs == 0 && Q.group <= 512 && rows <= kInt8DirectRows &&
         int8v::quantize_rows(q, q_ld, rows, Q.D, Q.mean(head), alpha, qc, qs, qm);
}

// x (rows, width) = alpha q k^T over key tile [j0, j0 + width) of key head `head`: in integers
// from the block's codes qc, qs, qm (int8_quantize_q; int8v::iscores_at) where qc is not null,
// else in float32.
inline void int8_scores(const Int8KV& Q, int64_t head, const float* q, int64_t q_ld, const int16_t* qc, const float* qs, const float* qm,
                        int64_t rows, int64_t j0, int64_t width, float alpha, float* x) {
  const int64_t D = Q.D;
  const int8_t* codes = Q.keys(head, j0);
  const float* scales = Q.key_scales(head, j0);
  if (qc) {
    int8v::by_four_rows(rows, [&](auto nr, int64_t r0) {
      constexpr int NR = decltype(nr)::value;
      int64_t j = 0;
      for (; j + int8v::kTreeKeys <= width; j += int8v::kTreeKeys)
        int8v::iscores_at<NR, int8v::kTreeKeys>(qc + r0 * D, qs + r0, qm + r0, codes, scales, j, D, Q.group, x + r0 * width, width);
      for (; j < width; ++j) int8v::iscores_at<NR, 1>(qc + r0 * D, qs + r0, qm + r0, codes, scales, j, D, Q.group, x + r0 * width, width);
    });
    return;
  }
  const float* mean = Q.mean(head);
  int8v::by_four_rows(rows, [&](auto nr, int64_t r0) {
    int8v::scores_rows<decltype(nr)::value>(q + r0 * q_ld, q_ld, Q, codes, scales, mean, width, D, alpha, x + r0 * width);
  });
}

// acc (rows, Dv) += p (rows, width) v over the same tile.
inline void int8_values(const Int8KV& Q, int64_t head, const float* p, int64_t rows, int64_t j0, int64_t width, float* acc) {
  const int64_t Dv = Q.Dv;
  const int8_t* codes = Q.values(head, j0);
  const float* scales = Q.value_scales(head, j0);
  int8v::by_four_rows(rows, [&](auto nr, int64_t r0) {
    int8v::values_rows<decltype(nr)::value>(p + r0 * width, width, codes, scales, width, Dv, acc + r0 * Dv, Dv);
  });
}
#else
constexpr bool kInt8Direct = false;
constexpr int64_t kInt8DirectRows = 0;
constexpr int64_t kInt8Lanes = 1;
inline bool int8_quantize_q(const Int8KV&, int64_t, const float*, int64_t, int64_t, float, int16_t*, float*, float*) { return false; }
inline void int8_scores(const Int8KV&, int64_t, const float*, int64_t, const int16_t*, const float*, const float*, int64_t, int64_t, int64_t, float,
                        float*) {}
inline void int8_values(const Int8KV&, int64_t, const float*, int64_t, int64_t, int64_t, float*) {}
#endif


// Prefill with bfloat16 queries where brgemm runs: brgemm's packs of the keys and values
// (Problem::kpack, vpack, packing.h's layouts) made from the codes, each key head's rows
// dequantized (dequantize_rows' floats) and rounded to bfloat16 (to nearest even), then packed as
// pack_problem packs bfloat16 inputs; the bfloat16 kernel then runs on them, its products those of
// bfloat16 inputs. kmax (or null): each key head's key_norm from the packs, as pack_problem makes
// it (B, Hkv), where rows may take a static offset. Returns the call's own memory (null where the
// thread's serves).
inline PackPtr pack_int8(Problem<float>& P, const Int8KV& Q, float* kmax) {
  const int64_t D = P.D, Dv = P.Dv, S = P.S, s_pad = (S + 1) & ~int64_t(1), heads = P.B * P.Hkv;
  PackPtr own;
  uint16_t* const memory = pack_memory(heads * s_pad * (D + Dv), own);
  uint16_t* const kpack = memory;
  uint16_t* const vpack = memory + heads * D * s_pad;
  at::parallel_for(0, heads, 1, [&](int64_t begin, int64_t end) {
    constexpr int64_t rows = 64;  // keys dequantized and rounded at a time
    std::vector<float> wide(rows * std::max(D, Dv));
    std::vector<uint16_t> narrow(S * std::max(D, Dv));
    for (int64_t head = begin; head < end; ++head) {
      for (const bool keys : {true, false}) {
        const int64_t d = keys ? D : Dv;
        for (int64_t j0 = 0; j0 < S; j0 += rows) {
          const int64_t n = std::min(rows, S - j0);
          if (keys)
            dequantize_rows(Q.keys(head, j0), Q.key_scales(head, j0), Q.mean(head), n, D, Q.group, wide.data());
          else
            dequantize_rows(Q.values(head, j0), Q.value_scales(head, j0), nullptr, n, Dv, Dv, wide.data());
          round_row(wide.data(), n * d, reinterpret_cast<at::BFloat16*>(narrow.data() + j0 * d));
        }
        if (keys) {
          pack_transposed(narrow.data(), D, S, D, s_pad, kpack + head * D * s_pad);
        } else if (kmax) {  // the values' peak from the packing's reads, the keys' norms from the packed k^T
          const uint16_t peak = pack_paired<true>(narrow.data(), Dv, S, Dv, s_pad, vpack + head * s_pad * Dv);
          const float vmax = peak > 0x7f80 ? std::numeric_limits<float>::quiet_NaN() : static_cast<float>(c10::BFloat16(peak, c10::BFloat16::from_bits()));
          kmax[head] = offset_norm(P, packed_key_norm2(kpack + head * D * s_pad, S, D, s_pad), vmax);
        } else {
          pack_paired(narrow.data(), Dv, S, Dv, s_pad, vpack + head * s_pad * Dv);
        }
      }
    }
  });
  P.kpack = kpack, P.vpack = vpack, P.s_pad = s_pad;
  return own;
}

}  // namespace
