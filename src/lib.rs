//! Bastile: fused CUDA kernels for LLM fine-tuning, registered as `torch.ops.bastile.*`.
//!
//! An op `<op>` is `cuda/<op>.cu` (kernels), `include/<op>.h` (parameter blocks and kernel
//! lists), `src/<op>.rs` (launch plans and CPU kernels, a module of this crate declared by build.rs) and
//! `src/torch/<op>.cpp` (its ops' specs, registered by `src/torch/op.h`). The shared runtime: `kernels`
//! (kernel tables, the `Launch` interface), `ffi` (the one bridge to C++), `driver` (CUDA through
//! cudarc), `geometry` and `elementwise` (launch geometry), `cpu` (the CPU kernels' element types), `experts`
//! (what the experts' grouped GEMMs share). `packing` is the data pipeline's: best-fit-decreasing packing of
//! sequences into rows, a C entry point.
pub mod cpu;
pub mod driver;
pub mod elementwise;
pub mod experts;
mod ffi;
pub mod geometry;
pub mod kernels;
pub mod packing;
pub mod params;
#[cfg(test)]
mod testing;

include!(concat!(env!("OUT_DIR"), "/ops.rs"));

/// Version of torch this library was built against; the Python shim refuses another major.minor.
pub const TORCH_VERSION: &str = env!("BASTILE_TORCH_VERSION");

/// NUL-terminated copy of [`TORCH_VERSION`], readable with ctypes before torch tries to load us.
#[no_mangle]
pub extern "C" fn bastile_torch_version() -> *const std::os::raw::c_char {
    static VERSION: &str = concat!(env!("BASTILE_TORCH_VERSION"), "\0");
    VERSION.as_ptr().cast()
}

/// The crate's version (Cargo.toml), which is `bastile.__version__`.
#[no_mangle]
pub extern "C" fn bastile_version() -> *const std::os::raw::c_char {
    static VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), "\0");
    VERSION.as_ptr().cast()
}

/// The `_GLIBCXX_USE_CXX11_ABI` of the torch this library was built against (0 or 1), which the running
/// torch's must equal: the two ABIs lay out std::string differently.
#[no_mangle]
pub extern "C" fn bastile_torch_cxx11_abi() -> std::os::raw::c_int {
    (env!("BASTILE_TORCH_CXX11_ABI") == "1").into()
}
