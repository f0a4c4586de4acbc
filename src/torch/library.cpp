// The `bastile` operator namespace and its library-wide ops. Each op's spec (src/torch/<op>.cpp) registers
// itself with BASTILE_OPS (op.h).
#include "op.h"

TORCH_LIBRARY(bastile, m) {
  // The torch version the library was built against.
  m.def("torch_version() -> str", [] { return std::string(bastile::rs::torch_version()); });
  // Loads every kernel module on a CUDA device ahead of the first launch.
  m.def("warmup(int device) -> ()", [](int64_t device) {
    bastile::rust([&] { bastile::rs::warmup(static_cast<int32_t>(device)); });
  });
  // Drops the cached kernel handles and occupancy figures launch geometries are derived from.
  m.def("clear_kernel_cache() -> ()", [] { bastile::rs::clear_kernel_cache(); });
}
