// BLAS products (float32, float64, and 16-bit inputs with float32 accumulation on oneMKL), and the
// vector loads and stores that convert 16-bit formats to and from float32.
#pragma once

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

// Products of at most this many multiply-adds (m * n * k) are computed here, not by BLAS: a
// decoding step's q k^T and p v are matrix-vector products of a few thousand, where the BLAS call
// (its argument checks and dispatch) costs more than the arithmetic.
constexpr int64_t kSmallProduct = int64_t(1) << 14;

// s plus the scalar part of the dot of x and y, from index from to k.
template <typename T>
inline T dot_tail(const T* x, const T* y, int64_t from, int64_t k, T s) {
  for (int64_t l = from; l < k; ++l) s += x[l] * y[l];
  return s;
}

// C (m x n, column-major) = alpha op(A) B + beta C by hand, for the two shapes the kernel's small
// products take: op(A) = A^T (C[i][j] = a dot of A's column i with B's column j, both contiguous)
// and op(A) = A (C's column j gathers A's columns, each times B[l][j], in registers 4 vectors at a
// time). As reference BLAS does, beta = 0 ignores C's contents and a zero B[l][j] skips A's column
// l (a hidden key's weight is exactly 0: its values are never read). False for other shapes or
// larger products.
template <typename T>
inline bool small_gemm(char ta, char tb, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda,
                       const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  using V = Vectorized<T>;
  constexpr int64_t w = V::size();
  if (tb != 'N' || m * n * k > kSmallProduct) return false;
  auto put = [&](int64_t i, int64_t j, T s) {
    T* out = c + i + j * ldc;
    *out = beta == T(0) ? alpha * s : alpha * s + beta * *out;
  };
  auto sum = [](V x) { return at::vec::vec_reduce_all<T>([](V& p, V& q) { return p + q; }, x); };
  if (ta == 'T') {
    const int64_t kv = k - k % w;  // the dots' vector part; the rest by scalars
    for (int64_t j = 0; j < n; ++j) {
      const T* y = b + j * ldb;
      int64_t i = 0;
      for (; i + 4 <= m; i += 4) {  // four of C's entries at a time: four independent chains share y's loads
        const T *x0 = a + i * lda, *x1 = x0 + lda, *x2 = x1 + lda, *x3 = x2 + lda;
        V s0(T(0)), s1(T(0)), s2(T(0)), s3(T(0));
        for (int64_t l = 0; l < kv; l += w) {
          const V yl = V::loadu(y + l);
          s0 = at::vec::fmadd(V::loadu(x0 + l), yl, s0);
          s1 = at::vec::fmadd(V::loadu(x1 + l), yl, s1);
          s2 = at::vec::fmadd(V::loadu(x2 + l), yl, s2);
          s3 = at::vec::fmadd(V::loadu(x3 + l), yl, s3);
        }
        put(i, j, dot_tail(x0, y, kv, k, sum(s0)));
        put(i + 1, j, dot_tail(x1, y, kv, k, sum(s1)));
        put(i + 2, j, dot_tail(x2, y, kv, k, sum(s2)));
        put(i + 3, j, dot_tail(x3, y, kv, k, sum(s3)));
      }
      for (; i < m; ++i) {
        const T* x = a + i * lda;
        V s0(T(0));
        for (int64_t l = 0; l < kv; l += w) s0 = at::vec::fmadd(V::loadu(x + l), V::loadu(y + l), s0);
        put(i, j, dot_tail(x, y, kv, k, sum(s0)));
      }
    }
    return true;
  }
  if (ta != 'N') return false;
  for (int64_t j = 0; j < n; ++j) {
    T* cj = c + j * ldc;
    if (beta == T(0)) {
      std::fill(cj, cj + m, T(0));
    } else if (beta != T(1)) {
      for (int64_t i = 0; i < m; ++i) cj[i] *= beta;
    }
    const T* bj = b + j * ldb;
    int64_t i = 0;
    for (; i + 4 * w <= m; i += 4 * w) {  // 4 vectors of C's column held in registers over every l
      V c0 = V::loadu(cj + i), c1 = V::loadu(cj + i + w), c2 = V::loadu(cj + i + 2 * w), c3 = V::loadu(cj + i + 3 * w);
      for (int64_t l = 0; l < k; ++l) {
        if (bj[l] == T(0)) continue;
        const V sv(alpha * bj[l]);
        const T* al = a + l * lda + i;
        c0 = at::vec::fmadd(sv, V::loadu(al), c0);
        c1 = at::vec::fmadd(sv, V::loadu(al + w), c1);
        c2 = at::vec::fmadd(sv, V::loadu(al + 2 * w), c2);
        c3 = at::vec::fmadd(sv, V::loadu(al + 3 * w), c3);
      }
      c0.store(cj + i), c1.store(cj + i + w), c2.store(cj + i + 2 * w), c3.store(cj + i + 3 * w);
    }
    for (; i + w <= m; i += w) {
      V c0 = V::loadu(cj + i);
      for (int64_t l = 0; l < k; ++l)
        if (bj[l] != T(0)) c0 = at::vec::fmadd(V(alpha * bj[l]), V::loadu(a + l * lda + i), c0);
      c0.store(cj + i);
    }
    for (; i < m; ++i)
      for (int64_t l = 0; l < k; ++l)
        if (bj[l] != T(0)) cj[i] += alpha * bj[l] * a[l * lda + i];
  }
  return true;
}

template <typename T>
inline void gemm(char ta, char tb, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
                 int64_t ldb, T beta, T* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (small_gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)) return;
  auto ld = [](int64_t x) { return static_cast<int>(std::max<int64_t>(x, 1)); };
  blas(ta, tb, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), alpha, a, ld(lda), b, ld(ldb), beta, c, ld(ldc));
}

// 16-bit inputs: q, k, v (and the weights p of the second product) in bfloat16 or float16, each
// product accumulated in float32 by oneMKL; everything else (the score path, the softmax, the
// statistics, the output) in float32, as for float32 inputs.
enum Half16 : int { kNoHalf = 0, kBF16 = 1, kF16 = 2 };
// The Half16 of a 16-bit type.
template <typename H>
constexpr int half_kind_of() {
  return std::is_same_v<H, at::BFloat16> ? kBF16 : std::is_same_v<H, at::Half> ? kF16 : kNoHalf;
}

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

}  // namespace
