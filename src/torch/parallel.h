// The thread pool of the CPU kernels: torch's intra-op pool. Running them there makes them use the threads
// torch.set_num_threads gives torch (one thread: the caller's alone) and run in a fork()ed child as torch's
// own ops do. src/cpu.rs calls this through the cxx bridge (src/ffi.rs).
#pragma once
#include <ATen/Parallel.h>

#include <cstddef>
#include <cstdint>

#include "rust/cxx.h"

namespace bastile::rs {

// Calls body(context, begin, end) on ranges covering [0, n), each of at least `grain` indices but the last.
inline void parallel_for(int64_t n, int64_t grain, rust::Fn<void(size_t, int64_t, int64_t)> body, size_t context) {
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) { body(context, begin, end); });
}

}  // namespace bastile::rs
