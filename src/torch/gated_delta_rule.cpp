// torch.ops.bastile.gated_delta_rule: the gated delta rule of Qwen3.5's Gated DeltaNet (include/gated_delta_rule.h),
// differentiable in q, k, v, g, beta and the initial state.
//
// q, k: [batch, T, k_heads, K], v: [batch, T, v_heads, V] (any strides with a unit last one; others cost a
// copy), g, beta: [batch, T, v_heads] (any float dtype), initial_state: [N, v_heads, K, V] or None for zeros,
// cu_seqlens: None (N = batch sequences, one a row) or int32/int64 [N + 1] with batch 1 (packed sequences).
// Returns o [batch, T, v_heads, V] in v's dtype and the final state [N, v_heads, K, V] in f32 (f64 for f64
// input). gated_delta_rule_forward also returns what the backward reads (include/gated_delta_rule.h): each
// chunk's starting state and v', in q's dtype; autograd saves them with the inputs. Autocast leaves the op
// alone, as HF runs its delta rule in f32 from whatever dtype it is given.
#include "op.h"

namespace bastile {
namespace {

constexpr const char* kOp = "gated_delta_rule";

using Optional = std::optional<at::Tensor>;

c10::SymInt sequences(const at::Tensor& q, const Optional& cu) { return cu ? cu->sym_size(0) - 1 : q.sym_size(0); }

std::vector<c10::SymInt> state_shape(const at::Tensor& q, const at::Tensor& v, const Optional& cu) {
  return {sequences(q, cu), v.sym_size(2), q.sym_size(3), v.sym_size(3)};
}

// The saved states' shape (rows = K) or v''s (rows = GDR_CHUNK): [slots, v_heads, slices of V, rows, GDR_V_SLICE].
std::vector<c10::SymInt> saved_shape(const at::Tensor& q, const at::Tensor& v, const Optional& cu, c10::SymInt rows) {
  const auto& tokens = q.sym_size(1);
  const auto slots = cu ? tokens / GDR_CHUNK + sequences(q, cu) : q.sym_size(0) * ((tokens + GDR_CHUNK - 1) / GDR_CHUNK);
  return {slots, v.sym_size(2), (v.sym_size(3) + GDR_V_SLICE - 1) / GDR_V_SLICE, std::move(rows), GDR_V_SLICE};
}

void check(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
           const at::Tensor& beta, const Optional& initial, const Optional& cu) {
  check_float(op, {{"q", q}, {"k", k}, {"v", v}, {"g", g}, {"beta", beta}});
  check_same_dtype(op, {"q", q}, {"k", k});
  check_same_dtype(op, {"q", q}, {"v", v});
  TORCH_CHECK(q.dim() == 4 && v.dim() == 4, "bastile.", op,
              ": q, k and v must be [batch, tokens, heads, head_dim], got q ", q.sym_sizes(), " and v ", v.sym_sizes());
  check_same_shape(op, {"q", q}, {"k", k});
  TORCH_CHECK(v.sym_size(0) == q.sym_size(0) && v.sym_size(1) == q.sym_size(1), "bastile.", op, ": v ", v.sym_sizes(),
              " and q ", q.sym_sizes(), " must agree in batch and tokens");
  const auto &hk = q.sym_size(2), &hv = v.sym_size(2);
  TORCH_CHECK(hk == 0 ? hv == 0 : hv % hk == 0, "bastile.", op, ": v's ", hv,
              " heads must be a multiple of q and k's ", hk, " heads");
  const std::vector<c10::SymInt> per_head{v.sym_size(0), v.sym_size(1), hv};
  TORCH_CHECK(g.sym_sizes() == c10::SymIntArrayRef(per_head) && beta.sym_sizes() == c10::SymIntArrayRef(per_head),
              "bastile.", op, ": g and beta must be [batch, tokens, v_heads] = ", c10::SymIntArrayRef(per_head),
              ", got ", g.sym_sizes(), " and ", beta.sym_sizes());
  if (cu) {
    TORCH_CHECK(cu->dim() == 1 && cu->sym_size(0) >= 1 &&
                    (cu->scalar_type() == at::kInt || cu->scalar_type() == at::kLong),
                "bastile.", op, ": cu_seqlens must be a 1-d int32 or int64 tensor of N + 1 offsets, got ",
                cu->scalar_type(), " ", cu->sym_sizes());
    TORCH_CHECK(q.sym_size(0) == 1, "bastile.", op, ": cu_seqlens packs sequences into one row, so batch must be 1, got ",
                q.sym_size(0));
    check_device(op, {"q", q}, {{"cu_seqlens", *cu}});
  }
  if (initial) {
    check_float(op, {{"initial_state", *initial}});
    const auto want = state_shape(q, v, cu);
    TORCH_CHECK(initial->sym_sizes() == c10::SymIntArrayRef(want), "bastile.", op,
                ": initial_state must be [sequences, v_heads, K, V] = ", c10::SymIntArrayRef(want), ", got ",
                initial->sym_sizes());
    check_device(op, {"q", q}, {{"initial_state", *initial}});
  }
  check_device(op, {"q", q}, {{"k", k}, {"v", v}, {"g", g}, {"beta", beta}});
}

TokenStrides strides(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

// What the kernels read: q, k, v with unit last stride, the rest contiguous in the state's dtype (cu_seqlens int64).
struct Inputs {
  at::Tensor q, k, v, g, beta, initial, cu;
  DeltaShape shape;

  Inputs(const char* op, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& g_in,
         const at::Tensor& beta_in, double scale, const Optional& initial_in, const Optional& cu_in, bool l2norm)
      : q(unit_last(q_in)), k(unit_last(k_in)), v(unit_last(v_in)) {
    const auto state = stats_dtype(q);
    g = g_in.to(state).contiguous();
    beta = beta_in.to(state).contiguous();
    if (initial_in) initial = initial_in->to(state).contiguous();
    if (cu_in) cu = cu_in->to(at::kLong).contiguous();
    shape = {.batch = q.size(0), .tokens = q.size(1), .sequences = cu_in ? cu_in->size(0) - 1 : q.size(0),
             .k_heads = q.size(2), .v_heads = v.size(2), .k_dim = q.size(3), .v_dim = v.size(3), .scale = scale,
             .l2norm_qk = l2norm, .dtype = dtype_code(op, {"q", q}), .state_dtype = dtype_code(op, {"g", g})};
  }

  const void* initial_ptr() const { return initial.defined() ? initial.data_ptr() : nullptr; }
  const int64_t* cu_ptr() const { return cu.defined() ? cu.data_ptr<int64_t>() : nullptr; }
  // Nothing to run: no token of any head (the final state is the initial one).
  bool empty() const { return q.numel() == 0 || v.numel() == 0; }
  at::Tensor initial_or_zeros(at::TensorOptions o, c10::SymIntArrayRef shape) const {
    return initial.defined() ? initial.clone() : at::zeros_symint(shape, o);
  }
};

using Pair = std::tuple<at::Tensor, at::Tensor>;
using Six = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

struct GatedDeltaRuleBackwardOp {
  static constexpr const char* schema =
      "gated_delta_rule_backward(Tensor grad_o, Tensor? grad_final_state, Tensor q, Tensor k, Tensor v, Tensor g, "
      "Tensor beta, Tensor states, Tensor v_new, float scale, Tensor? initial_state=None, Tensor? cu_seqlens=None, "
      "bool l2norm_qk=False) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)";

  static Six kernel(const at::Tensor& grad_o_in, const Optional& grad_final_in, const at::Tensor& q_in,
                    const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& g_in, const at::Tensor& beta_in,
                    const at::Tensor& states_in, const at::Tensor& v_new_in, double scale, const Optional& initial_in,
                    const Optional& cu_in, bool l2norm) {
    constexpr const char* op = "gated_delta_rule_backward";
    check(op, q_in, k_in, v_in, g_in, beta_in, initial_in, cu_in);
    check_same_shape(op, {"grad_o", grad_o_in}, {"v", v_in});
    check_same_dtype(op, {"grad_o", grad_o_in}, {"v", v_in});
    const auto saved_states = saved_shape(q_in, v_in, cu_in, q_in.sym_size(3));
    const auto saved_v = saved_shape(q_in, v_in, cu_in, GDR_CHUNK);
    TORCH_CHECK(states_in.sym_sizes() == c10::SymIntArrayRef(saved_states) &&
                    v_new_in.sym_sizes() == c10::SymIntArrayRef(saved_v) &&
                    states_in.scalar_type() == q_in.scalar_type() && v_new_in.scalar_type() == q_in.scalar_type(),
                "bastile.", op, ": states and v_new must be what gated_delta_rule_forward returned: ",
                c10::SymIntArrayRef(saved_states), " and ", c10::SymIntArrayRef(saved_v), " in ", q_in.scalar_type(),
                ", got ", states_in.sym_sizes(), " and ", v_new_in.sym_sizes(), " in ", states_in.scalar_type());
    check_device(op, {"q", q_in}, {{"states", states_in}, {"v_new", v_new_in}});
    const auto state = state_shape(q_in, v_in, cu_in);
    const auto state_options = q_in.options().dtype(stats_dtype(q_in));
    if (grad_final_in) {
      check_float(op, {{"grad_final_state", *grad_final_in}});
      TORCH_CHECK(grad_final_in->sym_sizes() == c10::SymIntArrayRef(state), "bastile.", op,
                  ": grad_final_state must have the final state's shape ", c10::SymIntArrayRef(state), ", got ",
                  grad_final_in->sym_sizes());
    }
    check_device(op, {"q", q_in}, {{"grad_o", grad_o_in}});
    auto dq = at::empty_symint(q_in.sym_sizes(), q_in.options()), dk = at::empty_symint(k_in.sym_sizes(), k_in.options());
    auto dv = at::empty_symint(v_in.sym_sizes(), v_in.options());
    auto dg = at::empty_symint(g_in.sym_sizes(), state_options), dbeta = at::empty_symint(beta_in.sym_sizes(), state_options);
    auto dinitial = at::empty_symint(state, state_options);
    const auto as_given = [&]() -> Six {
      return {dq, dk, dv, dg.to(g_in.scalar_type()), dbeta.to(beta_in.scalar_type()),
              initial_in ? dinitial.to(initial_in->scalar_type()) : dinitial};
    };
    if (q_in.is_meta()) return as_given();
    const Inputs x(op, q_in, k_in, v_in, g_in, beta_in, scale, initial_in, cu_in, l2norm);
    at::Tensor grad_final;
    if (grad_final_in) grad_final = grad_final_in->to(stats_dtype(q_in)).contiguous();
    if (x.empty()) {
      for (auto* t : {&dq, &dk, &dv, &dg, &dbeta}) t->zero_();
      dinitial = grad_final.defined() ? grad_final.clone() : dinitial.zero_();
      return as_given();
    }
    const auto grad_o = grad_o_in.contiguous(), states = states_in.contiguous(), v_new = v_new_in.contiguous();
    launch(x.q, GatedDeltaRuleBackward{
                    .grad_o = grad_o.data_ptr(), .grad_final_state = grad_final.defined() ? grad_final.data_ptr() : nullptr,
                    .q = x.q.data_ptr(), .k = x.k.data_ptr(), .v = x.v.data_ptr(), .g = x.g.data_ptr(),
                    .beta = x.beta.data_ptr(), .initial_state = x.initial_ptr(), .cu_seqlens = x.cu_ptr(),
                    .grad_q = dq.data_ptr(), .grad_k = dk.data_ptr(), .grad_v = dv.data_ptr(), .grad_g = dg.data_ptr(),
                    .grad_beta = dbeta.data_ptr(), .grad_initial_state = dinitial.data_ptr(),
                    .states = states.data_ptr(), .v_new = v_new.data_ptr(), .q_st = strides(x.q),
                    .k_st = strides(x.k), .v_st = strides(x.v), .shape = x.shape});
    return as_given();
  }
};

using Four = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// o and the final state, and with `save` the states and v' the backward reads (else empty).
Four run_forward(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& g_in,
                 const at::Tensor& beta_in, double scale, const Optional& initial_in, const Optional& cu_in, bool l2norm,
                 bool save) {
  check(kOp, q_in, k_in, v_in, g_in, beta_in, initial_in, cu_in);
  const auto shape = state_shape(q_in, v_in, cu_in);
  auto o = at::empty_symint(v_in.sym_sizes(), v_in.options());
  const auto state_options = q_in.options().dtype(stats_dtype(q_in));
  // The CUDA kernels write every chunk's saved tiles whole, the CPU kernel their rows and columns within the
  // sequences and V; packed sequences leave slots without a chunk.
  const auto saved = [&](c10::SymInt rows) {
    const auto shape = save ? saved_shape(q_in, v_in, cu_in, std::move(rows)) : std::vector<c10::SymInt>{0};
    const bool whole = q_in.is_cuda() && !cu_in;
    return whole ? at::empty_symint(shape, q_in.options()) : at::zeros_symint(shape, q_in.options());
  };
  auto states = saved(q_in.sym_size(3)), v_new = saved(GDR_CHUNK);
  if (q_in.is_meta()) return {o, at::empty_symint(shape, state_options), states, v_new};
  const Inputs x(kOp, q_in, k_in, v_in, g_in, beta_in, scale, initial_in, cu_in, l2norm);
  if (x.empty()) return {o, x.initial_or_zeros(state_options, shape), states.zero_(), v_new.zero_()};
  auto final_state = at::empty_symint(shape, state_options);
  launch(x.q, GatedDeltaRuleForward{.q = x.q.data_ptr(), .k = x.k.data_ptr(), .v = x.v.data_ptr(),
                                    .g = x.g.data_ptr(), .beta = x.beta.data_ptr(), .initial_state = x.initial_ptr(),
                                    .cu_seqlens = x.cu_ptr(), .o = o.data_ptr(), .final_state = final_state.data_ptr(),
                                    .states = save ? states.data_ptr() : nullptr,
                                    .v_new = save ? v_new.data_ptr() : nullptr, .q_st = strides(x.q),
                                    .k_st = strides(x.k), .v_st = strides(x.v), .shape = x.shape});
  return {o, final_state, states, v_new};
}

struct GatedDeltaRuleForwardOp {
  static constexpr const char* schema =
      "gated_delta_rule_forward(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, "
      "Tensor? initial_state=None, Tensor? cu_seqlens=None, bool l2norm_qk=False) -> (Tensor, Tensor, Tensor, Tensor)";

  static Four kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                     const at::Tensor& beta, double scale, const Optional& initial, const Optional& cu, bool l2norm) {
    return run_forward(q, k, v, g, beta, scale, initial, cu, l2norm, true);
  }
};

struct GatedDeltaRuleOp {
  static constexpr const char* schema =
      "gated_delta_rule(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, Tensor? initial_state=None, "
      "Tensor? cu_seqlens=None, bool l2norm_qk=False) -> (Tensor, Tensor)";
  static constexpr size_t no_grad[] = {7};  // cu_seqlens

  static Pair kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                     const at::Tensor& beta, double scale, const Optional& initial, const Optional& cu, bool l2norm) {
    auto [o, final_state, states, v_new] = run_forward(q, k, v, g, beta, scale, initial, cu, l2norm, false);
    return {o, final_state};
  }

  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& g, const at::Tensor& beta, double scale, const Optional& initial,
                               const Optional& cu, bool l2norm) {
    auto [o, final_state, states, v_new] = call<GatedDeltaRuleForwardOp>(q, k, v, g, beta, scale, initial, cu, l2norm);
    ctx->save_for_backward(
        {q, k, v, g, beta, initial.value_or(at::Tensor()), cu.value_or(at::Tensor()), states, v_new});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["l2norm_qk"] = l2norm;
    return {o, final_state};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const auto optional = [](const at::Tensor& t) { return t.defined() ? Optional(t) : std::nullopt; };
    auto [dq, dk, dv, dg, dbeta, dinitial] = call<GatedDeltaRuleBackwardOp>(
        grads[0].defined() ? grads[0] : at::zeros_like(s[2]), optional(grads[1]), s[0], s[1], s[2], s[3], s[4], s[7],
        s[8], ctx->saved_data["scale"].toDouble(), optional(s[5]), optional(s[6]), ctx->saved_data["l2norm_qk"].toBool());
    return {dq, dk, dv, dg, dbeta, at::Tensor(), s[5].defined() ? dinitial : at::Tensor()};
  }
};

}  // namespace
}  // namespace bastile

BASTILE_OPS(bastile::GatedDeltaRuleOp, bastile::GatedDeltaRuleForwardOp, bastile::GatedDeltaRuleBackwardOp)
