// The guard's questions of an eager call's values (attnscale/guard.py), one C++ call each instead
// of several torch ops from Python: whether every row (last dim) of x is finite and not all zeros
// (rows of no entries count as right), whether every entry of x is finite, and whether none is NaN
// or +inf. float32 and float64, and bfloat16 and float16 read as their bits; any strides.
//
// Each question holds of a tensor when it holds of every row, in any order, so rows are read in
// the order they lie in memory (RowRuns), not in the tensor's logical order: the views attention
// is called with are transposes of their storage (torch's CPU kernel writes its output (B, L, H,
// Dv) and returns it as (B, H, L, Dv); a projection's (B, L, H, D) rows are seen as (B, H, L, D)),
// where logical order reads one row from each of many pages, a stride apart that the hardware's
// prefetchers do not follow, and memory order reads one run of rows back to back. They are read
// from the last down (RowRuns::every), which leaves the first rows in cache for a kernel that
// reads the tensor next from the start.
#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

namespace {

// Whether every entry of p[0, count) is finite: x * 0 is NaN for an inf or NaN; four sums, so that
// the adds do not wait on one another. Read from the end down (RowRuns::every says why).
template <typename T>
bool finite_impl(const T* p, int64_t count) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t n = Vec::size();
  Vec acc(T(0)), acc1(T(0)), acc2(T(0)), acc3(T(0)), zero(T(0));
  int64_t i = count;
  for (; i >= 4 * n; i -= 4 * n) {
    acc = acc + Vec::loadu(p + i - n) * zero;
    acc1 = acc1 + Vec::loadu(p + i - 2 * n) * zero;
    acc2 = acc2 + Vec::loadu(p + i - 3 * n) * zero;
    acc3 = acc3 + Vec::loadu(p + i - 4 * n) * zero;
  }
  acc = (acc + acc1) + (acc2 + acc3);
  for (; i >= n; i -= n) acc = acc + Vec::loadu(p + i - n) * zero;
  T tail = T(0);
  for (; i > 0; --i) tail += p[i - 1] * T(0);
  // Every lane 0 (a NaN is no zero), read from the vector's zero mask: no store and sum of its
  // lanes, which cost a short run more than its loads.
  const int all_zero = static_cast<int>((int64_t(1) << n) - 1);
  return acc.zero_mask() == all_zero && tail == T(0);
}

// rows_ok_impl's question (below) of rows of V whole vectors, in one pass from the last row down:
// x - x is +0 (no bit set) for a finite x and NaN for an inf or a NaN, and its bits are OR-ed into
// one accumulator per vector of a row (V known here, so they stay in registers and no OR waits on
// another row's); a row is all zeros where the zero masks of its vectors all are, which no later
// row waits on.
template <typename T, int V>
bool rows_ok_vectors(const T* x, int64_t rows) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t n = Vec::size();
  const int all_zero = static_cast<int>((int64_t(1) << n) - 1);
  Vec acc[V];
  for (int j = 0; j < V; ++j) acc[j] = Vec(T(0));
  bool zero_row = false;
  for (int64_t r = rows - 1; r >= 0; --r) {
    const T* row = x + r * V * n;
    int zeros = all_zero;
    for (int j = 0; j < V; ++j) {
      const Vec v = Vec::loadu(row + j * n);
      acc[j] = acc[j] | (v - v);
      zeros &= v.zero_mask();
    }
    zero_row |= zeros == all_zero;
  }
  for (int j = 1; j < V; ++j) acc[0] = acc[0] | acc[j];
  return !zero_row && acc[0].zero_mask() == all_zero;  // (an OR of x - x is +0 only where every one was)
}

// Every entry of `rows` rows of `width` back to back finite (finite_impl's pass) and no row all
// zeros: per row, whether a vector of it has a lane that is not zero, from the vector's zero mask
// (no work per lane). Rows of 1, 2, 4, 8 or 16 whole vectors take rows_ok_vectors.
template <typename T>
bool rows_ok_impl(const T* x, int64_t rows, int64_t width) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t n = Vec::size();
  switch (width == 0 ? 0 : width % n ? -1 : width / n) {  // (float32 heads of 16 to 256 entries with AVX-512, 8 to 128 with AVX2)
    case 1: return rows_ok_vectors<T, 1>(x, rows);
    case 2: return rows_ok_vectors<T, 2>(x, rows);
    case 4: return rows_ok_vectors<T, 4>(x, rows);
    case 8: return rows_ok_vectors<T, 8>(x, rows);
    case 16: return rows_ok_vectors<T, 16>(x, rows);
    default: break;
  }
  const int all_zero = static_cast<int>((int64_t(1) << n) - 1);
  // in chunks of about 16 KiB from the last down, each checked for zero rows while in L1
  const int64_t chunk = std::max<int64_t>(1, (int64_t(16) << 10) / std::max<int64_t>(1, width * int64_t(sizeof(T))));
  for (int64_t end = rows; end > 0; end -= chunk) {
    const int64_t start = std::max<int64_t>(0, end - chunk);
    if (!finite_impl(x + start * width, (end - start) * width)) return false;
    for (int64_t r = start; r < end; ++r) {
      const T* row = x + r * width;
      bool nonzero = false;
      int64_t c = 0;
      for (; c + n <= width && !nonzero; c += n) nonzero = Vec::loadu(row + c).zero_mask() != all_zero;
      for (; c < width && !nonzero; ++c) nonzero = row[c] != T(0);
      if (!nonzero) return false;
    }
  }
  return true;
}

// Whether no entry of p[0, count) is NaN or +inf (-inf allowed: a float mask's hidden key): the
// running maximum, which NaN propagates to, below +inf.
template <typename T>
bool below_inf_impl(const T* p, int64_t count) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t n = Vec::size();
  constexpr T inf = std::numeric_limits<T>::infinity();
  Vec acc(-inf), acc1(-inf);
  int64_t i = 0;
  for (; i + 2 * n <= count; i += 2 * n) {
    acc = at::vec::maximum(acc, Vec::loadu(p + i));
    acc1 = at::vec::maximum(acc1, Vec::loadu(p + i + n));
  }
  acc = at::vec::maximum(acc, acc1);
  for (; i + n <= count; i += n) acc = at::vec::maximum(acc, Vec::loadu(p + i));
  T lanes[n];
  acc.store(lanes);
  bool below = true;
  for (int64_t j = 0; j < n; ++j) below = below && lanes[j] < inf;
  for (; i < count; ++i) below = below && p[i] < inf;  // NaN fails <
  return below;
}

// bfloat16 and float16 as their bits (uint16_t): an entry is an inf or a NaN where its exponent
// bits `e` (0x7F80, 0x7C00) are all set, a NaN where the bits but the sign exceed them, +inf where
// they are exactly them, and a zero where the bits but the sign are all clear. Loops without an
// early exit, which the compiler vectorises.
constexpr uint16_t kSignless = 0x7FFF;

inline uint16_t exponent_bits(at::ScalarType t) { return t == at::kBFloat16 ? 0x7F80 : 0x7C00; }

inline bool finite16(const uint16_t* p, int64_t count, uint16_t e) {
  uint16_t bad = 0;
  for (int64_t i = count - 1; i >= 0; --i) bad |= uint16_t((p[i] & e) == e);
  return bad == 0;
}

inline bool rows_ok16(const uint16_t* x, int64_t rows, int64_t width, uint16_t e) {
  for (int64_t r = rows - 1; r >= 0; --r) {
    const uint16_t* row = x + r * width;
    uint16_t bad = 0, any = 0;
    for (int64_t c = 0; c < width; ++c) {
      bad |= uint16_t((row[c] & e) == e);
      any |= uint16_t(row[c] & kSignless);
    }
    if (bad != 0 || any == 0) return false;
  }
  return true;
}

inline bool below_inf16(const uint16_t* p, int64_t count, uint16_t e) {
  uint16_t bad = 0;
  for (int64_t i = 0; i < count; ++i) bad |= uint16_t((p[i] & kSignless) > e) | uint16_t(p[i] == e);
  return bad == 0;
}

// A tensor's rows (its last dim, `width` entries at stride 1) in the order they lie in memory: the
// other dims ordered by stride, largest first, without those of size 1 or stride 0 (a broadcast
// dim repeats rows that are read once), and the innermost merged while each one's rows follow on
// from the next's, into runs of `run` rows back to back; `sizes` and `strides` (in entries) are the
// dims the runs step over, outermost first.
struct RowRuns {
  int64_t width = 0, run = 1;
  std::vector<int64_t> sizes, strides;
  int64_t rows = 0;  // run * the product of sizes

  explicit RowRuns(const torch::Tensor& x) : width(x.dim() == 0 ? 1 : x.size(-1)) {
    std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of the outer dims
    for (int64_t d = 0; d + 1 < x.dim(); ++d)
      if (x.size(d) != 1 && x.stride(d) != 0) dims.emplace_back(x.stride(d), x.size(d));
    std::stable_sort(dims.begin(), dims.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    while (!dims.empty() && dims.back().first == run * width) run *= dims.back().second, dims.pop_back();
    rows = run;
    for (const auto& [stride, size] : dims) sizes.push_back(size), strides.push_back(stride), rows *= size;
  }

  // Whether f(first_row, count, width) holds of each run of the rows [first, last), each cut to
  // that range; stops at the first run f says false of. Runs are read from the last down, and f
  // reads each from its end (finite_impl): a check made just before a kernel that reads the
  // tensor from the start (torch's reads a decoding step's keys head by head) leaves its first
  // rows the ones most recently read, still in cache where the tensor is larger than the cache,
  // and one made just after a kernel wrote or read it reads its last rows, the cached ones, first.
  template <typename T, typename F>
  bool every(const T* base, F&& f, int64_t first, int64_t last) const {
    if (first >= last) return true;
    const int64_t outer = static_cast<int64_t>(sizes.size());
    std::vector<int64_t> index(static_cast<size_t>(outer), 0);
    int64_t offset = 0, end = (last - 1) % run + 1;  // the rows [.., end) of the current run are left to read
    for (int64_t d = outer - 1, rest = (last - 1) / run; d >= 0; --d) {  // the run of row last - 1: its index and offset
      index[d] = rest % sizes[d], rest /= sizes[d];
      offset += index[d] * strides[d];
    }
    for (int64_t row = last; row > first; end = run) {
      const int64_t count = std::min(end, row - first);
      if (!f(base + offset + (end - count) * width, count, width)) return false;
      row -= count;
      for (int64_t d = outer - 1; d >= 0; --d) {  // the previous run's index, odometer-wise
        if (index[d] > 0) {
          --index[d], offset -= strides[d];
          break;
        }
        index[d] = sizes[d] - 1, offset += index[d] * strides[d];
      }
    }
    return true;
  }
};

// Outputs of at least this many entries are checked on every thread, each a range of rows: a
// kernel that wrote them on every thread left each part in the cache of the core that wrote it,
// where one thread reading them all waited on the other cores' caches (a (1, 8, 64, 64) float32
// output after torch's kernel at 2 threads: bench_overhead.py's HuggingFace layer case).
constexpr int64_t kParallelRows = int64_t(1) << 14;
// Inputs (keys, slopes, sinks) above 2^15 entries (128 KiB of float32), below which waking the
// other thread is taken to cost more than its half of the read (the HuggingFace layer's (1, 2, 64,
// 64) keys, 2^13 entries, read on both threads made its step slower); bench_overhead.py's
// growing-cache case, whose keys come from memory, is not helped by reading them on both.
constexpr int64_t kParallelInput = (int64_t(1) << 15) + 1;

// Whether f(first_row, count, width) holds of every run of x's rows (RowRuns), on every thread
// where x has at least `least` entries (each a range of rows in memory order), else on this one.
// x's last dim contiguous (or of one entry), at least one entry.
template <typename T, typename F>
bool every_run(const torch::Tensor& x, int64_t least, F f) {
  const RowRuns runs(x);
  const T* base = static_cast<const T*>(x.const_data_ptr());  // (uint16_t: a 16-bit float's bits)
  const int64_t threads = at::get_num_threads();
  if (x.numel() < least || threads < 2 || runs.rows < 2 || at::in_parallel_region()) return runs.every(base, f, 0, runs.rows);
  std::atomic<bool> all(true);
  at::parallel_for(0, runs.rows, (runs.rows + threads - 1) / threads, [&](int64_t first, int64_t last) {
    if (all.load(std::memory_order_relaxed) && !runs.every(base, f, first, last)) all.store(false);
  });
  return all.load();
}

// Whether the value checks read x's dtype: float32, float64, bfloat16 or float16.
inline bool checked_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf; }

// f's question of every run of x's rows, x of float32, float64, bfloat16 or float16 (`op` names
// the check in the error otherwise); a copy where the last dim is strided.
template <typename F>
bool ask_rows(const torch::Tensor& x, const char* op, int64_t least, F f) {
  TORCH_CHECK_VALUE(checked_dtype(x.scalar_type()), "attnscale fused kernel: ", op, " takes float32, float64, bfloat16 or float16, got ", x.scalar_type());
  if (x.numel() == 0) return true;
  const auto& rows = x.dim() == 0 || x.size(-1) == 1 || x.stride(-1) == 1 ? x : x.contiguous();
  if (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf) return every_run<uint16_t>(rows, least, f.bits(exponent_bits(x.scalar_type())));
  bool ok = true;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "attnscale_ask_rows", [&] { ok = every_run<scalar_t>(rows, least, f.template operator()<scalar_t>()); });
  return ok;
}

struct RowsOk {
  template <typename T>
  auto operator()() const {
    return [](const T* p, int64_t count, int64_t width) { return rows_ok_impl<T>(p, count, width); };
  }
  auto bits(uint16_t e) const {
    return [e](const uint16_t* p, int64_t count, int64_t width) { return rows_ok16(p, count, width, e); };
  }
};
struct Finite {
  template <typename T>
  auto operator()() const {
    return [](const T* p, int64_t count, int64_t width) { return finite_impl<T>(p, count * width); };
  }
  auto bits(uint16_t e) const {
    return [e](const uint16_t* p, int64_t count, int64_t width) { return finite16(p, count * width, e); };
  }
};
struct BelowInf {
  template <typename T>
  auto operator()() const {
    return [](const T* p, int64_t count, int64_t width) { return below_inf_impl<T>(p, count * width); };
  }
  auto bits(uint16_t e) const {
    return [e](const uint16_t* p, int64_t count, int64_t width) { return below_inf16(p, count * width, e); };
  }
};

bool rows_ok_op(const torch::Tensor& x) {
  if (x.dim() == 0) return true;  // (no row)
  return ask_rows(x, "rows_ok", kParallelRows, RowsOk{});
}

// rows_ok's question of the rows [first, last) of x, a contiguous (B, H, L, W) tensor (row r is
// (b, h, l) with r = (b H + h) L + l), asked of each row as it is copied to its place in y, a
// contiguous (B, L, H, W) one: one read of x where the check and the copy made two. From the last
// row down, as rows_ok_impl. W > 0.
template <typename T>
bool rows_ok_transposed_impl(const T* x, T* y, int64_t H, int64_t L, int64_t W, int64_t first, int64_t last) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t n = Vec::size();
  const int all_zero = static_cast<int>((int64_t(1) << n) - 1);
  Vec acc(T(0));
  bool zero_row = false;
  for (int64_t r = last - 1; r >= first; --r) {
    const int64_t l = r % L, bh = r / L, h = bh % H, b = bh / H;
    const T* row = x + r * W;
    T* to = y + ((b * L + l) * H + h) * W;
    int zeros = all_zero;
    int64_t c = 0;
    for (; c + n <= W; c += n) {
      const Vec v = Vec::loadu(row + c);
      acc = acc | (v - v);
      zeros &= v.zero_mask();
      v.store(to + c);
    }
    if (c < W) {  // (the lanes past the row load as zeros: +0 in acc, zeros in the mask)
      const Vec v = Vec::loadu(row + c, W - c);
      acc = acc | (v - v);
      zeros &= v.zero_mask();
      v.store(to + c, W - c);
    }
    zero_row |= zeros == all_zero;
  }
  return !zero_row && acc.zero_mask() == all_zero;
}

// x (B, H, L, W) of float32 or float64 as (x.transpose(1, 2).contiguous(), rows_ok(x)): the
// layout HuggingFace's attention functions return, checked as it is copied where x is contiguous
// (torch's kernel's output with enable_gqa, and every output of its math kernel), on every thread
// from kParallelRows entries as rows_ok; x's own memory, transposed, where it already lies so
// (torch's flash kernel writes (B, L, H, Dv)); a copy checked after it otherwise.
std::pair<torch::Tensor, bool> rows_ok_transposed_op(const torch::Tensor& x) {
  TORCH_CHECK_VALUE(x.dim() == 4, "attnscale fused kernel: rows_ok_transposed takes a (B, H, L, W) tensor, got ", x.dim(), " dims");
  TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble, "attnscale fused kernel: rows_ok_transposed takes float32 or float64, got ",
                    x.scalar_type());
  const auto t = x.transpose(1, 2);
  if (t.is_contiguous() || !x.is_contiguous() || x.numel() == 0) {
    auto y = t.contiguous();
    return {y, rows_ok_op(y)};
  }
  auto y = at::empty(t.sizes(), x.options());
  const int64_t H = x.size(1), L = x.size(2), W = x.size(3), rows = x.numel() / W;
  bool ok = true;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "attnscale_rows_ok_transposed", [&] {
    const scalar_t* from = x.const_data_ptr<scalar_t>();
    scalar_t* to = y.data_ptr<scalar_t>();
    const int64_t threads = at::get_num_threads();
    if (x.numel() < kParallelRows || threads < 2 || at::in_parallel_region()) {
      ok = rows_ok_transposed_impl<scalar_t>(from, to, H, L, W, 0, rows);
      return;
    }
    std::atomic<bool> all(true);
    at::parallel_for(0, rows, (rows + threads - 1) / threads, [&](int64_t first, int64_t last) {
      if (!rows_ok_transposed_impl<scalar_t>(from, to, H, L, W, first, last)) all.store(false, std::memory_order_relaxed);
    });
    ok = all.load();
  });
  return {y, ok};
}

// (keys large enough that torch's elementwise ops wrote them on every thread, as rows_ok's outputs)
bool all_finite_op(const torch::Tensor& x) { return ask_rows(x, "all_finite", kParallelInput, Finite{}); }

// (a float mask's values, on this thread)
bool below_inf_op(const torch::Tensor& x) { return ask_rows(x, "below_inf", std::numeric_limits<int64_t>::max(), BelowInf{}); }

}  // namespace
