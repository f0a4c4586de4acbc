// What every op's registration block shares: dtype codes, the call into Rust, torch's stream.
#pragma once
#include <ATen/ATen.h>
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

}  // namespace bastile
