// The kernel's options (everything but its tensors), read by name from the binding's keywords.
#pragma once

#include <torch/extension.h>

#include <string>
#include <vector>

namespace {

using at::vec::Vectorized;

// Everything the kernel takes besides its tensors, by name: the one list of attnscale.kernels.ops.
// KernelOptions (same names, same order; tests/test_compile.py holds the two equal). X-macro: each
// line makes a field and its keyword in the binding, so one new option is one line here, one field
// there, and the code that reads it.
#define ATTNSCALE_KERNEL_OPTIONS(X)                                                                          \
  X(double, scale)          /* the logits' multiplier */                                                     \
  X(double, softcap)        /* cap * tanh(s / cap); 0: none */                                               \
  X(bool, causal)           /* bottom-right aligned: query row i sees keys up to i + q_offset */             \
  X(int64_t, q_offset)      /* query row i sits at key position i + q_offset */                             \
  X(int64_t, left)          /* window sides; -1: unbounded */                                                \
  X(int64_t, right)                                                                                          \
  X(int64_t, q_start)       /* global positions of the first query row and key (context parallelism) */     \
  X(int64_t, k_start)                                                                                        \
  X(bool, with_stats)       /* the streamed statistics (forward) */                                          \
  X(int64_t, block_q)       /* tile rows and keys (the caller resolves 0 to its defaults) */                 \
  X(int64_t, block_k)                                                                                        \
  X(bool, half_products)    /* 16-bit inputs: multiply them as they are (else float32 tiles) */             \
  X(bool, round_out)        /* 16-bit inputs: out rounded to their format as its rows are written */

struct Options {
#define ATTNSCALE_FIELD(type, name) type name{};
  ATTNSCALE_KERNEL_OPTIONS(ATTNSCALE_FIELD)
#undef ATTNSCALE_FIELD

  // From the binding's keywords: every option named once, no other name (a misspelt or missing
  // one is an error that names it, never a default taken in silence).
  static Options from(const py::kwargs& given) {
    Options o;
    size_t found = 0;
    std::string missing;
#define ATTNSCALE_READ(type, name)                  \
  if (given.contains(#name)) {                      \
    o.name = given[#name].cast<type>();             \
    ++found;                                        \
  } else {                                          \
    missing += missing.empty() ? #name : ", " #name; \
  }
    ATTNSCALE_KERNEL_OPTIONS(ATTNSCALE_READ)
#undef ATTNSCALE_READ
    TORCH_CHECK(missing.empty(), "attnscale fused kernel: options missing: ", missing, " (pass every field of attnscale.kernels.ops.KernelOptions)");
    if (found != given.size()) {
      std::string unknown;
      for (const auto& item : given) {
        const auto name = item.first.cast<std::string>();
        bool known = false;
#define ATTNSCALE_KNOWN(type, field) known = known || name == #field;
        ATTNSCALE_KERNEL_OPTIONS(ATTNSCALE_KNOWN)
#undef ATTNSCALE_KNOWN
        if (!known) unknown += unknown.empty() ? name : ", " + name;
      }
      TORCH_CHECK(false, "attnscale fused kernel: unknown options: ", unknown, " (the fields of attnscale.kernels.ops.KernelOptions)");
    }
    return o;
  }

  // From one tuple in the fields' order: the binding's forward_ordered, for a caller that holds
  // attnscale.kernels.ops.KernelOptions, whose order ops checks against names() once, at load (no
  // keyword to look up per option on a decoding step's call).
#define ATTNSCALE_COUNT(type, name) +1
  static constexpr size_t count = 0 ATTNSCALE_KERNEL_OPTIONS(ATTNSCALE_COUNT);
#undef ATTNSCALE_COUNT
  static Options from(const py::tuple& given) {
    TORCH_CHECK(given.size() == count, "attnscale fused kernel: options: expected a tuple of ", count,
                " (the fields of attnscale.kernels.ops.KernelOptions, in order), got ", given.size());
    Options o;
    size_t at = 0;
#define ATTNSCALE_READ_AT(type, name) o.name = given[at++].cast<type>();
    ATTNSCALE_KERNEL_OPTIONS(ATTNSCALE_READ_AT)
#undef ATTNSCALE_READ_AT
    return o;
  }

  static std::vector<std::string> names() {
    std::vector<std::string> all;
#define ATTNSCALE_NAME(type, name) all.emplace_back(#name);
    ATTNSCALE_KERNEL_OPTIONS(ATTNSCALE_NAME)
#undef ATTNSCALE_NAME
    return all;
  }
};

}  // namespace
