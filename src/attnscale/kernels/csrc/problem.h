// One call's problem (tensors, strides, options, the visible key range of each row and the tiles
// of each query block), and the parallel loop that runs its tasks.
#pragma once

#include "products.h"

namespace {

using at::vec::Vectorized;

// brgemm's operands of each packed sequence (Problem::seq_packs), indexed by sequence.
struct SequencePacks {
  std::vector<const uint16_t*> kpack, vpack, vtpack, kpairs;
  std::vector<int64_t> s_pad;
  std::vector<const float*> kmax;  // each sequence's key norms, (Hkv,), where its rows may take a static offset
};

// Int8 keys and values (attnscale/quantized.py's layout, forward only): codes k (B, Hkv, S, D) and
// v (B, Hkv, S, Dv); float32 scales k_scale (B, Hkv, S, D / group), one per key and group of
// channels, and v_scale (B, Hkv, S, 1), one per value vector; k_mean (B, Hkv, 1, D), the mean the
// keys were smoothed by. Each key head's rows lie one after another (a head's S rows contiguous,
// as in views of the first S keys of a longer cache); heads and batches at any strides (*_sb,
// *_sh, in entries). A tile's keys and values are dequantized as it is reached, code * scale (+
// mean), each rounded once as QuantizedKV.dequantize rounds them.
struct Int8KV {
  const int8_t *k, *v;
  const float *k_scale, *k_mean, *v_scale;
  int64_t group, Hkv, D, Dv;
  int64_t k_sb, k_sh, v_sb, v_sh, ks_sb, ks_sh, vs_sb, vs_sh, km_sb, km_sh;
  // Decoding's q.k products in integers, q rounded to int16 per row (quantized.h, int8_scores):
  // for a 16-bit query, whose output is rounded to 16 bits.
  bool q_int16;
  // Head `head` (b * Hkv + hk) from key j on: its codes, scales, and mean.
  int64_t at(int64_t head, int64_t sb, int64_t sh) const { return (head / Hkv) * sb + (head % Hkv) * sh; }
  const int8_t* keys(int64_t head, int64_t j) const { return k + at(head, k_sb, k_sh) + j * D; }
  const float* key_scales(int64_t head, int64_t j) const { return k_scale + at(head, ks_sb, ks_sh) + j * (D / group); }
  const float* mean(int64_t head) const { return k_mean + at(head, km_sb, km_sh); }
  const int8_t* values(int64_t head, int64_t j) const { return v + at(head, v_sb, v_sh) + j * Dv; }
  const float* value_scales(int64_t head, int64_t j) const { return v_scale + at(head, vs_sb, vs_sh) + j; }
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
  // The largest |k_j| of each key head, (B, Hkv), where the forward's rows may take a static
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
  // Int8 keys and values (T = float, null otherwise), with the query heads folded into their key
  // head's rows: the problem's heads are the key heads (H = Hkv) and head hk's rows are the
  // caller's (head hk * fold + g, row i) at g * fold_rows + i (L = fold * fold_rows), so that
  // each key tile is dequantized once for every query head that reads it. That is also where
  // (B, H, L) outputs keep those rows. unfold gives a row's own head and row.
  const Int8KV* int8 = nullptr;
  int64_t fold = 1, fold_rows = 1;
  // Int8 products from the codes in registers (int8_scores, int8_values) instead of float32 tiles
  // in scratch and BLAS: blocks of few rows (decoding), where writing the tiles costs the most.
  bool int8_direct = false;
  void unfold(int64_t* h, int64_t* i) const {
    if (fold == 1) return;
    *h = *h * fold + *i / fold_rows;
    *i %= fold_rows;
  }

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

  // Query row i's aligned position as a local key index: ALiBi's distance to key j is |that - j|
  // (score_row in the forward, slope_gradient in the backward).
  int64_t aligned(int64_t i) const { return q_start + i + q_offset - k_start; }

  // Keys [lo, hi) (local) that causal / window leave visible to query row i; hi <= lo if none.
  // Only the limits that exist are applied (no stand-in for "unbounded" that a position could
  // reach). Positions are at most 2^61 (checks.h), window sides any int64: p plus or minus a side
  // is taken in 128 bits, then cut to the keys [0, S).
  void row_span(int64_t i, int64_t* lo, int64_t* hi) const {
    using Wide = __int128;
    const Wide p = Wide(q_start) + i + q_offset - k_start;  // aligned position, as a local key index
    Wide first = 0, last = S - 1;
    if (causal) last = std::min(last, p);
    if (left >= 0) first = std::max(first, p - left);
    if (right >= 0) last = std::min(last, p + right);
    *lo = static_cast<int64_t>(std::min<Wide>(first, S));
    *hi = static_cast<int64_t>(std::max<Wide>(last + 1, 0));
  }

  // The key tiles [j0, j1) of query block i0:i1: fixed blocks of block_k, cut to the keys some
  // row of the block can see (the same list in the forward and the backward pass).
  std::vector<std::pair<int64_t, int64_t>> key_tiles(int64_t i0, int64_t i1) const {
    int64_t lo0, hi0, lo1, hi1;
    // Folded heads: a block's rows may wrap from one query head's last row to the next head's
    // first, and then see every row's keys; otherwise rows i0..i1 of one head.
    int64_t first = i0, last = i1 - 1;
    if (fold > 1) {
      const bool wraps = i0 / fold_rows != (i1 - 1) / fold_rows;
      first = wraps ? 0 : i0 % fold_rows, last = wraps ? fold_rows - 1 : (i1 - 1) % fold_rows;
    }
    row_span(first, &lo0, &hi0);
    row_span(last, &lo1, &hi1);
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

// Tasks [0, n) on every thread, handed out one at a time from a shared counter (dynamic, in
// order) rather than split into equal ranges up front: a thread that starts late, or loses its
// core for a while, leaves its share to the others instead of making everyone wait for it. Each
// thread makes its scratch once (make()) and runs run(task, scratch) under SerialBlas. `serial`:
// every task on the calling thread (at::parallel_for of one task runs inline).
template <typename Make, typename Run>
void parallel_tasks(int64_t n, Make make, Run run, bool serial = false) {
  if (n <= 0) return;
  std::atomic<int64_t> next{0};
  const int64_t threads = serial ? 1 : std::min<int64_t>(at::get_num_threads(), n);
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

}  // namespace
