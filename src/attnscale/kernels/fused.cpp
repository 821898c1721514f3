// attnscale's fused CPU attention kernel: the score path of attnscale/score.py, fused per tile.
//
// Per (batch, query head, query block) the forward pass runs FlashAttention-2's online softmax
// over key tiles: one BLAS product q k^T per tile, then one pass over the tile that applies the
// score path (scale folded into the product; softcap; ALiBi; float mask; causal / window /
// bool-mask visibility), the running max, exp, the row sum and the statistics, then one BLAS
// product p v. Tiles that causality or the window hide are never computed, and each query block
// only visits the key range its rows can see. Where every logit is bounded in advance (no ALiBi
// or float mask), a row whose running max comes close enough to its bound keeps that max from
// then on as its static offset, and its later tiles skip the max pass and the rescaling
// (forward_block). The
// backward pass recomputes each tile exactly as the forward did (same tiles, same products, same
// order of operations) and normalises with the forward's own (m, l), so the weights it
// differentiates are the forward's.
//
// Shapes (attnscale's legend): q (B, H, L, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv), last dims
// contiguous; masks (B, H, L, S) and slopes (B, H) as strided views (stride 0 broadcasts).
// Arithmetic is in the inputs' dtype, float32 or float64; bfloat16 and float16 q, k, v (Half16) are
// computed in float32: where the CPU multiplies 16-bit tiles natively (the caller's half_products
// flag, ops.half_products) the products take them as they are with float32 accumulation, and the
// backward's five products take them the same way (with dout, the weights and dS in their format);
// elsewhere the forward converts each tile to float32 in scratch of its own (Problem::widen), and
// the caller passes the backward float32 copies.
//
// The algorithm, its names and its constants are attnscale/tiled.py's (the executable
// specification; the numbers both read live in attnscale/constants.py), but where a row's offset
// may become static: the tiled kernel decides it per query block before the block, this kernel
// per row, as soon as the row's running max comes within OFFSET_LIMIT of its bound.
//
// Files, one concern each (csrc/): options.h (the options by name), products.h (BLAS and 16-bit
// loads), vector_math.h (exp floor, tanh, exp), problem.h (a call's shapes, visible keys, tiles,
// scratch and parallel loop), rows.h (a row's score path, weights and statistics), bounds.h (the
// logits' bound behind static offsets), packing.h (brgemm's operands), quantized.h (int8 keys and
// values: their tiles dequantized, or decoding's products from the codes), forward.h, backward.h,
// value_checks.h (the guard's checks of values: finite rows, finite keys, a mask below +inf);
// this file makes a call's problem and outputs and binds the kernel to Python.

#include <optional>
#include <string>
#include <unordered_map>

#include <ATen/ExpandUtils.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/frontend/tracer.h>

#include "csrc/backward.h"
#include "csrc/bounds.h"
#include "csrc/checks.h"
#include "csrc/fast_call.h"
#include "csrc/forward.h"
#include "csrc/options.h"
#include "csrc/packing.h"
#include "csrc/value_checks.h"

namespace {

using at::vec::Vectorized;

inline int half_kind(const torch::Tensor& x) {
  return x.scalar_type() == at::kBFloat16 ? kBF16 : x.scalar_type() == at::kHalf ? kF16 : kNoHalf;
}

// A problem's options, tiles, output rows (L and S set: a plain call's) and its ALiBi slopes and
// mask, for make_problem and forward_int8.
template <typename T>
void set_options(Problem<T>& P, const Options& o, const c10::optional<torch::Tensor>& alibi, const c10::optional<torch::Tensor>& mask) {
  P.scale = static_cast<T>(o.scale);
  // A cap too small for T (1e-300 rounds to 0 in float32, and 0 means none) is computed as eps / 8:
  // every capped logit lies within it of 0, as with the cap given, so the weights agree to T's
  // rounding (tests/test_fused.py: test_a_tiny_softcap_still_caps).
  P.softcap = o.softcap > 0 ? std::max(static_cast<T>(o.softcap), std::numeric_limits<T>::epsilon() / 8) : T(0);
  P.causal = o.causal, P.q_offset = o.q_offset, P.left = o.left, P.right = o.right;
  P.q_start = o.q_start, P.k_start = o.k_start;
  P.block_q = o.block_q, P.block_k = o.block_k;
  P.o_rows = P.L, P.o_start = 0, P.k_rows = P.S, P.k_out_start = 0;
  if (alibi.has_value()) {
    P.alibi = alibi->data_ptr<T>();  // (units, H), or (H,): the same slopes for every unit
    P.al_sb = alibi->dim() == 2 ? alibi->stride(0) : 0, P.al_sh = alibi->stride(-1);
  }
  if (mask.has_value()) {
    if (mask->scalar_type() == torch::kBool) {
      P.bmask = mask->data_ptr<bool>();
    } else {
      P.fmask = mask->data_ptr<T>();
    }
    P.m_sb = mask->stride(0), P.m_sh = mask->stride(1), P.m_sl = mask->stride(2), P.m_ss = mask->stride(3);
  }
}

template <typename T>
Problem<T> make_problem(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const c10::optional<torch::Tensor>& alibi, const c10::optional<torch::Tensor>& mask,
                        const c10::optional<torch::Tensor>& spans, const Options& o) {
  // check_call has run: the layout is consistent and the options in range.
  Problem<T> P{};
  const auto half = half_kind(q);
  if (half) {  // 16-bit inputs: float problems only
    TORCH_CHECK((std::is_same_v<T, float>), "attnscale fused kernel: 16-bit q, k, v compute in float32");
    P.half = half;
    P.widen = !o.half_products;
    P.qh = static_cast<const uint16_t*>(q.const_data_ptr());
    P.kh = static_cast<const uint16_t*>(k.const_data_ptr());
    P.vh = static_cast<const uint16_t*>(v.const_data_ptr());
  } else {
    P.q = q.data_ptr<T>();
    P.k = k.data_ptr<T>();
    P.v = v.data_ptr<T>();
  }
  P.q_sb = q.stride(0), P.q_sh = q.stride(1), P.q_sl = q.stride(2);
  P.k_sb = k.stride(0), P.k_sh = k.stride(1), P.k_sl = k.stride(2);
  P.v_sb = v.stride(0), P.v_sh = v.stride(1), P.v_sl = v.stride(2);
  P.B = q.size(0), P.H = q.size(1), P.L = q.size(2), P.D = q.size(3);
  P.Hkv = k.size(1), P.S = k.size(2), P.Dv = v.size(3);
  set_options(P, o, alibi, mask);
  if (spans.has_value()) P.spans = spans->data_ptr<int64_t>(), P.nseq = spans->size(0);
  return P;
}

// Returns the outputs and whether every output row is finite and not all zeros (rows of packed
// sequences without keys are not visited and not counted); for 16-bit inputs, also once rounded
// to their format. half_products (16-bit inputs only): multiply them as they are (oneMKL or
// brgemm), or as float32 tiles converted in the kernel (Problem::widen). round_out (16-bit inputs
// only): out in their format, else float32 (the caller's sinks merge works on float32 rows, and
// a backward's D_i on the unrounded ones).
// [out, lse, m, l, max_logit, max_prob, entropy, visible, rows_ok]: the statistics empty (0 long)
// without with_stats, rows_ok a 0-d bool tensor. All made here, so a decoding step's Python makes
// no tensors of its own after the call (each torch op from Python then costs more than its share:
// the kernel has just streamed k and v through the caches).
// The statistics' outputs (B, H, L) after [out, lse, m, l]: made by make(shape, fill, dtype) with
// with_stats, else empty (0 long).
// Without with_stats and without `empties` (forward_run's lean outputs), nothing.
template <typename Make>
void add_statistics(std::vector<torch::Tensor>& result, Make& make, const at::TensorOptions& like, int64_t B, int64_t H, int64_t L,
                    at::ScalarType dt, bool with_stats, bool empties = true) {
  const double inf = std::numeric_limits<double>::infinity();
  if (with_stats) {
    result.push_back(make({B, H, L}, -inf, dt));  // max_logit
    result.push_back(make({B, H, L}, 0.0, dt));   // max_prob
    result.push_back(make({B, H, L}, 0.0, dt));   // entropy
    result.push_back(make({B, H, L}, 0.0, torch::kInt64));  // visible
  } else if (empties) {
    for (int i = 0; i < 3; ++i) result.push_back(torch::empty({0}, like.dtype(dt)));
    result.push_back(torch::empty({0}, like.dtype(torch::kInt64)));
  }
}

// The outputs' pointers for the kernel (statistics where asked for): [out, lse, m, l, statistics...],
// or with m and l given (forward_run's lean outputs), [out, lse, statistics...].
template <typename T>
ForwardOut<T> forward_out(const std::vector<torch::Tensor>& result, bool with_stats, std::atomic<bool>* suspect, bool lean = false,
                          T* m = nullptr, T* l = nullptr) {
  const size_t stats = lean ? 2 : 4;
  ForwardOut<T> O{result[0].scalar_type() == c10::CppTypeToScalarType<T>::value ? result[0].data_ptr<T>() : nullptr, nullptr, kNoHalf, result[1].data_ptr<T>(),
                  lean ? m : result[2].data_ptr<T>(), lean ? l : result[3].data_ptr<T>(), nullptr, nullptr, nullptr, nullptr, suspect};
  if (with_stats) {
    O.max_logit = result[stats].data_ptr<T>();
    O.max_prob = result[stats + 1].data_ptr<T>();
    O.entropy = result[stats + 2].data_ptr<T>();
    O.visible = result[stats + 3].data_ptr<int64_t>();
  }
  return O;
}

// The forward's outputs [out, lse, m, l, statistics...] (the statistics empty without with_stats)
// and whether every row looks right (forward_with's rows_ok); `lean` (forward_direct and the
// remembered calls without a gradient, whose callers read only out, lse and the statistics):
// [out, lse, statistics...], m and l the kernel's scratch and no empty statistics, each tensor
// fewer some tenths of a microsecond of a decoding step.
struct Forward {
  std::vector<torch::Tensor> result;
  bool ok;
};

Forward forward_run(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const c10::optional<torch::Tensor>& alibi,
                    const c10::optional<torch::Tensor>& mask, const c10::optional<torch::Tensor>& spans, const Options& o, bool lean) {
  check_call(q, k, v, alibi, mask, spans, o);
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), Dv = v.size(3);
  // Packed: rows of sequences without keys are not visited; they keep an empty row's values.
  const bool packed = spans.has_value();
  const double inf = std::numeric_limits<double>::infinity();
  auto make = [&](at::IntArrayRef shape, double fill, at::ScalarType dtype) {
    auto options = q.options().dtype(dtype);
    return packed ? torch::full(shape, fill, options) : torch::empty(shape, options);
  };
  // 16-bit inputs give float32 outputs, but for out with round_out: rounded to their format as its
  // rows are written (else the caller rounds it once); q, k, v stay 16-bit for the products.
  const auto dt = half_kind(q) ? at::kFloat : q.scalar_type();
  const bool out16 = o.round_out && half_kind(q) != kNoHalf;
  auto out = make({B, H, L, Dv}, 0.0, out16 ? q.scalar_type() : dt);
  auto lse = make({B, H, L}, -inf, dt);
  std::vector<torch::Tensor> result{out, lse};
  if (!lean) result.push_back(make({B, H, L}, 0.0, dt)), result.push_back(make({B, H, L}, 1.0, dt));  // m, l
  add_statistics(result, make, q.options(), B, H, L, dt, o.with_stats, !lean);
  if (H == 0) return {result, true};  // no query heads: the empty outputs, and no head is read
  std::atomic<bool> suspect{false};
  AT_DISPATCH_FLOATING_TYPES(dt, "attnscale_fused_forward", [&] {
    auto P = make_problem<scalar_t>(q, k, v, alibi, mask, spans, o);
    // A static offset needs a bound on every logit (no ALiBi, no float mask). With brgemm the key
    // norms come beside the packing, from its reads (pack_problem), at little cost: every such
    // call's rows may take one, packed sequences each on their own keys' norms, and bfloat16 rows
    // of a single key tile save its max pass too (start_rows's offset before the first tile).
    // Elsewhere the norms take a pass over k and v of their own, which costs several query rows'
    // products and pays only for rows that see more than one key tile: packed sequences (each row
    // sees only its own sequence's keys) and calls with fewer than 1024 query rows go without.
    std::vector<scalar_t> kmax;
    const bool brgemm = takes_brgemm(P, false);
    const bool bounded = P.alibi == nullptr && P.fmask == nullptr;
    const bool static_offsets = bounded && (brgemm || (P.spans == nullptr && P.L >= 1024 && P.S > P.block_k));
    if (static_offsets && !brgemm) kmax = key_norms(P);
    SequencePacks seqs;
    PackPtr packed;  // brgemm's k^T and v, every key head (P.kpack, P.vpack)
    if (brgemm) {
      if (static_offsets) kmax.resize((P.spans ? P.nseq : 1) * P.B * P.Hkv);
      packed = pack_problem(P, false, seqs, static_offsets ? kmax.data() : nullptr);
    }
    if (static_offsets && !P.spans) P.kmax = kmax.data();  // packed: each sequence's, from seqs
    std::vector<scalar_t> scratch(lean ? 2 * B * H * L : 0);  // lean: m, l (read by nothing after the kernel: packed rows it skips need no value)
    ForwardOut<scalar_t> O = forward_out<scalar_t>(result, o.with_stats, &suspect, lean, scratch.data(), scratch.data() + B * H * L);
    if (out16) O.out = nullptr, O.out16 = static_cast<uint16_t*>(out.data_ptr()), O.out16_kind = half_kind(q);
    if (P.half == kBF16)
      O.template set_rounded_range<at::BFloat16>();
    else if (P.half == kF16)
      O.template set_rounded_range<at::Half>();
    forward_kernel(P, O);
  });
  return {result, !suspect.load()};
}

std::vector<torch::Tensor> forward_with(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                        const c10::optional<torch::Tensor>& alibi, const c10::optional<torch::Tensor>& mask,
                                        const c10::optional<torch::Tensor>& spans, const Options& o) {
  Forward f = forward_run(q, k, v, alibi, mask, spans, o, false);
  f.result.push_back(torch::scalar_tensor(f.ok, q.options().dtype(torch::kBool)));
  return f.result;
}

// Attention of q (B, H, L, D) over int8 keys and values (Problem::int8; check_int8_call gives the
// layout): the forward's outputs as forward_with returns them for float32 inputs, rows taking no
// static offset (no bound on the int8 keys' norms is made). float32 q: the query heads of each key
// head are folded into its rows (Problem::fold), so a tile is dequantized once for all of them
// (decoding: its products taken from the codes, Problem::int8_direct). bfloat16 q (prefill, where
// brgemm runs and D is even): the codes dequantized into brgemm's bfloat16 packs (pack_int8) and
// the bfloat16 kernel run on them. q_int16 (float32 q holding a 16-bit query's values): decoding's
// q.k products in integers, q rounded to int16 per row (Int8KV::q_int16).
std::vector<torch::Tensor> forward_int8(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& k_scale,
                                        const torch::Tensor& k_mean, const torch::Tensor& v, const torch::Tensor& v_scale,
                                        const c10::optional<torch::Tensor>& alibi, const c10::optional<torch::Tensor>& mask, bool q_int16,
                                        const py::kwargs& options) {
  const Options o = Options::from(options);
  check_int8_call(q, k, k_scale, k_mean, v, v_scale, alibi, mask, o);
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), D = q.size(3), Hkv = k.size(1), S = k.size(2), Dv = v.size(3);
  const bool packs = q.scalar_type() == at::kBFloat16;
  TORCH_CHECK_VALUE(!packs || (D % 2 == 0 && S > 0 && brgemm_runs()),
                    "torch.ops.attnscale: q: expected float32 where brgemm does not run here, D is odd or there are no keys, got bfloat16 with D = ", D,
                    ", S = ", S, ". Fix: pass q.float()");
  auto make = [&](at::IntArrayRef shape, double, at::ScalarType dtype) { return torch::empty(shape, q.options().dtype(dtype)); };
  // round_out (bfloat16 q): the rows rounded to bfloat16 as they are written, as forward_with's.
  std::vector<torch::Tensor> result{make({B, H, L, Dv}, 0.0, o.round_out ? at::kBFloat16 : at::kFloat), make({B, H, L}, 0.0, at::kFloat),
                                    make({B, H, L}, 0.0, at::kFloat), make({B, H, L}, 0.0, at::kFloat)};
  add_statistics(result, make, q.options(), B, H, L, at::kFloat, o.with_stats);
  std::atomic<bool> suspect{false};
  if (H > 0 && L > 0) {
    Int8KV codes{};
    codes.k = k.const_data_ptr<int8_t>(), codes.k_sb = k.stride(0), codes.k_sh = k.stride(1);
    codes.v = v.const_data_ptr<int8_t>(), codes.v_sb = v.stride(0), codes.v_sh = v.stride(1);
    codes.k_scale = k_scale.const_data_ptr<float>(), codes.ks_sb = k_scale.stride(0), codes.ks_sh = k_scale.stride(1);
    codes.v_scale = v_scale.const_data_ptr<float>(), codes.vs_sb = v_scale.stride(0), codes.vs_sh = v_scale.stride(1);
    codes.k_mean = k_mean.const_data_ptr<float>(), codes.km_sb = k_mean.stride(0), codes.km_sh = k_mean.stride(1);
    codes.group = D / k_scale.size(3), codes.Hkv = Hkv, codes.D = D, codes.Dv = Dv;
    codes.q_int16 = q_int16;
    Problem<float> P{};
    const int64_t G = packs ? 1 : H / Hkv;  // query heads folded into a key head's rows
    P.q_sb = H * L * D, P.q_sh = G * L * D, P.q_sl = D;
    P.B = B, P.H = H / G, P.Hkv = Hkv, P.L = G * L, P.S = S, P.D = D, P.Dv = Dv;
    P.fold = G, P.fold_rows = L;
    set_options(P, o, alibi, mask);
    PackPtr packed;
    std::vector<float> kmax;  // bfloat16 packs: rows may take static offsets where every logit is bounded, as in forward_with
    if (packs) {
      P.half = kBF16, P.qh = static_cast<const uint16_t*>(q.const_data_ptr());
      if (P.alibi == nullptr && P.fmask == nullptr) kmax.resize(B * Hkv);
      packed = pack_int8(P, codes, kmax.empty() ? nullptr : kmax.data());
      if (!kmax.empty()) P.kmax = kmax.data();
    } else {
      const int64_t lanes = kInt8Lanes;
      P.q = q.const_data_ptr<float>(), P.int8 = &codes;
      P.int8_direct = kInt8Direct && P.tile_rows() <= kInt8DirectRows && D % lanes == 0 && codes.group % lanes == 0 && Dv % lanes == 0;
    }
    ForwardOut<float> O = forward_out<float>(result, o.with_stats, &suspect);
    if (o.round_out) {
      O.out16 = static_cast<uint16_t*>(result[0].data_ptr()), O.out16_kind = kBF16;
      O.template set_rounded_range<at::BFloat16>();
    }
    forward_kernel(P, O);
  }
  result.push_back(torch::scalar_tensor(!suspect.load(), q.options().dtype(torch::kBool)));
  return result;
}

std::vector<torch::Tensor> backward_with(const torch::Tensor& q16, const torch::Tensor& k16, const torch::Tensor& v16,
                                         const torch::Tensor& dout, const torch::Tensor& delta, const torch::Tensor& m,
                                         const torch::Tensor& l, const c10::optional<torch::Tensor>& alibi,
                                         const c10::optional<torch::Tensor>& mask, const c10::optional<torch::Tensor>& spans,
                                         bool slope_grad, const Options& o) {
  check_call(q16, k16, v16, alibi, mask, spans, o);
  check_backward(q16, v16, dout, delta, m, l);
  TORCH_CHECK_VALUE(!slope_grad || alibi.has_value(), "attnscale fused kernel: slope_grad asks for the gradient of ALiBi slopes, but the call has none");
  // A forward that widened its tiles (half_products false) is differentiated on float32 copies
  // the caller makes: 16-bit inputs here are always multiplied as they are.
  TORCH_CHECK(!half_kind(q16) || o.half_products, "attnscale fused kernel: the backward of 16-bit inputs takes them with half_products=True (else float32 copies)");
  // 16-bit inputs: the products take them as they are, and dout rounded to their format (the
  // gradient of an output the caller rounded to it); gradients come back in float32, for the
  // caller to round. (A forward that widened its tiles is differentiated on float32 copies: the
  // caller passes those.)
  const torch::Tensor &q = q16, &k = k16, &v = v16;
  const auto half = half_kind(q);
  const auto dt = half ? at::kFloat : q.scalar_type();
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), S = k.size(2), D = q.size(3), Dv = v.size(3);
  TORCH_CHECK(dout.is_contiguous() && delta.is_contiguous() && m.is_contiguous() && l.is_contiguous(),
              "attnscale fused kernel: contiguous dout, delta, m, l");
  TORCH_CHECK(dout.scalar_type() == dt && delta.scalar_type() == dt && m.scalar_type() == dt && l.scalar_type() == dt,
              "attnscale fused kernel: dout, delta, m, l in the compute dtype");
  const torch::Tensor dout16 = half ? dout.to(q.scalar_type()) : torch::Tensor();
  // Packed: rows of sequences without keys are not visited; their gradient is 0.
  auto dq = spans.has_value() ? torch::zeros({B, H, L, D}, q.options().dtype(dt)) : torch::empty({B, H, L, D}, q.options().dtype(dt));
  // Per-query-head dk, dv (summed per group by the caller) only when there are fewer (batch or
  // sequence, key head) tasks than threads: otherwise each task runs a whole group into its key
  // head's rows, with no O(H S D) scratch.
  const int64_t Hkv = k.size(1), units = spans.has_value() ? spans->size(0) : B;
  const bool grouped = H == 0 || Hkv == H || units * Hkv >= at::get_num_threads();
  auto dk = torch::zeros({B, grouped ? Hkv : H, S, D}, q.options().dtype(dt));
  auto dv = torch::zeros({B, grouped ? Hkv : H, S, Dv}, q.options().dtype(dt));
  // Learned ALiBi slopes (slope_grad): their gradient per (batch or sequence, head), for the caller
  // to reduce to the slopes' shape; else empty, and not computed.
  auto dslope = torch::zeros({slope_grad ? units : 0, slope_grad ? H : 0}, q.options().dtype(dt));
  if (H == 0) return {dq, dk, dv, dslope};  // no query heads: no gradient reaches k or v
  AT_DISPATCH_FLOATING_TYPES(dt, "attnscale_fused_backward", [&] {
    auto P = make_problem<scalar_t>(q, k, v, alibi, mask, spans, o);
    BackwardIO<scalar_t> IO{dout.data_ptr<scalar_t>(), delta.data_ptr<scalar_t>(), m.data_ptr<scalar_t>(),
                            l.data_ptr<scalar_t>(), dq.data_ptr<scalar_t>(), dk.data_ptr<scalar_t>(),
                            dv.data_ptr<scalar_t>(), grouped};
    if (half) IO.dout16 = static_cast<const uint16_t*>(dout16.const_data_ptr());
    if (slope_grad) IO.dslope = dslope.data_ptr<scalar_t>();
    SequencePacks seqs;
    PackPtr packed;  // brgemm's k^T, v^T and k, every key head
    if (takes_brgemm(P, true)) packed = pack_problem(P, true, seqs);
    backward_kernel(P, IO);
  });
  return {dq, dk, dv, dslope};
}

std::vector<torch::Tensor> backward(const torch::Tensor& q16, const torch::Tensor& k16, const torch::Tensor& v16,
                                    const torch::Tensor& dout, const torch::Tensor& delta, const torch::Tensor& m,
                                    const torch::Tensor& l, const c10::optional<torch::Tensor>& alibi,
                                    const c10::optional<torch::Tensor>& mask, const c10::optional<torch::Tensor>& spans,
                                    bool slope_grad, const py::kwargs& options) {
  return backward_with(q16, k16, v16, dout, delta, m, l, alibi, mask, spans, slope_grad, Options::from(options));
}

// Attention sinks on the kernel's finished rows, in place (attnscale.tiled.sink_scaled's four ops
// as one pass): each row of out (..., H, L, Dv) shrinks by its keys' share of the denominator once
// its head's sink joins it, exp(lse) / (exp(lse) + exp(sink)) = 1 / (1 + exp(sink - lse)); a row
// with no visible key (lse = -inf) stays as it is (zeros), a NaN lse makes its row NaN. Contiguous
// float32 or float64 out and lse of one dtype, sinks (H,) of any float dtype; rows split over the
// threads in chunks of about 64K entries (a decoding step's few rows stay on the calling thread).
void sink_scale_op(torch::Tensor& out, const torch::Tensor& lse, const torch::Tensor& sinks) {
  TORCH_CHECK_VALUE((out.scalar_type() == at::kFloat || out.scalar_type() == at::kDouble) && lse.scalar_type() == out.scalar_type(),
                    "attnscale fused kernel: sink_scale takes float32 or float64 out and lse of one dtype, got ", out.scalar_type(), " and ", lse.scalar_type());
  TORCH_CHECK_VALUE(out.is_contiguous() && lse.is_contiguous() && out.dim() >= 3 && lse.dim() == out.dim() - 1 &&
                        out.sizes().slice(0, out.dim() - 1) == lse.sizes() && sinks.dim() == 1 && sinks.size(0) == out.size(-3),
                    "attnscale fused kernel: sink_scale takes contiguous out (..., H, L, Dv), lse (..., H, L) and sinks (H,), got ",
                    out.sizes(), ", ", lse.sizes(), " and ", sinks.sizes());
  const int64_t H = out.size(-3), L = out.size(-2), Dv = out.size(-1), rows = lse.numel();
  // The H sink logits as doubles (exact from any float dtype), read in place where they are float32
  // or float64: no tensor made for a decoding step's few heads.
  std::vector<double> sink(H);
  if (sinks.scalar_type() == at::kFloat || sinks.scalar_type() == at::kDouble) {
    AT_DISPATCH_FLOATING_TYPES(sinks.scalar_type(), "attnscale_sink_values", [&] {
      const scalar_t* p = sinks.const_data_ptr<scalar_t>();
      for (int64_t h = 0; h < H; ++h) sink[h] = static_cast<double>(p[h * sinks.stride(0)]);
    });
  } else {
    const auto wide = sinks.to(at::kDouble).contiguous();
    std::copy(wide.const_data_ptr<double>(), wide.const_data_ptr<double>() + H, sink.begin());
  }
  AT_DISPATCH_FLOATING_TYPES(out.scalar_type(), "attnscale_sink_scale", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    const scalar_t* m = lse.const_data_ptr<scalar_t>();
    const double* s = sink.data();
    const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(Dv, 1));
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t lse_r = m[r];
        if (lse_r == -std::numeric_limits<scalar_t>::infinity()) continue;  // no visible key: zeros stay
        const scalar_t gap = lse_r - static_cast<scalar_t>(s[(r / L) % H]);
        const scalar_t share = scalar_t(1) / (scalar_t(1) + std::exp(-gap));  // sigmoid(lse - sink); NaN stays NaN
        for (int64_t c = 0; c < Dv; ++c) o[r * Dv + c] *= share;
      }
    });
  });
}

// The kernel's tanh elementwise on a contiguous tensor, on one thread, for its tests and benchmark.
torch::Tensor tanh_op(const torch::Tensor& x) {
  TORCH_CHECK(x.is_contiguous() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble),
              "attnscale fused kernel: tanh takes a contiguous float32 or float64 tensor");
  auto out = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "attnscale_fused_tanh", [&] {
    using Vec = Vectorized<scalar_t>;
    const scalar_t* src = x.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    int64_t i = 0, n = x.numel();  // one thread: what it costs per element is what it is for
    for (; i + Vec::size() <= n; i += Vec::size()) vtanh(Vec::loadu(src + i)).store(dst + i);
    for (; i < n; ++i) dst[i] = stanh(src[i]);
  });
  return out;
}

// The softmax's weights elementwise (vexp_weights, x = s - m), and ATen's exp_u20 with the same
// floor applied after it, on one thread, for the tests: float32 only.
std::tuple<torch::Tensor, torch::Tensor> weights_op(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 1 && x.is_contiguous() && x.scalar_type() == at::kFloat &&
                  x.numel() % Vectorized<float>::size() == 0,
              "attnscale fused kernel: weights takes a 1-d contiguous float32 tensor of whole vectors (", Vectorized<float>::size(), " floats)");
  using Vec = Vectorized<float>;
  auto out = torch::empty_like(x), ref = torch::empty_like(x);
  const float* src = x.data_ptr<float>();
  float *dst = out.data_ptr<float>(), *alt = ref.data_ptr<float>();
  const Vec vfloor(exp_floor<float>());
  for (int64_t i = 0; i < x.numel(); i += Vec::size()) {
    const Vec xv = Vec::loadu(src + i);
    vexp_weights(xv, vfloor).store(dst + i);
    Vec::blendv(xv.exp_u20(), Vec(0.0f), xv < vfloor).store(alt + i);
  }
  return {out, ref};
}

// One tile's softmax weights as the forward makes them, for the tests that hold them to the tiled
// kernel's: q (B, H, L, D), k, v float32 or float64, L <= block_q and S <= block_k (one query block,
// one key tile, no packed sequences). Each row runs the forward's first-tile steps (block_at, the
// tile's products, online_tile_row): weights exp(s - m) against the row's largest logit m, 0 at
// hidden keys and below the exp floor. Returns [weights (B, H, L, S), m (B, H, L)].
std::vector<torch::Tensor> tile_weights_op(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                           const c10::optional<torch::Tensor>& alibi, const c10::optional<torch::Tensor>& mask,
                                           const py::kwargs& options) {
  const Options o = Options::from(options);
  check_call(q, k, v, alibi, mask, c10::nullopt, o);
  TORCH_CHECK(half_kind(q) == kNoHalf && q.size(2) <= o.block_q && k.size(2) <= o.block_k,
              "attnscale fused kernel: tile_weights takes float32 or float64 inputs of one tile (L <= block_q, S <= block_k)");
  // Weights only: no statistics, no 16-bit products or rounding (their inputs are refused above),
  // so an option this path would not honour is refused, never ignored.
  TORCH_CHECK(!o.with_stats && !o.half_products && !o.round_out,
              "attnscale fused kernel: tile_weights computes weights only: with_stats, half_products and round_out must be False (got ",
              o.with_stats, ", ", o.half_products, ", ", o.round_out, ")");
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), S = k.size(2);
  auto weights = torch::zeros({B, H, L, S}, q.options()), m = torch::zeros({B, H, L}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "attnscale_tile_weights", [&] {
    const auto P = make_problem<scalar_t>(q, k, v, alibi, mask, c10::nullopt, o);
    ForwardOut<scalar_t> O{};  // no statistics: block_at reads only whether they are asked for
    ForwardScratch<scalar_t> W(P);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h) {
        const Block<scalar_t> blk = block_at(P, O, b, h, 0, W);
        start_rows<scalar_t, scalar_t>(P, blk, W);
        for (auto [j0, j1] : P.key_tiles(0, L)) {
          const Tile<scalar_t> t = tile_at<scalar_t, scalar_t>(P, blk, W, j0, j1);
          tile_scores<scalar_t, scalar_t>(P, blk, t, W.sbuf.data());
          scalar_t* out = weights.data_ptr<scalar_t>() + (b * H + h) * L * S;
          for (int64_t r = 0; r < L; ++r) {
            online_tile_row<scalar_t, scalar_t>(P, blk, t, W, r);
            std::copy(W.sbuf.data() + r * t.width, W.sbuf.data() + (r + 1) * t.width, out + r * S + j0);
            m.data_ptr<scalar_t>()[(b * H + h) * L + r] = W.m[r];
          }
        }
      }
  });
  return {weights, m};
}

std::vector<torch::Tensor> forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                   const c10::optional<torch::Tensor>& alibi, const c10::optional<torch::Tensor>& mask,
                                   const c10::optional<torch::Tensor>& spans, const py::kwargs& options) {
  return forward_with(q, k, v, alibi, mask, spans, Options::from(options));
}

std::vector<torch::Tensor> forward_ordered(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                           const c10::optional<torch::Tensor>& alibi, const c10::optional<torch::Tensor>& mask,
                                           const c10::optional<torch::Tensor>& spans, const py::tuple& options) {
  return forward_with(q, k, v, alibi, mask, spans, Options::from(options));
}

// forward_ordered for a planned eager call (attnscale.kernels.fused.run_planned; its sinks merged
// as sink_scale merges them, 16-bit inputs' out then float32), returning only
// what that caller reads, as (out, lse, rows_ok) or, with statistics, (out, lse, max_logit,
// max_prob, entropy, visible, rows_ok), rows_ok a Python bool: m, l and the empty statistics are
// never wrapped for Python, nor the verdict read back through a 0-d tensor. alibi: the caller's
// validated slopes, (H,) or (B, H) of any float dtype, taken as they are in the accumulation dtype
// (else converted to it).
py::tuple forward_direct(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                         const c10::optional<torch::Tensor>& alibi, const c10::optional<torch::Tensor>& sinks,
                         const py::tuple& options) {
  const Options o = Options::from(options);
  c10::optional<torch::Tensor> slopes;
  if (alibi.has_value()) {
    const auto acc = half_kind(q) ? at::kFloat : q.scalar_type();
    slopes = alibi->scalar_type() == acc ? *alibi : alibi->detach().to(acc);
  }
  auto [r, ok] = forward_run(q, k, v, slopes, c10::nullopt, c10::nullopt, o, true);
  // Sinks (H,) merged into the fresh rows in place (sink_scale_op checks what it takes): a row
  // scaled by its share, in [0, 1], keeps the verdict (attnscale.kernels.fused._finished).
  if (sinks.has_value()) sink_scale_op(r[0], r[1], *sinks);
  const auto& out = r[0];
  const auto& lse = r[1];
  if (!o.with_stats) return py::make_tuple(out, lse, ok);
  const auto &max_logit = r[2], &max_prob = r[3], &entropy = r[4], &visible = r[5];  // forward_run's lean layout
  return py::make_tuple(out, lse, max_logit, max_prob, entropy, visible, ok);
}

// The guard's check of an output that reports nothing on its rows (rows_ok(out)) and of its k
// (all_finite(key)), in one call, with the question of whether it applies: None unless both are
// CPU tensors of one dtype, float32, float64, bfloat16 or float16, of at most `limit` entries each (larger ones are
// torch's reductions', which use every thread).
py::object output_ok_op(const torch::Tensor& out, const torch::Tensor& key, int64_t limit) {
  const auto dt = out.scalar_type();
  if (!out.device().is_cpu() || !key.device().is_cpu() || key.scalar_type() != dt || !checked_dtype(dt) ||
      out.numel() > limit || key.numel() > limit)
    return py::none();
  return py::bool_(rows_ok_op(out) && all_finite_op(key));
}

// attnscale.scaled_dot_product_attention's answers, remembered by the call's signature once the
// full pipeline (its checks, its choice and its guard) has given one, for two kinds of call: those
// torch's kernel computes as they are (the "torch" backend with torch's own arguments; float32,
// float64, bfloat16 or float16, the dtypes the value checks read), and those
// the compiled kernel computes by its plan (attnscale.backends.kernel_plan: a feature torch
// lacks, no mask; float32 or float64, and bfloat16 or float16 where no gradient is asked and
// ATTNSCALE_HALF_PRODUCTS is unset); and varlen_attention's packed calls (below). The signature: every tensor's dtype and sizes (plain CPU
// strided tensors only: no subclass, meta or nested tensor; without a mask and with top-left
// alignment, keys and values of any length S > 0, as the pipeline's own memory of a growing
// cache has it, AttentionCall.same_along_s), whether the mask, slopes and sinks require grad, and
// every option as passed (exact bools, floats, None, a window of exact ints or None, the
// alignment as one of CausalAlignment's two members or its value as a str). remembered_call makes the same call for a
// later one of that signature, with the checks of values the pipeline makes of every call (a
// float mask below +inf; finite slopes, sinks below +inf) and the guard's first check of its
// output, or answers None (not remembered, not of this form, a value or an output the checks do
// not pass, torch.jit.trace, CPU autocast, a torch.func transform or a torch-function mode on):
// then the full pipeline runs, as on any call. Python holds the rest of the gate (backend "auto",
// no dropout, not compiling: attnscale._remembered.may_take).
enum class Kind { kTorch, kKernel, kPacked };

struct Remembered {
  Kind kind;                    // torch's kernel with the three arguments below, or the compiled kernel's plan (packed: on the sequences each call's lengths give)
  bool causal = false;
  bool gqa = false;
  std::optional<double> scale;  // nullopt: torch's default
  Options options{};            // the compiled kernel's, tiles resolved
  py::object backend;           // the Backend that answers (last_backend)
  py::object why;               // why the pipeline chose it (its log line)
};

// Outside any torch.func transform (functorch's dynamic layers, as torch._C._are_functorch_transforms_active
// reads them) and torch-function mode (torch._C._is_torch_function_mode_enabled): inside either, a
// call must reach torch's ops the way Python code reaches them, so no remembered call answers.
bool plain_dispatch() {
  const auto included = c10::impl::tls_local_dispatch_key_set().included_;
  return !included.has(c10::DispatchKey::FuncTorchDynamicLayerFrontMode) && !included.has(c10::DispatchKey::FuncTorchDynamicLayerBackMode) &&
         !at::impl::torch_function_mode_enabled();
}

constexpr size_t kRememberedMax = 512;  // as attnscale._validate's signatures

std::unordered_map<std::string, Remembered>& remembered_calls() {
  // Never destroyed: its Python objects must not be released after the interpreter has finalised.
  static auto* calls = new std::unordered_map<std::string, Remembered>();
  return *calls;
}

// CausalAlignment.TOP_LEFT and BOTTOM_RIGHT (set_alignments; held, never released).
PyObject* g_top_left = nullptr;
PyObject* g_bottom_right = nullptr;

void set_alignments(py::object top_left, py::object bottom_right) {
  if (g_top_left == nullptr) g_top_left = top_left.release().ptr(), g_bottom_right = bottom_right.release().ptr();
}

// The one size of a tensor a signature may leave out: none, dim -2 (keys and values of any
// length), dim 0 (packed rows of any count).
enum class Unkeyed { kNone, kKeyLength, kRowCount };

// A tensor's dtype and sizes, but the `unkeyed` one.
void append_sizes(std::string& key, at::ScalarType dtype, at::IntArrayRef sizes, Unkeyed unkeyed = Unkeyed::kNone) {
  const int64_t dim = static_cast<int64_t>(sizes.size());
  key.push_back(static_cast<char>(dtype));
  key.push_back(static_cast<char>(dim));
  const int64_t left_out = unkeyed == Unkeyed::kKeyLength ? dim - 2 : unkeyed == Unkeyed::kRowCount ? 0 : -1;
  for (int64_t d = 0; d < dim; ++d) {
    if (d != left_out) key.append(reinterpret_cast<const char*>(sizes.data() + d), sizeof(int64_t));
  }
}

bool append_tensor(std::string& key, PyObject* obj, Unkeyed unkeyed = Unkeyed::kNone) {
  if (!THPVariable_CheckExact(obj)) return false;
  const auto& t = THPVariable_Unpack(obj);
  if (!t.is_cpu() || t.layout() != at::kStrided || t.is_nested()) return false;
  append_sizes(key, t.scalar_type(), t.sizes(), unkeyed);
  return true;
}

// None, or a tensor (append_tensor) and whether it requires grad.
bool append_optional_tensor(std::string& key, PyObject* obj) {
  if (obj == Py_None) return key.push_back('n'), true;
  if (!append_tensor(key, obj)) return false;
  key.push_back(THPVariable_Unpack(obj).requires_grad() ? 'g' : 'c');
  return true;
}

bool append_flag(std::string& key, PyObject* obj) {
  if (obj != Py_True && obj != Py_False) return false;
  key.push_back(obj == Py_True ? 'T' : 'F');
  return true;
}

// None, or an exact float (its bits).
bool append_float(std::string& key, PyObject* obj) {
  if (obj == Py_None) return key.push_back('n'), true;
  if (!PyFloat_CheckExact(obj)) return false;
  const double x = PyFloat_AS_DOUBLE(obj);
  key.push_back('f');
  key.append(reinterpret_cast<const char*>(&x), sizeof(double));
  return true;
}

// None, or an exact int that fits int64.
bool append_int(std::string& key, PyObject* obj) {
  if (obj == Py_None) return key.push_back('n'), true;
  if (!PyLong_CheckExact(obj)) return false;
  int overflow = 0;
  const long long x = PyLong_AsLongLongAndOverflow(obj, &overflow);
  if (overflow != 0 || (x == -1 && PyErr_Occurred())) return PyErr_Clear(), false;
  key.push_back('i');
  key.append(reinterpret_cast<const char*>(&x), sizeof(x));
  return true;
}

// None, or an exact tuple of two sides, each None or an exact int (not a bool) that fits int64.
bool append_window(std::string& key, PyObject* obj) {
  if (obj == Py_None) return key.push_back('n'), true;
  if (!PyTuple_CheckExact(obj) || PyTuple_GET_SIZE(obj) != 2) return false;
  key.push_back('w');
  return append_int(key, PyTuple_GET_ITEM(obj, 0)) && append_int(key, PyTuple_GET_ITEM(obj, 1));
}

// Everything a call passes, as Python objects.
struct CallArgs {
  py::handle q, k, v, mask, causal, scale, gqa, alignment, softcap, alibi, window, sinks, stats;
};

// The alignment: one of CausalAlignment's members ('t', 'b'), or its value as an exact str ('T',
// 'B': another key than the member's, so that only a call whose options are the defaults as
// objects takes a remembered call of torch's kernel); else none.
char alignment_code(PyObject* alignment) {
  if (g_top_left == nullptr || alignment == nullptr) return 0;
  if (alignment == g_top_left) return 't';
  if (alignment == g_bottom_right) return 'b';
  if (!PyUnicode_CheckExact(alignment)) return 0;
  if (PyUnicode_CompareWithASCIIString(alignment, "top_left") == 0) return 'T';
  if (PyUnicode_CompareWithASCIIString(alignment, "bottom_right") == 0) return 'B';
  return 0;
}

// The q, k and v sizes of a call whose tensors are not made yet (MultiHeadAttention's projections):
// CPU strided tensors of one dtype.
struct QKVSizes {
  at::ScalarType dtype;
  std::vector<int64_t> q, k, v;
};

// The signature of a call (of q, k and v as `sizes` gives them where it is given).
std::optional<std::string> call_signature(const CallArgs& a, const QKVSizes* sizes = nullptr) {
  const char alignment = alignment_code(a.alignment.ptr());
  if (alignment == 0) return std::nullopt;
  std::string key;
  key.reserve(160);
  const bool any_length = a.mask.is_none() && (alignment == 't' || alignment == 'T');  // (top-left: the query offset is 0 at every S)
  const Unkeyed length = any_length ? Unkeyed::kKeyLength : Unkeyed::kNone;
  if (sizes != nullptr) {
    append_sizes(key, sizes->dtype, sizes->q), append_sizes(key, sizes->dtype, sizes->k, length), append_sizes(key, sizes->dtype, sizes->v, length);
  } else if (!append_tensor(key, a.q.ptr()) || !append_tensor(key, a.k.ptr(), length) || !append_tensor(key, a.v.ptr(), length)) {
    return std::nullopt;
  }
  key.push_back(alignment);
  if (!append_optional_tensor(key, a.mask.ptr()) || !append_flag(key, a.causal.ptr()) || !append_flag(key, a.gqa.ptr()) ||
      !append_float(key, a.scale.ptr()) || !append_float(key, a.softcap.ptr()) || !append_optional_tensor(key, a.alibi.ptr()) ||
      !append_window(key, a.window.ptr()) || !append_optional_tensor(key, a.sinks.ptr()) || !append_flag(key, a.stats.ptr()))
    return std::nullopt;
  return key;
}

bool remember(const CallArgs& a, Remembered entry) {
  auto key = call_signature(a);
  if (!key) return false;
  auto& calls = remembered_calls();
  if (calls.size() >= kRememberedMax) calls.clear();
  calls[*key] = std::move(entry);
  return true;
}

bool float_kind(const at::Tensor& t) { return t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble; }

bool remember_torch_call(const CallArgs& a, bool torch_causal, bool torch_gqa, std::optional<double> torch_scale, py::object backend, py::object why) {
  if (!THPVariable_CheckExact(a.q.ptr()) || !checked_dtype(THPVariable_Unpack(a.q.ptr()).scalar_type())) return false;  // (the guard's one-call check takes these)
  return remember(a, Remembered{Kind::kTorch, torch_causal, torch_gqa, torch_scale, Options{}, std::move(backend), std::move(why)});
}

// The dtype the kernel accumulates inputs of `dt` in (attnscale.kernels.fused.accumulation_dtype).
at::ScalarType accumulation(at::ScalarType dt) { return dt == at::kBFloat16 || dt == at::kHalf ? at::kFloat : dt; }

// Slopes or sinks the checks of values read in one call: float32 or float64, no wider than the
// accumulation dtype of q's (a float64 slope may not fit float32; a float32 one fits float64).
bool checked_in_one_call(py::handle x, at::ScalarType q_dtype) {
  if (x.is_none()) return true;
  if (!THPVariable_CheckExact(x.ptr())) return false;
  const auto dt = THPVariable_Unpack(x.ptr()).scalar_type();
  return float_kind(THPVariable_Unpack(x.ptr())) && (dt == accumulation(q_dtype) || q_dtype == at::kDouble);
}

// Whether ATTNSCALE_HALF_PRODUCTS is set (attnscale.kernels.ops.half_products): then 16-bit plans
// are neither remembered nor answered, so that Python's reading of it (its choice, its errors)
// applies to every call; unset, the plan's product path is the one Python chose, from the CPU
// and the call's sizes, which the signature holds.
bool half_products_forced() {
  const char* forced = std::getenv("ATTNSCALE_HALF_PRODUCTS");
  return forced != nullptr && *forced != '\0';
}

// Whether a gradient is asked of the call's q, k, v, slopes or sinks (all tensors where given).
bool asks_gradient(const CallArgs& a) {
  if (!at::GradMode::is_enabled()) return false;
  for (const auto& x : {a.q, a.k, a.v, a.alibi, a.sinks})
    if (!x.is_none() && THPVariable_Unpack(x.ptr()).requires_grad()) return true;
  return false;
}

bool remember_kernel_call(const CallArgs& a, const py::tuple& options, py::object backend, py::object why) {
  if (!THPVariable_CheckExact(a.q.ptr())) return false;
  const auto dt = THPVariable_Unpack(a.q.ptr()).scalar_type();
  if (!checked_dtype(dt) || !a.mask.is_none() || !checked_in_one_call(a.alibi, dt) || !checked_in_one_call(a.sinks, dt)) return false;
  // 16-bit: answered where no gradient is asked (kernel_call), the flag unset
  if (!float_kind(THPVariable_Unpack(a.q.ptr())) && (asks_gradient(a) || half_products_forced())) return false;
  const Options o = Options::from(options);
  TORCH_CHECK(o.block_q > 0 && o.block_k > 0, "attnscale fused kernel: a remembered plan has its tiles resolved");
  return remember(a, Remembered{Kind::kKernel, false, false, std::nullopt, o, std::move(backend), std::move(why)});
}

void forget_calls() { remembered_calls().clear(); }

py::object wrap(const at::Tensor& t) { return py::reinterpret_steal<py::object>(THPVariable_Wrap(t)); }

// torch's kernel, as the pipeline called it, and the guard's first check of its output.
// transposed: the output as out.transpose(1, 2).contiguous() (rows_ok_transposed_op), 4-D inputs.
py::object torch_call(const Remembered& call, const CallArgs& a, int64_t limit, bool transposed) {
  const auto& Q = THPVariable_Unpack(a.q.ptr());
  const auto& K = THPVariable_Unpack(a.k.ptr());
  const auto& V = THPVariable_Unpack(a.v.ptr());
  const int64_t out_numel = Q.dim() == 0 || Q.size(-1) == 0 ? 0 : Q.numel() / Q.size(-1) * V.size(-1);
  if (Q.numel() > limit || K.numel() > limit || out_numel > limit) return py::none();  // (the guard's check takes torch's reductions there)
  std::optional<at::Tensor> M;
  if (!a.mask.is_none()) {
    M = THPVariable_Unpack(a.mask.ptr());
    if (M->scalar_type() != at::kBool && M->numel() && !below_inf_op(*M)) return py::none();  // (the full checks say why)
  }
  // k finite first: it reads the keys torch's kernel reads next, and a call that fails it is not computed twice
  if (!all_finite_op(K)) return py::none();
  at::Tensor out;
  {
    py::gil_scoped_release released;
    out = at::scaled_dot_product_attention(Q, K, V, M, 0.0, call.causal, call.scale, call.gqa);
  }
  if (out.scalar_type() != Q.scalar_type()) return py::none();
  if (transposed && !out.requires_grad() && float_kind(out)) {  // (its copy is made of the data, outside autograd)
    auto [rows_first, ok] = rows_ok_transposed_op(out);
    if (!ok) return py::none();
    return py::make_tuple(wrap(rows_first), call.backend, call.why);
  }
  if (!rows_ok_op(out)) return py::none();
  return py::make_tuple(wrap(transposed ? out.transpose(1, 2).contiguous() : out), call.backend, call.why);
}

const char* const kNoDoubleBackward =
    "attnscale's fused backend has no double backward (the derivative of its backward pass, which create_graph=True, gradient "
    "penalties and nested torch.func.grad need). Fix: backend='math', which computes it";

// Gradients from a backward without a derivative, in a graph-building backward: behind a node that
// depends on the inputs and whose own backward raises (attnscale._autograd.first_order).
struct RefuseDoubleBackward : public torch::autograd::Function<RefuseDoubleBackward> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext*, at::TensorList grads, at::TensorList) {
    torch::autograd::variable_list copies;
    for (const auto& g : grads) copies.push_back(g.clone());
    return copies;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*, torch::autograd::variable_list) {
    TORCH_CHECK(false, kNoDoubleBackward);
  }
};

// The options in saved_data (ints cannot all be doubles: window sides reach 2**62).
void save_options(torch::autograd::AutogradContext* ctx, const Options& o) {
  std::vector<double> reals{o.scale, o.softcap};
  std::vector<int64_t> ints{o.causal, o.q_offset, o.left, o.right, o.q_start, o.k_start, o.with_stats, o.block_q, o.block_k, o.half_products, o.round_out};
  ctx->saved_data["reals"] = reals;
  ctx->saved_data["ints"] = ints;
}

Options saved_options(torch::autograd::AutogradContext* ctx) {
  const auto reals = ctx->saved_data["reals"].toDoubleVector();
  const auto ints = ctx->saved_data["ints"].toIntVector();
  Options o;
  o.scale = reals[0], o.softcap = reals[1];
  o.causal = ints[0], o.q_offset = ints[1], o.left = ints[2], o.right = ints[3], o.q_start = ints[4], o.k_start = ints[5];
  o.with_stats = ints[6], o.block_q = ints[7], o.block_k = ints[8], o.half_products = ints[9], o.round_out = ints[10];
  return o;
}

// The compiled kernel's forward where a gradient is asked of q, k, v or the slopes: the autograd
// rule of attnscale.kernels.ops.fused_forward (setup_forward, backward_forward, fused_backward)
// for float32 and float64 inputs of the kernel's layout, as one C++ node. Outputs: out, lse, and
// with statistics the four of them (not differentiable); *ok: the rows' verdict.
struct FusedForward : public torch::autograd::Function<FusedForward> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                const c10::optional<at::Tensor>& alibi, Options o, bool* ok) {
    c10::optional<at::Tensor> slopes;  // in the compute dtype, as the pipeline's cast gives them
    if (alibi.has_value()) slopes = alibi->scalar_type() == q.scalar_type() ? alibi->detach() : alibi->detach().to(q.scalar_type());
    auto [r, fine] = forward_run(q, k, v, slopes, c10::nullopt, c10::nullopt, o, false);  // [out, lse, m, l, statistics...]
    *ok = fine;
    ctx->save_for_backward({q, k, v, r[0], r[2], r[3], slopes.value_or(at::Tensor()), alibi.value_or(at::Tensor())});
    save_options(ctx, o);
    torch::autograd::variable_list outs{r[0], r[1]};
    if (o.with_stats) {
      for (size_t i = 4; i < 8; ++i) outs.push_back(r[i]);
      ctx->mark_non_differentiable({r[4], r[5], r[6], r[7]});
    }
    return outs;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &m = saved[4], &l = saved[5], &slopes = saved[6], &alibi = saved[7];
    const bool learned = alibi.defined() && ctx->needs_input_grad(3);
    at::Tensor dq, dk, dv, dslope;
    {
      at::NoGradGuard no_grad;  // the backward has no derivative: see RefuseDoubleBackward
      const at::Tensor& dout = grads[0];
      // D_i = rowsum(dO * O) - dlse_i (FlashAttention-2; a gradient on lse adds p dlse to dS)
      const at::Tensor delta = (dout * out).sum(-1) - grads[1];
      Options o = saved_options(ctx);
      o.with_stats = false, o.round_out = false, o.half_products = true;  // (the backward's fields; float inputs)
      const c10::optional<at::Tensor> kernel_slopes = slopes.defined() ? c10::optional<at::Tensor>(slopes) : c10::nullopt;
      auto g = backward_with(q, k, v, dout.contiguous(), delta.contiguous(), m, l, kernel_slopes, c10::nullopt, c10::nullopt, learned, o);
      dq = g[0], dk = g[1], dv = g[2];
      const int64_t B = q.size(0), H = q.size(1), Hkv = k.size(1), S = k.size(2);
      if (dk.size(1) != Hkv) {  // per query head: a group's heads share k
        dk = dk.view({B, Hkv, H / Hkv, S, dk.size(3)}).sum(2);
        dv = dv.view({B, Hkv, H / Hkv, S, dv.size(3)}).sum(2);
      }
      if (learned) dslope = at::sum_to(g[3], alibi.sizes()).to(alibi.scalar_type());  // (B, H) to the slopes' shape and dtype
    }
    torch::autograd::variable_list result{dq, dk, dv, dslope, at::Tensor(), at::Tensor()};
    if (!at::GradMode::is_enabled()) return result;
    std::vector<at::Tensor> anchors, present;
    for (const auto* x : {&q, &k, &v, &alibi})
      if (x->defined() && x->requires_grad()) anchors.push_back(*x);
    if (anchors.empty()) return result;
    for (size_t i = 0; i < 4; ++i)
      if (result[i].defined()) present.push_back(result[i]);
    auto refused = RefuseDoubleBackward::apply(at::TensorList(present), at::TensorList(anchors));
    for (size_t i = 0, j = 0; i < 4; ++i)
      if (result[i].defined()) result[i] = refused[j++];
    return result;
  }
};

// Rows BLAS reads as they lie (attnscale.kernels.fused._blas_rows).
bool blas_rows(const at::Tensor& x) { return x.stride(-1) == 1 && x.stride(-2) >= std::max<int64_t>(x.size(-1), 1); }

// The compiled kernel by the remembered plan, with the checks of values and the guard's first
// check (the kernel's verdict on its rows; where a gradient is asked of q or k, k finite).
// transposed: the output as out.transpose(1, 2).contiguous(), 4-D inputs without statistics.
py::object kernel_call(const Remembered& call, const CallArgs& a, bool transposed) {
  const auto& Q = THPVariable_Unpack(a.q.ptr());
  const auto& K = THPVariable_Unpack(a.k.ptr());
  const auto& V = THPVariable_Unpack(a.v.ptr());
  if (!blas_rows(Q) || !blas_rows(K) || !blas_rows(V)) return py::none();  // (the pipeline's copies)
  c10::optional<at::Tensor> alibi, sinks;
  if (!a.alibi.is_none()) {
    alibi = THPVariable_Unpack(a.alibi.ptr());
    if (!all_finite_op(*alibi)) return py::none();  // (the full checks say why)
  }
  if (!a.sinks.is_none()) {
    sinks = THPVariable_Unpack(a.sinks.ptr());
    if (!below_inf_op(*sinks)) return py::none();
  }
  const Options& o = call.options;
  const bool grad = asks_gradient(a);
  const bool half = !float_kind(Q);
  if (half && (grad || half_products_forced())) return py::none();  // (16-bit: the pipeline's autograd rule on float32 copies; its reading of the flag)
  std::vector<at::Tensor> r;
  if (grad) {
    if (sinks) return py::none();  // (their merge is torch ops the gradient flows through)
    bool ok = false;
    r = FusedForward::apply(Q, K, V, alibi, o, &ok);
    if (!ok || ((Q.requires_grad() || K.requires_grad()) && !all_finite_op(K))) return py::none();
  } else {
    c10::optional<at::Tensor> slopes;  // in the accumulation dtype, as the pipeline's cast gives them
    const auto acc = accumulation(Q.scalar_type());
    if (alibi) slopes = alibi->scalar_type() == acc ? *alibi : alibi->detach().to(acc);
    auto [lean, ok] = forward_run(Q, K, V, slopes, c10::nullopt, c10::nullopt, o, true);  // [out, lse, statistics...]
    if (!ok) return py::none();
    // A row scaled by its sink's share, in [0, 1], keeps the verdict; so does rounding 16-bit
    // rows the kernel checked once rounded (attnscale.kernels.fused._finished). With sinks a
    // 16-bit plan's rows are float32 (round_out off), rounded after their merge.
    if (sinks) sink_scale_op(lean[0], lean[1], *sinks);
    r = std::move(lean);
  }
  if (r[0].scalar_type() != Q.scalar_type()) {  // (16-bit inputs, rows merged in float32)
    if (transposed) {  // rounded as they are copied into the transposed layout
      auto rows_first = at::empty({r[0].size(0), r[0].size(2), r[0].size(1), r[0].size(3)}, r[0].options().dtype(Q.scalar_type()));
      rows_first.copy_(r[0].transpose(1, 2));
      return py::make_tuple(wrap(rows_first), call.backend, call.why);
    }
    r[0] = r[0].to(Q.scalar_type());
  }
  if (transposed) return py::make_tuple(wrap(r[0].transpose(1, 2).contiguous()), call.backend, call.why);
  if (!o.with_stats) return py::make_tuple(wrap(r[0]), call.backend, call.why);
  return py::make_tuple(wrap(r[0]), call.backend, call.why, wrap(r[1]), wrap(r[2]), wrap(r[3]), wrap(r[4]), wrap(r[5]));
}

// --- packed calls (attnscale.varlen_attention): the same memory. Their sequences are read from
// the cumulative lengths at every call, as the pipeline's checks read them; the key holds the
// lengths' dtype and count, not their values, nor the packed row counts, so that a batch whose
// lengths change every call (decoding steps) is one signature. It holds the longest query
// length, from which the plan's tiles are chosen (attnscale.kernels.fused.packed_plan) ---

constexpr int64_t kPackedLengthsMax = 1025;  // as attnscale._validate's memory of packed calls

// Cumulative lengths: an int32 or int64 contiguous CPU vector of at most kPackedLengthsMax entries.
bool append_lengths(std::string& key, PyObject* obj) {
  if (!append_tensor(key, obj)) return false;
  const auto& t = THPVariable_Unpack(obj);
  return t.dim() == 1 && t.numel() <= kPackedLengthsMax && t.is_contiguous() && (t.scalar_type() == at::kInt || t.scalar_type() == at::kLong);
}

// None ('n') or an exact int ('i'): a max_seqlen hint's kind; its value is read_sequences' to check.
bool append_hint(std::string& key, PyObject* obj) {
  if (obj != Py_None && !PyLong_CheckExact(obj)) return false;
  key.push_back(obj == Py_None ? 'n' : 'i');
  return true;
}

// Everything a packed call passes, as Python objects.
struct PackedArgs {
  py::handle q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, softcap, alibi, window, sinks, stats;
};

// A packed call's sequences: (nseq, 4) int64 rows (q0, q1, k0, k1), and the most query rows of one.
struct Sequences {
  at::Tensor table;
  int64_t longest_q = 0;
};

// The sequences of cumulative lengths the pipeline's checks pass (attnscale._validate's
// cu_seqlens_values and check_max_seqlen): as many entries in both, at least two (one sequence);
// each starting at 0, non-decreasing, ending at its packed tensor's row count; a max_seqlen hint at
// least the longest length. None otherwise (the full checks say why).
std::optional<Sequences> read_sequences(const PackedArgs& a) {
  const auto &CQ = THPVariable_Unpack(a.cu_q.ptr()), &CK = THPVariable_Unpack(a.cu_k.ptr());
  const int64_t entries = CQ.numel();
  if (CK.numel() != entries || entries < 2) return std::nullopt;
  auto at_ = [](const at::Tensor& cu, int64_t i) -> int64_t {
    return cu.scalar_type() == at::kInt ? int64_t(cu.const_data_ptr<int32_t>()[i]) : cu.const_data_ptr<int64_t>()[i];
  };
  Sequences found;
  found.table = at::empty({entries - 1, 4}, at::kLong);
  int64_t* row = found.table.data_ptr<int64_t>();
  int64_t longest_k = 0;
  for (int64_t b = 0; b + 1 < entries; ++b, row += 4) {
    row[0] = at_(CQ, b), row[1] = at_(CQ, b + 1), row[2] = at_(CK, b), row[3] = at_(CK, b + 1);
    if (row[1] < row[0] || row[3] < row[2]) return std::nullopt;
    found.longest_q = std::max(found.longest_q, row[1] - row[0]);
    longest_k = std::max(longest_k, row[3] - row[2]);
  }
  const auto &Q = THPVariable_Unpack(a.q.ptr()), &K = THPVariable_Unpack(a.k.ptr());
  if (at_(CQ, 0) != 0 || at_(CK, 0) != 0 || at_(CQ, entries - 1) != Q.size(0) || at_(CK, entries - 1) != K.size(0)) return std::nullopt;
  for (const auto& [hint, longest] : {std::pair{a.max_q.ptr(), found.longest_q}, std::pair{a.max_k.ptr(), longest_k}}) {
    if (hint == Py_None) continue;
    int overflow = 0;
    const long long value = PyLong_AsLongLongAndOverflow(hint, &overflow);
    if (value == -1 && PyErr_Occurred()) return PyErr_Clear(), std::nullopt;
    if (overflow < 0 || (overflow == 0 && value < longest)) return std::nullopt;
  }
  return found;
}

// The signature (every tensor's dtype and sizes but the packed row counts, the lengths' dtype and
// count, each hint's kind, every option as passed, the longest query length) and the sequences.
std::optional<std::pair<std::string, Sequences>> packed_signature(const PackedArgs& a) {
  std::string key;
  key.reserve(160);
  key.push_back('P');
  const auto rows = Unkeyed::kRowCount;
  if (!append_tensor(key, a.q.ptr(), rows) || !append_tensor(key, a.k.ptr(), rows) || !append_tensor(key, a.v.ptr(), rows) ||
      !append_lengths(key, a.cu_q.ptr()) || !append_lengths(key, a.cu_k.ptr()) || !append_hint(key, a.max_q.ptr()) || !append_hint(key, a.max_k.ptr()) ||
      !append_float(key, a.scale.ptr()) || !append_flag(key, a.causal.ptr()) || !append_float(key, a.softcap.ptr()) ||
      !append_optional_tensor(key, a.alibi.ptr()) || !append_window(key, a.window.ptr()) || !append_optional_tensor(key, a.sinks.ptr()) ||
      !append_flag(key, a.stats.ptr()))
    return std::nullopt;
  const auto &Q = THPVariable_Unpack(a.q.ptr()), &K = THPVariable_Unpack(a.k.ptr()), &V = THPVariable_Unpack(a.v.ptr());
  if (Q.dim() != 3 || K.dim() != 3 || V.dim() != 3 || V.size(0) != K.size(0)) return std::nullopt;  // (the row counts the key leaves out; q's are the lengths')
  auto sequences = read_sequences(a);
  if (!sequences) return std::nullopt;
  key.append(reinterpret_cast<const char*>(&sequences->longest_q), sizeof(int64_t));
  return std::make_pair(std::move(key), std::move(*sequences));
}

// A packed call the pipeline ran in one call of the compiled kernel and kept whole (no gradient,
// no sinks; float32 or float64, and bfloat16 or float16 while ATTNSCALE_HALF_PRODUCTS is unset, as
// remember_kernel_call's): `table` its sequences (which must be those read here from its lengths),
// `options` its tiles resolved.
bool remember_packed_call(const PackedArgs& a, const at::Tensor& table, const py::tuple& options, py::object backend, py::object why) {
  if (!THPVariable_CheckExact(a.q.ptr()) || !a.sinks.is_none()) return false;
  const auto dt = THPVariable_Unpack(a.q.ptr()).scalar_type();
  if (!checked_dtype(dt) || !checked_in_one_call(a.alibi, dt)) return false;
  if (!float_kind(THPVariable_Unpack(a.q.ptr())) && half_products_forced()) return false;
  const Options o = Options::from(options);
  TORCH_CHECK(o.block_q > 0 && o.block_k > 0, "attnscale fused kernel: a remembered plan has its tiles resolved");
  auto found = packed_signature(a);
  if (!found) return false;
  TORCH_CHECK(table.scalar_type() == at::kLong && table.device().is_cpu() && at::equal(table, found->second.table),
              "attnscale fused kernel: a remembered packed call's sequences are those its lengths give");
  auto& calls = remembered_calls();
  if (calls.size() >= kRememberedMax) calls.clear();
  calls[std::move(found->first)] = Remembered{Kind::kPacked, false, false, std::nullopt, o, std::move(backend), std::move(why)};
  return true;
}

// (total, heads, d) as the kernel's (1, heads, total, d) view (attnscale.kernels.fused._packed:
// transpose(0, 1).unsqueeze(0), as one view), and whether BLAS reads its rows as they lie.
at::Tensor packed_view(const at::Tensor& x) {
  return x.as_strided({1, x.size(1), x.size(0), x.size(2)}, {x.size(1) * x.stride(1), x.stride(1), x.stride(0), x.stride(2)});
}
bool packed_rows(const at::Tensor& x) { return x.stride(2) == 1 && x.stride(0) >= std::max<int64_t>(x.size(2), 1); }

py::object remembered_packed_call(py::handle q, py::handle k, py::handle v, py::handle cu_q, py::handle cu_k, py::handle max_q, py::handle max_k,
                                  py::handle scale, py::handle causal, py::handle softcap, py::handle alibi, py::handle window, py::handle sinks,
                                  py::handle stats) {
  if (!plain_dispatch() || torch::jit::tracer::isTracing() || at::autocast::is_autocast_enabled(at::kCPU)) return py::none();
  const auto found = packed_signature(PackedArgs{q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, softcap, alibi, window, sinks, stats});
  if (!found) return py::none();
  const auto& calls = remembered_calls();
  const auto entry = calls.find(found->first);
  if (entry == calls.end()) return py::none();
  const Remembered call = entry->second;  // (a copy, as remembered_call's)
  const at::Tensor& table = found->second.table;
  const auto &Q = THPVariable_Unpack(q.ptr()), &K = THPVariable_Unpack(k.ptr()), &V = THPVariable_Unpack(v.ptr());
  c10::optional<at::Tensor> alibi_t;
  if (!alibi.is_none()) {
    alibi_t = THPVariable_Unpack(alibi.ptr());
    if (!all_finite_op(*alibi_t)) return py::none();  // (the full checks say why)
  }
  if (at::GradMode::is_enabled() && (Q.requires_grad() || K.requires_grad() || V.requires_grad() || (alibi_t && alibi_t->requires_grad())))
    return py::none();  // (the guard then looks at each sequence's rows)
  if (!packed_rows(Q) || !packed_rows(K) || !packed_rows(V)) return py::none();  // (the pipeline's copies)
  if (!float_kind(Q) && half_products_forced()) return py::none();  // (16-bit: Python's reading of the flag)
  c10::optional<at::Tensor> slopes;  // (nseq, H) in the accumulation dtype, as the pipeline's cast and expand give them
  const auto acc = accumulation(Q.scalar_type());
  if (alibi_t) slopes = (alibi_t->scalar_type() == acc ? *alibi_t : alibi_t->detach().to(acc)).expand({table.size(0), Q.size(1)});
  auto [r, ok] = forward_run(packed_view(Q), packed_view(K), packed_view(V), slopes, c10::nullopt, table, call.options, true);  // [out, lse, statistics...]
  if (!ok) return py::none();
  if (r[0].scalar_type() != Q.scalar_type()) r[0] = r[0].to(Q.scalar_type());  // (16-bit rows the plan left in float32; the verdict covers them rounded)
  // (1, H, total_q, Dv) as (total_q, H, Dv); the statistics (1, H, total_q) as (H, total_q)
  const int64_t H = r[0].size(1), total = r[0].size(2), Dv = r[0].size(3);
  const auto out = r[0].as_strided({total, H, Dv}, {Dv, total * Dv, 1});
  auto rows = [&](const at::Tensor& t) { return wrap(t.as_strided({H, total}, {total, 1})); };
  if (!call.options.with_stats) return py::make_tuple(wrap(out), call.backend, call.why);
  return py::make_tuple(wrap(out), call.backend, call.why, rows(r[1]), rows(r[2]), rows(r[3]), rows(r[4]), rows(r[5]));
}

// The remembered call of a signature (a copy: while torch's call releases the GIL, another thread
// may remember a call, and start the memory again, destroying its entries, or forget them all).
std::optional<Remembered> find_remembered(const std::optional<std::string>& key) {
  if (!key) return std::nullopt;
  const auto& calls = remembered_calls();
  const auto found = calls.find(*key);
  if (found == calls.end()) return std::nullopt;
  return found->second;
}

// A remembered call's answer for these arguments (torch_call's or kernel_call's); transposed: its
// output as out.transpose(1, 2).contiguous(), for 4-D inputs without statistics (None otherwise).
py::object call_remembered(const Remembered& call, const CallArgs& a, int64_t limit, bool transposed = false) {
  if (transposed && (THPVariable_Unpack(a.q.ptr()).dim() != 4 || call.options.with_stats)) return py::none();
  if (a.mask.is_none()) {  // keys of any length S > 0: one S for k and v
    const auto &K = THPVariable_Unpack(a.k.ptr()), &V = THPVariable_Unpack(a.v.ptr());
    if (K.size(-2) != V.size(-2) || K.size(-2) == 0) return py::none();
  }
  return call.kind == Kind::kTorch ? torch_call(call, a, limit, transposed) : kernel_call(call, a, transposed);
}

py::object remembered_call(py::handle q, py::handle k, py::handle v, py::handle mask, py::handle causal, py::handle scale, py::handle gqa,
                           py::handle alignment, py::handle softcap, py::handle alibi, py::handle window, py::handle sinks, py::handle stats,
                           int64_t limit, bool transposed = false) {
  // (jit.trace: the pipeline refuses it; CPU autocast: torch's kernel answers in the autocast
  // dtype, which the pipeline's guard reads as such)
  if (!plain_dispatch() || torch::jit::tracer::isTracing() || at::autocast::is_autocast_enabled(at::kCPU)) return py::none();
  const CallArgs a{q, k, v, mask, causal, scale, gqa, alignment, softcap, alibi, window, sinks, stats};
  const auto call = find_remembered(call_signature(a));
  return call ? call_remembered(*call, a, limit, transposed) : py::none();
}

// One tensor over three parts that are consecutive in one storage, each contiguous, all of one
// dtype and of the same sizes past the first (MultiHeadAttention's q, k and v projection weights,
// or their biases, as _pack_projections lays them out): a view, nothing copied; undefined where
// they are not, or one is not a plain tensor or Parameter on the CPU (a subclass's memory is not
// read), as attnscale/modules.py's _consecutive finds them. Its strides are the contiguous ones of
// its sizes (a part of one row may carry any stride in its first dim).
at::Tensor consecutive_rows(PyObject* const (&parts)[3]) {
  if (!THPVariable_CheckExact(parts[0])) return {};
  const auto& first = THPVariable_Unpack(parts[0]);
  if (!first.is_cpu() || first.layout() != at::kStrided || first.dim() < 1 || !first.is_contiguous()) return {};
  const auto* storage = first.storage().unsafeGetStorageImpl();
  const char* end = static_cast<const char*>(first.const_data_ptr());
  int64_t rows = 0;
  for (PyObject* object : parts) {
    if (!THPVariable_CheckExact(object)) return {};
    const auto& part = THPVariable_Unpack(object);
    if (!part.is_cpu() || part.layout() != at::kStrided || part.scalar_type() != first.scalar_type() || part.dim() != first.dim() ||
        !part.is_contiguous() || part.storage().unsafeGetStorageImpl() != storage || static_cast<const char*>(part.const_data_ptr()) != end)
      return {};
    for (int64_t d = 1; d < first.dim(); ++d)
      if (part.size(d) != first.size(d)) return {};
    end += part.numel() * part.element_size();
    rows += part.size(0);
  }
  std::vector<int64_t> sizes = first.sizes().vec(), strides(first.dim(), 1);
  sizes[0] = rows;
  for (int64_t d = first.dim() - 2; d >= 0; --d) strides[d] = strides[d + 1] * sizes[d + 1];
  return first.as_strided(sizes, strides, first.storage_offset());
}

// MultiHeadAttention's forward of a plain self-attention call (attnscale/modules.py,
// _remembered_forward, says which): its packed q, k, v projection, its attention's remembered call
// (the signature the module's own full call of scaled_dot_product_attention left in this memory,
// with its checks) and its output projection, op for op as the module's forward makes them, in
// one compiled call: (out, backend, why), or None where the projections are not packed
// (consecutive_rows: all three biases or none), x is not a plain CPU (B, L, E) tensor of their
// dtype and width, the attention's signature is not remembered (looked up from the projection's
// sizes before it is made) or its checks do not pass (then the module's full forward runs, checks
// x itself, and projects again). x batch first; projection[i] the q, k, v weights and biases in
// turn (weight, bias, weight, ...).
py::object remembered_module_call(PyObject* x, PyObject* const (&projection)[6], const at::Tensor& out_weight, const c10::optional<at::Tensor>& out_bias,
                                  int64_t heads, int64_t kv_heads, int64_t head_dim, py::handle scale, py::handle gqa, py::handle alignment,
                                  py::handle softcap, py::handle window, py::handle sinks, int64_t limit) {
  if (!plain_dispatch() || torch::jit::tracer::isTracing() || at::autocast::is_autocast_enabled(at::kCPU) || !THPVariable_CheckExact(x)) return py::none();
  const auto& X = THPVariable_Unpack(x);
  const auto weight = consecutive_rows({projection[0], projection[2], projection[4]});
  const int64_t biases = (projection[1] != Py_None) + (projection[3] != Py_None) + (projection[5] != Py_None);
  const auto bias = biases == 3 ? consecutive_rows({projection[1], projection[3], projection[5]}) : at::Tensor();
  if (!weight.defined() || (biases != 0 && !bias.defined()) || !X.is_cpu() || X.layout() != at::kStrided || X.dim() != 3 ||
      weight.scalar_type() != X.scalar_type() || weight.dim() != 2 || weight.size(1) != X.size(2))
    return py::none();
  for (int i = 0; i < 3; ++i) {  // each projection's rows where the split below takes them, biases of one dim (parts of other shapes would be split or broadcast wrongly)
    const int64_t rows = (i == 0 ? heads : kv_heads) * head_dim;
    if (THPVariable_Unpack(projection[2 * i]).size(0) != rows) return py::none();
    if (biases != 0 && (THPVariable_Unpack(projection[2 * i + 1]).dim() != 1 || THPVariable_Unpack(projection[2 * i + 1]).size(0) != rows)) return py::none();
  }
  const int64_t B = X.size(0), L = X.size(1);
  const QKVSizes sizes{X.scalar_type(), {B, heads, L, head_dim}, {B, kv_heads, L, head_dim}, {B, kv_heads, L, head_dim}};
  CallArgs a{Py_None, Py_None, Py_None, Py_None, Py_False, scale, gqa, alignment, softcap, Py_None, window, sinks, Py_False};
  const auto call = find_remembered(call_signature(a, &sizes));
  if (!call) return py::none();
  at::Tensor projected;
  {
    py::gil_scoped_release released;
    projected = at::linear(X, weight, optional_of(bias));
  }
  const auto parts = projected.view({B, L, heads + 2 * kv_heads, head_dim}).transpose(1, 2).split_with_sizes({heads, kv_heads, kv_heads}, 1);
  const py::object q = wrap(parts[0]), k = wrap(parts[1]), v = wrap(parts[2]);
  a.q = q, a.k = k, a.v = v;
  const py::object hit = call_remembered(*call, a, limit);
  if (hit.is_none()) return hit;
  const auto answered = py::reinterpret_borrow<py::tuple>(hit);  // (out, backend, why): no statistics were asked
  const auto& out = THPVariable_Unpack(answered[0].ptr());
  at::Tensor y;
  {
    py::gil_scoped_release released;
    y = at::linear(out.transpose(1, 2).flatten(-2), out_weight, out_bias);
  }
  return py::make_tuple(wrap(y), answered[1], answered[2]);
}

// The three remembered calls as vectorcall builtins (csrc/fast_call.h), arguments by position or by name.
PyObject* remembered_call_fast(PyObject*, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  HANDLE_TH_ERRORS
  static const char* const names[] = {"q", "k", "v", "mask", "is_causal", "scale", "enable_gqa", "alignment", "softcap", "alibi_slopes", "window",
                                      "sinks", "return_stats", "limit"};
  PyObject* a[14];
  int64_t limit = 0;
  if (!fast_arguments("remembered_call", names, args, nargs, kwnames, a) || !fast_int("remembered_call", "limit", a[13], limit)) return nullptr;
  return remembered_call(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12], limit).release().ptr();
  END_HANDLE_TH_ERRORS
}

// remembered_call without statistics, the output as out.transpose(1, 2).contiguous() (B, L, H, Dv)
// for 4-D inputs: what HuggingFace's attention functions return (attnscale.functional.
// transposed_attention); torch's output is checked as it is copied there.
PyObject* remembered_transposed_call_fast(PyObject*, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  HANDLE_TH_ERRORS
  static const char* const names[] = {"q", "k", "v", "mask", "is_causal", "scale", "enable_gqa", "alignment", "softcap", "alibi_slopes", "window",
                                      "sinks", "limit"};
  PyObject* a[13];
  int64_t limit = 0;
  if (!fast_arguments("remembered_transposed_call", names, args, nargs, kwnames, a) || !fast_int("remembered_transposed_call", "limit", a[12], limit))
    return nullptr;
  return remembered_call(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], Py_False, limit, true).release().ptr();
  END_HANDLE_TH_ERRORS
}

PyObject* remembered_module_call_fast(PyObject*, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  HANDLE_TH_ERRORS
  static const char* const names[] = {"x", "q_weight", "q_bias", "k_weight", "k_bias", "v_weight", "v_bias", "out_weight", "out_bias", "heads",
                                      "kv_heads", "head_dim", "scale", "enable_gqa", "alignment", "softcap", "window", "sinks", "limit"};
  constexpr const char* function = "remembered_module_call";
  PyObject* a[19];
  int64_t heads = 0, kv_heads = 0, head_dim = 0, limit = 0;
  if (!fast_arguments(function, names, args, nargs, kwnames, a)) return nullptr;
  for (int i = 1; i < 9; ++i)  // (weights required, biases optional)
    if (!fast_tensor(function, names[i], a[i], /*optional=*/i % 2 == 0)) return nullptr;
  if (!fast_int(function, "heads", a[9], heads) || !fast_int(function, "kv_heads", a[10], kv_heads) || !fast_int(function, "head_dim", a[11], head_dim) ||
      !fast_int(function, "limit", a[18], limit))
    return nullptr;
  if (!THPVariable_CheckExact(a[7]) || (a[8] != Py_None && !THPVariable_CheckExact(a[8]))) Py_RETURN_NONE;  // (a subclass's memory is not read)
  PyObject* const projection[6] = {a[1], a[2], a[3], a[4], a[5], a[6]};
  return remembered_module_call(a[0], projection, THPVariable_Unpack(a[7]), a[8] == Py_None ? c10::nullopt : c10::optional<at::Tensor>(THPVariable_Unpack(a[8])),
                                heads, kv_heads, head_dim, a[12], a[13], a[14], a[15], a[16], a[17], limit)
      .release()
      .ptr();
  END_HANDLE_TH_ERRORS
}

PyObject* remembered_packed_call_fast(PyObject*, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  HANDLE_TH_ERRORS
  static const char* const names[] = {"q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "scale", "is_causal", "softcap",
                                      "alibi_slopes", "window", "sinks", "return_stats"};
  PyObject* a[14];
  if (!fast_arguments("remembered_packed_call", names, args, nargs, kwnames, a)) return nullptr;
  return remembered_packed_call(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12], a[13]).release().ptr();
  END_HANDLE_TH_ERRORS
}

#define ATTNSCALE_FAST(name, doc) PyMethodDef{#name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(name##_fast)), METH_FASTCALL | METH_KEYWORDS, doc}
PyMethodDef g_fast_calls[] = {
    ATTNSCALE_FAST(remembered_call,
                   "(out, backend, why), with statistics (out, backend, why, lse, max_logit, max_prob, entropy, visible), of a remembered call whose "
                   "checks and output pass; None otherwise (arguments in scaled_dot_product_attention's order, then the largest tensor torch's "
                   "call is checked on here)"),
    ATTNSCALE_FAST(remembered_transposed_call,
                   "(out, backend, why) as remembered_call without statistics, out as out.transpose(1, 2).contiguous() (B, L, H, Dv): 4-D "
                   "inputs only (None otherwise; arguments in scaled_dot_product_attention's order without return_stats, then limit)"),
    ATTNSCALE_FAST(remembered_module_call,
                   "(out, backend, why) of MultiHeadAttention's plain self-attention call whose attention is remembered and passes its checks: "
                   "the packed projection (its q, k, v weights, and biases, consecutive in one storage), the remembered call, the output projection; None otherwise"),
    ATTNSCALE_FAST(remembered_packed_call,
                   "(out, backend, why), with statistics (out, backend, why, lse, max_logit, max_prob, entropy, visible), of a remembered packed "
                   "call whose checks and output pass; None otherwise (arguments in varlen_attention's order)"),
};
#undef ATTNSCALE_FAST

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  // The options by keyword (Options::from): a call that names one wrongly, or leaves one out,
  // fails, where one that swapped two ints or bools by position was silent.
  module.def("forward", &forward, "attnscale fused attention forward: [out, lse, m, l, max_logit, max_prob, entropy, visible (empty without statistics), rows_ok (0-d bool)]; the options by keyword (Options)",
             py::arg("q"), py::arg("k"), py::arg("v"), py::arg("alibi"), py::arg("mask"), py::arg("spans"));
  module.def("forward_ordered", &forward_ordered, "forward with the options as one tuple in option_names' order (attnscale.kernels.ops.KernelOptions, whose order is checked at load)",
             py::arg("q"), py::arg("k"), py::arg("v"), py::arg("alibi"), py::arg("mask"), py::arg("spans"), py::arg("options"));
  module.def("forward_int8", &forward_int8, "attention of float32 or bfloat16 q over int8 keys and values (attnscale.QuantizedKV's layout): forward's outputs; the options by keyword (Options)",
             py::arg("q"), py::arg("k"), py::arg("k_scale"), py::arg("k_mean"), py::arg("v"), py::arg("v_scale"), py::arg("alibi"), py::arg("mask"),
             py::arg("q_int16") = false);
  module.def("option_names", &Options::names, "the options forward and backward take by keyword, in their order (Options)");
  module.def("brgemm_runs", &brgemm_runs, "whether bfloat16 products with an even head dim go through torch's brgemm (oneDNN) here, not oneMKL");
  module.def("half_gemm", &half_gemm, "whether 16-bit q, k, v of this format (1 bfloat16, 2 float16) can be passed as they are (oneMKL's products)");
  module.def("rows_ok", &rows_ok_op, "whether every row (last dim) of a float32, float64, bfloat16 or float16 tensor is finite and not all zeros (the guard's check)");
  module.def("forward_direct", &forward_direct, "forward_ordered for a planned eager call without mask or spans, sinks merged: (out, lse, rows_ok) or, with statistics, (out, lse, max_logit, max_prob, entropy, visible, rows_ok); rows_ok a bool",
             py::arg("q"), py::arg("k"), py::arg("v"), py::arg("alibi"), py::arg("sinks"), py::arg("options"));
  module.def("output_ok", &output_ok_op, "rows_ok(out) and all_finite(key) in one call (the guard's check of a backend that reports nothing on its rows); None unless both are CPU float32, float64, bfloat16 or float16 tensors of one dtype with at most limit entries",
             py::arg("out"), py::arg("key"), py::arg("limit"));
  module.def("rows_ok_transposed", &rows_ok_transposed_op, "(x.transpose(1, 2).contiguous(), rows_ok(x)) of a (B, H, L, W) float32 or float64 tensor, checked as it is copied",
             py::arg("x"));
  module.def("all_finite", &all_finite_op, "whether every entry of a float32, float64, bfloat16 or float16 tensor is finite (the guard's check of k)");
  // A call's arguments as remembered_call takes them (CallArgs), then each kind's own.
  auto call_args = [](py::handle q, py::handle k, py::handle v, py::handle mask, py::handle causal, py::handle scale, py::handle gqa, py::handle alignment,
                      py::handle softcap, py::handle alibi, py::handle window, py::handle sinks, py::handle stats) {
    return CallArgs{q, k, v, mask, causal, scale, gqa, alignment, softcap, alibi, window, sinks, stats};
  };
#define ATTNSCALE_CALL_ARGS                                                                                                                  \
  py::arg("q"), py::arg("k"), py::arg("v"), py::arg("mask"), py::arg("is_causal"), py::arg("scale"), py::arg("enable_gqa"), py::arg("alignment"), \
      py::arg("softcap"), py::arg("alibi_slopes"), py::arg("window"), py::arg("sinks"), py::arg("return_stats")
  module.def(
      "remember_torch_call",
      [call_args](py::handle q, py::handle k, py::handle v, py::handle mask, py::handle causal, py::handle scale, py::handle gqa, py::handle alignment,
                  py::handle softcap, py::handle alibi, py::handle window, py::handle sinks, py::handle stats, bool torch_causal, bool torch_gqa,
                  std::optional<double> torch_scale, py::object backend, py::object why) {
        return remember_torch_call(call_args(q, k, v, mask, causal, scale, gqa, alignment, softcap, alibi, window, sinks, stats), torch_causal, torch_gqa,
                                   torch_scale, std::move(backend), std::move(why));
      },
      "remember that torch's kernel computes calls of this signature with these arguments (False: not a signature remembered here)", ATTNSCALE_CALL_ARGS,
      py::arg("torch_causal"), py::arg("torch_gqa"), py::arg("torch_scale"), py::arg("backend"), py::arg("why"));
  module.def(
      "remember_kernel_call",
      [call_args](py::handle q, py::handle k, py::handle v, py::handle mask, py::handle causal, py::handle scale, py::handle gqa, py::handle alignment,
                  py::handle softcap, py::handle alibi, py::handle window, py::handle sinks, py::handle stats, const py::tuple& options, py::object backend,
                  py::object why) {
        return remember_kernel_call(call_args(q, k, v, mask, causal, scale, gqa, alignment, softcap, alibi, window, sinks, stats), options,
                                    std::move(backend), std::move(why));
      },
      "remember that the compiled kernel computes calls of this signature by this plan (options in KernelOptions' order; False: not a signature remembered here)",
      ATTNSCALE_CALL_ARGS, py::arg("options"), py::arg("backend"), py::arg("why"));
#undef ATTNSCALE_CALL_ARGS
  for (auto& def : g_fast_calls) add_fast(module, &def);
  module.def(
      "remember_packed_call",
      [](py::handle q, py::handle k, py::handle v, py::handle cu_q, py::handle cu_k, py::handle max_q, py::handle max_k, py::handle scale,
         py::handle causal, py::handle softcap, py::handle alibi, py::handle window, py::handle sinks, py::handle stats, const at::Tensor& table,
         const py::tuple& options, py::object backend, py::object why) {
        return remember_packed_call(PackedArgs{q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, softcap, alibi, window, sinks, stats}, table, options,
                                    std::move(backend), std::move(why));
      },
      "remember that the compiled kernel computes packed calls of this signature (the lengths' values read at each call) by this plan: the "
      "options in KernelOptions' order; the table must be the sequences the lengths give (False: not a signature remembered here)",
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("cu_seqlens_q"), py::arg("cu_seqlens_k"), py::arg("max_seqlen_q"), py::arg("max_seqlen_k"),
      py::arg("scale"), py::arg("is_causal"), py::arg("softcap"), py::arg("alibi_slopes"), py::arg("window"), py::arg("sinks"), py::arg("return_stats"),
      py::arg("table"), py::arg("options"), py::arg("backend"), py::arg("why"));
  module.def("set_alignments", &set_alignments, "the two CausalAlignment members a remembered call's alignment is one of", py::arg("top_left"), py::arg("bottom_right"));
  module.def("forget_calls", &forget_calls, "forget every remembered call");
  module.def("below_inf", &below_inf_op, "whether no entry of a float32, float64, bfloat16 or float16 tensor is NaN or +inf (a float mask's values)");
  module.def("sink_scale", &sink_scale_op, "attention sinks on the kernel's rows, in place: out (..., H, L, Dv) times sigmoid(lse - sink) per row, rows with lse = -inf left as they are");
  module.def("tanh", &tanh_op, "the kernel's tanh (float32: a polynomial near 0, exp farther out; float64: Sleef's 1-ulp)");
  module.def("weights", &weights_op, "the softmax's exp of centred scores, and exp_u20 floored the same way (float32, 1-d, a multiple of 8 long)");
  module.def("tile_weights", &tile_weights_op, "one tile's softmax weights exp(s - m) and m as the forward makes them (tests; float32/float64, one block and tile)",
             py::arg("q"), py::arg("k"), py::arg("v"), py::arg("alibi"), py::arg("mask"));
  module.def("backward", &backward, "attnscale fused attention backward (dq, dk, dv; dk, dv per key head, or per query head for the caller to sum per group; and, with slope_grad, the ALiBi slopes' gradient per (batch or sequence, head), else empty); the options by keyword (Options)",
             py::arg("q"), py::arg("k"), py::arg("v"), py::arg("dout"), py::arg("delta"), py::arg("m"), py::arg("l"),
             py::arg("alibi"), py::arg("mask"), py::arg("spans"), py::arg("slope_grad"));
}
