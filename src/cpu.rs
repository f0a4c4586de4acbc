//! CPU kernels' element types and threads. CPU kernels compute in f64 and round where torch would round
//! (through the input dtype, then to the output dtype), so they are the reference the GPU
//! kernels are tested against. They run on torch's intra-op thread pool ([`parallel_for`]), and each
//! result is computed the same way whatever the number of threads.
use crate::params::BastileDType;
use half::{bf16, f16};
use std::any::Any;
use std::marker::PhantomData;
use std::ops::Range;
use std::panic::{self, AssertUnwindSafe};
use std::sync::Mutex;

/// Elements (or element-sized pieces of work) a thread takes at least: below that, handing work to
/// another thread costs more than it saves.
pub const GRAIN: usize = 1 << 14;

/// Runs `body` on ranges covering `0..n`, each of at least `grain` indices but the last, on torch's
/// intra-op thread pool (at::parallel_for, src/torch/parallel.h): the threads torch.set_num_threads
/// gives torch, or the calling thread alone, as in a DataLoader worker, where a pool of our own would
/// not survive fork(). A panic in `body` resumes on the calling thread once every range is done.
pub fn parallel_for<F: Fn(Range<usize>) + Sync>(n: usize, grain: usize, body: F) {
    struct Task<F> {
        body: F,
        panic: Mutex<Option<Box<dyn Any + Send>>>,
    }
    fn run<F: Fn(Range<usize>) + Sync>(task: usize, begin: i64, end: i64) {
        // SAFETY: `task` is the address of the Task<F> below, alive until parallel_for returns.
        let task = unsafe { &*(task as *const Task<F>) };
        // No unwind may cross torch's C++ frames.
        if let Err(p) = panic::catch_unwind(AssertUnwindSafe(|| (task.body)(begin as usize..end as usize))) {
            task.panic.lock().unwrap().get_or_insert(p);
        }
    }
    let task = Task { body, panic: Mutex::new(None) };
    // SAFETY: run::<F> gets the address of a Task<F>, and it does not unwind.
    unsafe { crate::ffi::parallel_for(n as i64, grain.max(1) as i64, run::<F>, &task as *const Task<F> as usize) };
    if let Some(p) = task.panic.into_inner().unwrap() {
        panic::resume_unwind(p);
    }
}

/// `f(i)` for each `i` in `0..n`, in order, computed on torch's thread pool one index per task.
pub fn parallel_map<R: Send>(n: usize, f: impl Fn(usize) -> R + Sync) -> Vec<R> {
    let mut out: Vec<Option<R>> = (0..n).map(|_| None).collect();
    let slots = Disjoint::new(&mut out);
    parallel_for(n, 1, |range| {
        // SAFETY: the ranges of parallel_for do not overlap.
        for (slot, i) in unsafe { slots.part(range.clone()) }.iter_mut().zip(range) {
            *slot = Some(f(i));
        }
    });
    out.into_iter().map(|r| r.expect("parallel_for covers every index")).collect()
}

/// An output that the ranges of [`parallel_for`] write, each its own part of it.
pub struct Disjoint<'a, T> {
    ptr: *mut T,
    len: usize,
    _output: PhantomData<&'a mut [T]>,
}

// SAFETY: threads only reach the elements through `part`, whose parts do not overlap.
unsafe impl<T: Send> Sync for Disjoint<'_, T> {}

impl<'a, T> Disjoint<'a, T> {
    pub fn new(output: &'a mut [T]) -> Self {
        Disjoint { ptr: output.as_mut_ptr(), len: output.len(), _output: PhantomData }
    }

    /// An output of `len` elements at `ptr`, which other outputs' parts may interleave with (the halves of one
    /// tensor's rows).
    ///
    /// # Safety
    /// `ptr` holds `len` elements of T for 'a, and no part in use of this output or any other overlaps another.
    pub unsafe fn raw(ptr: *mut T, len: usize) -> Self {
        Disjoint { ptr, len, _output: PhantomData }
    }

    /// Elements `range` of the output.
    ///
    /// # Safety
    /// No other part in use may overlap `range`.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn part(&self, range: Range<usize>) -> &'a mut [T] {
        assert!(range.start <= range.end && range.end <= self.len, "{range:?} out of 0..{}", self.len);
        std::slice::from_raw_parts_mut(self.ptr.add(range.start), range.len())
    }
}

pub trait Element: Copy + Send + Sync + 'static {
    const DTYPE: BastileDType;
    fn to_f64(self) -> f64;
    fn from_f64(v: f64) -> Self;
    /// `v` stored in this type and read back.
    fn round(v: f64) -> f64 {
        Self::from_f64(v).to_f64()
    }
}

impl Element for f64 {
    const DTYPE: BastileDType = BastileDType::BASTILE_F64;
    fn to_f64(self) -> f64 {
        self
    }
    fn from_f64(v: f64) -> Self {
        v
    }
}
impl Element for f32 {
    const DTYPE: BastileDType = BastileDType::BASTILE_F32;
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn from_f64(v: f64) -> Self {
        v as f32
    }
}
/// The 16-bit types round through f32, as torch rounds an f32 intermediate.
macro_rules! half_element {
    ($($t:ident: $dtype:ident),*) => {$(
        impl Element for $t {
            const DTYPE: BastileDType = BastileDType::$dtype;
            fn to_f64(self) -> f64 {
                self.to_f64()
            }
            fn from_f64(v: f64) -> Self {
                $t::from_f32(v as f32)
            }
        }
    )*};
}
half_element!(f16: BASTILE_F16, bf16: BASTILE_BF16);

/// Runs `$body` with type aliases `$x`, `$w`, `$y` bound to the Rust types of an input dtype,
/// a weight dtype and their torch promotion (equal types stay; f64 wins; any other pair is f32).
#[macro_export]
macro_rules! with_dtypes {
    ($xd:expr, $wd:expr, |$x:ident, $w:ident, $y:ident| $body:expr) => {{
        use half::{bf16, f16};
        use $crate::params::BastileDType::*;
        match ($xd, $wd) {
            (BASTILE_F32, BASTILE_F32) => { type $x = f32; type $w = f32; type $y = f32; $body }
            (BASTILE_F32, BASTILE_F16) => { type $x = f32; type $w = f16; type $y = f32; $body }
            (BASTILE_F32, BASTILE_BF16) => { type $x = f32; type $w = bf16; type $y = f32; $body }
            (BASTILE_F32, BASTILE_F64) => { type $x = f32; type $w = f64; type $y = f64; $body }
            (BASTILE_F16, BASTILE_F32) => { type $x = f16; type $w = f32; type $y = f32; $body }
            (BASTILE_F16, BASTILE_F16) => { type $x = f16; type $w = f16; type $y = f16; $body }
            (BASTILE_F16, BASTILE_BF16) => { type $x = f16; type $w = bf16; type $y = f32; $body }
            (BASTILE_F16, BASTILE_F64) => { type $x = f16; type $w = f64; type $y = f64; $body }
            (BASTILE_BF16, BASTILE_F32) => { type $x = bf16; type $w = f32; type $y = f32; $body }
            (BASTILE_BF16, BASTILE_F16) => { type $x = bf16; type $w = f16; type $y = f32; $body }
            (BASTILE_BF16, BASTILE_BF16) => { type $x = bf16; type $w = bf16; type $y = bf16; $body }
            (BASTILE_BF16, BASTILE_F64) => { type $x = bf16; type $w = f64; type $y = f64; $body }
            (BASTILE_F64, BASTILE_F32) => { type $x = f64; type $w = f32; type $y = f64; $body }
            (BASTILE_F64, BASTILE_F16) => { type $x = f64; type $w = f16; type $y = f64; $body }
            (BASTILE_F64, BASTILE_BF16) => { type $x = f64; type $w = bf16; type $y = f64; $body }
            (BASTILE_F64, BASTILE_F64) => { type $x = f64; type $w = f64; type $y = f64; $body }
        }
    }};
}

/// torch.result_type of two floating dtypes.
pub fn promote(a: BastileDType, b: BastileDType) -> BastileDType {
    use BastileDType::*;
    match (a, b) {
        _ if a == b => a,
        (BASTILE_F64, _) | (_, BASTILE_F64) => BASTILE_F64,
        _ => BASTILE_F32,
    }
}

/// Each index from a caller's tensor within 0..n (else the error names op and tensor); with `once`, each of 0..n
/// exactly once (a permutation, through which a kernel writes).
pub fn check_indices(op: &str, name: &str, indices: &[i64], n: usize, once: bool) -> crate::driver::Result<()> {
    let mut seen = vec![false; if once { n } else { 0 }];
    for &i in indices {
        if i < 0 || i as usize >= n {
            return Err(format!("bastile.{op}: {name} holds {i}, outside 0..{n}"));
        }
        if once && std::mem::replace(&mut seen[i as usize], true) {
            return Err(format!("bastile.{op}: {name} holds {i} twice; it must hold each of 0..{n} once"));
        }
    }
    Ok(())
}

/// Slice view of `len` elements at `ptr`.
///
/// # Safety
/// `ptr` must point to `len` valid, initialised elements of `T` that outlive the slice.
pub unsafe fn slice<'a, T>(ptr: *const std::ffi::c_void, len: usize) -> &'a [T] {
    if len == 0 {
        &[]
    } else {
        std::slice::from_raw_parts(ptr.cast(), len)
    }
}

/// # Safety
/// As [`slice`], and nothing else may access the memory while the slice lives.
pub unsafe fn slice_mut<'a, T>(ptr: *mut std::ffi::c_void, len: usize) -> &'a mut [T] {
    if len == 0 {
        &mut []
    } else {
        std::slice::from_raw_parts_mut(ptr.cast(), len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn parallel_for_covers_each_index_once() {
        for (n, grain) in [(0, 1), (1, 1), (1000, 7), (1000, 1000), (GRAIN * 3 + 1, GRAIN)] {
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            parallel_for(n, grain, |r| r.for_each(|i| _ = hits[i].fetch_add(1, Ordering::Relaxed)));
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "n {n}, grain {grain}");
        }
        assert_eq!(parallel_map(5, |i| i * i), [0, 1, 4, 9, 16]);
    }

    #[test]
    fn panic_in_a_range_resumes_on_the_caller() {
        let caught = panic::catch_unwind(|| parallel_for(4 * GRAIN, GRAIN, |r| assert!(!r.contains(&GRAIN), "index {GRAIN}")));
        let message = caught.unwrap_err().downcast::<String>().unwrap();
        assert_eq!(*message, format!("index {GRAIN}"));
    }
}
