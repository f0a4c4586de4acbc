//! The cxx bridge: what the C++ torch layer may call. Every entry converts a Rust panic into an
//! error, which cxx throws as a C++ exception and torch raises in Python as RuntimeError.
use crate::params::{RmsNormBackward, RmsNormForward};
use crate::rms_norm;

#[cxx::bridge(namespace = "bastile::rs")]
mod bridge {
    #[namespace = ""]
    unsafe extern "C++" {
        include!("bastile.h");
        type RmsNormForward = crate::params::RmsNormForward;
        type RmsNormBackward = crate::params::RmsNormBackward;
    }

    extern "Rust" {
        fn torch_version() -> &'static str;
        fn rms_norm_forward_cuda(p: &mut RmsNormForward, device: i32, stream: usize) -> Result<()>;
        fn rms_norm_backward_plan(p: &mut RmsNormBackward, device: i32) -> Result<i64>;
        fn rms_norm_backward_cuda(p: &RmsNormBackward, device: i32, stream: usize) -> Result<()>;
        fn rms_norm_forward_cpu(p: &RmsNormForward) -> Result<()>;
        fn rms_norm_backward_cpu(p: &RmsNormBackward) -> Result<()>;
    }
}

/// Runs `f`, turning a panic into an error so that no unwind reaches C++.
fn guard<T>(f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => {
            let msg = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            Err(format!("bastile: internal error: {msg}"))
        }
    }
}

fn torch_version() -> &'static str {
    crate::TORCH_VERSION
}

fn rms_norm_forward_cuda(p: &mut RmsNormForward, device: i32, stream: usize) -> Result<(), String> {
    guard(|| rms_norm::forward_cuda(p, device, stream))
}

fn rms_norm_backward_plan(p: &mut RmsNormBackward, device: i32) -> Result<i64, String> {
    guard(|| rms_norm::backward_plan(p, device))
}

fn rms_norm_backward_cuda(p: &RmsNormBackward, device: i32, stream: usize) -> Result<(), String> {
    guard(|| rms_norm::backward_cuda(p, device, stream))
}

fn rms_norm_forward_cpu(p: &RmsNormForward) -> Result<(), String> {
    guard(|| rms_norm::forward_cpu(p))
}

fn rms_norm_backward_cpu(p: &RmsNormBackward) -> Result<(), String> {
    guard(|| rms_norm::backward_cpu(p))
}
