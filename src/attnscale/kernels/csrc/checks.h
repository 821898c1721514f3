// What a call of the kernel must satisfy, checked once for every entry (the ops of
// attnscale.kernels.ops and the binding itself): an inconsistent call raises a ValueError that
// names the argument, what was expected and what came, before anything is read or allocated,
// instead of reading out of bounds (garbage, a crash) or looping. From shapes, dtypes, strides and
// options alone, and a span table's few numbers: every decoding step passes here.
#pragma once

#include <torch/extension.h>

#include <cmath>
#include <limits>
#include <sstream>
#include <string>

#include "options.h"
#include "products.h"

namespace {

// Positions (q_offset, q_start, k_start) up to this size: the ALiBi distance, their sum, stays
// inside int64 (four terms of at most 2^61); Problem::row_span adds window sides in 128 bits.
constexpr int64_t kMaxPosition = int64_t(1) << 61;

inline std::string shape_of(const torch::Tensor& x) {
  std::ostringstream s;
  s << x.sizes();
  return s.str();
}

#define ATTNSCALE_REFUSE(cond, arg, expected, got)                                                       \
  TORCH_CHECK_VALUE(cond, "torch.ops.attnscale: ", arg, ": expected ", expected, ", got ", got,          \
                    ". Fix: pass the kernel's layout and options (see attnscale.kernels.ops)")

inline bool kernel_dtype(const torch::Tensor& x) {
  const auto t = x.scalar_type();
  return t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf;
}

// Rows the kernel reads with a contiguous last dim (any stride where it holds one entry), apart:
// BLAS reads each (n, d) matrix with leading dimension = the row stride, so rows must not overlap
// (stride 0 or unfold views), or it refuses the call and the product is never written.
inline bool rows_readable(const torch::Tensor& x) {
  return (x.stride(3) == 1 || x.size(3) <= 1) && x.stride(2) >= std::max<int64_t>(1, x.size(3));
}

inline void check_options(const Options& o) {
  ATTNSCALE_REFUSE(std::isfinite(o.scale), "scale", "a finite number", o.scale);
  ATTNSCALE_REFUSE(std::isfinite(o.softcap) && o.softcap >= 0, "softcap", "a finite cap > 0, or 0 for none", o.softcap);
  ATTNSCALE_REFUSE(o.left >= -1 && o.right >= -1, "left, right", "window sides of 0 keys or more, or -1 for unbounded",
                   std::to_string(o.left) + ", " + std::to_string(o.right));
  ATTNSCALE_REFUSE(o.q_start >= 0 && o.k_start >= 0 && o.q_start <= kMaxPosition && o.k_start <= kMaxPosition, "q_start, k_start",
                   "global positions from 0 to 2**61", std::to_string(o.q_start) + ", " + std::to_string(o.k_start));
  ATTNSCALE_REFUSE(o.q_offset >= -kMaxPosition && o.q_offset <= kMaxPosition, "q_offset", "a key position from -2**61 to 2**61",
                   o.q_offset);
  ATTNSCALE_REFUSE(o.block_q >= 1 && o.block_k >= 1, "block_q, block_k",
                   "positive block sizes (the ops resolve 0 to their defaults)", std::to_string(o.block_q) + ", " + std::to_string(o.block_k));
}

// ALiBi slopes (units, H), or (H,) for every unit, and a mask (B, H, L, S) of the compute dtype acc
// (a mask also bool).
inline void check_biases(const c10::optional<torch::Tensor>& alibi, const c10::optional<torch::Tensor>& mask,
                         const c10::optional<torch::Tensor>& spans, int64_t B, int64_t H, int64_t L, int64_t S, at::ScalarType acc) {
  const int64_t units = spans.has_value() && spans->dim() == 2 ? spans->size(0) : B;
  if (alibi.has_value())
    ATTNSCALE_REFUSE(((alibi->dim() == 2 && alibi->size(0) == units) || alibi->dim() == 1) && alibi->size(-1) == H && alibi->scalar_type() == acc &&
                         alibi->device().is_cpu(),
                     "alibi", c10::str("a ", acc, " CPU tensor (", spans.has_value() ? "nseq" : "B", ", H) = (", units, ", ", H, ") or (H,) = (", H, ",)"),
                     c10::str(alibi->scalar_type(), " ", alibi->sizes(), " on ", alibi->device()));
  if (mask.has_value())
    ATTNSCALE_REFUSE(mask->dim() == 4 && mask->size(0) == B && mask->size(1) == H && mask->size(2) == L && mask->size(3) == S &&
                         (mask->scalar_type() == at::kBool || mask->scalar_type() == acc) && mask->device().is_cpu(),
                     "mask", c10::str("a bool or ", acc, " CPU tensor (B, H, L, S) = (", B, ", ", H, ", ", L, ", ", S, ")"),
                     c10::str(mask->scalar_type(), " ", mask->sizes(), " on ", mask->device()));
}

inline void check_call(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                       const c10::optional<torch::Tensor>& alibi, const c10::optional<torch::Tensor>& mask,
                       const c10::optional<torch::Tensor>& spans, const Options& o) {
  for (const auto& [name, x] : {std::pair<const char*, const torch::Tensor&>{"q", q}, {"k", k}, {"v", v}}) {
    ATTNSCALE_REFUSE(x.dim() == 4, name, "a 4-d tensor (B, heads, rows, dims)", "shape " + shape_of(x));
    ATTNSCALE_REFUSE(x.device().is_cpu(), name, "a CPU tensor", c10::str("device ", x.device()));
    ATTNSCALE_REFUSE(rows_readable(x), name, "rows apart (row stride >= head dim) with a contiguous last dim",
                     c10::str("shape ", x.sizes(), " with strides ", x.strides()));
  }
  ATTNSCALE_REFUSE(kernel_dtype(q) && k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), "q, k, v dtype",
                   "one dtype of float32, float64, bfloat16, float16", c10::str(q.scalar_type(), ", ", k.scalar_type(), ", ", v.scalar_type()));
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), S = k.size(2);
  ATTNSCALE_REFUSE(k.size(0) == B && v.size(0) == B, "k, v", c10::str("q's batch B = ", B), "k " + shape_of(k) + ", v " + shape_of(v));
  // H = 0: no output rows, whatever Hkv (the kernel returns before it reads a head)
  ATTNSCALE_REFUSE((H == 0 || (1 <= Hkv && Hkv <= H && H % Hkv == 0)) && v.size(1) == Hkv, "k, v",
                   c10::str("key/value heads that divide q's H = ", H, " (1 <= Hkv <= H), as many in v as in k"),
                   "k " + shape_of(k) + ", v " + shape_of(v));
  ATTNSCALE_REFUSE(k.size(3) == D, "k", c10::str("q's head dim D = ", D), "shape " + shape_of(k));
  ATTNSCALE_REFUSE(v.size(2) == S, "v", c10::str("k's key count S = ", S), "shape " + shape_of(v));
  check_options(o);
  const bool half = q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf;
  ATTNSCALE_REFUSE(!half || !o.half_products || half_gemm(q.scalar_type() == at::kBFloat16 ? kBF16 : kF16), "half_products",
                   "False where this torch has no 16-bit products (oneMKL)", "True");
  const auto acc = half ? at::kFloat : q.scalar_type();
  const double top = acc == at::kDouble ? std::numeric_limits<double>::max() : std::numeric_limits<float>::max();
  ATTNSCALE_REFUSE(std::abs(o.scale) <= top && o.softcap <= top, "scale, softcap", c10::str("values that fit ", acc, ", where the scores are computed"),
                   c10::str(o.scale, ", ", o.softcap));
  check_biases(alibi, mask, spans, B, H, L, S, acc);
  if (spans.has_value()) {
    ATTNSCALE_REFUSE(spans->dim() == 2 && spans->size(0) >= 1 && spans->size(1) == 4 && spans->scalar_type() == at::kLong &&
                         spans->is_contiguous() && spans->device().is_cpu() && B == 1 && !mask.has_value(),
                     "spans", "a contiguous int64 CPU table (nseq >= 1, 4) of (q0, q1, k0, k1), with B = 1 and no mask",
                     c10::str(spans->scalar_type(), " ", spans->sizes(), " on ", spans->device(), ", B = ", B));
    const int64_t* span = spans->const_data_ptr<int64_t>();
    for (int64_t s = 0; s < spans->size(0); ++s, span += 4)
      ATTNSCALE_REFUSE(0 <= span[0] && span[0] <= span[1] && span[1] <= L && 0 <= span[2] && span[2] <= span[3] && span[3] <= S, "spans",
                       c10::str("rows 0 <= q0 <= q1 <= L = ", L, " and 0 <= k0 <= k1 <= S = ", S),
                       c10::str("(", span[0], ", ", span[1], ", ", span[2], ", ", span[3], ")"));
  }
}

// An int8 call (Problem::int8): q float32 or bfloat16 (B, H, L, D) contiguous; codes k (B, Hkv, S, D) and v
// (B, Hkv, S, Dv) int8, scales k_scale (B, Hkv, S, D / group), v_scale (B, Hkv, S, 1) and k_mean
// (B, Hkv, 1, D) float32, CPU tensors laid out as Int8KV reads them; D, Dv >= 1.
inline void check_int8_call(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& k_scale, const torch::Tensor& k_mean,
                            const torch::Tensor& v, const torch::Tensor& v_scale, const c10::optional<torch::Tensor>& alibi,
                            const c10::optional<torch::Tensor>& mask, const Options& o) {
  ATTNSCALE_REFUSE(q.dim() == 4 && (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16) && q.is_contiguous() &&
                       q.device().is_cpu() && q.size(3) >= 1,
                   "q", "a contiguous float32 or bfloat16 CPU tensor (B, H, L, D), D >= 1", c10::str(q.scalar_type(), " ", q.sizes(), " on ", q.device()));
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), D = q.size(3);
  ATTNSCALE_REFUSE(k.dim() == 4 && v.dim() == 4 && k.size(0) == B && v.sizes().slice(0, 3) == k.sizes().slice(0, 3) && k.size(3) == D &&
                       v.size(3) >= 1 && k.size(1) >= 1 && H % k.size(1) == 0,
                   "k, v", c10::str("codes (B, Hkv, S, D) and (B, Hkv, S, Dv) with B = ", B, ", D = ", D, ", Dv >= 1 and Hkv dividing H = ", H),
                   "k " + shape_of(k) + ", v " + shape_of(v));
  const int64_t Hkv = k.size(1), S = k.size(2), groups = k_scale.dim() == 4 ? k_scale.size(3) : 0;
  ATTNSCALE_REFUSE(groups >= 1 && D % groups == 0 && k_scale.sizes().slice(0, 3) == k.sizes().slice(0, 3), "k_scale",
                   c10::str("(B, Hkv, S, D / group) = (", B, ", ", Hkv, ", ", S, ", D / group)"), "shape " + shape_of(k_scale));
  ATTNSCALE_REFUSE(k_mean.dim() == 4 && k_mean.size(0) == B && k_mean.size(1) == Hkv && k_mean.size(2) == 1 && k_mean.size(3) == D, "k_mean",
                   c10::str("(B, Hkv, 1, D) = (", B, ", ", Hkv, ", 1, ", D, ")"), "shape " + shape_of(k_mean));
  ATTNSCALE_REFUSE(v_scale.dim() == 4 && v_scale.sizes().slice(0, 3) == k.sizes().slice(0, 3) && v_scale.size(3) == 1, "v_scale",
                   c10::str("(B, Hkv, S, 1) = (", B, ", ", Hkv, ", ", S, ", 1)"), "shape " + shape_of(v_scale));
  // Each head's rows one after another (the kernel walks them by the row's width); batches and
  // heads at any non-negative strides (views of a longer cache's first S keys).
  for (const auto& [name, x, dtype] : {std::tuple<const char*, const torch::Tensor&, at::ScalarType>{"k", k, at::kChar}, {"v", v, at::kChar},
                                       {"k_scale", k_scale, at::kFloat}, {"k_mean", k_mean, at::kFloat}, {"v_scale", v_scale, at::kFloat}})
    ATTNSCALE_REFUSE(x.scalar_type() == dtype && x.device().is_cpu() && (x.stride(3) == 1 || x.size(3) <= 1) &&
                         (x.stride(2) == x.size(3) || x.size(2) <= 1) && x.stride(0) >= 0 && x.stride(1) >= 0,
                     name, c10::str("a ", dtype, " CPU tensor whose rows of each head lie one after another"),
                     c10::str(x.scalar_type(), " with strides ", x.strides(), " on ", x.device()));
  check_options(o);
  ATTNSCALE_REFUSE(!o.half_products && (!o.round_out || q.scalar_type() == at::kBFloat16), "half_products, round_out",
                   "False (int8 keys and values take no 16-bit product option; round_out only with bfloat16 q)", c10::str(o.half_products, ", ", o.round_out));
  const double top = std::numeric_limits<float>::max();
  ATTNSCALE_REFUSE(std::abs(o.scale) <= top && o.softcap <= top, "scale, softcap", "values that fit float32, where the scores are computed",
                   c10::str(o.scale, ", ", o.softcap));
  check_biases(alibi, mask, c10::nullopt, B, H, L, S, at::kFloat);
}

// The backward's own tensors against the forward's (checked by check_call).
inline void check_backward(const torch::Tensor& q, const torch::Tensor& v, const torch::Tensor& dout, const torch::Tensor& delta,
                           const torch::Tensor& m, const torch::Tensor& l) {
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), Dv = v.size(3);
  ATTNSCALE_REFUSE(dout.dim() == 4 && dout.size(0) == B && dout.size(1) == H && dout.size(2) == L && dout.size(3) == Dv && dout.device().is_cpu(),
                   "dout", c10::str("the output's shape (B, H, L, Dv) = (", B, ", ", H, ", ", L, ", ", Dv, ") on the CPU"),
                   c10::str("shape ", dout.sizes(), " on ", dout.device()));
  for (const auto& [name, x] : {std::pair<const char*, const torch::Tensor&>{"delta", delta}, {"m", m}, {"l", l}})
    ATTNSCALE_REFUSE(x.dim() == 3 && x.size(0) == B && x.size(1) == H && x.size(2) == L && x.device().is_cpu(), name,
                     c10::str("shape (B, H, L) = (", B, ", ", H, ", ", L, ") on the CPU"), c10::str("shape ", x.sizes(), " on ", x.device()));
}

#undef ATTNSCALE_REFUSE

}  // namespace
