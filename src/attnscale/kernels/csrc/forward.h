// The forward pass: one query block against its key tiles (online softmax, or rows settled on a
// fixed offset), and the parallel loop over blocks.
#pragma once

#include "packing.h"
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

}  // namespace
