// The row path: one query row's scores through the score path (scale, softcap, ALiBi, masks), its
// exp against the row's offset (running max, or static), the weights' sums and the statistics.
#pragma once

#include "problem.h"
#include "vector_math.h"

namespace {

using at::vec::Vectorized;

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
// Cauchy-Schwarz bound behind the rows' static offsets (forward_block, key_norms).
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

// A row's vector loops over its span [c, hi): whole vectors, then once over the span's last
// entries, fewer than a vector, as a partial one (its lanes past hi read as 0, are not written and
// miss the maximum); vmax keeps the logits' maximum where asked.
template <typename T>
struct SpanLoop {
  using Vec = Vectorized<T>;
  static constexpr int64_t n = Vec::size();
  int64_t c, hi;
  Vec vmax = Vec(-std::numeric_limits<T>::infinity());

  template <typename Body>
  __attribute__((always_inline)) void run(Body&& body) {
    for (; c + n <= hi; c += n) body(c, n);
    if (c < hi) body(c, hi - c), c = hi;
  }
  __attribute__((always_inline)) void keep_max(const Vec& xv, int64_t count) {
    vmax = at::vec::maximum(vmax, count == n ? xv : Vec::blendv(Vec(-std::numeric_limits<T>::infinity()), xv, first_lanes<T>(count)));
  }
  T max() const {
    return at::vec::vec_reduce_all<T>([](const Vec& a, const Vec& v) { return at::vec::maximum(a, v); }, vmax);
  }
};

// Every loop below turns an infinite product (an inf in q or k, or overflow) into NaN with + (raw -
// raw), which is 0 for a finite one: as -inf it would hide its key and leave the row finite, where
// the rules make a row that sees a non-finite key NaN; as NaN the row check reports the row. Only
// rows that never take a static offset can meet one (their bound is inf or NaN), so want_max is
// false only where no product is infinite.

// The products are the logits (no softcap, ALiBi or float mask): multiplied by pre where brgemm left
// them unscaled, and their maximum, if wanted.
template <typename T>
__attribute__((always_inline)) inline void plain_logits(const Problem<T>& P, T* x, T pre, bool want_max, SpanLoop<T>& loop) {
  using Vec = Vectorized<T>;
  const Vec vpre(pre);
  if (pre != T(1) && want_max) {
    loop.run([&](int64_t c, int64_t count) __attribute__((always_inline)) {
      const Vec raw = Vec::loadu(x + c, count);
      const Vec xv = at::vec::fmadd(raw, vpre, raw - raw);
      xv.store(x + c, count);
      loop.keep_max(xv, count);
    });
  } else if (pre != T(1)) {
    loop.run([&](int64_t c, int64_t count) __attribute__((always_inline)) { (Vec::loadu(x + c, count) * vpre).store(x + c, count); });
  } else if (want_max && P.bmask) {  // the mask re-reads x: the NaN must be in it
    loop.run([&](int64_t c, int64_t count) __attribute__((always_inline)) {
      const Vec raw = Vec::loadu(x + c, count);
      const Vec xv = raw + (raw - raw);
      xv.store(x + c, count);
      loop.keep_max(xv, count);
    });
  } else if (want_max) {  // x may keep -inf: the NaN maximum makes the row NaN
    loop.run([&](int64_t c, int64_t count) __attribute__((always_inline)) {
      const Vec raw = Vec::loadu(x + c, count);
      loop.keep_max(raw + (raw - raw), count);
    });
  } else {
    loop.c = loop.hi;  // nothing to compute: the span's logits are the products as they stand
  }
}

// softcap only, the common case: its own loop, nothing else tested. t (or null): tanh of the products.
template <typename T>
__attribute__((always_inline)) inline void capped_logits(T* x, T* t, T cap, T pre, SpanLoop<T>& loop) {
  using Vec = Vectorized<T>;
  const Vec vcap(cap), vpre(pre);
  const bool scaled = pre != T(1);
  loop.run([&](int64_t c, int64_t count) __attribute__((always_inline)) {
    const Vec raw = scaled ? Vec::loadu(x + c, count) * vpre : Vec::loadu(x + c, count);
    const Vec th = vtanh(raw);
    if (t) th.store(t + c, count);
    // + (raw - raw): 0 for a finite product, NaN for an infinite one (overflow, or an inf in q or
    // k), which tanh would cap to a finite logit that no row check could tell from a right one.
    const Vec xv = at::vec::fmadd(th, vcap, raw - raw);
    xv.store(x + c, count);
    loop.keep_max(xv, count);
  });
}

// ALiBi and / or a float mask whose keys are contiguous (fm: the row's, from key j0), softcap or
// not (alibi: the slope applies). p: the row's aligned position less the tile's first key (i' - j =
// p - c at column c).
template <typename T>
__attribute__((always_inline)) inline void biased_logits(T* x, T* t, T cap, T pre, bool alibi, T slope, int64_t p, const T* fm,
                                                        SpanLoop<T>& loop) {
  using Vec = Vectorized<T>;
  const Vec vcap(cap), vslope(slope), iota = Vec::arange(T(0), T(1)), vpre(pre);
  const bool scaled = pre != T(1);
  loop.run([&](int64_t c, int64_t count) __attribute__((always_inline)) {
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
    loop.keep_max(xv, count);
  });
}

// Logits of one row of a tile, in place, and their maximum (NaN if any is NaN): on entry x (width
// entries) holds the raw products times (scale, or scale / softcap with softcap); on exit the score
// path's logits, -inf where a key is hidden. One pass over the keys causal / window leave visible
// (the rest is filled). With softcap, t (if not null) receives tanh of the products (0 at keys
// outside the span), for the backward pass, which calls this with the same arguments as the
// forward: both see bit-identical logits. pre: the factor brgemm's unscaled products still need.
// A float mask with strided keys takes the scalar loop at the end.
template <typename T>
T score_row(const Problem<T>& P, int64_t b, int64_t h, int64_t i, int64_t j0, int64_t width, T* x, T* t,
            int64_t* visible = nullptr, bool want_max = true, T pre = T(1)) {
  const T neg_inf = -std::numeric_limits<T>::infinity();
  const T cap = P.softcap;
  P.unfold(&h, &i);  // int8 problems: the row's own query head and row
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
  const int64_t p = P.aligned(i) - j0;  // i' - j = p - c at column c
  const T* fm = P.fmask ? P.fmask + b * P.m_sb + h * P.m_sh + i * P.m_sl + j0 * P.m_ss : nullptr;
  SpanLoop<T> loop{lo, hi};
  if (cap == T(0) && !P.alibi && !fm)
    plain_logits(P, x, pre, want_max, loop);
  else if (!P.alibi && !fm)
    capped_logits(x, t, cap, pre, loop);
  else if (!fm || P.m_ss == 1)
    biased_logits(x, t, cap, pre, P.alibi != nullptr, slope, p, fm, loop);
  T m = loop.max();
  for (int64_t c = loop.c; c < hi; ++c) {  // a float mask with strided keys
    T xc = pre != T(1) ? x[c] * pre : x[c];
    if (cap != T(0)) {
      const T th = stanh(xc);
      if (t) t[c] = th;
      xc = cap * th + (xc - xc);  // an infinite product gives NaN, as above
    } else if (want_max) {
      xc = xc + (xc - xc);
    }
    if (P.alibi) xc -= slope * static_cast<T>(std::abs(p - c));
    if (fm) xc += fm[c * P.m_ss];
    x[c] = xc;
    if (std::isnan(xc) || xc > m) m = xc;  // NaN propagates, as in at::vec::maximum
  }
  if (P.bmask) {
    const bool* mr = P.bmask + b * P.m_sb + h * P.m_sh + i * P.m_sl + j0 * P.m_ss;
    for (int64_t c = lo; c < hi; ++c) x[c] = mr[c * P.m_ss] ? x[c] : neg_inf;
    if (want_max) m = row_max(x + lo, hi - lo);
  }
  if (visible) {  // the keys in the span, less those a mask hides (-inf)
    int64_t count = hi - lo;
    if (P.bmask || P.fmask)
      for (int64_t c = lo; c < hi; ++c) count -= x[c] == neg_inf;
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

// static_row's vector pairs over [c, hi), specialised on the softcap and the pending factor: the
// constants are values here, so they stay in registers (as captured references they were reloaded
// after every store, since a float store may alias them); the results are the same operations.
// A static row's products are finite (its bound is), so the softcap's + (raw - raw) is +0 there,
// a constant. With kFloor false the caller knows that no weight falls under the floor
// (vexp_unfloored). With kStats also the logits' maximum (*top) and sum p (s - m) (*weighted): a
// weight under the floor is 0 and its finite s - m gives a 0 term. The last entries, fewer than a
// pair, take the same operations on partial vectors (the lanes past hi read as 0, weigh 0 and are
// not written); their weights in T take vexp_accurate.
template <bool kCap, bool kScaled, bool kFloor, bool kStats, typename T, typename O>
int64_t static_pairs(const T* x, int64_t c, int64_t hi, T m, T cap, T pre, O* out, Vectorized<T>* sum,
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

// What static_row adds for the statistics: sum p (s - m), the largest logit, the visible keys.
template <typename T>
struct StaticStats {
  T weighted, top;
  int64_t visible;
};

// score_row then exp_row (or exp_row_to) in one pass, for a row on its static offset m
// (forward_block) in a problem without ALiBi or masks: the products x (times pre) through the
// softcap, exp(s - m) and the sum, written to out (T, or the 16-bit format of the inputs), 0 outside
// the row's span; x is not written. Each entry takes score_row's and exp_row's operations on it,
// in the same order, so its weight has their bits, but for the row's last entries, fewer than a
// vector pair (static_pairs' partial vectors, which need not fall where exp_row's do). floored
// false: the caller knows every logit of the span is at least m + exp_floor (forward_block), so no
// weight needs the floor's test. stats (or null): the tile's sum p (s - m), largest logit (-inf
// without a visible key) and visible keys, written there.
template <typename T, typename O>
T static_row(const Problem<T>& P, int64_t i, int64_t j0, int64_t width, const T* x, T m, T pre, O* out, bool floored,
              StaticStats<T>* stats = nullptr) {
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
      return scaled ? static_pairs<true, true, kFloor, kStats>(x, lo, hi, m, cap, pre, out, &acc, &wacc, &vtop)
                    : static_pairs<true, false, kFloor, kStats>(x, lo, hi, m, cap, pre, out, &acc, &wacc, &vtop);
    return scaled ? static_pairs<false, true, kFloor, kStats>(x, lo, hi, m, cap, pre, out, &acc, &wacc, &vtop)
                  : static_pairs<false, false, kFloor, kStats>(x, lo, hi, m, cap, pre, out, &acc, &wacc, &vtop);
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
  if (stats) *stats = StaticStats<T>{weighted, top, hi - lo};
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

}  // namespace
