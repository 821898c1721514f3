// attnscale's fused CPU attention kernel: the score path of attnscale/score.py, fused per tile.
//
// Per (batch, query head, query block) the forward pass runs FlashAttention-2's online softmax
// over key tiles: one BLAS product q k^T per tile, then one pass over the tile that applies the
// score path (scale folded into the product; softcap; ALiBi; float mask; causal / window /
// bool-mask visibility), the running max, exp, the row sum and the statistics, then one BLAS
// product p v. Tiles that causality or the window hide are never computed, and each query block
// only visits the key range its rows can see. Where every logit is bounded in advance (no ALiBi
// or float mask), a row whose running max comes close enough to its bound keeps that max from
// then on, and its later tiles skip the max pass and the rescaling (forward_block). The
// backward pass recomputes each tile exactly as the forward did (same tiles, same products, same
// order of operations) and normalises with the forward's own (m, l), so the weights it
// differentiates are the forward's.
//
// Shapes (attnscale's legend): q (B, H, L, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv), last dims
// contiguous; masks (B, H, L, S) and slopes (B, H) as strided views (stride 0 broadcasts).
// Arithmetic is in the inputs' dtype, float32 or float64; bfloat16 and float16 q, k, v (Half16) are
// computed in float32: where the CPU multiplies 16-bit tiles natively (the caller's half_products
// flag, ops.half_products) the products take them as they are with float32 accumulation, and the
// backward's five products take them the same way (with dout, the weights and dS in their format);
// elsewhere the forward converts each tile to float32 in scratch of its own (Problem::widen), and
// the caller passes the backward float32 copies.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <string>
#include <tuple>
#include <vector>

#include <sys/mman.h>

extern "C" {
// MKL's per-thread thread count, its Fortran-style entry (the argument by reference), in libtorch_cpu
// on x86; weak, so that a torch without MKL still loads the kernel (the call is then skipped).
__attribute__((weak)) int mkl_set_num_threads_local(const int* n);
void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c, const int* ldc);
void dgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const double* alpha,
            const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
            const int* ldc);
// oneMKL's products of bfloat16 / float16 matrices with float32 accumulation (CBLAS, column-major
// here): AMX tiles where the CPU has them. Weak: a torch without MKL loads the kernel, and half
// inputs are then converted to float32 by the caller (half_gemm() says which).
__attribute__((weak)) void cblas_gemm_bf16bf16f32(int layout, int transa, int transb, int m, int n, int k, float alpha,
                                                  const uint16_t* a, int lda, const uint16_t* b, int ldb, float beta,
                                                  float* c, int ldc);
__attribute__((weak)) void cblas_gemm_f16f16f32(int layout, int transa, int transb, int m, int n, int k, float alpha,
                                                const uint16_t* a, int lda, const uint16_t* b, int ldb, float beta,
                                                float* c, int ldc);
}

namespace {

using at::vec::Vectorized;

// Everything the kernel takes besides its tensors, by name: the one list of attnscale.kernels.ops.
// KernelOptions (same names, same order; tests/test_compile.py holds the two equal). X-macro: each
// line makes a field and its keyword in the binding, so one new option is one line here, one field
// there, and the code that reads it.
#define ATTNSCALE_KERNEL_OPTIONS(X)                                                                          \
  X(double, scale)          /* the logits' multiplier */                                                     \
  X(double, softcap)        /* cap * tanh(s / cap); 0: none */                                               \
  X(bool, causal)           /* bottom-right aligned: query row i sees keys up to i + q_offset */             \
  X(int64_t, q_offset)      /* query row i sits at key position i + q_offset */                             \
  X(int64_t, left)          /* window sides; -1: unbounded */                                                \
  X(int64_t, right)                                                                                          \
  X(int64_t, q_start)       /* global positions of the first query row and key (context parallelism) */     \
  X(int64_t, k_start)                                                                                        \
  X(bool, with_stats)       /* the streamed statistics (forward) */                                          \
  X(int64_t, block_q)       /* tile rows and keys (the caller resolves 0 to its defaults) */                 \
  X(int64_t, block_k)                                                                                        \
  X(bool, half_products)    /* 16-bit inputs: multiply them as they are (else float32 tiles) */             \
  X(bool, round_out)        /* 16-bit inputs: out rounded to their format as its rows are written */

struct Options {
#define ATTNSCALE_FIELD(type, name) type name{};
  ATTNSCALE_KERNEL_OPTIONS(ATTNSCALE_FIELD)
#undef ATTNSCALE_FIELD

  // From the binding's keywords: every option named once, no other name (a misspelt or missing
  // one is an error that names it, never a default taken in silence).
  static Options from(const py::kwargs& given) {
    Options o;
    size_t found = 0;
    std::string missing;
#define ATTNSCALE_READ(type, name)                  \
  if (given.contains(#name)) {                      \
    o.name = given[#name].cast<type>();             \
    ++found;                                        \
  } else {                                          \
    missing += missing.empty() ? #name : ", " #name; \
  }
    ATTNSCALE_KERNEL_OPTIONS(ATTNSCALE_READ)
#undef ATTNSCALE_READ
    TORCH_CHECK(missing.empty(), "attnscale fused kernel: options missing: ", missing, " (pass every field of attnscale.kernels.ops.KernelOptions)");
    if (found != given.size()) {
      std::string unknown;
      for (const auto& item : given) {
        const auto name = item.first.cast<std::string>();
        bool known = false;
#define ATTNSCALE_KNOWN(type, field) known = known || name == #field;
        ATTNSCALE_KERNEL_OPTIONS(ATTNSCALE_KNOWN)
#undef ATTNSCALE_KNOWN
        if (!known) unknown += unknown.empty() ? name : ", " + name;
      }
      TORCH_CHECK(false, "attnscale fused kernel: unknown options: ", unknown, " (the fields of attnscale.kernels.ops.KernelOptions)");
    }
    return o;
  }

  static std::vector<std::string> names() {
    std::vector<std::string> all;
#define ATTNSCALE_NAME(type, name) all.emplace_back(#name);
    ATTNSCALE_KERNEL_OPTIONS(ATTNSCALE_NAME)
#undef ATTNSCALE_NAME
    return all;
  }
};

// Inside the kernel's parallel loops each BLAS call runs on its own thread: MKL is told so for the
// scope (restored after), so its products never start threads of their own on cores the loop
// already fills.
struct SerialBlas {
  SerialBlas() {
    if (mkl_set_num_threads_local) {
      const int one = 1;
      mkl_set_num_threads_local(&one);
    }
  }
  ~SerialBlas() {
    if (mkl_set_num_threads_local) {
      const int global = 0;  // 0: back to the global setting
      mkl_set_num_threads_local(&global);
    }
  }
};

// Column-major BLAS, as Fortran: C (m x n) = alpha op(A) op(B) + beta C. An empty C (m or n = 0,
// e.g. values with Dv = 0) is no call: BLAS rejects a leading dimension of 0 and prints an error.
inline void blas(char ta, char tb, int m, int n, int k, float alpha, const float* a, int lda, const float* b, int ldb,
                 float beta, float* c, int ldc) {
  sgemm_(&ta, &tb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc);
}

inline void blas(char ta, char tb, int m, int n, int k, double alpha, const double* a, int lda, const double* b, int ldb,
                 double beta, double* c, int ldc) {
  dgemm_(&ta, &tb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc);
}

template <typename T>
inline void gemm(char ta, char tb, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
                 int64_t ldb, T beta, T* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  auto ld = [](int64_t x) { return static_cast<int>(std::max<int64_t>(x, 1)); };
  blas(ta, tb, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), alpha, a, ld(lda), b, ld(ldb), beta, c, ld(ldc));
}

// 16-bit inputs: q, k, v (and the weights p of the second product) in bfloat16 or float16, each
// product accumulated in float32 by oneMKL; everything else (the score path, the softmax, the
// statistics, the output) in float32, as for float32 inputs.
enum Half16 : int { kNoHalf = 0, kBF16 = 1, kF16 = 2 };

// 16-bit entries as brgemm's bfloat16 operand.
inline const at::BFloat16* bf16(const uint16_t* x) { return reinterpret_cast<const at::BFloat16*>(x); }

bool half_gemm(int kind) {
  return kind == kBF16 ? cblas_gemm_bf16bf16f32 != nullptr : kind == kF16 ? cblas_gemm_f16f16f32 != nullptr : false;
}

inline void gemm16(int kind, char ta, char tb, int64_t m, int64_t n, int64_t k, float alpha, const uint16_t* a,
                   int64_t lda, const uint16_t* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  constexpr int col_major = 102, no_trans = 111, trans = 112;  // CBLAS_LAYOUT, CBLAS_TRANSPOSE
  auto ld = [](int64_t x) { return static_cast<int>(std::max<int64_t>(x, 1)); };
  auto op = [&](char t) { return t == 'T' ? trans : no_trans; };
  auto call = kind == kBF16 ? cblas_gemm_bf16bf16f32 : cblas_gemm_f16f16f32;
  call(col_major, op(ta), op(tb), static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), alpha, a, ld(lda), b,
       ld(ldb), beta, c, ld(ldc));
}

// A 16-bit row's entries as float vectors (n = Vectorized<float>::size() at a time).
template <typename H>
inline Vectorized<float> load_float(const H* x) {
  Vectorized<float> out;
  at::vec::load_to_float<H>(x, out);
  return out;
}

// The rows' entries in T's vectors: E is T itself, or (T = float) a 16-bit format.
template <typename T, typename E>
inline Vectorized<T> load_as(const E* x) {
  if constexpr (std::is_same_v<T, E>)
    return Vectorized<T>::loadu(x);
  else
    return load_float(x);
}

// Two vectors of softmax weights as one of 16-bit entries H, the second product's operand (round
// to nearest even, as torch's casts). Built for AVX512-BF16 (ATTNSCALE_AVX512_BF16), bfloat16
// takes the CPU's own conversion, VCVTNE2PS2BF16: one instruction where ATen's vectors take a
// dozen (costly in a softcapped row, perf showed). It rounds alike but reads a
// denormal float as zero: weights are 0, at least exp(exp_floor) = 1e-30 (a normal float), inf or
// NaN, so every weight gets ATen's bits but a NaN's, which stays a NaN.
template <typename H>
inline Vectorized<H> weights_to(const Vectorized<float>& lo, const Vectorized<float>& hi) {
#if defined(ATTNSCALE_AVX512_BF16)
  if constexpr (std::is_same_v<H, at::BFloat16>) return Vectorized<H>(reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
#endif
  return at::vec::convert_from_float<H>(lo, hi);
}

// float32 weights as the second product's 16-bit operand (round to nearest even, as torch's casts).
template <typename H>
void round_row(const float* x, int64_t width, H* out) {
  using Vec = Vectorized<float>;
  constexpr int64_t n = Vec::size();
  int64_t c = 0;
  for (; c + 2 * n <= width; c += 2 * n) at::vec::convert_from_float<H>(Vec::loadu(x + c), Vec::loadu(x + c + n)).store(out + c);
  for (; c < width; ++c) out[c] = static_cast<H>(x[c]);
}

// rows x cols 16-bit entries (row stride ld) of the format `kind` (Half16) as contiguous float32
// rows: a tile of q, k or v for the float32 products of Problem::widen. Exact (every bfloat16 and
// float16 value is a float32 one).
template <typename T>
void widen_rows(int kind, const uint16_t* x, int64_t ld, int64_t rows, int64_t cols, T* out) {
  if constexpr (std::is_same_v<T, float>) {
    using Vec = Vectorized<float>;
    constexpr int64_t n = Vec::size();
    auto row = [&](const auto* src, float* dst) {
      int64_t c = 0;
      for (; c + n <= cols; c += n) load_float(src + c).store(dst + c);
      for (; c < cols; ++c) dst[c] = static_cast<float>(src[c]);
    };
    for (int64_t r = 0; r < rows; ++r) {
      if (kind == kBF16)
        row(reinterpret_cast<const at::BFloat16*>(x + r * ld), out + r * cols);
      else
        row(reinterpret_cast<const at::Half*>(x + r * ld), out + r * cols);
    }
  }
}

// Weights below exp(floor) times the row maximum's are set to 0: a matmul whose products fall
// below the normal range runs ~100x slower on x86, and such a weight is far below the precision of
// the row's sum (float32: exp(-69) = 1e-30; float64: exp(-690)).
template <typename T>
constexpr T exp_floor() {
  return std::is_same_v<T, float> ? T(-69.0) : T(-690.0);
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
// test (settled rows, where no logit can fall under it: forward_block), and their core.
template <typename T>
inline Vectorized<T> vexp_unfloored(const Vectorized<T>& x) {
  return vexp(x);
}

// The softmax's weights: exp(x) for x = s - m, 0 where x < floor (-inf included), NaN for NaN; x <= 0
// with a running max, x <= 34.5 (float32) in rows that settled (forward_block). For float on AVX2
// this is exp_u20 specialised to that range, with the same bits on [floor, 34.5]: exp_u20 clamps x
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

// brgemm's operands of each packed sequence (Problem::seq_packs), indexed by sequence.
struct SequencePacks {
  std::vector<const uint16_t*> kpack, vpack, vtpack, kpairs;
  std::vector<int64_t> s_pad;
  std::vector<const float*> kmax;  // each sequence's key norms, (Hkv,), where its rows may settle
};

template <typename T>
struct Problem {
  const T* q;
  int64_t q_sb, q_sh, q_sl;
  const T* k;
  int64_t k_sb, k_sh, k_sl;
  const T* v;
  int64_t v_sb, v_sh, v_sl;
  int64_t B, H, Hkv, L, S, D, Dv;
  T scale, softcap;  // softcap 0: none
  bool causal;
  int64_t q_offset, left, right;  // aligned position of query row 0; window sides, -1 = unlimited
  int64_t q_start, k_start;       // global positions of this call's first query row and key
  const T* alibi;                 // (B, H) strided, or null
  int64_t al_sb, al_sh;
  const bool* bmask;  // (B, H, L, S) strided, or null
  const T* fmask;
  int64_t m_sb, m_sh, m_sl, m_ss;
  int64_t block_q, block_k;
  // Where this problem's rows sit in the outputs: query-side outputs (out, lse, m, l, stats, dq,
  // dout, delta) are (B, H, o_rows) rows with this problem's at o_start..; dk, dv are
  // (B, H, k_rows) rows with its keys at k_out_start... A plain call: o_rows = L, k_rows = S, 0.
  int64_t o_rows, o_start, k_rows, k_out_start;
  // Packed sequences (FlashAttention's varlen layout; null otherwise): q (1, H, total_q, D) and
  // k, v (1, Hkv, total_k, .) hold sequences end to end; spans (nseq, 4) gives sequence s's query
  // rows [q0, q1) and key rows [k0, k1). Each is a problem of its own (sequence(s)), bottom-right
  // aligned; rows no span names are not visited (the caller's fill values stay).
  const int64_t* spans = nullptr;
  int64_t nseq = 0;
  // The largest |k_j| of each key head, (B, Hkv), where the forward's rows may settle on an
  // offset (see forward_block); null where they may not (ALiBi, a float mask; without brgemm
  // also packed sequences, fewer than 1024 query rows, a single key tile: see forward).
  const T* kmax = nullptr;
  // 16-bit inputs (float only): q, k, v are qh, kh, vh (same strides, in elements) and q, k, v
  // are null; half says which format (Half16).
  const uint16_t *qh = nullptr, *kh = nullptr, *vh = nullptr;
  int half = kNoHalf;
  // 16-bit inputs on a CPU without native 16-bit products (forward only): each tile of q, k, v is
  // converted to float32 in the thread's scratch and multiplied by sgemm, the weights stay float32;
  // no copy of the whole inputs, and the output rows are checked here as the 16-bit path's are.
  bool widen = false;
  // 16-bit inputs multiplied by torch's brgemm (takes_brgemm), null otherwise: each key head's
  // k^T and v packed once per call in VNNI-2 pairs (pack_problem): kpack (D/2, s_pad, 2) per head,
  // pairs of d for every key; vpack (s_pad/2, Dv, 2), pairs of keys for every column; s_pad = S
  // rounded up to even, the pad key zero.
  const uint16_t *kpack = nullptr, *vpack = nullptr;
  int64_t s_pad = 0;
  // The backward's other two brgemm operands (with kpack; vpack stays null there): each key head's
  // v^T (Dv/2, s_pad, 2), pairs of columns for every key, as kpack; and k (s_pad/2, D, 2), pairs
  // of keys for every column, as vpack.
  const uint16_t *vtpack = nullptr, *kpairs = nullptr;
  // Packed sequences with brgemm: each sequence's keys packed on their own, paired from its first
  // key (sequence(s) takes its operands from here); the packed problem's own pointers stay null.
  const SequencePacks* seq_packs = nullptr;
  bool brgemm() const { return kpack != nullptr || seq_packs != nullptr; }

  int64_t G() const { return H / Hkv; }
  // The largest tile this problem has: scratch is sized by it, not by the block sizes (one query
  // row against 2048-key tiles needs 8 KiB, not the 2 MiB of a 256 x 2048 block, zeroed per
  // thread on every call).
  int64_t tile_rows() const { return std::max<int64_t>(1, std::min(block_q, L)); }
  int64_t tile_width() const { return std::max<int64_t>(1, std::min(block_k, S)); }

  // Sequence s of a packed problem as a plain one of batch 1 on views of the packed tensors; its
  // ALiBi slopes are row s of the (nseq, H) slopes.
  Problem sequence(int64_t s) const {
    Problem P = *this;
    const int64_t* span = spans + 4 * s;
    const int64_t q0 = span[0], k0 = span[2];
    P.spans = nullptr;
    P.nseq = 0;
    if (half)
      P.qh += q0 * q_sl, P.kh += k0 * k_sl, P.vh += k0 * v_sl;
    else
      P.q += q0 * q_sl, P.k += k0 * k_sl, P.v += k0 * v_sl;
    P.L = span[1] - q0, P.S = span[3] - k0;
    P.q_offset = P.S - P.L, P.q_start = 0, P.k_start = 0;
    if (alibi) P.alibi += s * al_sb;
    P.o_start = q0, P.k_out_start = k0;
    if (seq_packs) {
      P.kpack = seq_packs->kpack[s], P.vpack = seq_packs->vpack[s], P.vtpack = seq_packs->vtpack[s];
      P.kpairs = seq_packs->kpairs[s], P.s_pad = seq_packs->s_pad[s];
      if constexpr (std::is_same_v<T, float>) P.kmax = seq_packs->kmax.empty() ? nullptr : seq_packs->kmax[s];
      P.seq_packs = nullptr;
    }
    return P;
  }
  int64_t q_blocks() const { return (L + block_q - 1) / block_q; }

  // Keys [lo, hi) (local) that causal / window leave visible to query row i; hi <= lo if none.
  void row_span(int64_t i, int64_t* lo, int64_t* hi) const {
    const int64_t p = q_start + i + q_offset;  // aligned position (global key coordinates)
    int64_t first = std::numeric_limits<int64_t>::min() / 4, last = std::numeric_limits<int64_t>::max() / 4;
    if (causal) last = p;
    if (left >= 0) first = p - left;
    if (right >= 0) last = std::min(last, p + right);
    *lo = std::max<int64_t>(first - k_start, 0);
    *hi = std::min<int64_t>(last - k_start + 1, S);
  }

  // The key tiles [j0, j1) of query block i0:i1: fixed blocks of block_k, cut to the keys some
  // row of the block can see (the same list in the forward and the backward pass).
  std::vector<std::pair<int64_t, int64_t>> key_tiles(int64_t i0, int64_t i1) const {
    int64_t lo0, hi0, lo1, hi1;
    row_span(i0, &lo0, &hi0);
    row_span(i1 - 1, &lo1, &hi1);
    int64_t lo = std::min(lo0, lo1);
    const int64_t hi = std::max(hi0, hi1);  // spans move right with i
    // Packed values pair keys (2j, 2j + 1): tiles start on an even key; the key before lo that this
    // adds is hidden from every row of the block (weight 0), and block_k is even.
    if (kpack) lo = std::max<int64_t>(0, lo & ~int64_t(1));
    std::vector<std::pair<int64_t, int64_t>> tiles;
    for (int64_t b0 = 0; b0 < S; b0 += block_k) {
      const int64_t j0 = std::max(b0, lo), j1 = std::min(b0 + block_k, hi);
      if (j0 < j1) tiles.emplace_back(j0, j1);
    }
    return tiles;
  }
};

template <typename T>
T row_max(const T* x, int64_t width) {
  using Vec = Vectorized<T>;
  constexpr int64_t n = Vec::size();
  const T neg_inf = -std::numeric_limits<T>::infinity();
  Vec vmax(neg_inf);
  int64_t c = 0;
  for (; c + n <= width; c += n) vmax = at::vec::maximum(vmax, Vec::loadu(x + c));
  T m = at::vec::vec_reduce_all<T>([](const Vec& a, const Vec& b) { return at::vec::maximum(a, b); }, vmax);
  for (; c < width; ++c)
    if (std::isnan(x[c]) || x[c] > m) m = x[c];  // NaN propagates, as in at::vec::maximum
  return m;
}

// sum x_c^2 over one contiguous row of `width` entries, vectorised: |q_i|^2 and |k_j|^2 for the
// Cauchy-Schwarz bound rows settle on (forward_block, key_norms).
template <typename T, typename E = T>
T sum_squares(const E* x, int64_t width) {
  using Vec = Vectorized<T>;
  constexpr int64_t n = Vec::size();
  Vec sq(T(0));
  int64_t c = 0;
  for (; c + n <= width; c += n) {
    const Vec e = load_as<T>(x + c);
    sq = at::vec::fmadd(e, e, sq);
  }
  T ss = at::vec::vec_reduce_all<T>([](const Vec& a, const Vec& v) { return a + v; }, sq);
  for (; c < width; ++c) ss += static_cast<T>(x[c]) * static_cast<T>(x[c]);
  return ss;
}

// |q_i|^2 of query row r of a block (in whichever format the problem's q is).
template <typename T>
T query_norm2(const Problem<T>& P, const T* q, const uint16_t* qh, int64_t r) {
  if constexpr (std::is_same_v<T, float>) {
    if (P.half == kBF16) return sum_squares<float>(reinterpret_cast<const at::BFloat16*>(qh + r * P.q_sl), P.D);
    if (P.half == kF16) return sum_squares<float>(reinterpret_cast<const at::Half*>(qh + r * P.q_sl), P.D);
  }
  return sum_squares<T>(q + r * P.q_sl, P.D);
}

// Logits of one row of a tile, in place, and their maximum (NaN if any is NaN): on entry x (width
// entries) holds the raw products times (scale, or scale / softcap with softcap); on exit the score
// path's logits, -inf where a key is hidden. One pass over the keys causal / window leave visible
// (the rest is filled). With softcap, t (if not null) receives tanh of the products (0 at keys
// outside the span), for the backward pass, which calls this with the same arguments as the
// forward: both see bit-identical logits.
template <typename T>
T score_row(const Problem<T>& P, int64_t b, int64_t h, int64_t i, int64_t j0, int64_t width, T* x, T* t,
            int64_t* visible = nullptr, bool want_max = true, T pre = T(1)) {
  using Vec = Vectorized<T>;
  constexpr int64_t n = Vec::size();
  const T neg_inf = -std::numeric_limits<T>::infinity();
  const T cap = P.softcap;
  int64_t lo, hi;
  P.row_span(i, &lo, &hi);
  lo = std::clamp<int64_t>(lo - j0, 0, width);
  hi = std::clamp<int64_t>(hi - j0, lo, width);
  std::fill(x, x + lo, neg_inf);
  std::fill(x + hi, x + width, neg_inf);
  if (t) {
    std::fill(t, t + lo, T(0));
    std::fill(t + hi, t + width, T(0));
  }
  const T slope = P.alibi ? P.alibi[b * P.al_sb + h * P.al_sh] : T(0);
  const int64_t p = P.q_start + i + P.q_offset - P.k_start - j0;  // i' - j = p - c at column c
  const T* fm = P.fmask ? P.fmask + b * P.m_sb + h * P.m_sh + i * P.m_sl + j0 * P.m_ss : nullptr;
  const Vec vcap(cap), vslope(slope), iota = Vec::arange(T(0), T(1)), vpre(pre);
  Vec vmax(neg_inf);
  int64_t c = lo;
  const bool alibi = P.alibi != nullptr;  // a local: the loops below test it in a register
  const bool scaled = pre != T(1);  // products not yet multiplied by their factor (brgemm has none)
  // Every loop below turns an infinite product (an inf in q or k, or overflow) into NaN with
  // + (raw - raw), which is 0 for a finite one: as -inf it would hide its key and leave the row
  // finite, where the rules make a row that sees a non-finite key NaN; as NaN the row check
  // reports the row. Only rows that never settle can meet one (their bound is inf or NaN), so
  // want_max is false only where no product is infinite.
  // Each loop runs over whole vectors, then once over the span's last entries, fewer than a
  // vector, as a partial one: its lanes past hi read as 0, are not written and miss the maximum.
  const Vec vneg_inf(neg_inf);
  auto span = [&](auto&& body) __attribute__((always_inline)) {
    for (; c + n <= hi; c += n) body(c, n);
    if (c < hi) body(c, hi - c), c = hi;
  };
  auto keep_max = [&](const Vec& xv, int64_t count) __attribute__((always_inline)) {
    vmax = at::vec::maximum(vmax, count == n ? xv : Vec::blendv(vneg_inf, xv, first_lanes<T>(count)));
  };
  if (cap == T(0) && !alibi && !fm) {  // the products are the logits: only their maximum, if wanted
    if (scaled && want_max) {
      span([&](int64_t c, int64_t count) __attribute__((always_inline)) {
        const Vec raw = Vec::loadu(x + c, count);
        const Vec xv = at::vec::fmadd(raw, vpre, raw - raw);
        xv.store(x + c, count);
        keep_max(xv, count);
      });
    } else if (scaled) {
      span([&](int64_t c, int64_t count) __attribute__((always_inline)) { (Vec::loadu(x + c, count) * vpre).store(x + c, count); });
    } else if (want_max && P.bmask) {  // the mask below re-reads x: the NaN must be in it
      span([&](int64_t c, int64_t count) __attribute__((always_inline)) {
        const Vec raw = Vec::loadu(x + c, count);
        const Vec xv = raw + (raw - raw);
        xv.store(x + c, count);
        keep_max(xv, count);
      });
    } else if (want_max) {  // x may keep -inf: the NaN maximum makes the row NaN
      span([&](int64_t c, int64_t count) __attribute__((always_inline)) {
        const Vec raw = Vec::loadu(x + c, count);
        keep_max(raw + (raw - raw), count);
      });
    } else {
      c = hi;  // nothing to compute: the span's logits are the products as they stand
    }
  } else if (!alibi && !fm) {  // softcap only, the common case: its own loop, nothing else tested
    span([&](int64_t c, int64_t count) __attribute__((always_inline)) {
      const Vec raw = scaled ? Vec::loadu(x + c, count) * vpre : Vec::loadu(x + c, count);
      const Vec th = vtanh(raw);
      if (t) th.store(t + c, count);
      // + (raw - raw): 0 for a finite product, NaN for an infinite one (overflow, or an inf in q
      // or k), which tanh would cap to a finite logit that no row check could tell from a right one.
      const Vec xv = at::vec::fmadd(th, vcap, raw - raw);
      xv.store(x + c, count);
      keep_max(xv, count);
    });
  } else if (!fm || P.m_ss == 1) {
    span([&](int64_t c, int64_t count) __attribute__((always_inline)) {
      Vec xv = scaled ? Vec::loadu(x + c, count) * vpre : Vec::loadu(x + c, count);
      if (cap != T(0)) {
        const Vec th = vtanh(xv);
        if (t) th.store(t + c, count);
        xv = at::vec::fmadd(th, vcap, xv - xv);  // an infinite product gives NaN, as above
      } else {
        xv = xv + (xv - xv);
      }
      if (alibi) xv = xv - vslope * (Vec(static_cast<T>(p - c)) - iota).abs();  // exact below 2^24 keys
      if (fm) xv = xv + Vec::loadu(fm + c, count);
      xv.store(x + c, count);
      keep_max(xv, count);
    });
  }
  T m = at::vec::vec_reduce_all<T>([](const Vec& a, const Vec& v) { return at::vec::maximum(a, v); }, vmax);
  for (; c < hi; ++c) {
    T xc = scaled ? x[c] * pre : x[c];
    if (cap != T(0)) {
      const T th = stanh(xc);
      if (t) t[c] = th;
      xc = cap * th + (xc - xc);  // an infinite product gives NaN, as above
    } else if (want_max) {
      xc = xc + (xc - xc);
    }
    if (alibi) xc -= slope * static_cast<T>(std::abs(p - c));
    if (fm) xc += fm[c * P.m_ss];
    x[c] = xc;
    if (std::isnan(xc) || xc > m) m = xc;  // NaN propagates, as in at::vec::maximum
  }
  if (P.bmask) {
    const bool* mr = P.bmask + b * P.m_sb + h * P.m_sh + i * P.m_sl + j0 * P.m_ss;
    for (c = lo; c < hi; ++c) x[c] = mr[c * P.m_ss] ? x[c] : neg_inf;
    if (want_max) m = row_max(x + lo, hi - lo);
  }
  if (visible) {  // the keys in the span, less those a mask hides (-inf)
    int64_t count = hi - lo;
    if (P.bmask || P.fmask)
      for (c = lo; c < hi; ++c) count -= x[c] == neg_inf;
    *visible = count;
  }
  return m;
}

// p = exp(x - m) for one row, 0 where x - m < floor (hidden keys, -inf, included); returns sum p.
// The row's last entries, fewer than a vector, take a partial one (vexp_accurate).
template <typename T>
T exp_row(T* x, int64_t width, T m) {
  using Vec = Vectorized<T>;
  constexpr int64_t n = Vec::size();
  const Vec vm(m), vfloor(exp_floor<T>());
  Vec acc(T(0));
  int64_t c = 0;
  for (; c + n <= width; c += n) {
    const Vec centred = Vec::loadu(x + c) - vm;
    const Vec p = vexp_weights(centred, vfloor);
    p.store(x + c);
    acc = acc + p;
  }
  if (c < width) {
    const Vec p = Vec::blendv(Vec(T(0)), vexp_accurate(Vec::loadu(x + c, width - c) - vm, vfloor), first_lanes<T>(width - c));
    p.store(x + c, width - c);
    acc = acc + p;
  }
  return at::vec::vec_reduce_all<T>([](const Vec& a, const Vec& b) { return a + b; }, acc);
}

// exp_row for 16-bit inputs: the weights written to out, rounded to H for the second product (x
// keeps the logits); returns their sum in float32, before rounding, as torch sums them.
template <typename H>
float exp_row_to(const float* x, int64_t width, float m, H* out) {
  using Vec = Vectorized<float>;
  constexpr int64_t n = Vec::size();
  const Vec vm(m), vfloor(exp_floor<float>());
  Vec acc(0.0f);
  int64_t c = 0;
  for (; c + 2 * n <= width; c += 2 * n) {
    const Vec p0 = vexp_weights(Vec::loadu(x + c) - vm, vfloor);
    const Vec p1 = vexp_weights(Vec::loadu(x + c + n) - vm, vfloor);
    weights_to<H>(p0, p1).store(out + c);
    acc = acc + p0 + p1;
  }
  if (c < width) {  // fewer than a pair left: partial vectors, as exp_row
    const int64_t rest = width - c, n0 = std::min(n, rest), n1 = rest - n0;
    const Vec zero(0.0f);
    const Vec p0 = Vec::blendv(zero, vexp_weights(Vec::loadu(x + c, n0) - vm, vfloor), first_lanes<float>(n0));
    const Vec p1 = n1 > 0 ? Vec::blendv(zero, vexp_weights(Vec::loadu(x + c + n, n1) - vm, vfloor), first_lanes<float>(n1)) : zero;
    weights_to<H>(p0, p1).store(out + c, static_cast<int>(rest));
    acc = acc + p0 + p1;
  }
  return at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return a + b; }, acc);
}

// exp_row_weighted for 16-bit inputs: the weights written to out in H (x keeps the logits). The
// weighted sums are explicit FMAs here and below: left to the compiler, a + p * c was contracted
// in one build (ISA) and not in another, and the entropy's bits differed between them.
template <typename H>
float exp_row_weighted_to(const float* x, int64_t width, float m, float* weighted, H* out) {
  using Vec = Vectorized<float>;
  constexpr int64_t n = Vec::size();
  const Vec vm(m), vfloor(exp_floor<float>()), zero(0.0f);
  Vec acc(0.0f), wacc(0.0f);
  int64_t c = 0;
  for (; c + 2 * n <= width; c += 2 * n) {
    const Vec c0 = Vec::loadu(x + c) - vm, c1 = Vec::loadu(x + c + n) - vm;
    const Vec p0 = vexp_weights(c0, vfloor), p1 = vexp_weights(c1, vfloor);
    weights_to<H>(p0, p1).store(out + c);
    acc = acc + p0 + p1;
    wacc = at::vec::fmadd(p1, Vec::blendv(c1, zero, c1 < vfloor), at::vec::fmadd(p0, Vec::blendv(c0, zero, c0 < vfloor), wacc));
  }
  if (c < width) {  // fewer than a pair left: partial vectors, as exp_row
    const int64_t rest = width - c, n0 = std::min(n, rest), n1 = rest - n0;
    const Vec in0 = first_lanes<float>(n0), in1 = first_lanes<float>(n1);
    const Vec c0 = Vec::blendv(zero, Vec::loadu(x + c, n0) - vm, in0);  // lanes past the row: 0, weight 0 below
    const Vec c1 = n1 > 0 ? Vec::blendv(zero, Vec::loadu(x + c + n, n1) - vm, in1) : zero;
    const Vec p0 = Vec::blendv(zero, vexp_weights(c0, vfloor), in0), p1 = Vec::blendv(zero, vexp_weights(c1, vfloor), in1);
    weights_to<H>(p0, p1).store(out + c, static_cast<int>(rest));
    acc = acc + p0 + p1;
    wacc = at::vec::fmadd(p1, Vec::blendv(c1, zero, c1 < vfloor), at::vec::fmadd(p0, Vec::blendv(c0, zero, c0 < vfloor), wacc));
  }
  auto add = [](const Vec& a, const Vec& b) { return a + b; };
  *weighted = at::vec::vec_reduce_all<float>(add, wacc);
  return at::vec::vec_reduce_all<float>(add, acc);
}

// settled_row's vector pairs over [c, hi), specialised on the softcap and the pending factor: the
// constants are values here, so they stay in registers (as captured references they were reloaded
// after every store, since a float store may alias them); the results are the same operations.
// A settled row's products are finite (its bound is), so the softcap's + (raw - raw) is +0 there,
// a constant. With kFloor false the caller knows that no weight falls under the floor
// (vexp_unfloored). With kStats also the logits' maximum (*top) and sum p (s - m) (*weighted): a
// weight under the floor is 0 and its finite s - m gives a 0 term. The last entries, fewer than a
// pair, take the same operations on partial vectors (the lanes past hi read as 0, weigh 0 and are
// not written); their weights in T take vexp_accurate.
template <bool kCap, bool kScaled, bool kFloor, bool kStats, typename T, typename O>
int64_t settled_pairs(const T* x, int64_t c, int64_t hi, T m, T cap, T pre, O* out, Vectorized<T>* sum,
                      Vectorized<T>* weighted, Vectorized<T>* top) {
  using Vec = Vectorized<T>;
  constexpr int64_t n = Vec::size();
  const Vec vm(m), vfloor(exp_floor<T>()), vcap(cap), vpre(pre), zero(T(0));
  Vec acc = *sum, wacc = *weighted, vtop = *top;
  // The logits r (from the raw products r) and their centred values c = r - m.
  auto centre = [&](Vec& r0, Vec& r1, Vec& c0, Vec& c1) __attribute__((always_inline)) {
    if constexpr (kScaled) r0 = r0 * vpre, r1 = r1 * vpre;
    if constexpr (kCap) {  // an FMA with +0, not a product: the compiler would fuse a product with the - m below
      r0 = at::vec::fmadd(vtanh(r0), vcap, zero);
      r1 = at::vec::fmadd(vtanh(r1), vcap, zero);
    }
    c0 = r0 - vm, c1 = r1 - vm;
  };
  auto weigh = [&](const Vec& c0, const Vec& c1, Vec& p0, Vec& p1) __attribute__((always_inline)) {
    if constexpr (kFloor)
      p0 = vexp_weights(c0, vfloor), p1 = vexp_weights(c1, vfloor);
    else
      p0 = vexp_unfloored(c0), p1 = vexp_unfloored(c1);
  };
  for (; c + 2 * n <= hi; c += 2 * n) {
    Vec r0 = Vec::loadu(x + c), r1 = Vec::loadu(x + c + n), c0, c1, p0, p1;
    centre(r0, r1, c0, c1);
    weigh(c0, c1, p0, p1);
    if constexpr (std::is_same_v<O, T>) {
      p0.store(out + c);
      p1.store(out + c + n);
    } else {
      weights_to<O>(p0, p1).store(out + c);
    }
    acc = acc + p0 + p1;
    if constexpr (kStats) {
      wacc = at::vec::fmadd(p1, c1, at::vec::fmadd(p0, c0, wacc));
      vtop = at::vec::maximum(vtop, at::vec::maximum(r0, r1));
    }
  }
  if (c < hi) {
    const int64_t rest = hi - c, n0 = std::min(n, rest), n1 = rest - n0;
    Vec r0 = Vec::loadu(x + c, n0), r1 = n1 > 0 ? Vec::loadu(x + c + n, n1) : zero, c0, c1, p0, p1;
    centre(r0, r1, c0, c1);
    if constexpr (std::is_same_v<O, T>)
      p0 = vexp_accurate(c0, vfloor), p1 = vexp_accurate(c1, vfloor);
    else
      weigh(c0, c1, p0, p1);
    const Vec in0 = first_lanes<T>(n0), in1 = first_lanes<T>(n1);
    p0 = Vec::blendv(zero, p0, in0), p1 = Vec::blendv(zero, p1, in1);  // a select: whatever the lanes past hi gave
    if constexpr (std::is_same_v<O, T>) {
      p0.store(out + c, n0);
      if (n1 > 0) p1.store(out + c + n, n1);
    } else {
      weights_to<O>(p0, p1).store(out + c, static_cast<int>(rest));
    }
    acc = acc + p0 + p1;
    if constexpr (kStats) {
      const Vec neg_inf(-std::numeric_limits<T>::infinity());
      wacc = at::vec::fmadd(p1, Vec::blendv(zero, c1, in1), at::vec::fmadd(p0, Vec::blendv(zero, c0, in0), wacc));
      vtop = at::vec::maximum(vtop, at::vec::maximum(Vec::blendv(neg_inf, r0, in0), Vec::blendv(neg_inf, r1, in1)));
    }
    c = hi;
  }
  *sum = acc, *weighted = wacc, *top = vtop;
  return c;
}

// What settled_row adds for the statistics: sum p (s - m), the largest logit, the visible keys.
template <typename T>
struct SettledStats {
  T weighted, top;
  int64_t visible;
};

// score_row then exp_row (or exp_row_to) in one pass, for a row that settled on its offset m
// (forward_block) in a problem without ALiBi or masks: the products x (times pre) through the
// softcap, exp(s - m) and the sum, written to out (T, or the 16-bit format of the inputs), 0 outside
// the row's span; x is not written. Each entry takes score_row's and exp_row's operations on it,
// in the same order, so its weight has their bits, but for the row's last entries, fewer than a
// vector pair (settled_pairs' partial vectors, which need not fall where exp_row's do). floored
// false: the caller knows every logit of the span is at least m + exp_floor (forward_block), so no
// weight needs the floor's test. stats (or null): the tile's sum p (s - m), largest logit (-inf
// without a visible key) and visible keys, written there.
template <typename T, typename O>
T settled_row(const Problem<T>& P, int64_t i, int64_t j0, int64_t width, const T* x, T m, T pre, O* out, bool floored,
              SettledStats<T>* stats = nullptr) {
  using Vec = Vectorized<T>;
  int64_t lo, hi;
  P.row_span(i, &lo, &hi);
  lo = std::clamp<int64_t>(lo - j0, 0, width);
  hi = std::clamp<int64_t>(hi - j0, lo, width);
  std::fill(out, out + lo, O(0));
  std::fill(out + hi, out + width, O(0));
  const T cap = P.softcap;
  const bool scaled = pre != T(1);
  const T neg_inf = -std::numeric_limits<T>::infinity();
  Vec acc(T(0)), wacc(T(0)), vtop(neg_inf);
  int64_t c;
  auto pairs = [&](auto floor, auto with_stats) {
    constexpr bool kFloor = decltype(floor)::value, kStats = decltype(with_stats)::value;
    if (cap != T(0))
      return scaled ? settled_pairs<true, true, kFloor, kStats>(x, lo, hi, m, cap, pre, out, &acc, &wacc, &vtop)
                    : settled_pairs<true, false, kFloor, kStats>(x, lo, hi, m, cap, pre, out, &acc, &wacc, &vtop);
    return scaled ? settled_pairs<false, true, kFloor, kStats>(x, lo, hi, m, cap, pre, out, &acc, &wacc, &vtop)
                  : settled_pairs<false, false, kFloor, kStats>(x, lo, hi, m, cap, pre, out, &acc, &wacc, &vtop);
  };
  if (stats)
    c = floored ? pairs(std::true_type{}, std::true_type{}) : pairs(std::false_type{}, std::true_type{});
  else
    c = floored ? pairs(std::true_type{}, std::false_type{}) : pairs(std::false_type{}, std::false_type{});
  auto add = [](const Vec& a, const Vec& b) { return a + b; };
  T sum = at::vec::vec_reduce_all<T>(add, acc);
  T weighted = at::vec::vec_reduce_all<T>(add, wacc);
  T top = at::vec::vec_reduce_all<T>([](const Vec& a, const Vec& b) { return at::vec::maximum(a, b); }, vtop);
  TORCH_INTERNAL_ASSERT(c == hi);
  if (stats) *stats = SettledStats<T>{weighted, top, hi - lo};
  return sum;
}

// As exp_row, and also returns sum p (s - m) in *weighted (hidden keys contribute 0), for the entropy.
template <typename T>
T exp_row_weighted(T* x, int64_t width, T m, T* weighted) {
  using Vec = Vectorized<T>;
  constexpr int64_t n = Vec::size();
  const Vec vm(m), vfloor(exp_floor<T>()), zero(T(0));
  Vec acc(T(0)), wacc(T(0));
  int64_t c = 0;
  for (; c + n <= width; c += n) {
    const Vec centred = Vec::loadu(x + c) - vm;
    const Vec drop = centred < vfloor;  // NaN is kept: NaN in, NaN out
    const Vec p = vexp_weights(centred, vfloor);
    p.store(x + c);
    acc = acc + p;
    wacc = at::vec::fmadd(p, Vec::blendv(centred, zero, drop), wacc);
  }
  if (c < width) {  // a partial vector, as exp_row
    const Vec in = first_lanes<T>(width - c);
    const Vec centred = Vec::blendv(zero, Vec::loadu(x + c, width - c) - vm, in);
    const Vec p = Vec::blendv(zero, vexp_accurate(centred, vfloor), in);
    p.store(x + c, width - c);
    acc = acc + p;
    wacc = at::vec::fmadd(p, Vec::blendv(centred, zero, centred < vfloor), wacc);
  }
  auto add = [](const Vec& a, const Vec& b) { return a + b; };
  *weighted = at::vec::vec_reduce_all<T>(add, wacc);
  return at::vec::vec_reduce_all<T>(add, acc);
}


// Scratch on 64-byte (cache-line) boundaries, as torch's own buffers are: BLAS reads and writes
// the tiles row by row, and rows that straddle cache lines cost it loads.
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const CacheLineAllocator<U>&) const { return false; }
};
template <typename T>
using Scratch = std::vector<T, CacheLineAllocator<T>>;

template <typename T>
struct ForwardOut {
  T* out;   // (B, H, L, Dv) contiguous, or null where out16 takes the output
  // 16-bit inputs (T = float) whose caller asks for the output in their format (round_out): the
  // rows rounded to it here (to nearest even, as torch's casts), (B, H, L, Dv) contiguous, instead
  // of float32 rows that a pass after the kernel would round.
  uint16_t* out16 = nullptr;
  int out16_kind = kNoHalf;
  T* lse;   // (B, H, L)
  T* m;     // (B, H, L): the offset the row's weights were last taken against
  T* l;     // (B, H, L): sum exp(s - m), 1 for rows without a visible key
  T* max_logit;  // stats (null without)
  T* max_prob;
  T* entropy;
  int64_t* visible;
  // Set when some output row is non-finite or all zeros (Dv > 0): the caller's one check of the
  // output, made here while the rows are written instead of in further passes over them.
  std::atomic<bool>* suspect;
  // A row counts as suspect unless its largest |entry| lies strictly between floor and ceiling:
  // above 0 and finite; for 16-bit inputs, whose output is rounded to their format (to nearest
  // even), above half its smallest subnormal and under its largest finite value plus half a unit
  // in its last place (the ties round to 0 and to inf), so that rows_ok holds of the rounded
  // output (set_rounded_range).
  T floor = T(0), ceiling = std::numeric_limits<T>::infinity();
  template <typename H>
  void set_rounded_range() {
    const H top = std::numeric_limits<H>::max(), below(static_cast<uint16_t>(top.x - 1), H::from_bits());
    floor = static_cast<T>(std::numeric_limits<H>::denorm_min()) / T(2);
    ceiling = static_cast<T>(top) + (static_cast<T>(top) - static_cast<T>(below)) / T(2);
  }
};

// One thread's buffers for forward blocks.
template <typename T>
struct ForwardScratch {
  Scratch<T> sbuf, acc, m, l, w, bound, top;  // top: the largest logit so far (statistics)
  Scratch<uint16_t> pbuf;  // 16-bit products: the tile's weights, rounded for the second product
  Scratch<T> wq, wk, wv;   // Problem::widen: the block's q and the tile's k, v in float32
  std::vector<int64_t> seen;
  std::vector<char> settled;
  explicit ForwardScratch(const Problem<T>& P)
      : sbuf(P.tile_rows() * P.tile_width()), acc(P.tile_rows() * P.Dv), m(P.tile_rows()), l(P.tile_rows()),
        w(P.tile_rows()), bound(P.tile_rows()), top(P.tile_rows()), pbuf(P.half && !P.widen ? P.tile_rows() * (P.tile_width() + 1) : 0),
        wq(P.widen ? P.tile_rows() * P.D : 0), wk(P.widen ? P.tile_width() * P.D : 0),
        wv(P.widen ? P.tile_width() * P.Dv : 0), seen(P.tile_rows()), settled(P.tile_rows()), brgemm(P.brgemm()) {}
  // The thread's AMX tile state, set up by brgemm's first call, released with the scratch.
  bool brgemm;
  ~ForwardScratch() {
    if (brgemm) at::native::cpublas::brgemm_release(true);
  }
  ForwardScratch(ForwardScratch&&) = delete;
};

// Query block qb of head h, batch b: the online softmax over its key tiles, written to O.
template <typename T>
void forward_block(const Problem<T>& P, const ForwardOut<T>& O, int64_t b, int64_t h, int64_t qb, ForwardScratch<T>& W) {
  const int64_t G = P.G();
  const bool stats = O.max_logit != nullptr;
  const T alpha = P.softcap != T(0) ? P.scale / P.softcap : P.scale;
  const T neg_inf = -std::numeric_limits<T>::infinity();
  Scratch<T>&sbuf = W.sbuf, &acc = W.acc, &m = W.m, &l = W.l, &w = W.w, &bound = W.bound, &top = W.top;
  std::vector<int64_t>& seen = W.seen;
  std::vector<char>& settled = W.settled;
  {
    {
      const int64_t hk = h / G;
      const int64_t i0 = qb * P.block_q, i1 = std::min(i0 + P.block_q, P.L), rows = i1 - i0;
      const int64_t q_at = b * P.q_sb + h * P.q_sh + i0 * P.q_sl, k_at = b * P.k_sb + hk * P.k_sh, v_at = b * P.v_sb + hk * P.v_sh;
      const T* q = P.half ? nullptr : P.q + q_at;
      const T* k = P.half ? nullptr : P.k + k_at;
      const T* v = P.half ? nullptr : P.v + v_at;
      const uint16_t* qh = P.half ? P.qh + q_at : nullptr;
      const uint16_t* kh = P.half ? P.kh + k_at : nullptr;
      const uint16_t* vh = P.half ? P.vh + v_at : nullptr;
      // The 16-bit format of the products' operands (the weights rounded to it), or none: float
      // inputs, and 16-bit ones that Problem::widen multiplies as float32 tiles.
      const int h16 = P.widen ? kNoHalf : P.half;
      int64_t q_ld = P.q_sl;
      if (P.widen) {  // the block's q rows in float32, once
        widen_rows(P.half, qh, P.q_sl, rows, P.D, W.wq.data());
        q = W.wq.data(), q_ld = P.D;
      }
      // A settled offset: Cauchy-Schwarz bounds every logit of row i, s_ij <= u_i = alpha |q_i|
      // max_j |k_j| (with softcap, softcap tanh of that). Once the row's running max m has reached
      // u_i - 34.5 (float32; -floor / 2), no later weight exp(s - m) can exceed exp(34.5) = 1e15, so
      // the row keeps m as its offset from then on: its later tiles need no max pass and no
      // rescaling of the sum or the accumulator. m is an actual logit of the row (but for the
      // bfloat16 rows below), so the row's largest weight is at least 1 and precision is the
      // running max's. (key_norms refuses the
      // bound where values are so large that 1e15 times their sum could overflow.) With
      // statistics a settled row also keeps its largest logit (top) apart from m, and sum p (s - m)
      // against m: the entropy, log l - w / l, does not depend on the offset.
      const bool settles = P.kmax != nullptr;
      const T limit = -exp_floor<T>() / 2;
      std::fill(settled.begin(), settled.end(), 0);
      if (settles) {
        const T kn = P.kmax[b * P.Hkv + hk];
        for (int64_t r = 0; r < rows; ++r) bound[r] = std::abs(alpha) * std::sqrt(query_norm2(P, q, qh, r)) * kn;
        if (P.softcap != T(0)) {
          // softcap tanh(u), with the score path's tanh, in vectors (libm's, row by row, showed in
          // profiles). Where u is NaN or inf (an inf or NaN in q or k, or overflow) the bound stays
          // u, so the row never settles, softcap or not: the unsettled path sees the infinite
          // product, which a settled row's softcap would bound to a finite logit.
          using Vec = Vectorized<T>;
          const Vec vcap(P.softcap), zero(T(0));
          for (int64_t r = 0; r < rows; r += Vec::size()) {
            const int64_t count = std::min<int64_t>(Vec::size(), rows - r);
            const Vec u = Vec::loadu(bound.data() + r, count);
            Vec::blendv(u, vcap * vtanh(u), (u - u) == zero).store(bound.data() + r, count);
          }
        }
      }
      std::fill(acc.begin(), acc.begin() + rows * P.Dv, T(0));
      std::fill(m.begin(), m.end(), neg_inf);
      std::fill(l.begin(), l.end(), T(0));
      std::fill(w.begin(), w.end(), T(0));
      std::fill(top.begin(), top.end(), neg_inf);
      std::fill(seen.begin(), seen.end(), 0);
      // Weights rounded to bfloat16 (without statistics): a row whose bound is at most 47.25
      // settles before its first tile, on the offset bound - 34.5. Its logits lie in [-bound,
      // bound], so its weights lie in [e^-60, e^34.5]: none overflows, none reaches the floor
      // (settled_row's unfloored form), and bfloat16 has float32's range. The offset is no logit
      // of the row, so s - m keeps the rounding of numbers up to 47 + 34.5 (a few float32 ulps of
      // them), far under bfloat16's; float32 and float16 weights, and statistics, keep the
      // running max until it settles.
      if (settles && !stats && h16 == kBF16) {
        for (int64_t r = 0; r < rows; ++r) {
          if (bound[r] <= T(47.25)) m[r] = bound[r] - limit, settled[r] = 1;  // false for NaN or inf
        }
      }
      const T pre = P.kpack ? alpha : T(1);  // brgemm's products come unscaled: score_row scales them
      for (auto [j0, j1] : P.key_tiles(i0, i1)) {
        const int64_t width = j1 - j0;
        T* x = sbuf.data();
        // The tile's float keys and values (widen: converted to the scratch) and their row strides.
        const T* kt = k ? k + j0 * P.k_sl : nullptr;
        const T* vt = v ? v + j0 * P.v_sl : nullptr;
        int64_t k_ld = P.k_sl, v_ld = P.v_sl;
        if (P.widen) {
          widen_rows(P.half, kh + j0 * P.k_sl, P.k_sl, width, P.D, W.wk.data());
          widen_rows(P.half, vh + j0 * P.v_sl, P.v_sl, width, P.Dv, W.wv.data());
          kt = W.wk.data(), vt = W.wv.data(), k_ld = P.D, v_ld = P.Dv;
        }
        if constexpr (std::is_same_v<T, float>) {
          if (P.kpack)  // x (rows, width) = q (rows, D) k^T, the packed k^T's columns j0..
            at::native::cpublas::brgemm(rows, width, P.D, P.q_sl, P.s_pad, width, false,
                                        bf16(qh),
                                        bf16(P.kpack + (b * P.Hkv + hk) * P.D * P.s_pad + 2 * j0),
                                        x, true);
          else if (h16)
            gemm16(h16, 'T', 'N', width, rows, P.D, alpha, kh + j0 * P.k_sl, P.k_sl, qh, P.q_sl, 0.0f, x, width);
          else
            gemm('T', 'N', width, rows, P.D, alpha, kt, k_ld, q, q_ld, T(0), x, width);
        } else {
          gemm('T', 'N', width, rows, P.D, alpha, kt, k_ld, q, q_ld, T(0), x, width);
        }
        // 16-bit inputs: the weights go to pbuf in the inputs' format, row by row as they are
        // made (pstride apart: brgemm pairs keys, so its rows have an even length, the pad key 0).
        const int64_t pstride = P.kpack ? (width + 1) & ~int64_t(1) : width;
        uint16_t* const pb = h16 ? W.pbuf.data() : nullptr;
        auto weights = [&](T* xr, T centre, int64_t r) -> T {  // sum exp(x - centre) of row r
          if constexpr (std::is_same_v<T, float>) {
            if (h16 == kBF16) return exp_row_to(xr, width, centre, reinterpret_cast<at::BFloat16*>(pb + r * pstride));
            if (h16 == kF16) return exp_row_to(xr, width, centre, reinterpret_cast<at::Half*>(pb + r * pstride));
          }
          return exp_row(xr, width, centre);
        };
        auto weighted_weights = [&](T* xr, T centre, int64_t r, T* weighted) -> T {  // also sum p (x - centre)
          if constexpr (std::is_same_v<T, float>) {
            if (h16 == kBF16)
              return exp_row_weighted_to(xr, width, centre, weighted, reinterpret_cast<at::BFloat16*>(pb + r * pstride));
            if (h16 == kF16) return exp_row_weighted_to(xr, width, centre, weighted, reinterpret_cast<at::Half*>(pb + r * pstride));
          }
          return exp_row_weighted(xr, width, centre, weighted);
        };
        for (int64_t r = 0; r < rows; ++r) {
          T* xr = x + r * width;
          if (settled[r] && !P.bmask) {  // one pass: no ALiBi or float mask where rows settle
            // Every logit of the row is at least -bound (no ALiBi or mask here): where m + bound
            // stays 9 short of -floor (a margin far above the products' rounding), no weight
            // reaches the floor (a NaN keeps the test).
            const bool floored = !(m[r] + bound[r] <= -exp_floor<T>() - T(9));
            SettledStats<T> tile;
            SettledStats<T>* const st = stats ? &tile : nullptr;
            T sum;
            if constexpr (std::is_same_v<T, float>) {
              if (h16 == kBF16)
                sum = settled_row(P, i0 + r, j0, width, xr, m[r], pre, reinterpret_cast<at::BFloat16*>(pb + r * pstride), floored, st);
              else if (h16 == kF16)
                sum = settled_row(P, i0 + r, j0, width, xr, m[r], pre, reinterpret_cast<at::Half*>(pb + r * pstride), floored, st);
              else
                sum = settled_row(P, i0 + r, j0, width, xr, m[r], pre, xr, floored, st);  // in place: each entry read before written
            } else {
              sum = settled_row(P, i0 + r, j0, width, xr, m[r], pre, xr, floored, st);
            }
            l[r] += sum;
            if (stats) w[r] += tile.weighted, top[r] = std::max(top[r], tile.top), seen[r] += tile.visible;
            continue;
          }
          if (settled[r]) {  // hidden keys are -inf, so weight 0
            if (stats) {
              int64_t visible = 0;
              const T tile_max = score_row(P, b, h, i0 + r, j0, width, xr, static_cast<T*>(nullptr), &visible, true, pre);
              T weighted;
              l[r] += weighted_weights(xr, m[r], r, &weighted);
              w[r] += weighted, top[r] = std::max(top[r], tile_max), seen[r] += visible;
            } else {
              score_row(P, b, h, i0 + r, j0, width, xr, static_cast<T*>(nullptr), nullptr, false, pre);
              l[r] += weights(xr, m[r], r);
            }
            continue;
          }
          int64_t visible = 0;
          const T tile_max = score_row(P, b, h, i0 + r, j0, width, xr, static_cast<T*>(nullptr), stats ? &visible : nullptr, true, pre);
          seen[r] += visible;
          // NaN (from NaN inputs, or products that overflowed to inf - inf) must reach the output.
          const T m_new = std::isnan(tile_max) ? tile_max : std::max(m[r], tile_max);
          if (m_new == neg_inf) {  // nothing visible to this row yet
            std::fill(xr, xr + width, T(0));
            if (pb) std::fill(pb + r * pstride, pb + r * pstride + width, uint16_t(0));  // +0 in both formats
            continue;
          }
          const T rescale = std::exp(m[r] - m_new);  // 0 while m = -inf
          if (stats) {
            T weighted;
            const T sum = weighted_weights(xr, m_new, r, &weighted);
            // Re-centre the running sum of p (s - m) on the new max, then add this tile's.
            w[r] = l[r] > T(0) ? rescale * (w[r] + l[r] * (m[r] - m_new)) + weighted : weighted;
            l[r] = rescale * l[r] + sum;
          } else {
            l[r] = rescale * l[r] + weights(xr, m_new, r);
          }
          if (rescale != T(1)) {
            T* ar = acc.data() + r * P.Dv;
            for (int64_t c = 0; c < P.Dv; ++c) ar[c] *= rescale;
          }
          m[r] = m_new, top[r] = m_new;
          settled[r] = settles && bound[r] - m_new <= limit;  // false for NaN
        }
        if constexpr (std::is_same_v<T, float>) {
          if (P.kpack) {  // acc (rows, Dv) += p (rows, pstride) v, the packed v's keys j0..
            if (pstride != width)
              for (int64_t r = 0; r < rows; ++r) pb[r * pstride + width] = 0;  // the pair's second key: weight 0
            at::native::cpublas::brgemm(rows, P.Dv, pstride, pstride, P.Dv, P.Dv, true, bf16(pb),
                                        bf16(P.vpack + (b * P.Hkv + hk) * P.s_pad * P.Dv + j0 * P.Dv),
                                        acc.data(), true);
          } else if (h16) {  // the weights in the inputs' format, products accumulated in float32 (as torch)
            gemm16(h16, 'N', 'N', P.Dv, rows, width, 1.0f, vh + j0 * P.v_sl, P.v_sl, pb, width, 1.0f, acc.data(), P.Dv);
          } else {
            gemm('N', 'N', P.Dv, rows, width, T(1), vt, v_ld, x, width, T(1), acc.data(), P.Dv);
          }
        } else {
          gemm('N', 'N', P.Dv, rows, width, T(1), vt, v_ld, x, width, T(1), acc.data(), P.Dv);
        }
      }
      const int64_t row0 = (b * P.H + h) * P.o_rows + P.o_start + i0;
      bool suspect = false;
      for (int64_t r = 0; r < rows; ++r) {
        const bool has = l[r] != T(0);  // a NaN sum (NaN inputs) is no empty row: NaN reaches the output
        const T safe = has ? l[r] : T(1);
        T* ar = acc.data() + r * P.Dv;
        // out16: the float32 row in place of its accumulator, then rounded to the 16-bit output.
        T* dst = O.out16 ? ar : O.out + (row0 + r) * P.Dv;
        // The row, and its largest |entry| (NaN if any is NaN), vectorised.
        T peak = T(0);
        if (has) {
          using Vec = Vectorized<T>;
          constexpr int64_t n = Vec::size();
          const Vec vsafe(safe);
          Vec vpeak(T(0));
          int64_t c = 0;
          for (; c + n <= P.Dv; c += n) {
            const Vec value = Vec::loadu(ar + c) / vsafe;
            value.store(dst + c);
            vpeak = at::vec::maximum(vpeak, value.abs());  // NaN propagates
          }
          peak = at::vec::vec_reduce_all<T>([](const Vec& a, const Vec& v) { return at::vec::maximum(a, v); }, vpeak);
          for (; c < P.Dv; ++c) {
            dst[c] = ar[c] / safe;
            const T a = std::abs(dst[c]);
            if (std::isnan(a) || a > peak) peak = a;  // a NaN peak stays NaN
          }
        } else {
          std::fill(dst, dst + P.Dv, T(0));
        }
        if constexpr (std::is_same_v<T, float>) {
          if (O.out16) {
            uint16_t* row16 = O.out16 + (row0 + r) * P.Dv;
            if (O.out16_kind == kBF16)
              round_row(dst, P.Dv, reinterpret_cast<at::BFloat16*>(row16));
            else
              round_row(dst, P.Dv, reinterpret_cast<at::Half*>(row16));
          }
        }
        // Finite and not all zeros (once rounded, for 16-bit inputs): floor < peak < ceiling.
        suspect = suspect || (P.Dv > 0 && !(peak > O.floor && peak < O.ceiling));  // false for NaN
        O.lse[row0 + r] = has ? m[r] + std::log(safe) : neg_inf;
        O.m[row0 + r] = has ? m[r] : T(0);
        O.l[row0 + r] = safe;
        if (stats) {
          O.max_logit[row0 + r] = has ? top[r] : neg_inf;
          // exp(top - m) / l: 1 / l where the row never settled (top = m; NaN: NaN either way).
          O.max_prob[row0 + r] = has ? (top[r] == m[r] ? T(1) : std::exp(top[r] - m[r])) / safe : T(0);
          O.entropy[row0 + r] = has ? std::max(T(0), std::log(safe) - w[r] / safe) : T(0);
          O.visible[row0 + r] = seen[r];
        }
      }
      if (suspect) O.suspect->store(true, std::memory_order_relaxed);
    }
  }
}

// Tasks [0, n) on every thread, handed out one at a time from a shared counter (dynamic, in
// order) rather than split into equal ranges up front: a thread that starts late, or loses its
// core for a while, leaves its share to the others instead of making everyone wait for it. Each
// thread makes its scratch once (make()) and runs run(task, scratch) under SerialBlas.
template <typename Make, typename Run>
void parallel_tasks(int64_t n, Make make, Run run) {
  if (n <= 0) return;
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    SerialBlas serial;
    auto W = make();
    for (int64_t task = next.fetch_add(1, std::memory_order_relaxed); task < n;
         task = next.fetch_add(1, std::memory_order_relaxed))
      run(task, W);
  });
}

// Query blocks of packed sequences, (sequence, block) pairs in order: the unit of parallel work.
template <typename T>
std::vector<std::pair<int64_t, int64_t>> sequence_blocks(const Problem<T>& P) {
  std::vector<std::pair<int64_t, int64_t>> blocks;
  for (int64_t s = 0; s < P.nseq; ++s) {
    const int64_t* span = P.spans + 4 * s;
    const int64_t L = span[1] - span[0], S = span[3] - span[2];
    if (S == 0) continue;  // rows without keys: the caller's zeros
    for (int64_t qb = 0; qb * P.block_q < L; ++qb) blocks.emplace_back(s, qb);
  }
  return blocks;
}

// max_j |k_j| from max_j |k_j|^2 (best), but inf where max |v| (vmax) is too large: see head_key_norm.
template <typename T>
T settle_norm(const Problem<T>& P, T best, T vmax) {
  const T room = std::numeric_limits<T>::max() / (T(256) * static_cast<T>(P.S) * std::exp(-exp_floor<T>() / 2));
  return vmax <= room ? std::sqrt(best) : std::numeric_limits<T>::infinity();  // NaN vmax: inf
}

// max_j |k_j| of one key head (NaN if some |k_j| is NaN): the settled offset's key side
// (forward_block). Inf where the head's values are so large (max |v| above max / (256 S e^limit))
// that weights up to e^limit could overflow the accumulator: such heads keep the running max.
template <typename T, typename E>
T head_key_norm(const Problem<T>& P, const E* k, const E* v) {
  using Vec = Vectorized<T>;
  constexpr int64_t n = Vec::size();
  T best = T(0);
  for (int64_t j = 0; j < P.S; ++j) {
    const T ss = sum_squares<T>(k + j * P.k_sl, P.D);
    if (std::isnan(ss)) {
      best = ss;
      break;
    }
    best = std::max(best, ss);
  }
  Vec vpeak(T(0));
  T vmax = T(0);
  for (int64_t j = 0; j < P.S; ++j) {
    const E* vr = v + j * P.v_sl;
    int64_t c = 0;
    for (; c + n <= P.Dv; c += n) vpeak = at::vec::maximum(vpeak, load_as<T>(vr + c).abs());  // NaN stays
    for (; c < P.Dv; ++c) {
      const T e = static_cast<T>(vr[c]);
      vmax = std::isnan(e) ? e : std::max(vmax, std::abs(e));
    }
  }
  const T peak = at::vec::vec_reduce_all<T>([](const Vec& a, const Vec& b) { return at::vec::maximum(a, b); }, vpeak);
  if (std::isnan(peak) || peak > vmax) vmax = peak;  // a NaN (in either) stays, and fails the test below
  return settle_norm(P, best, vmax);
}

// head_key_norm of key head bh (batch bh / Hkv), in whichever format the problem's k and v are.
template <typename T>
T key_norm(const Problem<T>& P, int64_t bh) {
  const int64_t k_at = (bh / P.Hkv) * P.k_sb + (bh % P.Hkv) * P.k_sh, v_at = (bh / P.Hkv) * P.v_sb + (bh % P.Hkv) * P.v_sh;
  if constexpr (std::is_same_v<T, float>) {
    if (P.half == kBF16)
      return head_key_norm(P, reinterpret_cast<const at::BFloat16*>(P.kh + k_at), reinterpret_cast<const at::BFloat16*>(P.vh + v_at));
    if (P.half == kF16)
      return head_key_norm(P, reinterpret_cast<const at::Half*>(P.kh + k_at), reinterpret_cast<const at::Half*>(P.vh + v_at));
  }
  return head_key_norm(P, P.k + k_at, P.v + v_at);
}

template <typename T>
std::vector<T> key_norms(const Problem<T>& P) {
  std::vector<T> out(P.B * P.Hkv);
  at::parallel_for(0, P.B * P.Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) out[bh] = key_norm(P, bh);
  });
  return out;
}

// Whether torch's brgemm multiplies bfloat16 tiles in VNNI-2 layout here: its oneDNN microkernel
// runs from AVX-512 on (natively with AVX512-BF16 or AMX), with oneDNN enabled
// (torch.backends.mkldnn); elsewhere brgemm refuses such calls. torch exports no test of its own
// (could_pack asks for AMX, which its packing routine needs, not brgemm), so one 2 x 2 x 2 product
// is tried, once; whether oneDNN is enabled is asked on every call (the user may switch it off).
bool brgemm_runs() {
  if (!at::globalContext().userEnabledMkldnn()) return false;
  static const bool runs = [] {
    const uint16_t one = 0x3f80, two = 0x4000;  // bfloat16 1 and 2
    const uint16_t a[4] = {one, two, one, one}, b[4] = {one, one, two, one};  // b: [k pair][n][2]
    float c[4] = {0, 0, 0, 0};
    try {
      at::native::cpublas::brgemm(2, 2, 2, 2, 2, 2, false, bf16(a), bf16(b), c, true);
      at::native::cpublas::brgemm_release(true);
    } catch (const c10::Error&) {
      return false;
    }
    // a = [[1, 2], [1, 1]], b = [[1, 2], [1, 1]] (b's VNNI pairs: column 0 (1, 1), column 1 (2, 1))
    return c[0] == 3.0f && c[1] == 4.0f && c[2] == 2.0f && c[3] == 3.0f;
  }();
  return runs;
}

// Whether brgemm takes this problem's products: bfloat16 where it runs (brgemm_runs), an even head
// dim (VNNI pairs of d), and values with columns (brgemm takes no empty product: Dv = 0 goes to
// oneMKL's, which skips it). The backward also needs an even value dim (dout v^T pairs v's columns).
template <typename T>
bool takes_brgemm(const Problem<T>& P, bool backward) {
  return P.half == kBF16 && !P.widen && P.D % 2 == 0 && P.D > 0 && P.S > 0 && P.Dv > 0 && (!backward || P.Dv % 2 == 0) &&
         brgemm_runs();
}

// Rows a, b (b null: zeros) of 16-bit entries interleaved as brgemm's VNNI-2 pair row, width pairs.
// kPeak: also the rows' largest |entry| as bfloat16 bits with the sign cleared, into *peak (as
// integers those order the magnitudes: inf 0x7f80, a NaN above it).
template <bool kPeak = false>
inline void pair_rows(const uint16_t* a, const uint16_t* b, int64_t width, uint16_t* out, uint16_t* peak = nullptr) {
  uint32_t* o = reinterpret_cast<uint32_t*>(out);
  uint16_t top = kPeak ? *peak : 0;
  if (b) {
    for (int64_t c = 0; c < width; ++c) {
      o[c] = uint32_t(a[c]) | uint32_t(b[c]) << 16;
      if constexpr (kPeak) top = std::max<uint16_t>(top, std::max<uint16_t>(a[c] & 0x7fff, b[c] & 0x7fff));
    }
  } else {
    for (int64_t c = 0; c < width; ++c) {
      o[c] = uint32_t(a[c]);
      if constexpr (kPeak) top = std::max<uint16_t>(top, a[c] & 0x7fff);
    }
  }
  if constexpr (kPeak) *peak = top;
}

// brgemm's VNNI-2 layouts of a key head's (S, width) rows x (row stride sl, 16-bit entries):
// transposed, (width/2, s_pad, 2): the pair (x[j][2p], x[j][2p + 1]) at [p][j] (width even);
// paired, (s_pad/2, width, 2): rows (2i, 2i + 1) interleaved per column, [i][c][2]. The pad row
// (S odd) is zero in both.
inline void pack_transposed(const uint16_t* x, int64_t sl, int64_t S, int64_t width, int64_t s_pad, uint16_t* out) {
  // One 32-bit move per pair, 16 rows at a time, so that each pair row is written 64 contiguous
  // bytes at a time.
  uint32_t* d = reinterpret_cast<uint32_t*>(out);
  constexpr int64_t rows = 16;
  for (int64_t j0 = 0; j0 < S; j0 += rows) {
    const int64_t j1 = std::min(j0 + rows, S);
    for (int64_t p = 0; p < width / 2; ++p) {
      uint32_t* row = d + p * s_pad;
      for (int64_t j = j0; j < j1; ++j) std::memcpy(row + j, x + j * sl + 2 * p, sizeof(uint32_t));
    }
  }
  if (s_pad != S)
    for (int64_t p = 0; p < width / 2; ++p) d[p * s_pad + S] = 0;
}

// kPeak (bfloat16 rows): returns their largest |entry| as pair_rows gives it, so the forward's
// pass over v for head_key_norm's test rides on the packing's reads (0 without).
template <bool kPeak = false>
inline uint16_t pack_paired(const uint16_t* x, int64_t sl, int64_t S, int64_t width, int64_t s_pad, uint16_t* out) {
  uint16_t peak = 0;
  for (int64_t j = 0; j < s_pad; j += 2) {
    pair_rows<kPeak>(x + j * sl, j + 1 < S ? x + (j + 1) * sl : nullptr, width, out + j * width, &peak);
  }
  return peak;
}

// max_j |k_j|^2 over a key head's bfloat16 keys from their packed k^T (pack_transposed's (width/2,
// s_pad, 2) pairs, just written, in the caches): each key's squares summed down its column, a
// vector of keys at a time, with no sum across lanes per key (sum_squares' reduction, key by key,
// cost more than the packing). NaN if some key's sum is NaN.
inline float packed_key_norm2(const uint16_t* kt, int64_t S, int64_t width, int64_t s_pad) {
  using Vec = Vectorized<float>;
  using IVec = Vectorized<int32_t>;
  constexpr int64_t n = Vec::size();
  const int32_t* d = reinterpret_cast<const int32_t*>(kt);
  const IVec high(static_cast<int32_t>(0xffff0000u)), shift(16);
  Vec best(0.0f);
  for (int64_t j = 0; j < S; j += n) {
    const int64_t count = std::min<int64_t>(n, S - j);
    Vec ss(0.0f);
    for (int64_t p = 0; p < width / 2; ++p) {
      // A pair's two bfloat16 entries as floats: the low one shifted up, the high one masked.
      const IVec pair = count == n ? IVec::loadu(d + p * s_pad + j) : IVec::loadu(d + p * s_pad + j, count);
      const Vec lo = at::vec::cast<float>(pair << shift), hi = at::vec::cast<float>(pair & high);
      ss = at::vec::fmadd(hi, hi, at::vec::fmadd(lo, lo, ss));
    }
    best = at::vec::maximum(best, ss);  // NaN propagates; lanes past S hold 0
  }
  return at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return at::vec::maximum(a, b); }, best);
}

// Memory for one call's packed operands (n entries), valid until the calling thread's next call.
// Up to kPackKeep bytes it is the calling thread's, kept from call to call: an allocation that
// large comes fresh from the system (mmap), and faulting its pages in on every call can cost as
// much as the products themselves (bfloat16 calls of a few dozen query rows). Larger ones are the
// call's own (in own).
constexpr int64_t kPackKeep = int64_t(64) << 20;

struct PackFree {
  void operator()(uint16_t* p) const { std::free(p); }
};
using PackPtr = std::unique_ptr<uint16_t[], PackFree>;

// n entries on a 2 MiB boundary, advised to huge pages (the packs' rows are long strides apart).
// From malloc, a pack's place in the caches depended on where the process's memory lay, and the
// same bfloat16 forward ran markedly slower in some processes than in others (never with address
// randomisation off); on the boundary every process runs at the fast time.
PackPtr pack_alloc(int64_t n) {
  constexpr size_t huge = size_t(2) << 20;
  const size_t bytes = (size_t(n) * sizeof(uint16_t) + huge - 1) / huge * huge;
  void* p = std::aligned_alloc(huge, bytes);
  if (p == nullptr) throw std::bad_alloc();
  madvise(p, bytes, MADV_HUGEPAGE);
  return PackPtr(static_cast<uint16_t*>(p));
}

uint16_t* pack_memory(int64_t n, PackPtr& own) {
  static thread_local PackPtr kept;
  static thread_local int64_t kept_n = 0;
  n = std::max<int64_t>(n, 1);
  if (n * int64_t(sizeof(uint16_t)) > kPackKeep) {
    own = pack_alloc(n);
    return own.get();
  }
  if (n > kept_n) {
    kept.reset();  // before the larger one: never both at once
    kept_n = 0;
    kept = pack_alloc(n);
    kept_n = n;
  }
  return kept.get();
}

// brgemm's operands of every key head in VNNI-2 layouts (memory from pack_memory, every entry
// written): the forward's k^T and v (Problem::kpack, vpack), or the backward's k^T, v^T and k
// (kpack, vtpack, kpairs). Packed sequences pack each sequence's keys on their own
// (Problem::seq_packs, in seqs). Returns the call's own memory (null where the thread's serves).
// kmax (or null; forward only): each key head's key_norm, (B, Hkv) (packed sequences: (nseq,
// Hkv), each sequence's own, in seqs), made beside the packing: max |v| from the values the packing
// reads, max |k_j| from the packed k^T, still in the caches (packed_key_norm2).
template <typename T>
PackPtr pack_problem(Problem<T>& P, bool backward, SequencePacks& seqs, T* kmax = nullptr) {
  const int64_t D = P.D, Dv = P.Dv, n = P.spans ? P.nseq : 1;
  const int64_t per_key = backward ? 2 * D + Dv : D + Dv;
  std::vector<Problem<T>> parts;
  std::vector<int64_t> start{0};
  for (int64_t s = 0; s < n; ++s) {
    parts.push_back(P.spans ? P.sequence(s) : P);
    const Problem<T>& Q = parts.back();
    start.push_back(start.back() + Q.B * Q.Hkv * ((Q.S + 1) & ~int64_t(1)) * per_key);
  }
  PackPtr own;
  uint16_t* const memory = pack_memory(start.back(), own);
  // Each part's k^T, then v (forward) or v^T (backward), then k (backward), where packing writes them.
  std::vector<std::array<uint16_t*, 3>> out(n);
  for (int64_t s = 0; s < n; ++s) {
    Problem<T>& Q = parts[s];
    const int64_t s_pad = (Q.S + 1) & ~int64_t(1), heads = Q.B * Q.Hkv;
    uint16_t* kpack = memory + start[s];
    uint16_t* second = kpack + heads * D * s_pad;
    out[s] = {kpack, second, backward ? second + heads * Dv * s_pad : nullptr};
    Q.kpack = kpack, Q.s_pad = s_pad;
    if (backward)
      Q.vtpack = second, Q.kpairs = out[s][2];
    else
      Q.vpack = second;
  }
  std::vector<std::pair<int64_t, int64_t>> units;  // (part, batch-and-key-head)
  for (int64_t s = 0; s < n; ++s)
    for (int64_t bh = 0; bh < parts[s].B * parts[s].Hkv; ++bh) units.emplace_back(s, bh);
  at::parallel_for(0, static_cast<int64_t>(units.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const auto [s, bh] = units[u];
      const Problem<T>& Q = parts[s];
      const int64_t bi = bh / Q.Hkv, hk = bh % Q.Hkv;
      const uint16_t* k = Q.kh + bi * Q.k_sb + hk * Q.k_sh;
      const uint16_t* v = Q.vh + bi * Q.v_sb + hk * Q.v_sh;
      const auto& [kt, second, kp] = out[s];
      pack_transposed(k, Q.k_sl, Q.S, D, Q.s_pad, kt + bh * D * Q.s_pad);
      if (backward) {
        pack_transposed(v, Q.v_sl, Q.S, Dv, Q.s_pad, second + bh * Dv * Q.s_pad);
        pack_paired(k, Q.k_sl, Q.S, D, Q.s_pad, kp + bh * Q.s_pad * D);
      } else if (kmax) {  // head_key_norm's result, from the packing's reads and the packed k^T
        const uint16_t peak = pack_paired<true>(v, Q.v_sl, Q.S, Dv, Q.s_pad, second + bh * Q.s_pad * Dv);
        const float vmax = peak > 0x7f80 ? std::numeric_limits<float>::quiet_NaN() : static_cast<float>(c10::BFloat16(peak, c10::BFloat16::from_bits()));
        kmax[s * Q.B * Q.Hkv + bh] = settle_norm(Q, static_cast<T>(packed_key_norm2(kt + bh * D * Q.s_pad, Q.S, D, Q.s_pad)), static_cast<T>(vmax));
      } else {
        pack_paired(v, Q.v_sl, Q.S, Dv, Q.s_pad, second + bh * Q.s_pad * Dv);
      }
    }
  });
  if (P.spans) {
    for (const Problem<T>& Q : parts) {
      seqs.kpack.push_back(Q.kpack), seqs.vpack.push_back(Q.vpack), seqs.vtpack.push_back(Q.vtpack);
      seqs.kpairs.push_back(Q.kpairs), seqs.s_pad.push_back(Q.s_pad);
    }
    if constexpr (std::is_same_v<T, float>)
      if (kmax)
        for (int64_t s = 0; s < n; ++s) seqs.kmax.push_back(kmax + s * parts[s].B * parts[s].Hkv);
    P.seq_packs = &seqs;
  } else {
    P.kpack = parts[0].kpack, P.vpack = parts[0].vpack, P.vtpack = parts[0].vtpack, P.kpairs = parts[0].kpairs;
    P.s_pad = parts[0].s_pad;
  }
  return own;
}

// Parallel over batch, heads and query blocks (packed: heads and every sequence's query blocks).
template <typename T>
void forward_kernel(const Problem<T>& P, const ForwardOut<T>& O) {
  auto make = [&] { return ForwardScratch<T>(P); };
  if (P.spans) {
    const auto blocks = sequence_blocks(P);
    const int64_t nb = static_cast<int64_t>(blocks.size());
    parallel_tasks(P.H * nb, make, [&](int64_t task, ForwardScratch<T>& W) {
      const auto [s, qb] = blocks[task % nb];
      forward_block(P.sequence(s), O, 0, task / nb, qb, W);
    });
    return;
  }
  // Head by head, each head's query blocks last to first: under causality the last see the most
  // keys, so the work left at the end, when threads run out of tasks, is the smallest.
  const int64_t nqb = P.q_blocks();
  parallel_tasks(P.B * P.H * nqb, make, [&](int64_t task, ForwardScratch<T>& W) {
    forward_block(P, O, task / (nqb * P.H), (task / nqb) % P.H, nqb - 1 - task % nqb, W);
  });
}

template <typename T>
struct BackwardIO {
  const T* dout;   // (B, H, L, Dv) contiguous
  const T* delta;  // (B, H, L): rowsum(dO * O) - dlse
  const T* m;      // the forward's normaliser
  const T* l;
  T* dq;  // (B, H, L, D), written
  T* dk;  // (B, H, S, D) per query head, accumulated (the caller sums each group); grouped: (B, Hkv, S, D)
  T* dv;  // (B, H, S, Dv) per query head, accumulated; grouped: (B, Hkv, S, Dv)
  bool grouped;  // one task per key head runs its whole group: dk, dv per key head, no scratch
  // 16-bit inputs (Problem::half): dout in their format, for the products (null otherwise).
  const uint16_t* dout16 = nullptr;
};

// One thread's buffers for backward tasks.
template <typename T>
struct BackwardScratch {
  Scratch<T> sbuf, tbuf, dpbuf, dqb;
  // 16-bit inputs: the weights and dS in their format, for the products; with brgemm (rows and
  // keys rounded up to even, pads zero) dS row by row (ds16, padded rows of keys), the weights and
  // dS in pairs of rows (pv, dsv: VNNI-2), and the query block's q^T and dout^T (qt, dot).
  Scratch<uint16_t> p16, ds16, pv, dsv, qt, dot;
  // With brgemm, the task's dk^T (D, S) and dv^T (Dv, S): brgemm writes rows of C, and these are
  // the rows that take a tile's keys as columns; transposed into dk, dv once per task.
  Scratch<T> dkt, dvt;
  bool brgemm;
  explicit BackwardScratch(const Problem<T>& P)
      : sbuf(P.tile_rows() * P.tile_width()), tbuf(P.softcap != T(0) ? P.tile_rows() * P.tile_width() : 0),
        dpbuf(P.tile_rows() * P.tile_width()), dqb(P.tile_rows() * P.D),
        p16(P.half ? even(P.tile_rows()) * even(P.tile_width()) : 0),
        ds16(P.half ? even(P.tile_rows()) * even(P.tile_width()) : 0),
        pv(P.brgemm() ? even(P.tile_rows()) * P.tile_width() : 0), dsv(P.brgemm() ? even(P.tile_rows()) * P.tile_width() : 0),
        qt(P.brgemm() ? P.D * even(P.tile_rows()) : 0), dot(P.brgemm() ? P.Dv * even(P.tile_rows()) : 0),
        dkt(P.brgemm() ? P.D * P.S : 0), dvt(P.brgemm() ? P.Dv * P.S : 0), brgemm(P.brgemm()) {}
  ~BackwardScratch() {
    if (brgemm) at::native::cpublas::brgemm_release(true);
  }
  BackwardScratch(BackwardScratch&&) = delete;
  static int64_t even(int64_t n) { return (n + 1) & ~int64_t(1); }
};

// rows x cols 16-bit entries (row stride ld) transposed into (cols, rows_pad), the pad column zero.
inline void transpose16(const uint16_t* x, int64_t ld, int64_t rows, int64_t cols, int64_t rows_pad, uint16_t* out) {
  constexpr int64_t tile = 16;
  for (int64_t r0 = 0; r0 < rows; r0 += tile)
    for (int64_t c0 = 0; c0 < cols; c0 += tile)
      for (int64_t c = c0; c < std::min(c0 + tile, cols); ++c)
        for (int64_t r = r0; r < std::min(r0 + tile, rows); ++r) out[c * rows_pad + r] = x[r * ld + c];
  for (int64_t r = rows; r < rows_pad; ++r)
    for (int64_t c = 0; c < cols; ++c) out[c * rows_pad + r] = 0;
}

// float32 rows as 16-bit ones of the format `kind` (Half16), n entries.
inline void round_to(int kind, const float* x, int64_t n, uint16_t* out) {
  if (kind == kBF16)
    round_row(x, n, reinterpret_cast<at::BFloat16*>(out));
  else
    round_row(x, n, reinterpret_cast<at::Half*>(out));
}

// Head h of batch b: every query block, accumulating its dk, dv rows (the query head's own, or its
// key head's when grouped); dk is not yet multiplied by the scale (the caller does, once per row).
template <typename T>
void backward_head(const Problem<T>& P, const BackwardIO<T>& IO, int64_t b, int64_t h, BackwardScratch<T>& W) {
  using Vec = Vectorized<T>;
  constexpr int64_t n = Vec::size();
  const int64_t nqb = P.q_blocks(), G = P.G();
  const bool capped = P.softcap != T(0);
  const T alpha = capped ? P.scale / P.softcap : P.scale;
  Scratch<T>&sbuf = W.sbuf, &tbuf = W.tbuf, &dpbuf = W.dpbuf, &dqb = W.dqb;
  {
    {
      const int64_t hk = h / G;
      // 16-bit inputs: the same five products on the 16-bit q, k, v, dout and on the weights and dS
      // rounded to their format, accumulated in float32 (oneMKL), as torch's CPU kernel does.
      const bool half = P.half != kNoHalf;
      const T* k = half ? nullptr : P.k + b * P.k_sb + hk * P.k_sh;
      const T* v = half ? nullptr : P.v + b * P.v_sb + hk * P.v_sh;
      const uint16_t* kh = half ? P.kh + b * P.k_sb + hk * P.k_sh : nullptr;
      const uint16_t* vh = half ? P.vh + b * P.v_sb + hk * P.v_sh : nullptr;
      const int64_t kv_head = IO.grouped ? b * P.Hkv + hk : b * P.H + h;
      T* dk = IO.dk + (kv_head * P.k_rows + P.k_out_start) * P.D;
      T* dv = IO.dv + (kv_head * P.k_rows + P.k_out_start) * P.Dv;
      // brgemm (bfloat16, P.kpack): x = q k^T and dp = dout v^T on the packed k^T, v^T; dq += dS k
      // on the packed k; dk^T += q^T dS and dv^T += dout^T p on dS and p in pairs of rows (W.dkt,
      // W.dvt: the caller transposes them into dk, dv).
      const bool packed = P.kpack != nullptr;
      const uint16_t *kt_head = nullptr, *vt_head = nullptr, *kp_head = nullptr;
      if (packed) {
        const int64_t bh = b * P.Hkv + hk;
        kt_head = P.kpack + bh * P.D * P.s_pad, vt_head = P.vtpack + bh * P.Dv * P.s_pad, kp_head = P.kpairs + bh * P.s_pad * P.D;
      }
      const T pre = packed ? alpha : T(1);  // brgemm's products come unscaled: score_row scales them
      for (int64_t qb = 0; qb < nqb; ++qb) {
        const int64_t i0 = qb * P.block_q, i1 = std::min(i0 + P.block_q, P.L), rows = i1 - i0;
        const T* q = half ? nullptr : P.q + b * P.q_sb + h * P.q_sh + i0 * P.q_sl;
        const uint16_t* qh = half ? P.qh + b * P.q_sb + h * P.q_sh + i0 * P.q_sl : nullptr;
        const int64_t row0 = (b * P.H + h) * P.o_rows + P.o_start + i0;
        const T* dout = IO.dout + row0 * P.Dv;
        const uint16_t* dout16 = half ? IO.dout16 + row0 * P.Dv : nullptr;
        std::fill(dqb.begin(), dqb.begin() + rows * P.D, T(0));
        const int64_t rp = BackwardScratch<T>::even(rows);  // brgemm: the products over rows take pairs
        if (packed) {
          transpose16(qh, P.q_sl, rows, P.D, rp, W.qt.data());
          transpose16(dout16, P.Dv, rows, P.Dv, rp, W.dot.data());
        }
        for (auto [j0, j1] : P.key_tiles(i0, i1)) {
          const int64_t width = j1 - j0;
          T* x = sbuf.data();
          T* t = capped ? tbuf.data() : nullptr;
          // The five products, each in the inputs' format: (transposes, m, n, k, alpha, A, lda, B,
          // ldb, beta, C, ldc) column-major, the 16-bit operands where the inputs are 16-bit.
          auto product = [&](char ta, char tb, int64_t mm, int64_t nn, int64_t kk, T a, const T* A, const uint16_t* A16,
                             int64_t lda, const T* Bm, const uint16_t* B16, int64_t ldb, T beta, T* C, int64_t ldc) {
            if constexpr (std::is_same_v<T, float>) {
              if (half) return gemm16(P.half, ta, tb, mm, nn, kk, a, A16, lda, B16, ldb, beta, C, ldc);
            }
            gemm(ta, tb, mm, nn, kk, a, A, lda, Bm, ldb, beta, C, ldc);
          };
          if constexpr (std::is_same_v<T, float>) {
            if (packed)  // x (rows, width) = q k^T, the packed k^T's columns j0.. (as the forward)
              at::native::cpublas::brgemm(rows, width, P.D, P.q_sl, P.s_pad, width, false, bf16(qh), bf16(kt_head + 2 * j0), x, true);
          }
          if (!packed)
            product('T', 'N', width, rows, P.D, alpha, k + (half ? 0 : j0 * P.k_sl), kh ? kh + j0 * P.k_sl : nullptr, P.k_sl,
                    q, qh, P.q_sl, T(0), x, width);
          for (int64_t r = 0; r < rows; ++r) {  // p = exp(s - m) / l: the forward's weights
            T* xr = x + r * width;
            score_row(P, b, h, i0 + r, j0, width, xr, capped ? t + r * width : nullptr, nullptr, true, pre);
            exp_row(xr, width, IO.m[row0 + r]);
            const Vec vl(IO.l[row0 + r]);
            int64_t c = 0;
            for (; c + n <= width; c += n) (Vec::loadu(xr + c) / vl).store(xr + c);
            for (; c < width; ++c) xr[c] /= IO.l[row0 + r];
          }
          uint16_t* p16 = half ? W.p16.data() : nullptr;
          if constexpr (std::is_same_v<T, float>)
            if (half) round_to(P.half, x, rows * width, p16);
          T* dp = dpbuf.data();
          if constexpr (std::is_same_v<T, float>) {
            if (packed) {  // dv^T (Dv, width) += dout^T p ; dp (rows, width) = dout v^T
              for (int64_t r = 0; r < rp; r += 2)
                pair_rows(p16 + r * width, r + 1 < rows ? p16 + (r + 1) * width : nullptr, width, W.pv.data() + r * width);
              at::native::cpublas::brgemm(P.Dv, width, rp, rp, width, P.S, true, bf16(W.dot.data()), bf16(W.pv.data()), W.dvt.data() + j0, true);
              at::native::cpublas::brgemm(rows, width, P.Dv, P.Dv, P.s_pad, width, false, bf16(dout16), bf16(vt_head + 2 * j0), dp, true);
            }
          }
          if (!packed) {  // dV += P^T dO ; dP = dO V^T
            product('N', 'T', P.Dv, width, rows, T(1), dout, dout16, P.Dv, x, p16, width, T(1), dv + j0 * P.Dv, P.Dv);
            product('T', 'N', width, rows, P.Dv, T(1), v + (half ? 0 : j0 * P.v_sl), vh ? vh + j0 * P.v_sl : nullptr, P.v_sl,
                    dout, dout16, P.Dv, T(0), dp, width);
          }
          for (int64_t r = 0; r < rows; ++r) {  // dS = P (dP - delta), times (1 - t^2) with softcap
            const T* pr = x + r * width;
            T* dr = dp + r * width;
            const Vec vd(IO.delta[row0 + r]), one(T(1));
            int64_t c = 0;
            if (capped) {
              const T* tr = t + r * width;
              for (; c + n <= width; c += n) {
                const Vec tv = Vec::loadu(tr + c);
                ((Vec::loadu(dr + c) - vd) * Vec::loadu(pr + c) * (one - tv * tv)).store(dr + c);
              }
              for (; c < width; ++c) dr[c] = (dr[c] - IO.delta[row0 + r]) * pr[c] * (T(1) - tr[c] * tr[c]);
            } else {
              for (; c + n <= width; c += n) ((Vec::loadu(dr + c) - vd) * Vec::loadu(pr + c)).store(dr + c);
              for (; c < width; ++c) dr[c] = (dr[c] - IO.delta[row0 + r]) * pr[c];
            }
          }
          uint16_t* ds16 = half ? W.ds16.data() : nullptr;
          if constexpr (std::is_same_v<T, float>) {
            if (packed) {  // dq (rows, D) += dS k ; dk^T (D, width) += q^T dS (the scale multiplies both at the end)
              const int64_t wp = BackwardScratch<T>::even(width);  // brgemm pairs keys: the pad key's dS is 0
              for (int64_t r = 0; r < rows; ++r) {
                round_to(P.half, dp + r * width, width, ds16 + r * wp);
                if (wp != width) ds16[r * wp + width] = 0;
              }
              for (int64_t r = 0; r < rp; r += 2)
                pair_rows(ds16 + r * wp, r + 1 < rows ? ds16 + (r + 1) * wp : nullptr, width, W.dsv.data() + r * width);
              at::native::cpublas::brgemm(rows, P.D, wp, wp, P.D, P.D, true, bf16(ds16), bf16(kp_head + j0 * P.D), dqb.data(), true);
              at::native::cpublas::brgemm(P.D, width, rp, rp, width, P.S, true, bf16(W.qt.data()), bf16(W.dsv.data()), W.dkt.data() + j0, true);
              continue;
            }
            if (half) round_to(P.half, dp, rows * width, ds16);
          }
          // dQ += dS K ; dK += dS^T Q (the scale multiplies both at the end)
          product('N', 'N', P.D, rows, width, T(1), k + (half ? 0 : j0 * P.k_sl), kh ? kh + j0 * P.k_sl : nullptr, P.k_sl,
                  dp, ds16, width, T(1), dqb.data(), P.D);
          product('N', 'T', P.D, width, rows, T(1), q, qh, P.q_sl, dp, ds16, width, T(1), dk + j0 * P.D, P.D);
        }
        T* dq = IO.dq + row0 * P.D;
        for (int64_t e = 0; e < rows * P.D; ++e) dq[e] = dqb[e] * P.scale;
      }
    }
  }
}

// dk rows of (batch-and-head index) kv_head, this problem's keys, times the scale.
template <typename T>
void scale_dk(const Problem<T>& P, const BackwardIO<T>& IO, int64_t kv_head) {
  T* dk = IO.dk + (kv_head * P.k_rows + P.k_out_start) * P.D;
  for (int64_t e = 0; e < P.S * P.D; ++e) dk[e] *= P.scale;
}

// With brgemm: dk, dv rows of (batch-and-head index) kv_head from the task's dk^T (times the
// scale) and dv^T, 16 x 16 blocks at a time.
template <typename T>
void write_dk_dv(const Problem<T>& P, const BackwardIO<T>& IO, int64_t kv_head, const BackwardScratch<T>& W) {
  T* dk = IO.dk + (kv_head * P.k_rows + P.k_out_start) * P.D;
  T* dv = IO.dv + (kv_head * P.k_rows + P.k_out_start) * P.Dv;
  auto transpose = [&](const T* src, int64_t cols, T factor, T* dst) {  // src (cols, S) -> dst (S, cols)
    constexpr int64_t tile = 16;
    for (int64_t j0 = 0; j0 < P.S; j0 += tile)
      for (int64_t c0 = 0; c0 < cols; c0 += tile)
        for (int64_t j = j0; j < std::min(j0 + tile, P.S); ++j)
          for (int64_t c = c0; c < std::min(c0 + tile, cols); ++c) dst[j * cols + c] = src[c * P.S + j] * factor;
  };
  transpose(W.dkt.data(), P.D, P.scale, dk);
  transpose(W.dvt.data(), P.Dv, T(1), dv);
}

// Parallel over batch and heads (packed: heads and sequences; a sequence's rows of dq, dk, dv are
// its own, so tasks never write the same memory).
template <typename T>
void backward_kernel(const Problem<T>& P, const BackwardIO<T>& IO) {
  const int64_t G = P.G(), heads = IO.grouped ? P.Hkv : P.H;  // one task per (sequence or batch, heads)
  auto run = [&](const Problem<T>& Q, int64_t b, int64_t head, BackwardScratch<T>& W) {
    if (W.brgemm) {  // this problem's keys only (a packed sequence's are a share of the scratch)
      std::fill(W.dkt.begin(), W.dkt.begin() + Q.D * Q.S, T(0));
      std::fill(W.dvt.begin(), W.dvt.begin() + Q.Dv * Q.S, T(0));
    }
    if (IO.grouped)
      for (int64_t h = head * G; h < (head + 1) * G; ++h) backward_head(Q, IO, b, h, W);
    else
      backward_head(Q, IO, b, head, W);
    const int64_t kv_head = IO.grouped ? b * Q.Hkv + head : b * Q.H + head;
    if (W.brgemm)
      write_dk_dv(Q, IO, kv_head, W);
    else
      scale_dk(Q, IO, kv_head);
  };
  auto make = [&] { return BackwardScratch<T>(P); };
  if (P.spans) {
    std::vector<int64_t> seqs;
    for (int64_t s = 0; s < P.nseq; ++s)
      if (P.spans[4 * s + 1] > P.spans[4 * s] && P.spans[4 * s + 3] > P.spans[4 * s + 2]) seqs.push_back(s);
    const int64_t ns = static_cast<int64_t>(seqs.size());
    parallel_tasks(heads * ns, make, [&](int64_t task, BackwardScratch<T>& W) { run(P.sequence(seqs[task % ns]), 0, task / ns, W); });
    return;
  }
  parallel_tasks(P.B * heads, make, [&](int64_t task, BackwardScratch<T>& W) { run(P, task / heads, task % heads, W); });
}

inline int half_kind(const torch::Tensor& x) {
  return x.scalar_type() == at::kBFloat16 ? kBF16 : x.scalar_type() == at::kHalf ? kF16 : kNoHalf;
}

template <typename T>
Problem<T> make_problem(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const c10::optional<torch::Tensor>& alibi, const c10::optional<torch::Tensor>& mask,
                        const c10::optional<torch::Tensor>& spans, const Options& o) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "attnscale fused kernel: q, k, v must be 4-d");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "attnscale fused kernel: last dims must be contiguous");
  // BLAS reads each (n, d) matrix with leading dimension = the row stride: rows must not overlap
  // (stride 0 or unfold views), or BLAS refuses the call and the product is never written.
  auto rows_apart = [](const torch::Tensor& x) { return x.stride(2) >= std::max<int64_t>(1, x.size(3)); };
  TORCH_CHECK(rows_apart(q) && rows_apart(k) && rows_apart(v), "attnscale fused kernel: rows must not overlap (row stride >= head dim)");
  Problem<T> P{};
  const auto half = half_kind(q);
  if (half) {  // 16-bit inputs: float problems only
    TORCH_CHECK((std::is_same_v<T, float>) && k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
                "attnscale fused kernel: 16-bit q, k, v share one format and compute in float32");
    TORCH_CHECK(!o.half_products || half_gemm(half),
                "attnscale fused kernel: this torch has no 16-bit products (oneMKL); pass half_products=False or float32 inputs");
    P.half = half;
    P.widen = !o.half_products;
    P.qh = static_cast<const uint16_t*>(q.const_data_ptr());
    P.kh = static_cast<const uint16_t*>(k.const_data_ptr());
    P.vh = static_cast<const uint16_t*>(v.const_data_ptr());
  } else {
    P.q = q.data_ptr<T>();
    P.k = k.data_ptr<T>();
    P.v = v.data_ptr<T>();
  }
  P.q_sb = q.stride(0), P.q_sh = q.stride(1), P.q_sl = q.stride(2);
  P.k_sb = k.stride(0), P.k_sh = k.stride(1), P.k_sl = k.stride(2);
  P.v_sb = v.stride(0), P.v_sh = v.stride(1), P.v_sl = v.stride(2);
  P.B = q.size(0), P.H = q.size(1), P.L = q.size(2), P.D = q.size(3);
  P.Hkv = k.size(1), P.S = k.size(2), P.Dv = v.size(3);
  P.scale = static_cast<T>(o.scale), P.softcap = static_cast<T>(o.softcap);
  P.causal = o.causal, P.q_offset = o.q_offset, P.left = o.left, P.right = o.right;
  P.q_start = o.q_start, P.k_start = o.k_start;
  P.block_q = o.block_q, P.block_k = o.block_k;
  P.o_rows = P.L, P.o_start = 0, P.k_rows = P.S, P.k_out_start = 0;
  if (alibi.has_value()) {
    TORCH_CHECK(alibi->dim() == 2 && alibi->scalar_type() == c10::CppTypeToScalarType<T>::value, "attnscale fused kernel: slopes (B, H) in the compute dtype");
    P.alibi = alibi->data_ptr<T>();
    P.al_sb = alibi->stride(0), P.al_sh = alibi->stride(1);
  }
  if (mask.has_value()) {
    TORCH_CHECK(mask->dim() == 4, "attnscale fused kernel: mask (B, H, L, S)");
    if (mask->scalar_type() == torch::kBool) {
      P.bmask = mask->data_ptr<bool>();
    } else {
      TORCH_CHECK(mask->scalar_type() == c10::CppTypeToScalarType<T>::value, "attnscale fused kernel: float mask in the compute dtype");
      P.fmask = mask->data_ptr<T>();
    }
    P.m_sb = mask->stride(0), P.m_sh = mask->stride(1), P.m_sl = mask->stride(2), P.m_ss = mask->stride(3);
  }
  if (spans.has_value()) {
    TORCH_CHECK(P.B == 1 && !mask.has_value(), "attnscale fused kernel: packed sequences take batch 1 and no mask");
    TORCH_CHECK(spans->scalar_type() == torch::kInt64 && spans->is_contiguous() && spans->dim() == 2 && spans->size(1) == 4,
                "attnscale fused kernel: spans (nseq, 4) contiguous int64");
    P.spans = spans->data_ptr<int64_t>(), P.nseq = spans->size(0);
    for (int64_t s = 0; s < P.nseq; ++s) {
      const int64_t* span = P.spans + 4 * s;
      TORCH_CHECK(0 <= span[0] && span[0] <= span[1] && span[1] <= P.L && 0 <= span[2] && span[2] <= span[3] &&
                      span[3] <= P.S && (!alibi.has_value() || s < alibi->size(0)),
                  "attnscale fused kernel: spans inside the packed tensors, one slope row per span");
    }
  }
  return P;
}

// Returns the outputs and whether every output row is finite and not all zeros (rows of packed
// sequences without keys are not visited and not counted); for 16-bit inputs, also once rounded
// to their format. half_products (16-bit inputs only): multiply them as they are (oneMKL or
// brgemm), or as float32 tiles converted in the kernel (Problem::widen). round_out (16-bit inputs
// only): out in their format, else float32 (the caller's sinks merge works on float32 rows, and
// a backward's D_i on the unrounded ones).
// [out, lse, m, l, max_logit, max_prob, entropy, visible, rows_ok]: the statistics empty (0 long)
// without with_stats, rows_ok a 0-d bool tensor. All made here, so a decoding step's Python makes
// no tensors of its own after the call (each torch op from Python then costs more than its share:
// the kernel has just streamed k and v through the caches).
std::vector<torch::Tensor> forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                   const c10::optional<torch::Tensor>& alibi, const c10::optional<torch::Tensor>& mask,
                                   const c10::optional<torch::Tensor>& spans, const py::kwargs& options) {
  const Options o = Options::from(options);
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), Dv = v.size(3);
  // Packed: rows of sequences without keys are not visited; they keep an empty row's values.
  const bool packed = spans.has_value();
  const double inf = std::numeric_limits<double>::infinity();
  auto make = [&](at::IntArrayRef shape, double fill, at::ScalarType dtype) {
    auto options = q.options().dtype(dtype);
    return packed ? torch::full(shape, fill, options) : torch::empty(shape, options);
  };
  // 16-bit inputs give float32 outputs, but for out with round_out: rounded to their format as its
  // rows are written (else the caller rounds it once); q, k, v stay 16-bit for the products.
  const auto dt = half_kind(q) ? at::kFloat : q.scalar_type();
  const bool out16 = o.round_out && half_kind(q) != kNoHalf;
  auto out = make({B, H, L, Dv}, 0.0, out16 ? q.scalar_type() : dt);
  auto lse = make({B, H, L}, -inf, dt), m = make({B, H, L}, 0.0, dt), l = make({B, H, L}, 1.0, dt);
  std::vector<torch::Tensor> result{out, lse, m, l};
  if (o.with_stats) {
    result.push_back(make({B, H, L}, -inf, dt));  // max_logit
    result.push_back(make({B, H, L}, 0.0, dt));   // max_prob
    result.push_back(make({B, H, L}, 0.0, dt));   // entropy
    result.push_back(make({B, H, L}, 0.0, torch::kInt64));  // visible
  } else {
    for (int i = 0; i < 3; ++i) result.push_back(torch::empty({0}, q.options().dtype(dt)));
    result.push_back(torch::empty({0}, q.options().dtype(torch::kInt64)));
  }
  std::atomic<bool> suspect{false};
  AT_DISPATCH_FLOATING_TYPES(dt, "attnscale_fused_forward", [&] {
    auto P = make_problem<scalar_t>(q, k, v, alibi, mask, spans, o);
    // Settling needs a bound on every logit (no ALiBi, no float mask). With brgemm the key norms
    // come beside the packing, from its reads (pack_problem), at little cost: every such call
    // settles, packed sequences each on their own keys' norms, and bfloat16 rows of a single
    // key tile save its max pass too (forward_block's early settle). Elsewhere the norms take a
    // pass over k and v of their own, which costs several query rows' products and pays only for
    // rows that see more than one key tile: packed sequences (each row sees only its own
    // sequence's keys) and calls with fewer than 1024 query rows go without.
    std::vector<scalar_t> kmax;
    const bool brgemm = takes_brgemm(P, false);
    const bool bounded = P.alibi == nullptr && P.fmask == nullptr;
    const bool settles = bounded && (brgemm || (P.spans == nullptr && P.L >= 1024 && P.S > P.block_k));
    if (settles && !brgemm) kmax = key_norms(P);
    SequencePacks seqs;
    PackPtr packed;  // brgemm's k^T and v, every key head (P.kpack, P.vpack)
    if (brgemm) {
      if (settles) kmax.resize((P.spans ? P.nseq : 1) * P.B * P.Hkv);
      packed = pack_problem(P, false, seqs, settles ? kmax.data() : nullptr);
    }
    if (settles && !P.spans) P.kmax = kmax.data();  // packed: each sequence's, from seqs
    ForwardOut<scalar_t> O{out16 ? nullptr : out.data_ptr<scalar_t>(), nullptr, kNoHalf, lse.data_ptr<scalar_t>(),
                           m.data_ptr<scalar_t>(), l.data_ptr<scalar_t>(), nullptr, nullptr, nullptr, nullptr, &suspect};
    if (out16) O.out16 = static_cast<uint16_t*>(out.data_ptr()), O.out16_kind = half_kind(q);
    if (P.half == kBF16)
      O.template set_rounded_range<at::BFloat16>();
    else if (P.half == kF16)
      O.template set_rounded_range<at::Half>();
    if (o.with_stats) {
      O.max_logit = result[4].data_ptr<scalar_t>();
      O.max_prob = result[5].data_ptr<scalar_t>();
      O.entropy = result[6].data_ptr<scalar_t>();
      O.visible = result[7].data_ptr<int64_t>();
    }
    forward_kernel(P, O);
  });
  result.push_back(torch::scalar_tensor(!suspect.load(), q.options().dtype(torch::kBool)));
  return result;
}

std::vector<torch::Tensor> backward(const torch::Tensor& q16, const torch::Tensor& k16, const torch::Tensor& v16,
                                    const torch::Tensor& dout, const torch::Tensor& delta, const torch::Tensor& m,
                                    const torch::Tensor& l, const c10::optional<torch::Tensor>& alibi,
                                    const c10::optional<torch::Tensor>& mask, const c10::optional<torch::Tensor>& spans,
                                    const py::kwargs& options) {
  const Options o = Options::from(options);
  // A forward that widened its tiles (half_products false) is differentiated on float32 copies
  // the caller makes: 16-bit inputs here are always multiplied as they are.
  TORCH_CHECK(!half_kind(q16) || o.half_products, "attnscale fused kernel: the backward of 16-bit inputs takes them with half_products=True (else float32 copies)");
  // 16-bit inputs: the products take them as they are, and dout rounded to their format (the
  // gradient of an output the caller rounded to it); gradients come back in float32, for the
  // caller to round. (A forward that widened its tiles is differentiated on float32 copies: the
  // caller passes those.)
  const torch::Tensor &q = q16, &k = k16, &v = v16;
  const auto half = half_kind(q);
  const auto dt = half ? at::kFloat : q.scalar_type();
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), S = k.size(2), D = q.size(3), Dv = v.size(3);
  TORCH_CHECK(dout.is_contiguous() && delta.is_contiguous() && m.is_contiguous() && l.is_contiguous(),
              "attnscale fused kernel: contiguous dout, delta, m, l");
  TORCH_CHECK(dout.scalar_type() == dt && delta.scalar_type() == dt && m.scalar_type() == dt && l.scalar_type() == dt,
              "attnscale fused kernel: dout, delta, m, l in the compute dtype");
  const torch::Tensor dout16 = half ? dout.to(q.scalar_type()) : torch::Tensor();
  // Packed: rows of sequences without keys are not visited; their gradient is 0.
  auto dq = spans.has_value() ? torch::zeros({B, H, L, D}, q.options().dtype(dt)) : torch::empty({B, H, L, D}, q.options().dtype(dt));
  // Per-query-head dk, dv (summed per group by the caller) only when there are fewer (batch or
  // sequence, key head) tasks than threads: otherwise each task runs a whole group into its key
  // head's rows, with no O(H S D) scratch.
  const int64_t Hkv = k.size(1), units = spans.has_value() ? spans->size(0) : B;
  const bool grouped = Hkv == H || units * Hkv >= at::get_num_threads();
  auto dk = torch::zeros({B, grouped ? Hkv : H, S, D}, q.options().dtype(dt));
  auto dv = torch::zeros({B, grouped ? Hkv : H, S, Dv}, q.options().dtype(dt));
  AT_DISPATCH_FLOATING_TYPES(dt, "attnscale_fused_backward", [&] {
    auto P = make_problem<scalar_t>(q, k, v, alibi, mask, spans, o);
    BackwardIO<scalar_t> IO{dout.data_ptr<scalar_t>(), delta.data_ptr<scalar_t>(), m.data_ptr<scalar_t>(),
                            l.data_ptr<scalar_t>(), dq.data_ptr<scalar_t>(), dk.data_ptr<scalar_t>(),
                            dv.data_ptr<scalar_t>(), grouped};
    if (half) IO.dout16 = static_cast<const uint16_t*>(dout16.const_data_ptr());
    SequencePacks seqs;
    PackPtr packed;  // brgemm's k^T, v^T and k, every key head
    if (takes_brgemm(P, true)) packed = pack_problem(P, true, seqs);
    backward_kernel(P, IO);
  });
  return {dq, dk, dv};
}

}  // namespace

// The kernel's tanh elementwise on a contiguous tensor, on one thread, for its tests and benchmark.
torch::Tensor tanh_op(const torch::Tensor& x) {
  TORCH_CHECK(x.is_contiguous() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble),
              "attnscale fused kernel: tanh takes a contiguous float32 or float64 tensor");
  auto out = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "attnscale_fused_tanh", [&] {
    using Vec = Vectorized<scalar_t>;
    const scalar_t* src = x.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    int64_t i = 0, n = x.numel();  // one thread: what it costs per element is what it is for
    for (; i + Vec::size() <= n; i += Vec::size()) vtanh(Vec::loadu(src + i)).store(dst + i);
    for (; i < n; ++i) dst[i] = stanh(src[i]);
  });
  return out;
}

// The softmax's weights elementwise (vexp_weights, x = s - m), and ATen's exp_u20 with the same
// floor applied after it, on one thread, for the tests: float32 only.
std::tuple<torch::Tensor, torch::Tensor> weights_op(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 1 && x.is_contiguous() && x.scalar_type() == at::kFloat &&
                  x.numel() % Vectorized<float>::size() == 0,
              "attnscale fused kernel: weights takes a 1-d contiguous float32 tensor of whole vectors (", Vectorized<float>::size(), " floats)");
  using Vec = Vectorized<float>;
  auto out = torch::empty_like(x), ref = torch::empty_like(x);
  const float* src = x.data_ptr<float>();
  float *dst = out.data_ptr<float>(), *alt = ref.data_ptr<float>();
  const Vec vfloor(exp_floor<float>());
  for (int64_t i = 0; i < x.numel(); i += Vec::size()) {
    const Vec xv = Vec::loadu(src + i);
    vexp_weights(xv, vfloor).store(dst + i);
    Vec::blendv(xv.exp_u20(), Vec(0.0f), xv < vfloor).store(alt + i);
  }
  return {out, ref};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  // The options by keyword (Options::from): a call that names one wrongly, or leaves one out,
  // fails, where one that swapped two ints or bools by position was silent.
  module.def("forward", &forward, "attnscale fused attention forward: [out, lse, m, l, max_logit, max_prob, entropy, visible (empty without statistics), rows_ok (0-d bool)]; the options by keyword (Options)",
             py::arg("q"), py::arg("k"), py::arg("v"), py::arg("alibi"), py::arg("mask"), py::arg("spans"));
  module.def("option_names", &Options::names, "the options forward and backward take by keyword, in their order (Options)");
  module.def("brgemm_runs", &brgemm_runs, "whether bfloat16 products with an even head dim go through torch's brgemm (oneDNN) here, not oneMKL");
  module.def("half_gemm", &half_gemm, "whether 16-bit q, k, v of this format (1 bfloat16, 2 float16) can be passed as they are (oneMKL's products)");
  module.def("tanh", &tanh_op, "the kernel's tanh (float32: a polynomial near 0, exp farther out; float64: Sleef's 1-ulp)");
  module.def("weights", &weights_op, "the softmax's exp of centred scores, and exp_u20 floored the same way (float32, 1-d, a multiple of 8 long)");
  module.def("backward", &backward, "attnscale fused attention backward (dq, dk, dv; dk, dv per key head, or per query head for the caller to sum per group); the options by keyword (Options)",
             py::arg("q"), py::arg("k"), py::arg("v"), py::arg("dout"), py::arg("delta"), py::arg("m"), py::arg("l"),
             py::arg("alibi"), py::arg("mask"), py::arg("spans"));
}
