// The `bastile` operator namespace: the library-wide ops, and the checks every op's kernel shares. Each
// op's spec (src/torch/<op>.cpp) registers itself with BASTILE_OPS (op.h).
#include <c10/cuda/CUDAStream.h>

#include "op.h"

namespace bastile {

BastileDType dtype_code(const char* op, Named arg) {
  switch (arg.t.scalar_type()) {
    case at::kFloat: return BASTILE_F32;
    case at::kHalf: return BASTILE_F16;
    case at::kBFloat16: return BASTILE_BF16;
    case at::kDouble: return BASTILE_F64;
    default:
      TORCH_CHECK(false, "bastile.", op, ": ", arg.name,
                  " must be float32, float16, bfloat16 (or float64 on CPU), got ", arg.t.scalar_type());
  }
}

void check_float(const char* op, std::initializer_list<Named> args) {
  for (const auto& a : args) dtype_code(op, a);
}

void check_device(const char* op, Named first, std::initializer_list<Named> rest) {
  for (const auto& r : rest)
    TORCH_CHECK(r.t.device() == first.t.device(), "bastile.", op, ": ", first.name, " is on ", first.t.device(),
                " but ", r.name, " is on ", r.t.device());
}

void check_same_dtype(const char* op, Named a, Named b) {
  TORCH_CHECK(a.t.scalar_type() == b.t.scalar_type(), "bastile.", op, ": ", a.name, " and ", b.name,
              " must have the same dtype, got ", a.t.scalar_type(), " and ", b.t.scalar_type());
}

void check_same_shape(const char* op, Named a, Named b) {
  TORCH_CHECK(a.t.sym_sizes() == b.t.sym_sizes(), "bastile.", op, ": ", a.name, " and ", b.name,
              " must have the same shape, got ", a.t.sym_sizes(), " and ", b.t.sym_sizes());
}

void check_tables(const char* op, const at::Tensor& cos, const at::Tensor& sin, const c10::SymInt& batch,
                  const c10::SymInt& seq, const c10::SymInt& dim) {
  check_same_dtype(op, {"cos", cos}, {"sin", sin});
  check_same_shape(op, {"cos", cos}, {"sin", sin});
  TORCH_CHECK((cos.dim() == 2 || cos.dim() == 3) && cos.sym_size(-1) == dim && cos.sym_size(-2) == seq &&
                  (cos.dim() == 2 || cos.sym_size(0) == 1 || cos.sym_size(0) == batch),
              "bastile.", op, ": cos and sin must have shape [seq, head_dim], [1, seq, head_dim] or [batch, seq, ",
              "head_dim] with batch, seq, head_dim = ", batch, ", ", seq, ", ", dim, ", got ", cos.sym_sizes());
}

at::ScalarType stats_dtype(const at::Tensor& x) { return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

void refuse_table_grad(const char* op, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(!cos.requires_grad() && !sin.requires_grad(), "bastile.", op, ": cos and sin require grad, but ", op,
              " does not differentiate them (HF computes them under torch.no_grad()); pass cos.detach() and "
              "sin.detach()");
}

size_t current_stream(const at::Tensor& t) {
  return reinterpret_cast<size_t>(c10::cuda::getCurrentCUDAStream(t.device().index()).stream());
}

}  // namespace bastile

TORCH_LIBRARY(bastile, m) {
  // The torch version the library was built against; the Python shim compares it with the running one.
  m.def("torch_version() -> str", [] { return std::string(bastile::rs::torch_version()); });
  // Loads every kernel module on a CUDA device ahead of the first launch.
  m.def("warmup(int device) -> ()", [](int64_t device) {
    bastile::rust([&] { bastile::rs::warmup(static_cast<int32_t>(device)); });
  });
  // Drops the cached kernel handles and occupancy figures launch geometries are derived from.
  m.def("clear_kernel_cache() -> ()", [] { bastile::rs::clear_kernel_cache(); });
}
