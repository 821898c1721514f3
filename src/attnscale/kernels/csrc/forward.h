// The forward pass: one query block against its key tiles (online softmax, or rows on a static
// offset), and the parallel loop over blocks.
#pragma once

#include "packing.h"
#include "quantized.h"
#include "rows.h"

namespace {

using at::vec::Vectorized;

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
  Scratch<T> wq, wk, wv;   // Problem::widen: the block's q and the tile's k, v in float32 (int8: k, v)
  Scratch<int16_t> qc;     // int8 decoding's integer products: the block's q as int16 codes, and per row
  Scratch<T> qs, qm;       // alpha times its step, and the key mean's share of its logits (int8_quantize_q)
  std::vector<int64_t> seen;
  std::vector<char> is_static;
  explicit ForwardScratch(const Problem<T>& P)
      : sbuf(P.tile_rows() * P.tile_width()), acc(P.tile_rows() * P.Dv), m(P.tile_rows()), l(P.tile_rows()),
        w(P.tile_rows()), bound(P.tile_rows()), top(P.tile_rows()), pbuf(P.half && !P.widen ? P.tile_rows() * (P.tile_width() + 1) : 0),
        wq(P.widen ? P.tile_rows() * P.D : 0), wk(P.widen || (P.int8 && !P.int8_direct) ? P.tile_width() * P.D : 0),
        wv(P.widen || (P.int8 && !P.int8_direct) ? P.tile_width() * P.Dv : 0), qc(P.int8_direct && P.int8->q_int16 ? P.tile_rows() * P.D : 0),
        qs(qc.empty() ? 0 : P.tile_rows()), qm(qs.size()), seen(P.tile_rows()), is_static(P.tile_rows()), brgemm(P.brgemm()) {}
  // The thread's AMX tile state, set up by brgemm's first call, released with the scratch.
  bool brgemm;
  ~ForwardScratch() {
    if (brgemm) at::native::cpublas::brgemm_release(true);
  }
  ForwardScratch(ForwardScratch&&) = delete;
};

// Query block qb of head h, batch b: its rows, where its operands are, and what its tiles share.
template <typename T>
struct Block {
  int64_t b, h, hk, i0, rows;
  const T *q, *k, *v;             // float operands (q: the block's rows, widened where Problem::widen)
  const uint16_t *qh, *kh, *vh;   // 16-bit operands (null for float inputs)
  int64_t q_ld;                   // q's row stride
  const int16_t* qc = nullptr;    // int8 decoding: q's int16 codes (row stride D), qs, qm (int8_quantize_q), or null
  const T *qs = nullptr, *qm = nullptr;
  T alpha;                        // the products' multiplier: scale, over softcap where capped
  T pre;                          // brgemm's products come unscaled: score_row multiplies them by pre
  bool stats, static_offsets;            // statistics asked for; rows may take a static offset (Problem::kmax)
};

template <typename T>
Block<T> block_at(const Problem<T>& P, const ForwardOut<T>& O, int64_t b, int64_t h, int64_t qb, ForwardScratch<T>& W) {
  Block<T> B;
  B.b = b, B.h = h, B.hk = h / P.G();
  B.i0 = qb * P.block_q, B.rows = std::min(B.i0 + P.block_q, P.L) - B.i0;
  const int64_t q_at = b * P.q_sb + h * P.q_sh + B.i0 * P.q_sl, k_at = b * P.k_sb + B.hk * P.k_sh, v_at = b * P.v_sb + B.hk * P.v_sh;
  B.q = P.half ? nullptr : P.q + q_at;
  B.k = P.half || P.int8 ? nullptr : P.k + k_at, B.v = P.half || P.int8 ? nullptr : P.v + v_at;
  B.qh = P.half ? P.qh + q_at : nullptr, B.kh = P.half ? P.kh + k_at : nullptr, B.vh = P.half ? P.vh + v_at : nullptr;
  B.q_ld = P.q_sl;
  if (P.widen) {  // the block's q rows in float32, once
    widen_rows(P.half, B.qh, P.q_sl, B.rows, P.D, W.wq.data());
    B.q = W.wq.data(), B.q_ld = P.D;
  }
  B.alpha = P.softcap != T(0) ? P.scale / P.softcap : P.scale;
  B.pre = P.kpack ? B.alpha : T(1);
  if constexpr (std::is_same_v<T, float>) {
    if (!W.qc.empty() && int8_quantize_q(*P.int8, b * P.Hkv + B.hk, B.q, B.q_ld, B.rows, B.alpha, W.qc.data(), W.qs.data(), W.qm.data()))
      B.qc = W.qc.data(), B.qs = W.qs.data(), B.qm = W.qm.data();
  }
  B.stats = O.max_logit != nullptr;
  B.static_offsets = P.kmax != nullptr;
  return B;
}

// A static offset: Cauchy-Schwarz bounds every logit of row i, s_ij <= u_i = alpha |q_i| max_j
// |k_j| (with softcap, softcap tanh of that). Once the row's running max m has reached u_i - 34.5
// (float32; -floor / 2), no later weight exp(s - m) can exceed exp(34.5) = 1e15, so the row keeps
// m as its offset from then on: its later tiles need no max pass and no rescaling of the sum or
// the accumulator. m is an actual logit of the row (but for the bfloat16 rows of start_rows), so
// the row's largest weight is at least 1 and precision is the running max's. (key_norms refuses
// the bound where values are so large that 1e15 times their sum could overflow.) With statistics
// a static row also keeps its largest logit (top) apart from m, and sum p (s - m) against m: the
// entropy, log l - w / l, does not depend on the offset. This writes u_i into W.bound.
template <typename T>
void row_bounds(const Problem<T>& P, const Block<T>& B, ForwardScratch<T>& W) {
  const T kn = P.kmax[B.b * P.Hkv + B.hk];
  for (int64_t r = 0; r < B.rows; ++r) W.bound[r] = std::abs(B.alpha) * std::sqrt(query_norm2(P, B.q, B.qh, r)) * kn;
  if (P.softcap == T(0)) return;
  // softcap tanh(u), with the score path's tanh, in vectors (libm's, row by row, showed in
  // profiles). Where u is NaN or inf (an inf or NaN in q or k, or overflow) the bound stays u, so
  // the row never takes a static offset, softcap or not: the running max sees the infinite
  // product, which a static row's softcap would bound to a finite logit.
  using Vec = Vectorized<T>;
  const Vec vcap(P.softcap), zero(T(0));
  for (int64_t r = 0; r < B.rows; r += Vec::size()) {
    const int64_t count = std::min<int64_t>(Vec::size(), B.rows - r);
    const Vec u = Vec::loadu(W.bound.data() + r, count);
    Vec::blendv(u, vcap * vtanh(u), (u - u) == zero).store(W.bound.data() + r, count);
  }
}

// The rows' running state before the first tile (Weight: the type the weights of the second
// product take, T or the inputs' 16-bit format).
template <typename T, typename Weight>
void start_rows(const Problem<T>& P, const Block<T>& B, ForwardScratch<T>& W) {
  const T neg_inf = -std::numeric_limits<T>::infinity();
  std::fill(W.is_static.begin(), W.is_static.end(), 0);
  if (B.static_offsets) row_bounds(P, B, W);
  std::fill(W.acc.begin(), W.acc.begin() + B.rows * P.Dv, T(0));
  std::fill(W.m.begin(), W.m.end(), neg_inf);
  std::fill(W.l.begin(), W.l.end(), T(0));
  std::fill(W.w.begin(), W.w.end(), T(0));
  std::fill(W.top.begin(), W.top.end(), neg_inf);
  std::fill(W.seen.begin(), W.seen.end(), 0);
  // Weights rounded to bfloat16 (without statistics): a row whose bound is at most 47.25 takes
  // the static offset bound - 34.5 before its first tile. Its logits lie in [-bound, bound], so its
  // weights lie in [e^-60, e^34.5]: none overflows, none reaches the floor (static_row's
  // unfloored form), and bfloat16 has float32's range. The offset is no logit of the row, so s - m
  // keeps the rounding of numbers up to 47 + 34.5 (a few float32 ulps of them), far under
  // bfloat16's; float32 and float16 weights, and statistics, keep the running max until it may
  // become their static offset.
  if constexpr (std::is_same_v<Weight, at::BFloat16>) {
    if (B.static_offsets && !B.stats) {
      for (int64_t r = 0; r < B.rows; ++r) {
        if (W.bound[r] <= T(47.25)) W.m[r] = W.bound[r] - offset_limit<T>(), W.is_static[r] = 1;  // false for NaN or inf
      }
    }
  }
}

// Key tile [j0, j0 + width) of a block: its float keys and values (widened into the scratch where
// Problem::widen) with their row strides, and where each row's weights go.
template <typename T>
struct Tile {
  int64_t j0, width;
  const T *k, *v;
  int64_t k_ld, v_ld;
  int64_t pstride;  // 16-bit weights: row r's at W.pbuf + r * pstride (brgemm pairs keys: even)
};

template <typename T, typename Weight>
Tile<T> tile_at(const Problem<T>& P, const Block<T>& B, ForwardScratch<T>& W, int64_t j0, int64_t j1) {
  Tile<T> t{j0, j1 - j0, B.k ? B.k + j0 * P.k_sl : nullptr, B.v ? B.v + j0 * P.v_sl : nullptr, P.k_sl, P.v_sl, j1 - j0};
  if (P.widen) {
    widen_rows(P.half, B.kh + j0 * P.k_sl, P.k_sl, t.width, P.D, W.wk.data());
    widen_rows(P.half, B.vh + j0 * P.v_sl, P.v_sl, t.width, P.Dv, W.wv.data());
    t.k = W.wk.data(), t.v = W.wv.data(), t.k_ld = P.D, t.v_ld = P.Dv;
  }
  if constexpr (std::is_same_v<T, float>) {
    if (P.int8 && !P.int8_direct) {  // the tile's codes as float32 rows (P.H = P.Hkv: the block's head is its key head)
      const Int8KV& Q = *P.int8;
      const int64_t head = B.b * P.Hkv + B.hk;
      dequantize_rows(Q.keys(head, j0), Q.key_scales(head, j0), Q.mean(head), t.width, P.D, Q.group, W.wk.data());
      dequantize_rows(Q.values(head, j0), Q.value_scales(head, j0), nullptr, t.width, P.Dv, P.Dv, W.wv.data());
      t.k = W.wk.data(), t.v = W.wv.data(), t.k_ld = P.D, t.v_ld = P.Dv;
    }
  }
  if (P.kpack) t.pstride = (t.width + 1) & ~int64_t(1);
  return t;
}

// Row r's weights: in place of its logits (Weight = T), else its row of W.pbuf.
template <typename T, typename Weight>
Weight* weights_of(ForwardScratch<T>& W, const Tile<T>& t, int64_t r) {
  if constexpr (std::is_same_v<Weight, T>)
    return W.sbuf.data() + r * t.width;
  else
    return reinterpret_cast<Weight*>(W.pbuf.data() + r * t.pstride);
}

// exp(x - centre) into out (in place where Weight = T), returning its sum; exp_weights_to also
// sum p (x - centre) in *weighted.
template <typename T, typename Weight>
T exp_to(T* x, int64_t width, T centre, Weight* out) {
  if constexpr (std::is_same_v<Weight, T>)
    return exp_row(x, width, centre);
  else
    return exp_row_to(x, width, centre, out);
}
template <typename T, typename Weight>
T exp_weights_to(T* x, int64_t width, T centre, T* weighted, Weight* out) {
  if constexpr (std::is_same_v<Weight, T>)
    return exp_row_weighted(x, width, centre, weighted);
  else
    return exp_row_weighted_to(x, width, centre, weighted, out);
}

// x (rows, width) = the tile's logits before the score path: q k^T times alpha (brgemm: unscaled,
// from the packed k^T's columns j0..).
template <typename T, typename Weight>
void tile_scores(const Problem<T>& P, const Block<T>& B, const Tile<T>& t, T* x) {
  if constexpr (std::is_same_v<Weight, T>) {
    if constexpr (std::is_same_v<T, float>) {
      if (P.int8_direct) return int8_scores(*P.int8, B.b * P.Hkv + B.hk, B.q, B.q_ld, B.qc, B.qs, B.qm, B.rows, t.j0, t.width, B.alpha, x);
    }
    gemm('T', 'N', t.width, B.rows, P.D, B.alpha, t.k, t.k_ld, B.q, B.q_ld, T(0), x, t.width);
  } else if (P.kpack) {
    at::native::cpublas::brgemm(B.rows, t.width, P.D, P.q_sl, P.s_pad, t.width, false, bf16(B.qh),
                                bf16(P.kpack + (B.b * P.Hkv + B.hk) * P.D * P.s_pad + 2 * t.j0), x, true);
  } else {
    gemm16(half_kind_of<Weight>(), 'T', 'N', t.width, B.rows, P.D, B.alpha, B.kh + t.j0 * P.k_sl, P.k_sl, B.qh, P.q_sl, 0.0f, x, t.width);
  }
}

// acc (rows, Dv) += p (rows, width) v: the weights in their format, accumulated in float32 (as torch).
template <typename T, typename Weight>
void tile_values(const Problem<T>& P, const Block<T>& B, const Tile<T>& t, ForwardScratch<T>& W) {
  if constexpr (std::is_same_v<Weight, T>) {
    if constexpr (std::is_same_v<T, float>) {
      if (P.int8_direct) return int8_values(*P.int8, B.b * P.Hkv + B.hk, W.sbuf.data(), B.rows, t.j0, t.width, W.acc.data());
    }
    gemm('N', 'N', P.Dv, B.rows, t.width, T(1), t.v, t.v_ld, W.sbuf.data(), t.width, T(1), W.acc.data(), P.Dv);
  } else if (P.kpack) {  // the packed v's keys j0..
    uint16_t* pb = W.pbuf.data();
    if (t.pstride != t.width)
      for (int64_t r = 0; r < B.rows; ++r) pb[r * t.pstride + t.width] = 0;  // the pair's second key: weight 0
    at::native::cpublas::brgemm(B.rows, P.Dv, t.pstride, t.pstride, P.Dv, P.Dv, true, bf16(pb),
                                bf16(P.vpack + (B.b * P.Hkv + B.hk) * P.s_pad * P.Dv + t.j0 * P.Dv), W.acc.data(), true);
  } else {
    gemm16(half_kind_of<Weight>(), 'N', 'N', P.Dv, B.rows, t.width, 1.0f, B.vh + t.j0 * P.v_sl, P.v_sl, W.pbuf.data(), t.width, 1.0f,
           W.acc.data(), P.Dv);
  }
}

// Row r of a tile, on its static offset W.m[r]: its weights added to the row's sums. Without a
// mask, in one pass (static_row; no ALiBi or float mask where rows take static offsets); with a
// bool mask, the score path first (hidden keys are -inf, so weight 0).
template <typename T, typename Weight>
void static_tile_row(const Problem<T>& P, const Block<T>& B, const Tile<T>& t, ForwardScratch<T>& W, int64_t r) {
  T* xr = W.sbuf.data() + r * t.width;
  Weight* out = weights_of<T, Weight>(W, t, r);
  const int64_t i = B.i0 + r;
  if (!P.bmask) {
    // Every logit of the row is at least -bound (no ALiBi or mask here): where m + bound stays 9
    // short of -floor (a margin far above the products' rounding), no weight reaches the floor (a
    // NaN keeps the test). In place where Weight = T: each entry is read before it is written.
    const bool floored = !(W.m[r] + W.bound[r] <= -exp_floor<T>() - T(9));
    StaticStats<T> tile;
    W.l[r] += static_row(P, i, t.j0, t.width, xr, W.m[r], B.pre, out, floored, B.stats ? &tile : nullptr);
    if (B.stats) W.w[r] += tile.weighted, W.top[r] = std::max(W.top[r], tile.top), W.seen[r] += tile.visible;
    return;
  }
  if (!B.stats) {
    score_row(P, B.b, B.h, i, t.j0, t.width, xr, static_cast<T*>(nullptr), nullptr, false, B.pre);
    W.l[r] += exp_to(xr, t.width, W.m[r], out);
    return;
  }
  int64_t visible = 0;
  const T tile_max = score_row(P, B.b, B.h, i, t.j0, t.width, xr, static_cast<T*>(nullptr), &visible, true, B.pre);
  T weighted;
  W.l[r] += exp_weights_to(xr, t.width, W.m[r], &weighted, out);
  W.w[r] += weighted, W.top[r] = std::max(W.top[r], tile_max), W.seen[r] += visible;
}

// Row r of a tile with the running max (FlashAttention-2's online softmax): the score path, the
// new max, the row's sums and accumulator rescaled to it, this tile's weights added; the row
// takes a static offset once its max comes within -floor / 2 of its bound.
template <typename T, typename Weight>
void online_tile_row(const Problem<T>& P, const Block<T>& B, const Tile<T>& t, ForwardScratch<T>& W, int64_t r) {
  T* xr = W.sbuf.data() + r * t.width;
  int64_t visible = 0;
  const T tile_max = score_row(P, B.b, B.h, B.i0 + r, t.j0, t.width, xr, static_cast<T*>(nullptr), B.stats ? &visible : nullptr, true, B.pre);
  W.seen[r] += visible;
  // NaN (from NaN inputs, or products that overflowed to inf - inf) must reach the output.
  const T m = W.m[r], m_new = std::isnan(tile_max) ? tile_max : std::max(m, tile_max);
  Weight* out = weights_of<T, Weight>(W, t, r);
  if (m_new == -std::numeric_limits<T>::infinity()) {  // nothing visible to this row yet
    std::fill(xr, xr + t.width, T(0));
    if constexpr (!std::is_same_v<Weight, T>) std::fill(out, out + t.width, Weight(0));  // +0
    return;
  }
  const T rescale = std::exp(m - m_new);  // 0 while m = -inf
  if (B.stats) {
    T weighted;
    const T sum = exp_weights_to(xr, t.width, m_new, &weighted, out);
    // Re-centre the running sum of p (s - m) on the new max, then add this tile's.
    W.w[r] = W.l[r] > T(0) ? rescale * (W.w[r] + W.l[r] * (m - m_new)) + weighted : weighted;
    W.l[r] = rescale * W.l[r] + sum;
  } else {
    W.l[r] = rescale * W.l[r] + exp_to(xr, t.width, m_new, out);
  }
  if (rescale != T(1)) {
    T* ar = W.acc.data() + r * P.Dv;
    for (int64_t c = 0; c < P.Dv; ++c) ar[c] *= rescale;
  }
  W.m[r] = m_new, W.top[r] = m_new;
  W.is_static[r] = B.static_offsets && W.bound[r] - m_new <= offset_limit<T>();  // false for NaN
}

// dst = the accumulator's row over its sum; returns the row's largest |entry| (NaN if any is NaN).
template <typename T>
T normalise_row(const T* ar, int64_t Dv, T sum, T* dst) {
  using Vec = Vectorized<T>;
  constexpr int64_t n = Vec::size();
  const Vec vsum(sum);
  Vec vpeak(T(0));
  int64_t c = 0;
  for (; c + n <= Dv; c += n) {
    const Vec value = Vec::loadu(ar + c) / vsum;
    value.store(dst + c);
    vpeak = at::vec::maximum(vpeak, value.abs());  // NaN propagates
  }
  T peak = at::vec::vec_reduce_all<T>([](const Vec& a, const Vec& v) { return at::vec::maximum(a, v); }, vpeak);
  for (; c < Dv; ++c) {
    dst[c] = ar[c] / sum;
    const T a = std::abs(dst[c]);
    if (std::isnan(a) || a > peak) peak = a;  // a NaN peak stays NaN
  }
  return peak;
}

// The block's rows written to O: out (rounded to the 16-bit output where O.out16), lse, m, l, the
// statistics, and whether some row is non-finite or all zeros (O.suspect).
template <typename T>
void write_rows(const Problem<T>& P, const Block<T>& B, const ForwardOut<T>& O, ForwardScratch<T>& W) {
  const T neg_inf = -std::numeric_limits<T>::infinity();
  const int64_t row0 = (B.b * P.H + B.h) * P.o_rows + P.o_start + B.i0;
  bool suspect = false;
  for (int64_t r = 0; r < B.rows; ++r) {
    const T l = W.l[r], m = W.m[r], top = W.top[r];
    const bool has = l != T(0);  // a NaN sum (NaN inputs) is no empty row: NaN reaches the output
    const T safe = has ? l : T(1);
    T* ar = W.acc.data() + r * P.Dv;
    T* dst = O.out16 ? ar : O.out + (row0 + r) * P.Dv;  // out16: the float32 row in place of its accumulator
    T peak = T(0);
    if (has)
      peak = normalise_row(ar, P.Dv, safe, dst);
    else
      std::fill(dst, dst + P.Dv, T(0));
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
    O.lse[row0 + r] = has ? m + std::log(safe) : neg_inf;
    O.m[row0 + r] = has ? m : T(0);
    O.l[row0 + r] = safe;
    if (O.max_logit) {
      O.max_logit[row0 + r] = has ? top : neg_inf;
      // exp(top - m) / l: 1 / l where the row kept its running max (top = m; NaN: NaN either way).
      O.max_prob[row0 + r] = has ? (top == m ? T(1) : std::exp(top - m)) / safe : T(0);
      O.entropy[row0 + r] = has ? std::max(T(0), std::log(safe) - W.w[r] / safe) : T(0);
      O.visible[row0 + r] = W.seen[r];
    }
  }
  if (suspect) O.suspect->store(true, std::memory_order_relaxed);
}

// Query block qb of head h, batch b: the online softmax over its key tiles, written to O. Weight:
// the type the weights of the second product take (T; for 16-bit products the inputs' format).
template <typename T, typename Weight>
void forward_block(const Problem<T>& P, const ForwardOut<T>& O, int64_t b, int64_t h, int64_t qb, ForwardScratch<T>& W) {
  const Block<T> B = block_at(P, O, b, h, qb, W);
  start_rows<T, Weight>(P, B, W);
  for (auto [j0, j1] : P.key_tiles(B.i0, B.i0 + B.rows)) {
    const Tile<T> t = tile_at<T, Weight>(P, B, W, j0, j1);
    tile_scores<T, Weight>(P, B, t, W.sbuf.data());
    for (int64_t r = 0; r < B.rows; ++r) {
      if (W.is_static[r])
        static_tile_row<T, Weight>(P, B, t, W, r);
      else
        online_tile_row<T, Weight>(P, B, t, W, r);
    }
    tile_values<T, Weight>(P, B, t, W);
  }
  write_rows(P, B, O, W);
}

constexpr int64_t kSerialWork = int64_t(1) << 16;

// Parallel over batch, heads and query blocks (packed: heads and every sequence's query blocks).
template <typename T, typename Weight>
void forward_blocks(const Problem<T>& P, const ForwardOut<T>& O) {
  auto make = [&] { return ForwardScratch<T>(P); };
  if (P.spans) {
    const auto blocks = sequence_blocks(P);
    const int64_t nb = static_cast<int64_t>(blocks.size());
    parallel_tasks(P.H * nb, make, [&](int64_t task, ForwardScratch<T>& W) {
      const auto [s, qb] = blocks[task % nb];
      forward_block<T, Weight>(P.sequence(s), O, 0, task / nb, qb, W);
    });
    return;
  }
  // Head by head, each head's query blocks last to first: under causality the last see the most
  // keys, so the work left at the end, when threads run out of tasks, is the smallest. A call of at
  // most kSerialWork multiply-adds (a decoding step over a short cache: 8 heads, 64 keys of 64
  // dims) runs on the calling thread, where waking the pool costs about what its arithmetic does.
  const int64_t nqb = P.q_blocks();
  const bool serial = P.B * P.H * P.L * P.S * (P.D + P.Dv) <= kSerialWork;
  parallel_tasks(P.B * P.H * nqb, make, [&](int64_t task, ForwardScratch<T>& W) {
    forward_block<T, Weight>(P, O, task / (nqb * P.H), (task / nqb) % P.H, nqb - 1 - task % nqb, W);
  }, serial);
}

// The weights' type resolved once per call (a static switch): 16-bit products take the weights in
// the inputs' format; float inputs, and 16-bit ones widened to float32 tiles, in T.
template <typename T>
void forward_kernel(const Problem<T>& P, const ForwardOut<T>& O) {
  if constexpr (std::is_same_v<T, float>) {
    if (P.half == kBF16 && !P.widen) return forward_blocks<T, at::BFloat16>(P, O);
    if (P.half == kF16 && !P.widen) return forward_blocks<T, at::Half>(P, O);
  }
  forward_blocks<T, T>(P, O);
}

}  // namespace
