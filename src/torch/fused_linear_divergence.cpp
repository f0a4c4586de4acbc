// torch.ops.bastile.fused_linear_divergence: the summed divergence between a student's and a teacher's next-token
// distributions (include/fused_linear_divergence.h: forward KL, reverse KL or TRL's generalized JSD by beta) and
// the student's summed entropy, from both models' hidden states and heads, without either [rows, vocab] logits.
// Rows go in chunks, and chunks in groups (Rust's DivergencePlan); per chunk, cuBLAS makes both logits in f32 (as
// TRL's function projects them) and our kernel turns them into the rows' divergences, entropies and dD/d(student
// logits) in the student's dtype; per group, two more GEMMs fold those gradient rows into the student's hidden and
// weight gradients (fused_head.h's helpers). The forward forms the gradients for a unit upstream gradient; the
// backward scales them (fused_head.h: scale_formed). The teacher gets no gradient, as in TRL.
#include "fused_head.h"

#include <c10/util/accumulate.h>

#include <cmath>

namespace bastile {
namespace {

using namespace head;
constexpr const char* kOp = "fused_linear_divergence";

struct Settings {
  double beta, temperature, student_scale, student_softcap, teacher_scale, teacher_softcap;
  bool fp32_weight_grad;
  int64_t chunk_bytes;
};

void check(const Settings& o) {
  TORCH_CHECK(o.beta >= 0 && o.beta <= 1, "bastile.fused_linear_divergence: beta must be in [0, 1], got ", o.beta);
  TORCH_CHECK(std::isfinite(o.temperature) && o.temperature > 0,
              "bastile.fused_linear_divergence: temperature must be > 0, got ", o.temperature);
  for (const auto& [name, v] : {std::pair{"student_scale", o.student_scale}, {"teacher_scale", o.teacher_scale}})
    TORCH_CHECK(std::isfinite(v), "bastile.fused_linear_divergence: ", name, " must be finite, got ", v);
  for (const auto& [name, v] : {std::pair{"student_softcap", o.student_softcap}, {"teacher_softcap", o.teacher_softcap}})
    TORCH_CHECK(std::isfinite(v) && v >= 0, "bastile.fused_linear_divergence: ", name, " must be >= 0 (0 = off), got ", v);
  TORCH_CHECK(o.chunk_bytes >= 0, "bastile.fused_linear_divergence: chunk_bytes must be >= 0 (0 = automatic), got ",
              o.chunk_bytes);
}

// hidden [..., width] and its head: weight [vocab, width], bias [vocab].
void check_side(const char* side, const at::Tensor& hidden, const at::Tensor& weight,
                const std::optional<at::Tensor>& bias) {
  const std::string h = std::string(side) + "_hidden", w = std::string(side) + "_weight", b = std::string(side) + "_bias";
  check_float(kOp, {{h.c_str(), hidden}, {w.c_str(), weight}});
  TORCH_CHECK(hidden.dim() >= 1, "bastile.fused_linear_divergence: ", h, " must have at least one dimension");
  TORCH_CHECK(weight.dim() == 2 && weight.sym_size(1) == hidden.sym_size(-1), "bastile.fused_linear_divergence: ", w,
              " must have shape [vocab, ", hidden.sym_size(-1), "] (", h, "'s last dimension), got ", weight.sym_sizes());
  check_device(kOp, {h.c_str(), hidden}, {{w.c_str(), weight}});
  if (has(bias)) {
    check_float(kOp, {{b.c_str(), *bias}});
    TORCH_CHECK(bias->dim() == 1 && bias->sym_size(0) == weight.sym_size(0), "bastile.fused_linear_divergence: ", b,
                " must have shape [", weight.sym_size(0), "], got ", bias->sym_sizes());
    check_device(kOp, {h.c_str(), hidden}, {{b.c_str(), *bias}});
  }
}

void check_inputs(const at::Tensor& sh, const at::Tensor& sw, const at::Tensor& th, const at::Tensor& tw,
                  const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& sb,
                  const std::optional<at::Tensor>& tb) {
  check_side("student", sh, sw, sb);
  check_side("teacher", th, tw, tb);
  const auto lead = sh.sym_sizes().slice(0, sh.dim() - 1);
  TORCH_CHECK(th.sym_sizes().slice(0, th.dim() - 1) == lead, "bastile.fused_linear_divergence: teacher_hidden must ",
              "have student_hidden's shape but its last dimension, ", lead, ", got ", th.sym_sizes());
  TORCH_CHECK(tw.sym_size(0) == sw.sym_size(0), "bastile.fused_linear_divergence: the heads' vocabularies differ: ",
              "student_weight has ", sw.sym_size(0), " rows, teacher_weight ", tw.sym_size(0));
  TORCH_CHECK(sw.sym_size(0) > 0, "bastile.fused_linear_divergence: the heads must have at least one row");
  check_device(kOp, {"student_hidden", sh}, {{"teacher_hidden", th}});
  if (has(mask)) {
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->sym_sizes() == lead, "bastile.fused_linear_divergence: ",
                "mask must be bool with shape ", lead, ", got ", mask->scalar_type(), " of shape ", mask->sym_sizes());
    check_device(kOp, {"student_hidden", sh}, {{"mask", *mask}});
  }
}

struct Result {
  at::Tensor divergence, entropy, grad_hidden, grad_weight, grad_bias;
};

// out = hidden @ weight.T + bias in out's dtype.
void project(at::Tensor& out, const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& bias) {
  add_product(out, hidden, weight.t(), true);
  if (bias.defined()) out.add_(bias);
}

Result run(const at::Tensor& sh_in, const at::Tensor& sw_in, const at::Tensor& th_in, const at::Tensor& tw_in,
           const std::optional<at::Tensor>& mask_in, const std::optional<at::Tensor>& sb_in,
           const std::optional<at::Tensor>& tb_in, const Settings& o, Mask mask) {
  check(o);
  check_inputs(sh_in, sw_in, th_in, tw_in, mask_in, sb_in, tb_in);
  const bool with_bias = has(sb_in);
  const bool need_h = mask[0], need_w = mask[1], need_b = mask[2] && with_bias;
  const auto L = stats_dtype(sh_in);
  const auto none = [](const at::Tensor& like) { return at::empty({0}, like.options()); };
  const auto scalar = [&] { return at::empty({}, sh_in.options().dtype(L)); };
  if (sh_in.is_meta())
    return {scalar(), scalar(), need_h ? at::empty_symint(sh_in.sym_sizes(), sh_in.options()) : none(sh_in),
            need_w ? at::empty_symint(sw_in.sym_sizes(), sw_in.options()) : none(sw_in),
            need_b ? at::empty_symint(sb_in->sym_sizes(), sb_in->options()) : none(with_bias ? *sb_in : sh_in)};
  const c10::DeviceGuard guard(sh_in.device());
  // Rows counted by the leading dimensions: with width 0, the hidden's numel does not tell them.
  const int64_t width = sh_in.size(-1), vocab = sw_in.size(0);
  const int64_t n_rows = c10::multiply_integers(sh_in.sizes().slice(0, sh_in.dim() - 1));
  const auto sh = sh_in.reshape({n_rows, width}).contiguous(), th = th_in.reshape({n_rows, th_in.size(-1)}).contiguous();
  // Each projection in its hidden's dtype, as F.linear's; the bias added to the f32 logits.
  const auto sw = sw_in.to(sh.scalar_type()).contiguous(), tw = tw_in.to(th.scalar_type()).contiguous();
  const auto sb = with_bias ? sb_in->to(L) : at::Tensor(), tb = has(tb_in) ? tb_in->to(L) : at::Tensor();
  const auto rows_mask = has(mask_in) ? mask_in->reshape({n_rows}).contiguous() : at::Tensor();
  const bool grad = need_h || need_w || need_b;
  // The gradient is written over the student's logits when it has their dtype, else into its own buffer.
  const bool own_grad = grad && sh.scalar_type() != L;
  const auto plan = decide(DivergencePlan{.rows = n_rows, .vocab = vocab, .logit_bytes = 2 * vocab * int64_t(at::elementSize(L)),
                                          .grad_bytes = own_grad ? vocab * sh.element_size() : 0,
                                          .chunk_bytes = o.chunk_bytes});
  const int64_t step = plan.step, group = plan.group;
  auto s_buf = at::empty({std::min(step, n_rows), vocab}, sh.options().dtype(L)), t_buf = at::empty_like(s_buf);
  auto g_buf = own_grad ? at::empty({std::min(group, n_rows), vocab}, sh.options()) : s_buf;
  auto div_rows = at::empty({n_rows}, sh.options().dtype(L)), ent_rows = at::empty({n_rows}, sh.options().dtype(L));
  auto grad_hidden = need_h ? at::empty({n_rows, width}, sh.options()) : none(sh_in);
  auto acc_w = need_w ? at::empty({vocab, width}, sw.options().dtype(sum_dtype(sw_in.scalar_type(), o.fp32_weight_grad)))
                      : at::Tensor();
  auto acc_b = need_b ? at::empty({vocab}, sh.options().dtype(sum_dtype(sb_in->scalar_type(), o.fp32_weight_grad)))
                      : at::Tensor();
  for (int64_t first = 0; first < n_rows; first += group) {
    const int64_t rows = std::min(group, n_rows - first);
    for (int64_t start = first; start < first + rows; start += step) {
      const int64_t n = std::min(step, first + rows - start);
      auto s = s_buf.narrow(0, 0, n), t = t_buf.narrow(0, 0, n);
      project(s, sh.narrow(0, start, n), sw, sb);
      project(t, th.narrow(0, start, n), tw, tb);
      const auto g = own_grad ? g_buf.narrow(0, start - first, n) : s;
      launch(s, DivergenceChunk{.student = s.data_ptr(), .teacher = t.data_ptr(),
                                .mask = rows_mask.defined() ? static_cast<const uint8_t*>(rows_mask.data_ptr()) + start : nullptr,
                                .grad = grad ? g.data_ptr() : nullptr,
                                .divergence = div_rows.narrow(0, start, n).data_ptr(),
                                .entropy = ent_rows.narrow(0, start, n).data_ptr(), .rows = n, .vocab = vocab,
                                .ld = vocab, .beta = o.beta, .temperature = o.temperature,
                                .student_scale = o.student_scale, .student_softcap = o.student_softcap,
                                .teacher_scale = o.teacher_scale, .teacher_softcap = o.teacher_softcap,
                                .dtype = dtype_code(kOp, {"logits", s}), .grad_dtype = dtype_code(kOp, {"gradient", g})});
    }
    // A group is one chunk where the gradient is written over the student's logits (g_buf is s_buf).
    if (grad)
      fold_chunk(g_buf.narrow(0, 0, rows), sh.narrow(0, first, rows), sw,
                 need_h ? grad_hidden.narrow(0, first, rows) : at::Tensor(), acc_w, acc_b, first == 0);
  }
  s_buf = t_buf = g_buf = at::Tensor();  // freed before the weight gradient's cast below
  if (n_rows == 0) {
    if (need_w) acc_w.zero_();
    if (need_b) acc_b.zero_();
  }
  return {div_rows.sum(), ent_rows.sum(),
          need_h ? grad_hidden.view(sh_in.sizes()) : grad_hidden,
          need_w ? acc_w.to(sw_in.scalar_type()) : none(sw_in),
          need_b ? acc_b.to(sb_in->scalar_type()) : none(with_bias ? *sb_in : sh_in)};
}

using Five = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

struct FldForwardOp {
  static constexpr const char* schema =
      "fused_linear_divergence_forward(Tensor student_hidden, Tensor student_weight, Tensor teacher_hidden, "
      "Tensor teacher_weight, Tensor? mask=None, Tensor? student_bias=None, Tensor? teacher_bias=None, "
      "float beta=0.5, float temperature=1.0, float student_scale=1.0, float student_softcap=0.0, "
      "float teacher_scale=1.0, float teacher_softcap=0.0, bool fp32_weight_grad=True, int chunk_bytes=0, "
      "bool[3] grad_mask=[True, True, True]) -> "
      "(Tensor divergence, Tensor entropy, Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias)";

  // The sums, and the student's gradients grad_mask asks for (hidden, weight, bias) of the divergence's sum.
  static Five kernel(const at::Tensor& sh, const at::Tensor& sw, const at::Tensor& th, const at::Tensor& tw,
                     const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& sb,
                     const std::optional<at::Tensor>& tb, double beta, double temperature, double student_scale,
                     double student_softcap, double teacher_scale, double teacher_softcap, bool fp32_weight_grad,
                     int64_t chunk_bytes, Mask grad_mask) {
    const auto r = run(sh, sw, th, tw, mask, sb, tb,
                       {beta, temperature, student_scale, student_softcap, teacher_scale, teacher_softcap,
                        fp32_weight_grad, chunk_bytes},
                       grad_mask);
    return {r.divergence, r.entropy, r.grad_hidden, r.grad_weight, r.grad_bias};
  }
};

struct FldOp {
  static constexpr const char* schema =
      "fused_linear_divergence(Tensor student_hidden, Tensor student_weight, Tensor teacher_hidden, "
      "Tensor teacher_weight, Tensor? mask=None, Tensor? student_bias=None, Tensor? teacher_bias=None, "
      "float beta=0.5, float temperature=1.0, float student_scale=1.0, float student_softcap=0.0, "
      "float teacher_scale=1.0, float teacher_softcap=0.0, bool fp32_weight_grad=True, int chunk_bytes=0) -> "
      "(Tensor divergence, Tensor entropy)";

  static std::tuple<at::Tensor, at::Tensor> kernel(
      const at::Tensor& sh, const at::Tensor& sw, const at::Tensor& th, const at::Tensor& tw,
      const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& sb, const std::optional<at::Tensor>& tb,
      double beta, double temperature, double student_scale, double student_softcap, double teacher_scale,
      double teacher_softcap, bool fp32_weight_grad, int64_t chunk_bytes) {
    auto [d, e, gh, gw, gb] = call<FldForwardOp>(sh, sw, th, tw, mask, sb, tb, beta, temperature, student_scale,
                                                 student_softcap, teacher_scale, teacher_softcap, fp32_weight_grad,
                                                 chunk_bytes, Mask{false, false, false});
    return {d, e};
  }

  static variable_list forward(AutogradContext* ctx, const at::Tensor& sh, const at::Tensor& sw, const at::Tensor& th,
                               const at::Tensor& tw, const std::optional<at::Tensor>& mask,
                               const std::optional<at::Tensor>& sb, const std::optional<at::Tensor>& tb, double beta,
                               double temperature, double student_scale, double student_softcap, double teacher_scale,
                               double teacher_softcap, bool fp32_weight_grad, int64_t chunk_bytes) {
    const Mask m{sh.requires_grad(), sw.requires_grad(), has(sb) && sb->requires_grad()};
    save_mask(ctx, m);
    auto [d, e, gh, gw, gb] = call<FldForwardOp>(sh, sw, th, tw, mask, sb, tb, beta, temperature, student_scale,
                                                 student_softcap, teacher_scale, teacher_softcap, fp32_weight_grad,
                                                 chunk_bytes, m);
    ctx->save_for_backward({gh, gw, gb});
    ctx->mark_non_differentiable({e});
    return {d, e};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Mask m = saved_mask(ctx);
    auto saved = ctx->get_saved_variables();
    variable_list out(6);
    if (!grads[0].defined()) return out;
    const auto [gh, gw, gb] = scale_formed(saved, grads[0]);
    saved.clear();
    if (m[0]) out[0] = gh;
    if (m[1]) out[1] = gw;
    if (m[2]) out[5] = gb;
    return out;
  }

  // As F.linear under autocast: both hidden states in the autocast dtype; the heads keep theirs (the op casts
  // them for the GEMMs, and the student's gradients come back in its own dtypes).
  template <c10::DeviceType device>
  static std::tuple<at::Tensor, at::Tensor> autocast(const at::Tensor& sh, const at::Tensor& sw, const at::Tensor& th,
                                                     const auto&... rest) {
    const auto dt = at::autocast::get_autocast_dtype(device);
    return call<FldOp>(at::autocast::cached_cast(dt, sh, device), sw, at::autocast::cached_cast(dt, th, device), rest...);
  }
};

}  // namespace
}  // namespace bastile

BASTILE_OPS(bastile::FldOp, bastile::FldForwardOp)
