// torch.ops.bastile.expert_combine (cuda/expert_combine.cu): a mixture of experts' token-expert pairs joined back
// into their tokens. `rows` [tokens * k, dim] are the pairs' rows (the experts' outputs, in any order: grouped by
// expert), `position` [tokens, k] (int64) the row of each token's j-th pair, `weights` [tokens, k] its routing
// weight (None: ones): out[t] = sum_j weights[t, j] * rows[position[t, j]], each product rounded to the promoted
// dtype as torch's `rows * weights` rounds it, the sum in f32 (one rounding, the same on every run), of the
// promoted dtype. With `bias` [experts, dim] (rows' dtype) and `expert` [tokens, k] (int64, each pair's expert, as
// the router chose them), each pair's row is rows[position[t, j]] + bias[expert[t, j]] first, rounded as HF's
// `out + bias` (the experts' down bias, with no pass of its own); the backward's weight gradient reads the rows with
// their bias, made again. The kernels take weights of rows' dtype or float32 (Mixtral's and GLM's routers keep them in
// float32); others are promoted with the rows first.
// expert_dispatch(x, order, weights, rows, dtype) is the other direction, its backward as a piece: with order
// [tokens * k] (the inverse of position: the pair of each row), row r gets weights[p] * x[p / k] in `dtype`
// (p = order[r]), and given rows the weights' gradient <x[p / k], rows[r]>; without weights it is the experts'
// dispatch of each token to its pairs (python_shim/bastile/experts.py runs both directions in its own node).
// expert_group(chosen, experts) orders the pairs by expert beforehand: chosen [tokens, k] (int64, each pair's
// expert in 0..experts) gives (order [tokens * k], the pair of each row, stably sorted by expert; offsets [experts]
// int32, each expert's end; expert [tokens * k], each row's expert; position [tokens, k], the row of each pair), in
// one op of three launches and no host sync; an expert outside 0..experts stops the kernel (CUDA) or raises (CPU).
// Autograd saves position, the weights, and the rows where the weights need a gradient; the backward inverts
// position by a scatter over -1s, so a position that is not a permutation stops it (an index of -1) rather than
// leave gradients unwritten. Autocast leaves the op alone.
#include "op.h"

namespace bastile {
namespace {

// The weights as the kernels read them, and their dtype code: rows' dtype, or f32 with 16-bit rows. Weights of
// another float dtype are promoted with the rows' as torch's `rows * weights` promotes them (exactly: the promoted
// dtype holds them; bf16 weights of an fp32 model under autocast). Of shape [tokens, k] with `pairs` elements.
std::pair<at::Tensor, BastileDType> kernel_weights(const char* op, const at::Tensor& weights, const c10::SymInt& tokens,
                                                   const c10::SymInt& pairs, at::ScalarType rows) {
  dtype_code(op, {"weights", weights});
  const auto w = at::promote_types(weights.scalar_type(), rows);
  TORCH_CHECK(w == rows || (w == at::kFloat && (rows == at::kHalf || rows == at::kBFloat16)), "bastile.", op,
              ": weights of ", weights.scalar_type(), " and rows of ", rows, " promote to ", w,
              ", wider than the rows' dtype or float32");
  TORCH_CHECK(weights.dim() == 2 && weights.sym_size(0) == tokens && weights.sym_numel() == pairs, "bastile.", op,
              ": weights must be [tokens, k] with tokens = ", tokens, " and tokens * k = ", pairs, ", got ",
              weights.sym_sizes());
  const auto promoted = weights.to(w);
  return {promoted, dtype_code(op, {"weights", promoted})};
}

struct ExpertGroupOp {
  static constexpr const char* schema = "expert_group(Tensor chosen, int experts) -> (Tensor, Tensor, Tensor, Tensor)";

  static std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> kernel(const at::Tensor& chosen_in,
                                                                           int64_t experts) {
    constexpr const char* op = "expert_group";
    check_index(op, {"chosen", chosen_in});
    const auto& pairs = chosen_in.sym_numel();
    TORCH_CHECK(experts >= 0 && experts <= std::numeric_limits<int32_t>::max(), "bastile.", op,
                ": experts must be in 0..2^31, got ", experts);
    TORCH_CHECK(pairs <= std::numeric_limits<int32_t>::max(), "bastile.", op, ": ", pairs,
                " pairs are more than the int32 offsets count");
    TORCH_CHECK(experts > 0 || pairs == 0, "bastile.", op, ": chosen has ", pairs, " pairs but there are no experts");
    const auto index = chosen_in.options();
    auto order = at::empty_symint({pairs}, index), expert = at::empty_symint({pairs}, index);
    auto position = at::empty_symint(chosen_in.sym_sizes(), index);
    auto offsets = at::empty({experts}, index.dtype(at::kInt));
    if (chosen_in.is_meta()) return {order, offsets, expert, position};
    if (pairs == 0) return {order, offsets.zero_(), expert, position};
    const auto chosen = chosen_in.contiguous();
    launch(chosen, ExpertGroup{.chosen = chosen.data_ptr<int64_t>(), .order = order.data_ptr<int64_t>(),
                               .expert = expert.data_ptr<int64_t>(), .position = position.data_ptr<int64_t>(),
                               .offsets = offsets.data_ptr<int32_t>(), .pairs = chosen.numel(), .experts = experts});
    return {order, offsets, expert, position};
  }
};

struct ExpertDispatchOp {
  static constexpr const char* schema =
      "expert_dispatch(Tensor x, Tensor order, Tensor? weights=None, Tensor? rows=None, "
      "ScalarType? dtype=None) -> (Tensor, Tensor)";

  // (the rows [tokens * k, dim] of dtype (rows' dtype without it, else x's), the weights' gradient [tokens, k]
  // with rows, else empty)
  static std::tuple<at::Tensor, at::Tensor> kernel(const at::Tensor& x_in, const at::Tensor& order_in,
                                                   const std::optional<at::Tensor>& weights_in,
                                                   const std::optional<at::Tensor>& rows_in,
                                                   std::optional<at::ScalarType> dtype) {
    constexpr const char* op = "expert_dispatch";
    check_float(op, {{"x", x_in}});
    check_index(op, {"order", order_in});
    TORCH_CHECK(x_in.dim() == 2, "bastile.", op, ": x must be [tokens, dim], got shape ", x_in.sym_sizes());
    TORCH_CHECK(order_in.dim() == 1, "bastile.", op, ": order must be [tokens * k], got shape ", order_in.sym_sizes());
    const auto& tokens = x_in.sym_size(0);
    const auto& pairs = order_in.sym_size(0);
    TORCH_CHECK(tokens == 0 ? pairs == 0 : pairs % tokens == 0, "bastile.", op, ": order's length ", pairs,
                " must be tokens * k for x's ", tokens, " tokens");
    check_device(op, {"x", x_in}, {{"order", order_in}});
    const auto t = dtype.value_or(rows_in ? rows_in->scalar_type() : x_in.scalar_type());
    const auto dt = dtype_code(op, "dtype", t);
    at::Tensor weights;
    BastileDType wt = dt;
    if (weights_in) {
      check_device(op, {"x", x_in}, {{"weights", *weights_in}});
      std::tie(weights, wt) = kernel_weights(op, *weights_in, tokens, pairs, t);
    }
    const auto grad_dtype = weights.defined() ? weights.scalar_type() : t;
    if (rows_in) {
      TORCH_CHECK(weights_in.has_value(), "bastile.", op, ": rows are for the weights' gradient: pass the weights");
      TORCH_CHECK(rows_in->scalar_type() == t, "bastile.", op, ": rows must be ", t, ", got ", rows_in->scalar_type());
      TORCH_CHECK(rows_in->dim() == 2 && rows_in->sym_size(0) == pairs && rows_in->sym_size(1) == x_in.sym_size(1),
                  "bastile.", op, ": rows must be [tokens * k, dim] = [", pairs, ", ", x_in.sym_size(1), "], got ",
                  rows_in->sym_sizes());
      check_device(op, {"x", x_in}, {{"rows", *rows_in}});
    }
    auto grad_rows = at::empty_symint({pairs, x_in.sym_size(1)}, x_in.options().dtype(t));
    // The weights' gradient in the kernels' dtype, returned in the weights' own.
    auto grad_weights = rows_in ? at::empty_symint(weights.sym_sizes(), weights.options())
                                : at::empty({0}, x_in.options().dtype(weights_in ? weights_in->scalar_type() : t));
    const auto returned = [&] { return rows_in ? grad_weights.to(weights_in->scalar_type()) : grad_weights; };
    if (x_in.is_meta()) return {grad_rows, returned()};
    if (pairs == 0 || x_in.size(1) == 0) {  // sums over nothing
      grad_weights.zero_();
      return {grad_rows, returned()};
    }
    // The kernels read x in the promoted dtype (a [tokens, dim] copy where it differs).
    const auto grad = x_in.to(grad_dtype).contiguous(), order = order_in.contiguous();
    if (weights.defined()) weights = weights.contiguous();
    const auto rows = rows_in ? rows_in->contiguous() : at::Tensor();
    launch(grad, ExpertCombineBackward{.grad = grad.data_ptr(), .order = order.data_ptr<int64_t>(),
                                       .weights = weights.defined() ? weights.data_ptr() : nullptr,
                                       .rows = rows.defined() ? rows.data_ptr() : nullptr,
                                       .grad_rows = grad_rows.data_ptr(),
                                       .grad_weights = rows.defined() ? grad_weights.data_ptr() : nullptr,
                                       .tokens = grad.size(0), .k = order.size(0) / grad.size(0), .dim = grad.size(1),
                                       .dtype = dt, .weights_dtype = wt});
    return {grad_rows, returned()};
  }
};

using Optional = std::optional<at::Tensor>;

// The pairs' bias and experts (contiguous, kept alive by the caller), checked against the rows and position:
// undefined without them.
std::pair<at::Tensor, at::Tensor> pair_bias(const char* op, const at::Tensor& rows, const at::Tensor& position,
                                            const Optional& bias, const Optional& expert) {
  if (!check_bias(op, {"rows", rows}, bias, expert)) return {};
  TORCH_CHECK(bias->dim() == 2 && bias->sym_size(1) == rows.sym_size(1), "bastile.", op, ": bias must be [experts, ",
              rows.sym_size(1), "] (the rows' dim), got ", bias->sym_sizes());
  TORCH_CHECK(expert->sym_sizes() == position.sym_sizes(), "bastile.", op,
              ": expert must be [tokens, k] as position, each pair's expert, got shape ", expert->sym_sizes(),
              " for position's ", position.sym_sizes());
  return {bias->contiguous(), expert->contiguous()};
}

struct ExpertCombineOp {
  static constexpr const char* schema =
      "expert_combine(Tensor rows, Tensor position, Tensor? weights=None, Tensor? bias=None, Tensor? expert=None) "
      "-> Tensor";

  static at::Tensor kernel(const at::Tensor& rows_in, const at::Tensor& position_in, const Optional& weights_in,
                           const Optional& bias_in, const Optional& expert_in) {
    constexpr const char* op = "expert_combine";
    const auto dt = dtype_code(op, {"rows", rows_in});
    check_index(op, {"position", position_in});
    TORCH_CHECK(rows_in.dim() == 2, "bastile.", op, ": rows must be [tokens * k, dim], got shape ", rows_in.sym_sizes());
    TORCH_CHECK(position_in.dim() == 2 && position_in.sym_numel() == rows_in.sym_size(0), "bastile.", op,
                ": position must be [tokens, k] with tokens * k = rows' ", rows_in.sym_size(0), ", got ",
                position_in.sym_sizes());
    check_device(op, {"rows", rows_in}, {{"position", position_in}});
    const auto [bias, expert] = pair_bias(op, rows_in, position_in, bias_in, expert_in);
    at::Tensor weights;
    BastileDType wt = dt;
    if (weights_in) {
      check_device(op, {"rows", rows_in}, {{"weights", *weights_in}});
      std::tie(weights, wt) =
          kernel_weights(op, *weights_in, position_in.sym_size(0), position_in.sym_numel(), rows_in.scalar_type());
    }
    const auto& tokens = position_in.sym_size(0);
    auto out = at::empty_symint({tokens, rows_in.sym_size(1)},
                                rows_in.options().dtype(weights.defined() ? weights.scalar_type() : rows_in.scalar_type()));
    if (rows_in.is_meta() || out.numel() == 0) return out;
    if (position_in.size(1) == 0) return out.zero_();
    const auto rows = rows_in.contiguous(), position = position_in.contiguous();
    if (weights.defined()) weights = weights.contiguous();
    launch(rows, ExpertCombineForward{.rows = rows.data_ptr(), .position = position.data_ptr<int64_t>(),
                                      .weights = weights.defined() ? weights.data_ptr() : nullptr,
                                      .out = out.data_ptr(),
                                      .bias = bias.defined() ? bias.data_ptr() : nullptr,
                                      .expert = bias.defined() ? expert.data_ptr<int64_t>() : nullptr,
                                      .experts = bias.defined() ? bias.size(0) : 0,
                                      .tokens = position.size(0), .k = position.size(1),
                                      .dim = rows.size(1), .dtype = dt, .weights_dtype = wt});
    return out;
  }

  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& rows, const at::Tensor& position,
                            const Optional& weights, const Optional& bias, const Optional& expert) {
    const bool weights_grad = weights && weights->requires_grad();
    ctx->save_for_backward({position, weights.value_or(at::Tensor()), weights_grad ? rows : at::Tensor(),
                            bias.value_or(at::Tensor()), expert.value_or(at::Tensor())});
    ctx->saved_data["dtype"] = rows.scalar_type();
    ctx->saved_data["bias_grad"] = bias && bias->requires_grad();
    return call<ExpertCombineOp>(rows, position, weights, bias, expert);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const auto &position = s[0], &bias = s[3], &expert = s[4];
    const auto flat = position.reshape(-1);
    const auto order = at::full_like(flat, -1).scatter_(0, flat, at::arange(c10::Scalar(flat.sym_numel()), flat.options()));
    const auto opt = [](const at::Tensor& t) { return t.defined() ? std::optional(t) : std::nullopt; };
    // each row's expert, for the weights' gradient, which reads the rows as the forward summed them (with their
    // bias), and the bias's: each expert's rows' gradients (the weighted products, rounded to the rows' dtype) summed
    const auto row_expert = bias.defined() ? expert.reshape(-1).index_select(0, order) : at::Tensor();
    const auto rows = s[2].defined() && bias.defined() ? s[2] + bias.index_select(0, row_expert) : s[2];
    auto [grad_rows, grad_weights] = call<ExpertDispatchOp>(
        grads[0], order, opt(s[1]), opt(rows), ctx->saved_data["dtype"].toScalarType());
    const auto grad_bias = ctx->saved_data["bias_grad"].toBool()
                               ? sum_by_expert(grad_rows, row_expert, bias.sym_size(0)).to(bias.scalar_type())
                               : at::Tensor();
    return {grad_rows, at::Tensor(), s[2].defined() ? grad_weights : at::Tensor(), grad_bias, at::Tensor()};
  }

};

}  // namespace
}  // namespace bastile

BASTILE_OPS(bastile::ExpertCombineOp, bastile::ExpertDispatchOp, bastile::ExpertGroupOp)
