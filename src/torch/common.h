// What every op's registration block shares: dtype codes, the call into Rust, torch's stream, device dispatch.
#pragma once
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include "bastile.h"
#include "rust/cxx.h"

namespace bastile {

// The dtype code of a floating-point tensor; any other dtype is an error naming op and argument.
BastileDType dtype_code(const at::Tensor& t, const char* op, const char* arg);

// Calls into Rust; a Rust error (already worded for the user) becomes a c10::Error, which Python
// sees as RuntimeError.
template <class F>
auto call_rust(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const rust::Error& e) {
    TORCH_CHECK(false, e.what());
  }
}

// torch's current stream on t's device, as a driver-API handle.
size_t current_stream(const at::Tensor& t);

// Runs cuda(device, stream) for tensors on t's CUDA device (made current), cpu() for CPU tensors.
template <class Cuda, class Cpu>
void on_device(const at::Tensor& t, const char* op, Cuda cuda, Cpu cpu) {
  if (t.is_cuda()) {
    const c10::DeviceGuard guard(t.device());
    call_rust([&] { cuda(t.device().index(), current_stream(t)); });
  } else {
    TORCH_CHECK(t.is_cpu(), "bastile.", op, ": unsupported device ", t.device());
    call_rust(cpu);
  }
}

}  // namespace bastile
