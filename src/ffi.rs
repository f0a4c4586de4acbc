//! The one bridge between the C++ torch layer and Rust. A parameter block crosses it as the id build.rs
//! gave its type (`Block<P>::id` in C++) and a pointer to it; `for_block` turns the id back into the
//! type, whose [`Launch`] impl plans or runs it, and `for_decision` a decision block's, whose [`Decide`]
//! impl fills in its answer. Nothing here knows an op. Every entry runs under [`guard`], so a Rust panic
//! becomes an error, which cxx throws as a C++ exception and torch raises as RuntimeError. The other way,
//! the CPU kernels reach torch's thread pool (src/cpu.rs).
use crate::kernels::{for_block, for_decision, Decide, Launch, Plan, Visit, VisitDecision};
use std::ffi::c_void;

#[cxx::bridge(namespace = "bastile::rs")]
mod bridge {
    extern "Rust" {
        type Plan;
        /// The CUDA plan of the parameter block at `params`, whose type has id `block`, on `device`.
        unsafe fn plan(block: u32, params: *const u8, device: i32) -> Result<Box<Plan>>;
        /// Bytes of device scratch the plan's launches need.
        fn scratch(self: &Plan) -> i64;
        /// Runs the plan on `stream` (torch's `cudaStream_t`); `scratch` holds `plan.scratch()` bytes.
        unsafe fn launch(plan: Box<Plan>, scratch: *mut u8, stream: usize) -> Result<()>;
        /// The CPU kernel of the parameter block at `params`.
        unsafe fn run_cpu(block: u32, params: *const u8) -> Result<()>;
        /// Completes the decision block at `params`, whose type has id `block`, with Rust's answer.
        unsafe fn decide(block: u32, params: *mut u8) -> Result<()>;
        fn torch_version() -> &'static str;
        /// Loads every kernel module on a CUDA device ahead of the first launch.
        fn warmup(device: i32) -> Result<()>;
        fn clear_kernel_cache();
    }

    unsafe extern "C++" {
        include!("bastile/src/torch/parallel.h");
        /// Calls `body(context, begin, end)` on ranges covering `0..n`, each of at least `grain` indices but
        /// the last, on torch's intra-op thread pool. `body` must not unwind.
        unsafe fn parallel_for(n: i64, grain: i64, body: fn(usize, i64, i64), context: usize);
    }
}

pub(crate) use bridge::parallel_for;

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

/// The block of type `P` at `params`.
///
/// # Safety
/// `params` must point to a `P` (the C++ layer passes `Block<P>::id` with it).
unsafe fn block<P: Copy>(params: *const u8) -> P {
    std::ptr::read_unaligned(params.cast())
}

struct PlanOn(*const u8, i32);
impl Visit for PlanOn {
    type Out = Result<Plan, String>;
    fn visit<P: Launch>(self) -> Self::Out {
        // SAFETY: the id came with a block of this type.
        let p: P = unsafe { block(self.0) };
        p.plan(crate::driver::device(self.1)?)
    }
}

struct Cpu(*const u8);
impl Visit for Cpu {
    type Out = Result<(), String>;
    fn visit<P: Launch>(self) -> Self::Out {
        // SAFETY: as in PlanOn.
        unsafe { block::<P>(self.0) }.cpu()
    }
}

unsafe fn plan(block: u32, params: *const u8, device: i32) -> Result<Box<Plan>, String> {
    guard(|| for_block(block, PlanOn(params, device))?.map(Box::new))
}

impl Plan {
    fn scratch(&self) -> i64 {
        self.scratch
    }
}

unsafe fn launch(plan: Box<Plan>, scratch: *mut u8, stream: usize) -> Result<(), String> {
    guard(|| plan.run(scratch.cast::<c_void>(), stream))
}

unsafe fn run_cpu(block: u32, params: *const u8) -> Result<(), String> {
    guard(|| for_block(block, Cpu(params))?)
}

struct DecideAt(*mut u8);
impl VisitDecision for DecideAt {
    type Out = Result<(), String>;
    fn visit<P: Decide>(self) -> Self::Out {
        // SAFETY: the id came with a block of this type, which is written back whole.
        let mut p: P = unsafe { block(self.0) };
        p.decide()?;
        unsafe { std::ptr::write_unaligned(self.0.cast(), p) };
        Ok(())
    }
}

unsafe fn decide(block: u32, params: *mut u8) -> Result<(), String> {
    guard(|| for_decision(block, DecideAt(params))?)
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
