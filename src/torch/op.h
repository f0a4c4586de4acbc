// The one registration of Bastile's ops. An op is a spec, a struct with
//   schema   its dispatcher schema, "name(Tensor x, ...) -> ...", registered as bastile::name
//   kernel   its CPU, CUDA and Meta kernel: it checks its inputs and allocates its outputs (with symbolic
//            sizes), returns them as they are for Meta tensors, else fills its parameter block and
//            `launch`es it
// and, when it is differentiable:
//   forward(ctx, args...), backward(ctx, grads)   its autograd node (forward gets the kernel's arguments
//                         and calls the ops below autograd through `call`; backward returns the gradients
//                         of the leading arguments, the rest get none); a node is recorded in grad mode
//                         when a tensor argument requires grad
//   no_grad               optional: indices of tensor arguments it does not differentiate: an error when
//                         they require grad
//   autocast<device>(args...) optional: its Autocast kernel (default: the op keeps its inputs' dtypes)
// BASTILE_OPS(Spec, ...) registers their schemas, CPU/CUDA/Meta kernels, Autograd (the node, or for an op
// without one an error on backward) and the Autocast kernels of the differentiable ones. `call<Spec>`
// dispatches with the C++ signature of Spec::kernel, which the dispatcher checks against the schema when
// the library loads: the two cannot drift.
#pragma once
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/core/DeviceGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include <algorithm>
#include <initializer_list>
#include <string>
#include <tuple>
#include <utility>

#include "bastile/src/ffi.rs.h"
#include "rust/cxx.h"
#include "blocks.h"

namespace bastile {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// ------------------------------------------------------------------------------------------ checks

// A tensor argument and its name, for checks that say what is wrong.
struct Named {
  const char* name;
  const at::Tensor& t;
};

// The dtype code of a floating-point dtype; any other dtype is an error naming op and argument.
inline BastileDType dtype_code(const char* op, const char* name, at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return BASTILE_F32;
    case at::kHalf: return BASTILE_F16;
    case at::kBFloat16: return BASTILE_BF16;
    case at::kDouble: return BASTILE_F64;
    default:
      TORCH_CHECK(false, "bastile.", op, ": ", name, " must be float32, float16, bfloat16 (or float64 on CPU), got ",
                  dtype);
  }
}

inline BastileDType dtype_code(const char* op, Named arg) { return dtype_code(op, arg.name, arg.t.scalar_type()); }

inline void check_float(const char* op, std::initializer_list<Named> args) {
  for (const auto& a : args) dtype_code(op, a);
}

// Every argument is on `first`'s device.
inline void check_device(const char* op, Named first, std::initializer_list<Named> rest) {
  for (const auto& r : rest)
    TORCH_CHECK(r.t.device() == first.t.device(), "bastile.", op, ": ", first.name, " is on ", first.t.device(),
                " but ", r.name, " is on ", r.t.device());
}

inline void check_same_dtype(const char* op, Named a, Named b) {
  TORCH_CHECK(a.t.scalar_type() == b.t.scalar_type(), "bastile.", op, ": ", a.name, " and ", b.name,
              " must have the same dtype, got ", a.t.scalar_type(), " and ", b.t.scalar_type());
}

inline void check_same_shape(const char* op, Named a, Named b) {
  TORCH_CHECK(a.t.sym_sizes() == b.t.sym_sizes(), "bastile.", op, ": ", a.name, " and ", b.name,
              " must have the same shape, got ", a.t.sym_sizes(), " and ", b.t.sym_sizes());
}

// The rotary tables cos and sin: one dtype and shape, [seq, w], [1, seq, w] or [batch, seq, w] with w = dim, or
// with `partial` any even w = rot <= dim, positive unless the heads are empty (a head's first rot elements
// rotate).
inline void check_tables(const char* op, const at::Tensor& cos, const at::Tensor& sin, const c10::SymInt& batch,
                         const c10::SymInt& seq, const c10::SymInt& dim, bool partial = false) {
  check_same_dtype(op, {"cos", cos}, {"sin", sin});
  check_same_shape(op, {"cos", cos}, {"sin", sin});
  const char* w = partial ? "rot" : "head_dim";
  TORCH_CHECK((cos.dim() == 2 || cos.dim() == 3) && (partial || cos.sym_size(-1) == dim) &&
                  cos.sym_size(-2) == seq && (cos.dim() == 2 || cos.sym_size(0) == 1 || cos.sym_size(0) == batch),
              "bastile.", op, ": cos and sin must have shape [seq, ", w, "], [1, seq, ", w, "] or [batch, seq, ", w,
              "] with batch, seq, head_dim = ", batch, ", ", seq, ", ", dim, ", got ", cos.sym_sizes());
  if (partial) {
    const c10::SymInt& rot = cos.sym_size(-1);
    TORCH_CHECK(rot % 2 == 0 && rot <= dim && (rot > 0 || dim == 0), "bastile.", op,
                ": the rotary width rot (cos and sin's last dim) must be even with 0 < rot <= head_dim, got rot = ",
                rot, " for head_dim = ", dim);
  }
}

// The code (swiglu.h's SWIGLU_*) of a gated MLP's activation, "silu" or "gelu_tanh".
inline int32_t gate_activation(const char* op, c10::string_view activation) {
  if (activation == "silu") return SWIGLU_SILU;
  if (activation == "gelu_tanh") return SWIGLU_GELU_TANH;
  TORCH_CHECK(false, "bastile.", op, ": activation must be \"silu\" or \"gelu_tanh\", got \"", activation, "\"");
}

// t, or a contiguous copy where its last stride is not 1: the kernels read rows with unit stride and take
// any other strides as they are.
inline at::Tensor unit_last(const at::Tensor& t) { return t.sym_stride(-1) == 1 ? t : t.contiguous(); }

// The dtype of per-row statistics and losses: float32, float64 for float64 input.
inline at::ScalarType stats_dtype(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// What a gated activation's backward gives for its `dot` argument: each row's <grad_y, y>, one per row of y (of
// shape y_sizes) in stats_dtype, zeros where the rows are empty; unasked, an empty tensor.
inline at::Tensor row_dots(const char* op, bool dot, c10::SymIntArrayRef y_sizes, const at::Tensor& like) {
  const auto options = like.options().dtype(stats_dtype(like));
  if (!dot) return at::empty({0}, options);
  TORCH_CHECK(!y_sizes.empty(), "bastile.", op, ": dot sums rows, and a 0-dim input has none");
  auto rows = at::empty_symint(y_sizes.slice(0, y_sizes.size() - 1), options);
  return like.is_meta() || y_sizes.back() != 0 ? rows : rows.zero_();
}

// An index tensor from the caller: int64.
inline void check_index(const char* op, Named index) {
  TORCH_CHECK(index.t.scalar_type() == at::kLong, "bastile.", op, ": ", index.name, " must be int64, got ",
              index.t.scalar_type());
}

// The experts' bias an op adds to its tensor `to` and the experts that pick its rows (int64): both or neither, the
// bias in to's dtype, both on its device. Whether they are given; their shapes are the op's to check.
inline bool check_bias(const char* op, Named to, const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& expert) {
  TORCH_CHECK(bias.has_value() == expert.has_value(), "bastile.", op,
              ": bias and expert go together (an expert picks its row of bias), got ",
              bias ? "bias without expert" : "expert without bias");
  if (!bias) return false;
  check_same_dtype(op, to, {"bias", *bias});
  check_index(op, {"expert", *expert});
  check_device(op, to, {{"bias", *bias}, {"expert", *expert}});
  return true;
}

// The arguments of the experts' grouped products (expert_swiglu, expert_linear): x [pairs, in] of a float dtype,
// weight [experts, rows, in] of x's dtype with `rows_ok(rows)` (`shape` names the op's layout in the message),
// offsets [experts] int32, all on x's device. Returns x's dtype code.
template <class RowsOk>
BastileDType check_grouped(const char* op, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& offsets,
                           const char* shape, RowsOk&& rows_ok) {
  const auto dt = dtype_code(op, {"x", x});
  check_same_dtype(op, {"x", x}, {"weight", weight});
  TORCH_CHECK(offsets.scalar_type() == at::kInt, "bastile.", op, ": offsets must be int32, got ", offsets.scalar_type());
  TORCH_CHECK(x.dim() == 2, "bastile.", op, ": x must be [pairs, in], got shape ", x.sym_sizes());
  TORCH_CHECK(weight.dim() == 3 && weight.sym_size(2) == x.sym_size(1) && rows_ok(weight.sym_size(1)), "bastile.", op,
              ": weight must be ", shape, " with in = ", x.sym_size(1), " (x's), got shape ", weight.sym_sizes());
  TORCH_CHECK(offsets.dim() == 1 && offsets.sym_size(0) == weight.sym_size(0), "bastile.", op,
              ": offsets must be [experts] with experts = ", weight.sym_size(0), " (weight's), got shape ",
              offsets.sym_sizes());
  check_device(op, {"x", x}, {{"weight", weight}, {"offsets", offsets}});
  return dt;
}

// A grouped product with rows to compute: experts for them, counted in int32.
inline void check_experts(const char* op, const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(weight.size(0) > 0, "bastile.", op, ": x has ", x.size(0), " rows but weight no experts");
  TORCH_CHECK(weight.size(0) <= std::numeric_limits<int32_t>::max(), "bastile.", op, ": ", weight.size(0),
              " experts are more than int32 counts");
}

// Whether t's data starts on 16 bytes, as TMA and 16-byte loads read it.
inline bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// t contiguous, its data starting on 16 bytes as TMA reads it (a copy where it does not).
inline at::Tensor contiguous16(const at::Tensor& t) {
  const auto c = t.contiguous();
  return aligned16(c) ? c : c.clone();
}

// A grouped product's low-rank operands (an expert LoRA's factors): lora_x [pairs, rank] and lora_weight [experts,
// rows, rank] (`rows` naming weight's second size in the message) of x's dtype and device, both or neither; whether
// they are given.
inline bool check_lora(const char* op, const at::Tensor& x, const at::Tensor& weight, const char* rows,
                       const std::optional<at::Tensor>& lora_x, const std::optional<at::Tensor>& lora_weight) {
  TORCH_CHECK(lora_x.has_value() == lora_weight.has_value(), "bastile.", op, ": lora_x and lora_weight go together, got ",
              lora_x ? "lora_x without lora_weight" : "lora_weight without lora_x");
  if (!lora_x) return false;
  check_same_dtype(op, {"x", x}, {"lora_x", *lora_x});
  check_same_dtype(op, {"x", x}, {"lora_weight", *lora_weight});
  TORCH_CHECK(lora_x->dim() == 2 && lora_x->sym_size(0) == x.sym_size(0), "bastile.", op,
              ": lora_x must be [pairs, rank] with pairs = ", x.sym_size(0), " (x's), got shape ", lora_x->sym_sizes());
  TORCH_CHECK(lora_weight->dim() == 3 && lora_weight->sym_size(0) == weight.sym_size(0) &&
                  lora_weight->sym_size(1) == weight.sym_size(1) && lora_weight->sym_size(2) == lora_x->sym_size(1),
              "bastile.", op, ": lora_weight must be [experts, ", rows, ", rank] = [", weight.sym_size(0), ", ",
              weight.sym_size(1), ", ", lora_x->sym_size(1), "] (weight's and lora_x's), got shape ",
              lora_weight->sym_sizes());
  check_device(op, {"x", x}, {{"lora_x", *lora_x}, {"lora_weight", *lora_weight}});
  return true;
}

// rows [n, dim] summed by their expert (expert: int64 [n], each in 0..experts): [experts, dim] in at least float32,
// as the product of the rows' one-hot experts and the rows, the same on every run (index_add_'s atomics on CUDA sum
// in any order).
inline at::Tensor sum_by_expert(const at::Tensor& rows, const at::Tensor& expert, const c10::SymInt& experts) {
  const auto acc = at::promote_types(rows.scalar_type(), at::kFloat);
  // rows of the identity: Inductor (2.11) lowered a scatter of ones into zeros to an int64 tensor
  const auto one_hot = at::eye_symint(experts, rows.options().dtype(acc)).index_select(0, expert);
  return one_hot.t().mm(rows.to(acc));
}

// ------------------------------------------------------------------------------------------ launches

// Calls into Rust; a Rust error (already worded for the user) becomes a c10::Error, which Python sees as
// RuntimeError.
template <class F>
auto rust(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const ::rust::Error& e) {
    TORCH_CHECK(false, e.what());
  }
}

// torch's current stream on t's device, as a driver-API handle.
inline size_t current_stream(const at::Tensor& t) {
  return reinterpret_cast<size_t>(c10::cuda::getCurrentCUDAStream(t.device().index()).stream());
}

// Runs parameter block p on `on`'s device: its CPU kernel, or its CUDA plan on torch's current stream
// with the scratch memory the plan asks for, from torch's allocator.
template <class P>
void launch(const at::Tensor& on, const P& p) {
  const auto* bytes = reinterpret_cast<const uint8_t*>(&p);
  if (on.is_cpu()) return rust([&] { rs::run_cpu(Block<P>::id, bytes); });
  TORCH_CHECK(on.is_cuda(), "bastile.", Block<P>::op, ": unsupported device ", on.device());
  const c10::DeviceGuard guard(on.device());
  auto plan = rust([&] { return rs::plan(Block<P>::id, bytes, on.device().index()); });
  at::Tensor scratch;
  if (plan->scratch() > 0) scratch = at::empty({plan->scratch()}, on.options().dtype(at::kByte));
  auto* memory = scratch.defined() ? static_cast<uint8_t*>(scratch.data_ptr()) : nullptr;
  rust([&] { rs::launch(std::move(plan), memory, current_stream(on)); });
}

// Decision block p with Rust's answer in its "chosen by Rust" fields.
template <class P>
P decide(P p) {
  rust([&] { rs::decide(Block<P>::id, reinterpret_cast<uint8_t*>(&p)); });
  return p;
}

// ------------------------------------------------------------------------------------------ registration

template <class Spec>
const char* op_name() {
  static const std::string name = [] {
    const std::string schema = Spec::schema;
    return schema.substr(0, schema.find('('));
  }();
  return name.c_str();
}

template <class Spec>
const auto& handle() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow((std::string("bastile::") + op_name<Spec>()).c_str(), "")
                             .template typed<decltype(Spec::kernel)>();
  return op;
}

// The op through the dispatcher.
template <class Spec, class... A>
decltype(auto) call(A&&... a) {
  return handle<Spec>().call(std::forward<A>(a)...);
}

inline bool requires_grad(const at::Tensor& t) { return t.defined() && t.requires_grad(); }
inline bool requires_grad(const std::optional<at::Tensor>& t) { return t.has_value() && requires_grad(*t); }
template <class T>
bool requires_grad(const T&) { return false; }

template <class Spec, class... A>
bool needs_grad(const A&... a) {
  size_t i = 0;
  const auto check = [&](bool grad) {
    if constexpr (requires { Spec::no_grad; })
      if (grad && std::ranges::find(Spec::no_grad, i) != std::end(Spec::no_grad)) {
        const auto& name = handle<Spec>().schema().arguments()[i].name();
        TORCH_CHECK(false, "bastile.", op_name<Spec>(), ": ", name, " requires grad, but ", op_name<Spec>(),
                    " does not differentiate it; pass ", name, ".detach()");
      }
    ++i;
    return grad;
  };
  return (check(requires_grad(a)) | ...);  // `|`: every argument is checked
}

template <class Spec>
struct Node : torch::autograd::Function<Node<Spec>> {
  template <class... A>
  static auto forward(AutogradContext* ctx, A&&... a) {
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    return Spec::forward(ctx, std::forward<A>(a)...);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto g = Spec::backward(ctx, std::move(grads));
    g.resize(handle<Spec>().schema().arguments().size());  // none for the arguments after the last given
    return g;
  }
};

template <class Spec, class Signature = decltype(Spec::kernel)>
struct Kernels;
template <class Spec, class R, class... A>
struct Kernels<Spec, R(A...)> {
  static R autograd(A... a) {
    if (at::GradMode::is_enabled() && needs_grad<Spec>(a...)) {
      const auto out = Node<Spec>::apply(a...);  // one tensor, or a list for a tuple
      if constexpr (std::is_same_v<R, at::Tensor>)
        return out;
      else
        return [&]<size_t... I>(std::index_sequence<I...>) { return R(out[I]...); }(
                   std::make_index_sequence<std::tuple_size_v<R>>{});
    }
    // Nothing to differentiate: nothing saved.
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    return call<Spec>(a...);
  }

  template <c10::DeviceType device>
  static R autocast(A... a) {
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    if constexpr (requires { Spec::template autocast<device>(a...); })
      return Spec::template autocast<device>(a...);
    else
      return call<Spec>(a...);
  }
};

template <class Spec>
constexpr bool differentiable = requires { &Spec::backward; };

template <class... Specs>
struct Ops {
  static void define(torch::Library& m) { (m.def(Specs::schema, {at::Tag::pt2_compliant_tag}), ...); }
  static void kernels(torch::Library& m) { (m.impl(op_name<Specs>(), &Specs::kernel), ...); }
  static void autograd(torch::Library& m) { (autograd_of<Specs>(m), ...); }
  template <c10::DeviceType device>
  static void autocast(torch::Library& m) { (autocast_of<Specs, device>(m), ...); }

 private:
  // Autocast applies to the ops users call; their pieces run as those ops call them.
  template <class Spec, c10::DeviceType device>
  static void autocast_of(torch::Library& m) {
    if constexpr (differentiable<Spec>) m.impl(op_name<Spec>(), &Kernels<Spec>::template autocast<device>);
  }

  template <class Spec>
  static void autograd_of(torch::Library& m) {
    if constexpr (differentiable<Spec>)
      m.impl(op_name<Spec>(), &Kernels<Spec>::autograd);
    else  // a piece of a differentiable op: a clear error on backward instead of a silent missing grad_fn
      m.impl(op_name<Spec>(), torch::autograd::autogradNotImplementedFallback());
  }
};

}  // namespace bastile

#define BASTILE_OPS(...)                                                                                   \
  TORCH_LIBRARY_FRAGMENT(bastile, m) { bastile::Ops<__VA_ARGS__>::define(m); }                          \
  TORCH_LIBRARY_IMPL(bastile, CPU, m) { bastile::Ops<__VA_ARGS__>::kernels(m); }                        \
  TORCH_LIBRARY_IMPL(bastile, CUDA, m) { bastile::Ops<__VA_ARGS__>::kernels(m); }                       \
  TORCH_LIBRARY_IMPL(bastile, Meta, m) { bastile::Ops<__VA_ARGS__>::kernels(m); }                       \
  TORCH_LIBRARY_IMPL(bastile, Autograd, m) { bastile::Ops<__VA_ARGS__>::autograd(m); }                  \
  TORCH_LIBRARY_IMPL(bastile, AutocastCPU, m) { bastile::Ops<__VA_ARGS__>::autocast<c10::kCPU>(m); }    \
  TORCH_LIBRARY_IMPL(bastile, AutocastCUDA, m) { bastile::Ops<__VA_ARGS__>::autocast<c10::kCUDA>(m); }
