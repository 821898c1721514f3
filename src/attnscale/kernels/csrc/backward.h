// The backward pass: each head's query blocks recomputed tile by tile as the forward did, dq,
// dk and dv accumulated, and the parallel loop over heads.
#pragma once

#include "packing.h"
#include "rows.h"

namespace {

using at::vec::Vectorized;

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
  // Learned ALiBi slopes: their gradient, (B, H) (packed: (sequences, H)), accumulated; a (batch or
  // sequence, head) belongs to one task, so no two tasks add to one entry. Null: not asked.
  T* dslope = nullptr;
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

// One of the backward's five products, each in the inputs' format: (transposes, m, n, k, alpha, A,
// lda, B, ldb, beta, C, ldc) column-major, the 16-bit operands where the inputs are 16-bit (oneMKL,
// accumulated in float32, as torch's CPU kernel does).
template <typename T>
void product(const Problem<T>& P, char ta, char tb, int64_t m, int64_t n, int64_t k, T alpha, const T* A, const uint16_t* A16,
             int64_t lda, const T* B, const uint16_t* B16, int64_t ldb, T beta, T* C, int64_t ldc) {
  if constexpr (std::is_same_v<T, float>) {
    if (P.half) return gemm16(P.half, ta, tb, m, n, k, alpha, A16, lda, B16, ldb, beta, C, ldc);
  }
  gemm(ta, tb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc);
}

// Head h of batch b's operands and gradients, with its query block's rows (at).
template <typename T>
struct BackwardHead {
  int64_t b, h;
  const T *k, *v;               // float inputs (null for 16-bit ones)
  const uint16_t *kh, *vh;      // 16-bit inputs (null for float ones)
  T *dk, *dv;                   // the head's dk, dv rows (its own, or its key head's when grouped)
  // brgemm (bfloat16, P.kpack): x = q k^T and dp = dout v^T on the packed k^T, v^T; dq += dS k on
  // the packed k; dk^T += q^T dS and dv^T += dout^T p on dS and p in pairs of rows (W.dkt, W.dvt:
  // the caller transposes them into dk, dv).
  const uint16_t *kt, *vt, *kp;
  T alpha, pre;  // the products' multiplier; brgemm's products come unscaled: score_row scales them by pre
  // The query block: rows i0.., its q, dout (and their 16-bit forms) and first output row.
  int64_t i0, rows, rp, row0;   // rp: rows rounded up to even (brgemm's products over rows take pairs)
  const T *q, *dout;
  const uint16_t *qh, *dout16;

  BackwardHead(const Problem<T>& P, const BackwardIO<T>& IO, int64_t b, int64_t h) : b(b), h(h) {
    const int64_t hk = h / P.G(), bh = b * P.Hkv + hk;
    const bool half = P.half != kNoHalf;
    k = half ? nullptr : P.k + b * P.k_sb + hk * P.k_sh, v = half ? nullptr : P.v + b * P.v_sb + hk * P.v_sh;
    kh = half ? P.kh + b * P.k_sb + hk * P.k_sh : nullptr, vh = half ? P.vh + b * P.v_sb + hk * P.v_sh : nullptr;
    const int64_t kv_head = IO.grouped ? bh : b * P.H + h;
    dk = IO.dk + (kv_head * P.k_rows + P.k_out_start) * P.D, dv = IO.dv + (kv_head * P.k_rows + P.k_out_start) * P.Dv;
    const bool packed = P.kpack != nullptr;
    kt = packed ? P.kpack + bh * P.D * P.s_pad : nullptr, vt = packed ? P.vtpack + bh * P.Dv * P.s_pad : nullptr;
    kp = packed ? P.kpairs + bh * P.s_pad * P.D : nullptr;
    alpha = P.softcap != T(0) ? P.scale / P.softcap : P.scale;
    pre = packed ? alpha : T(1);
  }

  // Query block qb's rows (brgemm: its q^T and dout^T transposed into W.qt, W.dot).
  void at(const Problem<T>& P, const BackwardIO<T>& IO, int64_t qb, BackwardScratch<T>& W) {
    const bool half = P.half != kNoHalf;
    i0 = qb * P.block_q, rows = std::min(i0 + P.block_q, P.L) - i0, rp = BackwardScratch<T>::even(rows);
    q = half ? nullptr : P.q + b * P.q_sb + h * P.q_sh + i0 * P.q_sl;
    qh = half ? P.qh + b * P.q_sb + h * P.q_sh + i0 * P.q_sl : nullptr;
    row0 = (b * P.H + h) * P.o_rows + P.o_start + i0;
    dout = IO.dout + row0 * P.Dv, dout16 = half ? IO.dout16 + row0 * P.Dv : nullptr;
    if (P.kpack) {
      transpose16(qh, P.q_sl, rows, P.D, rp, W.qt.data());
      transpose16(dout16, P.Dv, rows, P.Dv, rp, W.dot.data());
    }
  }
};

// The tile's weights p = exp(s - m) / l (the forward's, from its m and l) into W.sbuf (rows, width),
// with softcap tanh of the products into W.tbuf; 16-bit inputs: also rounded to their format (W.p16).
template <typename T>
void backward_weights(const Problem<T>& P, const BackwardIO<T>& IO, const BackwardHead<T>& A, int64_t j0, int64_t width, BackwardScratch<T>& W) {
  using Vec = Vectorized<T>;
  constexpr int64_t n = Vec::size();
  const bool capped = P.softcap != T(0);
  T* x = W.sbuf.data();
  if constexpr (std::is_same_v<T, float>) {
    if (P.kpack)  // x (rows, width) = q k^T, the packed k^T's columns j0.. (as the forward)
      at::native::cpublas::brgemm(A.rows, width, P.D, P.q_sl, P.s_pad, width, false, bf16(A.qh), bf16(A.kt + 2 * j0), x, true);
  }
  if (!P.kpack)
    product(P, 'T', 'N', width, A.rows, P.D, A.alpha, A.k + (P.half ? 0 : j0 * P.k_sl), A.kh ? A.kh + j0 * P.k_sl : nullptr, P.k_sl,
            A.q, A.qh, P.q_sl, T(0), x, width);
  for (int64_t r = 0; r < A.rows; ++r) {
    T* xr = x + r * width;
    const T l = IO.l[A.row0 + r];
    score_row(P, A.b, A.h, A.i0 + r, j0, width, xr, capped ? W.tbuf.data() + r * width : nullptr, nullptr, true, A.pre);
    exp_row(xr, width, IO.m[A.row0 + r]);
    const Vec vl(l);
    int64_t c = 0;
    for (; c + n <= width; c += n) (Vec::loadu(xr + c) / vl).store(xr + c);
    for (; c < width; ++c) xr[c] /= l;
  }
  if constexpr (std::is_same_v<T, float>)
    if (P.half) round_to(P.half, x, A.rows * width, W.p16.data());
}

// dv (brgemm: dv^T) += p^T dout, and dp (rows, width) = dout v^T into W.dpbuf.
template <typename T>
void backward_dv_dp(const Problem<T>& P, const BackwardHead<T>& A, int64_t j0, int64_t width, BackwardScratch<T>& W) {
  T* dp = W.dpbuf.data();
  uint16_t* p16 = P.half ? W.p16.data() : nullptr;
  if constexpr (std::is_same_v<T, float>) {
    if (P.kpack) {
      for (int64_t r = 0; r < A.rp; r += 2)
        pair_rows(p16 + r * width, r + 1 < A.rows ? p16 + (r + 1) * width : nullptr, width, W.pv.data() + r * width);
      at::native::cpublas::brgemm(P.Dv, width, A.rp, A.rp, width, P.S, true, bf16(W.dot.data()), bf16(W.pv.data()), W.dvt.data() + j0, true);
      at::native::cpublas::brgemm(A.rows, width, P.Dv, P.Dv, P.s_pad, width, false, bf16(A.dout16), bf16(A.vt + 2 * j0), dp, true);
      return;
    }
  }
  product(P, 'N', 'T', P.Dv, width, A.rows, T(1), A.dout, A.dout16, P.Dv, W.sbuf.data(), p16, width, T(1), A.dv + j0 * P.Dv, P.Dv);
  product(P, 'T', 'N', width, A.rows, P.Dv, T(1), A.v + (P.half ? 0 : j0 * P.v_sl), A.vh ? A.vh + j0 * P.v_sl : nullptr, P.v_sl,
          A.dout, A.dout16, P.Dv, T(0), dp, width);
}

// The gradient of the tile's ALiBi bias -slope |i' - j|: minus the sum over the tile of
// g |i' - j|, g = p (dp - delta) the gradient of the logits (before softcap's factor, which
// belongs to the products, not the bias).
template <typename T>
T slope_gradient(const Problem<T>& P, const BackwardHead<T>& A, int64_t j0, int64_t width, const BackwardScratch<T>& W, const T* delta) {
  using Vec = Vectorized<T>;
  constexpr int64_t n = Vec::size();
  const Vec iota = Vec::arange(T(0), T(1));
  Vec acc(T(0));
  T tail = T(0);
  for (int64_t r = 0; r < A.rows; ++r) {
    const T* pr = W.sbuf.data() + r * width;
    const T* dr = W.dpbuf.data() + r * width;
    const int64_t p = P.aligned(A.i0 + r) - j0;  // i' - j = p - c at column c, as score_row has it
    const Vec vd(delta[r]);
    int64_t c = 0;
    for (; c + n <= width; c += n)
      acc = at::vec::fmadd((Vec::loadu(dr + c) - vd) * Vec::loadu(pr + c), (Vec(static_cast<T>(p - c)) - iota).abs(), acc);
    for (; c < width; ++c) tail += (dr[c] - delta[r]) * pr[c] * static_cast<T>(std::abs(p - c));
  }
  return -(at::vec::vec_reduce_all<T>([](Vec& x, Vec& y) { return x + y; }, acc) + tail);
}

// dS = p (dp - delta) in place of dp, times (1 - t^2) with softcap (t = tanh of the products).
template <typename T>
void backward_ds(const Problem<T>& P, const BackwardIO<T>& IO, const BackwardHead<T>& A, int64_t j0, int64_t width, BackwardScratch<T>& W) {
  using Vec = Vectorized<T>;
  constexpr int64_t n = Vec::size();
  if (IO.dslope && P.alibi) IO.dslope[A.b * P.H + A.h] += slope_gradient(P, A, j0, width, W, IO.delta + A.row0);
  for (int64_t r = 0; r < A.rows; ++r) {
    const T* pr = W.sbuf.data() + r * width;
    T* dr = W.dpbuf.data() + r * width;
    const T delta = IO.delta[A.row0 + r];
    const Vec vd(delta), one(T(1));
    int64_t c = 0;
    if (P.softcap != T(0)) {
      const T* tr = W.tbuf.data() + r * width;
      for (; c + n <= width; c += n) {
        const Vec tv = Vec::loadu(tr + c);
        ((Vec::loadu(dr + c) - vd) * Vec::loadu(pr + c) * (one - tv * tv)).store(dr + c);
      }
      for (; c < width; ++c) dr[c] = (dr[c] - delta) * pr[c] * (T(1) - tr[c] * tr[c]);
    } else {
      for (; c + n <= width; c += n) ((Vec::loadu(dr + c) - vd) * Vec::loadu(pr + c)).store(dr + c);
      for (; c < width; ++c) dr[c] = (dr[c] - delta) * pr[c];
    }
  }
}

// dq (the block's, W.dqb) += dS k and dk (brgemm: dk^T) += dS^T q; the scale multiplies both at the end.
template <typename T>
void backward_dq_dk(const Problem<T>& P, const BackwardHead<T>& A, int64_t j0, int64_t width, BackwardScratch<T>& W) {
  T* ds = W.dpbuf.data();
  uint16_t* ds16 = P.half ? W.ds16.data() : nullptr;
  if constexpr (std::is_same_v<T, float>) {
    if (P.kpack) {
      const int64_t wp = BackwardScratch<T>::even(width);  // brgemm pairs keys: the pad key's dS is 0
      for (int64_t r = 0; r < A.rows; ++r) {
        round_to(P.half, ds + r * width, width, ds16 + r * wp);
        if (wp != width) ds16[r * wp + width] = 0;
      }
      for (int64_t r = 0; r < A.rp; r += 2)
        pair_rows(ds16 + r * wp, r + 1 < A.rows ? ds16 + (r + 1) * wp : nullptr, width, W.dsv.data() + r * width);
      at::native::cpublas::brgemm(A.rows, P.D, wp, wp, P.D, P.D, true, bf16(ds16), bf16(A.kp + j0 * P.D), W.dqb.data(), true);
      at::native::cpublas::brgemm(P.D, width, A.rp, A.rp, width, P.S, true, bf16(W.qt.data()), bf16(W.dsv.data()), W.dkt.data() + j0, true);
      return;
    }
    if (P.half) round_to(P.half, ds, A.rows * width, ds16);
  }
  product(P, 'N', 'N', P.D, A.rows, width, T(1), A.k + (P.half ? 0 : j0 * P.k_sl), A.kh ? A.kh + j0 * P.k_sl : nullptr, P.k_sl,
          ds, ds16, width, T(1), W.dqb.data(), P.D);
  product(P, 'N', 'T', P.D, width, A.rows, T(1), A.q, A.qh, P.q_sl, ds, ds16, width, T(1), A.dk + j0 * P.D, P.D);
}

// Head h of batch b: every query block, accumulating its dk, dv rows (the query head's own, or its
// key head's when grouped); dk is not yet multiplied by the scale (the caller does, once per row).
// Each tile recomputes the forward's weights, then the five products of FlashAttention-2's backward.
template <typename T>
void backward_head(const Problem<T>& P, const BackwardIO<T>& IO, int64_t b, int64_t h, BackwardScratch<T>& W) {
  BackwardHead<T> A(P, IO, b, h);
  for (int64_t qb = 0; qb < P.q_blocks(); ++qb) {
    A.at(P, IO, qb, W);
    std::fill(W.dqb.begin(), W.dqb.begin() + A.rows * P.D, T(0));
    for (auto [j0, j1] : P.key_tiles(A.i0, A.i0 + A.rows)) {
      backward_weights(P, IO, A, j0, j1 - j0, W);
      backward_dv_dp(P, A, j0, j1 - j0, W);
      backward_ds(P, IO, A, j0, j1 - j0, W);
      backward_dq_dk(P, A, j0, j1 - j0, W);
    }
    T* dq = IO.dq + A.row0 * P.D;
    for (int64_t e = 0; e < A.rows * P.D; ++e) dq[e] = W.dqb[e] * P.scale;
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
  auto run = [&](const Problem<T>& Q, const BackwardIO<T>& IO, int64_t b, int64_t head, BackwardScratch<T>& W) {
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
    parallel_tasks(heads * ns, make, [&](int64_t task, BackwardScratch<T>& W) {
      BackwardIO<T> own = IO;  // a sequence's slope gradients: its own row of dslope
      if (own.dslope) own.dslope += seqs[task % ns] * P.H;
      run(P.sequence(seqs[task % ns]), own, 0, task / ns, W);
    });
    return;
  }
  parallel_tasks(P.B * heads, make, [&](int64_t task, BackwardScratch<T>& W) { run(P, IO, task / heads, task % heads, W); });
}

}  // namespace
