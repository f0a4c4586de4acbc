//! Bastile: fused CUDA kernels for LLM fine-tuning, registered as `torch.ops.bastile.*`.
//!
//! Layers, one file each per kernel family (`rms_norm`, ...):
//! `cuda/<op>.cu` (kernels) → `src/<op>.rs` (launch geometry, CUDA launch, CPU kernel) →
//! `src/torch/<op>.cpp` (schemas, dispatch keys, checks, autograd) → `python_shim/bastile`.
pub mod cpu;
pub mod driver;
pub mod elementwise;
mod ffi;
pub mod fused_linear_cross_entropy;
pub mod geglu;
pub mod geometry;
pub mod params;
pub mod qk_norm_rope;
pub mod rms_norm;
pub mod rope;
pub mod swiglu;
#[cfg(test)]
mod testing;

/// Version of torch this library was built against; the Python shim refuses another one.
pub const TORCH_VERSION: &str = env!("BASTILE_TORCH_VERSION");

/// NUL-terminated copy of [`TORCH_VERSION`], readable with ctypes before torch tries to load us.
#[no_mangle]
pub extern "C" fn bastile_torch_version() -> *const std::os::raw::c_char {
    static VERSION: &str = concat!(env!("BASTILE_TORCH_VERSION"), "\0");
    VERSION.as_ptr().cast()
}
