//! What all cxx bridges share. Each kernel family declares its C++-callable entries in a bridge in
//! its own module (namespace `bastile::rs::<op>`); every entry runs under [`guard`], so a Rust
//! panic becomes an error, which cxx throws as a C++ exception and torch raises as RuntimeError.

#[cxx::bridge(namespace = "bastile::rs")]
mod bridge {
    extern "Rust" {
        fn torch_version() -> &'static str;
        fn warmup(device: i32) -> Result<()>;
        fn clear_kernel_cache();
    }
}

/// Runs `f`, turning a panic into an error so that no unwind reaches C++.
pub fn guard<T>(f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
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

fn warmup(device: i32) -> Result<(), String> {
    guard(|| crate::driver::device(device)?.load_all())
}

fn clear_kernel_cache() {
    crate::driver::clear_kernel_cache()
}
