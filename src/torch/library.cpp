// The `bastile` operator namespace; each op adds its schemas with TORCH_LIBRARY_FRAGMENT.
#include <c10/cuda/CUDAStream.h>

#include "bastile/src/ffi.rs.h"
#include "common.h"

namespace bastile {

BastileDType dtype_code(const at::Tensor& t, const char* op, const char* arg) {
  switch (t.scalar_type()) {
    case at::kFloat: return BASTILE_F32;
    case at::kHalf: return BASTILE_F16;
    case at::kBFloat16: return BASTILE_BF16;
    case at::kDouble: return BASTILE_F64;
    default:
      TORCH_CHECK(false, "bastile.", op, ": ", arg,
                  " must be float32, float16, bfloat16 (or float64 on CPU), got ", t.scalar_type());
  }
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
    bastile::call_rust([&] { bastile::rs::warmup(static_cast<int32_t>(device)); });
  });
  // Drops the cached kernel handles and occupancy figures launch geometries are derived from.
  m.def("clear_kernel_cache() -> ()", [] { bastile::rs::clear_kernel_cache(); });
}
