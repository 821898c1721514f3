// The bound on every logit of a row (|q_i| max |k_j| scale, capped by softcap) that lets a row
// take a static offset: each key head's largest |k_j|.
#pragma once

#include "rows.h"

namespace {

using at::vec::Vectorized;

// max_j |k_j| from max_j |k_j|^2 (best), but inf where max |v| (vmax) is too large: see head_key_norm.
template <typename T>
T offset_norm(const Problem<T>& P, T best, T vmax) {
  const T room = std::numeric_limits<T>::max() / (T(256) * static_cast<T>(P.S) * std::exp(offset_limit<T>()));
  return vmax <= room ? std::sqrt(best) : std::numeric_limits<T>::infinity();  // NaN vmax: inf
}

// max_j |k_j| of one key head (NaN if some |k_j| is NaN): the static offset's key side
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
  return offset_norm(P, best, vmax);
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

}  // namespace
