// brgemm (oneDNN) for 16-bit products: whether it runs here, and its operands packed in VNNI-2
// pairs once per call, with the key norms beside the packing.
#pragma once

#include "bounds.h"

namespace {

using at::vec::Vectorized;

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
        kmax[s * Q.B * Q.Hkv + bh] = offset_norm(Q, static_cast<T>(packed_key_norm2(kt + bh * D * Q.s_pad, Q.S, D, Q.s_pad)), static_cast<T>(vmax));
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

}  // namespace
