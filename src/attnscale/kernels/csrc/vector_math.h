// Vector math of the score path and the softmax: the exp floor, tanh (softcap) and exp in vectors.
#pragma once

#include "products.h"

namespace {

using at::vec::Vectorized;

// attnscale.constants, defined by the build (kernels/__init__.py): one value for both kernels.
#if !defined(ATTNSCALE_EXP_FLOOR_F32) || !defined(ATTNSCALE_EXP_FLOOR_F64)
#error "build the kernel with attnscale.constants.cpp_defines() (python -m attnscale.kernels)"
#endif

// EXP_FLOOR: weights below exp(floor) times the offset's are set to 0: a matmul whose products fall
// below the normal range runs ~100x slower on x86, and such a weight is far below the precision of
// the row's sum (float32: exp(-69) = 1e-30; float64: exp(-690)).
template <typename T>
constexpr T exp_floor() {
  return std::is_same_v<T, float> ? T(ATTNSCALE_EXP_FLOOR_F32) : T(ATTNSCALE_EXP_FLOOR_F64);
}

// OFFSET_LIMIT: a row takes a static offset once no weight against it can exceed e^limit (float32:
// 34.5), so none overflows or, its logits within 2 limit of each other, falls below the floor.
template <typename T>
constexpr T offset_limit() {
  return -exp_floor<T>() / 2;
}

// tanh for float, in two pieces. |x| < 0.625: x (1 + x^2 P(x^2)), P of degree 4 fitted (minimax
// in relative error, in float64) on [0, 0.625]: five FMAs and a product, no division. |x| >= 0.625:
// 1 - 2 / (1 + exp(2|x|)) with ATen's exp_u20, |x| clamped to 10 (tanh rounds to 1 from 9.02 on),
// with x's sign; no cancellation, as tanh >= 0.55 there. A vector computes the second piece only
// when one of its lanes needs it: softcapped logits mostly lie well inside the cap, where this
// costs a fraction of Sleef's vector tanh. Within 1.9 ulp of tanh over float32
// (tests/test_fused.py); NaN stays NaN.
__attribute__((always_inline)) inline bool any_lane(const Vectorized<float>& mask) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i bits = _mm512_castps_si512(mask);  // a set lane is all ones
  return _mm512_test_epi32_mask(bits, bits) != 0;
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_movemask_ps(mask) != 0;
#else
  float lanes[Vectorized<float>::size()];
  mask.store(lanes);
  for (float lane : lanes)
    if (lane != 0.0f) return true;  // a set mask lane is all ones: a NaN, != 0
  return false;
#endif
}
// Always inlined: as a call, the argument and result pass through memory and the constants are
// reloaded for every vector (perf showed the call, not the arithmetic, dominating the softcap path).
__attribute__((always_inline)) inline Vectorized<float> vtanh(const Vectorized<float>& x) {
  using V = Vectorized<float>;
  const V y = x * x;
  V p = at::vec::fmadd(V(-5.705085100e-03f), y, V(2.063917333e-02f));
  p = at::vec::fmadd(p, y, V(-5.373974085e-02f));
  p = at::vec::fmadd(p, y, V(1.333144250e-01f));
  p = at::vec::fmadd(p, y, V(-3.333328195e-01f));
  const V near = x * at::vec::fmadd(y, p, V(1.0f));  // x (1 + x^2 P): keeps the sign of -0
  const V a = x.abs();
#if defined(CPU_CAPABILITY_AVX512)
  // The comparison on a mask register, without ATen's widening of it to a vector.
  const __mmask16 far = _mm512_cmp_ps_mask(a, _mm512_set1_ps(0.625f), _CMP_GE_OQ);  // false for NaN: the polynomial keeps it
  if (far == 0) return near;
#else
  const V far = a >= V(0.625f);  // false for NaN: the polynomial keeps it
  if (!any_lane(far)) return near;
#endif
  const V e = (at::vec::minimum(a, V(10.0f)) * V(2.0f)).exp_u20();
  const V t = V(1.0f) - V(2.0f) / (e + V(1.0f));
  const V signed_t = V::blendv(t, V(0.0f) - t, x < V(0.0f));
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_mask_blend_ps(far, near, signed_t);
#else
  return V::blendv(near, signed_t, far);
#endif
}
// The same function on one float (the tails of rows), lane 0 of the vector one: bit-identical.
inline float stanh(float x) {
  float out[Vectorized<float>::size()];
  vtanh(Vectorized<float>(x)).store(out);
  return out[0];
}
// For double (the oracle tests) the 1-ulp tanh.
inline Vectorized<double> vtanh(const Vectorized<double>& x) { return x.tanh(); }
inline double stanh(double x) { return std::tanh(x); }

// exp on a vector: for float ATen's exp_u20 (a degree-5 polynomial after range reduction, what
// torch's own CPU flash kernel uses: its error is measured against the plain formula in the tests);
// for double Sleef's 1-ulp exp, as the float64 oracle tests need.
inline Vectorized<float> vexp(const Vectorized<float>& x) { return x.exp_u20(); }
inline Vectorized<double> vexp(const Vectorized<double>& x) { return x.exp(); }

// exp(x) for x known to lie in [floor, 34.5] (float32): vexp_weights' steps without the floor's
// test (static rows, where no logit can fall under it: forward_block), and their core.
template <typename T>
inline Vectorized<T> vexp_unfloored(const Vectorized<T>& x) {
  return vexp(x);
}

// The softmax's weights: exp(x) for x = s - m, 0 where x < floor (-inf included), NaN for NaN; x <= 0
// with a running max, x <= 34.5 (float32) in rows on a static offset (forward_block). For float on
// AVX2 this is exp_u20 specialised to that range, with the same bits on [floor, 34.5]: exp_u20 clamps x
// to [ln FLT_MIN, ln FLT_MAX], zeroes below ln FLT_MIN and forms 2^(n-1) * 2 (for n = 128 near
// ln FLT_MAX); here the only bound x can cross is the floor, so one max (NaN passes: max_ps returns
// its second operand then) and one blend replace the clamp, exp_u20's own zeroing and ours, and
// n <= 50 lets 2^n be formed directly. Scaling by a power of two is exact on this range (exp(floor)
// = 1e-30 is a normal float), so the product is exp_u20's, bit for bit.
template <typename T>
inline Vectorized<T> vexp_weights(const Vectorized<T>& x, const Vectorized<T>& floor) {
  return Vectorized<T>::blendv(vexp(x), Vectorized<T>(T(0)), x < floor);
}
#if defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512)
template <>
inline Vectorized<float> vexp_unfloored(const Vectorized<float>& x) {
  const __m256 src = x;
  const __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(src, _mm256_castsi256_ps(_mm256_set1_epi32(0x3fb8aa3b)), _mm256_set1_ps(0.5f)));
  const __m256 r = _mm256_fnmadd_ps(fx, _mm256_castsi256_ps(_mm256_set1_epi32(0x3f317218)), src);
  __m256 poly = _mm256_fmadd_ps(r, _mm256_set1_ps(0.00828929059f), _mm256_set1_ps(0.0418978221f));
  poly = _mm256_fmadd_ps(r, poly, _mm256_set1_ps(0.166676521f));
  poly = _mm256_fmadd_ps(r, poly, _mm256_set1_ps(0.499991506f));
  poly = _mm256_fmadd_ps(r, poly, _mm256_set1_ps(0.999999701f));
  poly = _mm256_fmadd_ps(r, poly, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(poly, _mm256_castsi256_ps(bits));
}
template <>
inline Vectorized<float> vexp_weights(const Vectorized<float>& x, const Vectorized<float>& floor) {
  const __m256 drop = _mm256_cmp_ps(x, floor, _CMP_LT_OQ);                        // false for NaN
  const __m256 value = vexp_unfloored(Vectorized<float>(_mm256_max_ps(floor, x)));  // x for NaN
  return _mm256_blendv_ps(value, _mm256_setzero_ps(), drop);
}
#elif defined(CPU_CAPABILITY_AVX512)
// The same steps on 16 lanes (exp_u20's AVX-512 polynomial is the AVX2 one).
template <>
inline Vectorized<float> vexp_unfloored(const Vectorized<float>& x) {
  const __m512 src = x;
  const __m512 fx = _mm512_roundscale_ps(_mm512_fmadd_ps(src, _mm512_castsi512_ps(_mm512_set1_epi32(0x3fb8aa3b)), _mm512_set1_ps(0.5f)),
                                         _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(fx, _mm512_castsi512_ps(_mm512_set1_epi32(0x3f317218)), src);
  __m512 poly = _mm512_fmadd_ps(r, _mm512_set1_ps(0.00828929059f), _mm512_set1_ps(0.0418978221f));
  poly = _mm512_fmadd_ps(r, poly, _mm512_set1_ps(0.166676521f));
  poly = _mm512_fmadd_ps(r, poly, _mm512_set1_ps(0.499991506f));
  poly = _mm512_fmadd_ps(r, poly, _mm512_set1_ps(0.999999701f));
  poly = _mm512_fmadd_ps(r, poly, _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(poly, _mm512_castsi512_ps(bits));
}
template <>
inline Vectorized<float> vexp_weights(const Vectorized<float>& x, const Vectorized<float>& floor) {
  const __mmask16 drop = _mm512_cmp_ps_mask(x, floor, _CMP_LT_OQ);                  // false for NaN
  const __m512 value = vexp_unfloored(Vectorized<float>(_mm512_max_ps(floor, x)));  // x for NaN
  return _mm512_mask_blend_ps(drop, value, _mm512_setzero_ps());
}
#endif

// Weights that stay in T (float32 or float64 outputs) in a row's last, partial vector: the 1-ulp
// exp (Sleef's), 0 under the floor, NaN for NaN. Short rows (packed sequences, decoding) are
// mostly such a vector, and keep its accuracy where exp_u20's error reaches 2 ulp; 16-bit
// weights, rounded after, take vexp_weights there too.
template <typename T>
inline Vectorized<T> vexp_accurate(const Vectorized<T>& x, const Vectorized<T>& floor) {
  return Vectorized<T>::blendv(x.exp(), Vectorized<T>(T(0)), x < floor);
}

// The lanes [0, count) of a vector: a row's last, partial one (its lanes past the row read as 0,
// are set to 0 by a select, whatever they gave, and are not written).
template <typename T>
inline Vectorized<T> first_lanes(int64_t count) {
  return Vectorized<T>::arange(T(0), T(1)) < Vectorized<T>(static_cast<T>(count));
}

}  // namespace
