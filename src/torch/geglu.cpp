// torch.ops.bastile.geglu: GPT-OSS's clamped GLU (cuda/geglu.cu) of gate_up [..., 2I], gate at even and up
// at odd positions of the last dim, into y [..., I]; with `bias` [experts, 2I] and `expert` (int64, one per row
// of gate_up), each row's expert's bias added first (the experts' gate/up bias, rounded as HF's `gate_up + bias`),
// so that no pass of its own writes the sum. The kernels read the pairs flat, so a non-contiguous gate_up is made
// contiguous first. Autograd saves gate_up (and the bias and experts): the backward recomputes the sigmoid; the
// bias's gradient is gate_up's summed over each expert's rows (sum_by_expert). geglu_backward(dot=True) also gives
// each row's <grad_y, y> (the experts' routing weights' gradient, with no y made again for it).
// Autocast leaves it alone, as it leaves HF's clamps, sigmoid and products. Its gradient at the clamps' bounds
// follows the running torch's clamp (clamp_passes_at_bounds).
#include <cmath>

#include "op.h"

namespace bastile {
namespace {

// gate_up's shape with the last dim halved: y's.
std::vector<c10::SymInt> y_sizes(const at::Tensor& x) {
  auto sizes = x.sym_sizes().vec();
  sizes.back() = sizes.back() / 2;
  return sizes;
}

void check(const char* op, const at::Tensor& x, double limit) {
  check_float(op, {{"gate_up", x}});
  TORCH_CHECK(x.dim() >= 1, "bastile.", op, ": gate_up must have at least one dimension");
  TORCH_CHECK(x.sym_size(-1) % 2 == 0, "bastile.", op,
              ": the last dim of gate_up interleaves gate and up, so it must be even, got shape ", x.sym_sizes());
  TORCH_CHECK(!std::isnan(limit), "bastile.", op,
              ": limit is NaN, with which HF's clamp of up makes every output NaN; inf clamps nothing");
}

using Bias = std::optional<at::Tensor>;

// The bias of each row's expert as the kernels read it (contiguous bias and expert, kept alive by the caller),
// after checking them against gate_up: none without one.
struct RowBias {
  at::Tensor bias, expert;

  RowBias(const char* op, const at::Tensor& x, const Bias& bias_in, const Bias& expert_in) {
    if (!check_bias(op, {"gate_up", x}, bias_in, expert_in)) return;
    TORCH_CHECK(bias_in->dim() == 2 && bias_in->sym_size(1) == x.sym_size(-1), "bastile.", op,
                ": bias must be [experts, ", x.sym_size(-1), "] (gate_up's last dim), got ", bias_in->sym_sizes());
    TORCH_CHECK(expert_in->dim() == 1 && expert_in->sym_size(0) * x.sym_size(-1) == x.sym_numel(), "bastile.", op,
                ": expert must hold one index for each of gate_up's rows of ", x.sym_size(-1), ", got shape ",
                expert_in->sym_sizes(), " for gate_up of shape ", x.sym_sizes());
    bias = bias_in->contiguous();
    expert = expert_in->contiguous();
  }

  GegluBias block(const at::Tensor& x) const {
    if (!bias.defined()) return {};
    return {.bias = bias.data_ptr(), .expert = expert.data_ptr<int64_t>(), .experts = bias.size(0)};
  }
};

// Whether the running torch's clamp passes the gradient at its bounds themselves (through 2.11) or stops it
// there too (newer releases, pytorch/pytorch#184574: the minimum-norm subgradient). The op's gradient is that
// of HF's expression under the torch it runs in, so torch's autograd is asked, once, outside whatever mode
// (tracing, inference, no_grad, below autograd) the first call runs in.
bool clamp_passes_at_bounds() {
  static const bool passes = [] {
    const c10::impl::ForceDispatchKeyGuard plain(c10::default_included_set, c10::default_excluded_set);
    const c10::InferenceMode not_inference(false);
    const at::AutoGradMode grad(true);
    const auto x = at::ones({1}, at::kDouble).requires_grad_();
    return torch::autograd::grad({x.clamp_max(1.0)}, {x})[0].item<double>() == 1.0;
  }();
  return passes;
}

struct GegluBackwardOp {
  static constexpr const char* schema =
      "geglu_backward(Tensor grad_y, Tensor gate_up, float alpha, float limit, Tensor? bias=None, "
      "Tensor? expert=None, bool dot=False) -> (Tensor, Tensor)";

  static std::tuple<at::Tensor, at::Tensor> kernel(const at::Tensor& grad_y, const at::Tensor& gate_up, double alpha,
                                                   double limit, const Bias& bias_in, const Bias& expert, bool dot) {
    constexpr const char* op = "geglu_backward";
    check(op, gate_up, limit);
    const RowBias bias(op, gate_up, bias_in, expert);
    check_float(op, {{"grad_y", grad_y}});
    check_same_dtype(op, {"gate_up", gate_up}, {"grad_y", grad_y});
    TORCH_CHECK(grad_y.sym_sizes() == c10::SymIntArrayRef(y_sizes(gate_up)), "bastile.", op,
                ": grad_y must have gate_up's shape with the last dim halved, got ", grad_y.sym_sizes(),
                " for gate_up of shape ", gate_up.sym_sizes());
    check_device(op, {"gate_up", gate_up}, {{"grad_y", grad_y}});
    auto grad_gate_up = at::empty_symint(gate_up.sym_sizes(), gate_up.options());
    auto dots = row_dots(op, dot, grad_y.sym_sizes(), gate_up);
    if (gate_up.is_meta() || grad_y.numel() == 0) return {grad_gate_up, dots};
    const auto dy = grad_y.contiguous(), x = gate_up.contiguous();
    launch(x, GegluBackward{.grad_y = dy.data_ptr(), .gate_up = x.data_ptr(), .grad_gate_up = grad_gate_up.data_ptr(),
                            .dot = dot ? dots.data_ptr() : nullptr, .bias = bias.block(x), .n = dy.numel(),
                            .inter = dy.size(-1), .alpha = alpha, .limit = limit, .dtype = dtype_code(op, {"gate_up", x}),
                            .at_limit = clamp_passes_at_bounds()});
    return {grad_gate_up, dots};
  }
};

struct GegluOp {
  static constexpr const char* schema =
      "geglu(Tensor gate_up, float alpha, float limit, Tensor? bias=None, Tensor? expert=None) -> Tensor";

  static at::Tensor kernel(const at::Tensor& gate_up, double alpha, double limit, const Bias& bias_in,
                           const Bias& expert) {
    check("geglu", gate_up, limit);
    const RowBias bias("geglu", gate_up, bias_in, expert);
    auto y = at::empty_symint(y_sizes(gate_up), gate_up.options());
    if (gate_up.is_meta() || y.numel() == 0) return y;
    const auto x = gate_up.contiguous();
    launch(x, GegluForward{.gate_up = x.data_ptr(), .y = y.data_ptr(), .bias = bias.block(x), .n = y.numel(),
                           .inter = y.size(-1), .alpha = alpha, .limit = limit, .dtype = dtype_code("geglu", {"gate_up", x})});
    return y;
  }

  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate_up, double alpha, double limit,
                            const Bias& bias, const Bias& expert) {
    ctx->save_for_backward({gate_up, bias.value_or(at::Tensor()), expert.value_or(at::Tensor())});
    ctx->saved_data["alpha"] = alpha;
    ctx->saved_data["limit"] = limit;
    ctx->saved_data["bias_grad"] = bias && bias->requires_grad();
    return call<GegluOp>(gate_up, alpha, limit, bias, expert);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto alpha = ctx->saved_data["alpha"].toDouble(), limit = ctx->saved_data["limit"].toDouble();
    const auto s = ctx->get_saved_variables();
    const auto& bias = s[1];
    const auto opt = [](const at::Tensor& t) { return t.defined() ? Bias(t) : std::nullopt; };
    auto [grad, dots] = call<GegluBackwardOp>(grads[0], s[0], alpha, limit, opt(bias), opt(s[2]), false);
    at::Tensor grad_bias;
    if (ctx->saved_data["bias_grad"].toBool()) {
      const auto rows = grad.reshape_symint({-1, grad.sym_size(-1)});
      grad_bias = sum_by_expert(rows, s[2], bias.sym_size(0)).to(bias.scalar_type());
    }
    return {grad, at::Tensor(), at::Tensor(), grad_bias, at::Tensor()};
  }
};

}  // namespace
}  // namespace bastile

BASTILE_OPS(bastile::GegluOp, bastile::GegluBackwardOp)
