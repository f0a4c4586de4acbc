//! Launches of the flat elementwise kernels of `cuda/elementwise.cuh` (swiglu, geglu): a grid-stride
//! loop over 16-byte vectors, or single elements where a pointer is not 16-byte aligned.
use crate::driver::{self, Dir, Fatbin, Result};
use crate::geometry;
use crate::params::BastileDType;
use std::ffi::c_void;

/// Elements of `dt` per access: a 16-byte vector when every pointer allows it, else one.
pub fn vector_width(dt: BastileDType, ptrs: &[*const c_void]) -> i64 {
    if ptrs.iter().all(|&p| geometry::aligned(p, 16)) {
        (16 / dt.size()) as i64
    } else {
        1
    }
}

/// A family's kernels, `<op>_<fwd|bwd>_<dtype>_<vec|scalar>`: `block` threads per block, each taking
/// `unroll` accesses per grid-stride step.
pub struct Family {
    pub op: &'static str,
    pub fatbin: &'static Fatbin,
    pub block: u32,
    pub unroll: u32,
}

impl Family {
    /// The dtype code of a CUDA call, which has no float64 kernels.
    pub fn cuda_dtype(&self, raw: i32) -> Result<BastileDType> {
        let dt = BastileDType::from_raw(raw)?;
        BastileDType::check_cuda(self.op, &[dt])?;
        Ok(dt)
    }

    /// The kernel of `dir` for `dt` with accesses of `vec` elements (see [`vector_width`]).
    pub fn name(&self, dir: Dir, dt: BastileDType, vec: i64) -> String {
        format!("{}_{}_{}_{}", self.op, dir.tag(), dt.tag(), if vec > 1 { "vec" } else { "scalar" })
    }

    /// Launches the kernel of `dir` over `n` output elements (vectors of `vec`), `p` its parameter block.
    ///
    /// # Safety
    /// `p` must be the block that kernel takes, with every pointer valid for the accesses it makes.
    pub unsafe fn launch<P>(&self, dir: Dir, dt: BastileDType, vec: i64, n: i64, p: &P, device: i32, stream: usize) -> Result<()> {
        let key = (dir == Dir::Bwd) as u64 | (dt as u64) << 4 | (vec as u64) << 8;
        self.launch_kernel(key, || self.name(dir, dt, vec), n / vec, p, device, stream)
    }

    /// Launches kernel `name()` of the family's fatbin (cached under `key`, which must identify it) over
    /// `units` accesses, with `p` as its parameter block.
    ///
    /// # Safety
    /// As [`Family::launch`].
    pub unsafe fn launch_kernel<P>(&self, key: u64, name: impl FnOnce() -> String, units: i64, p: &P, device: i32, stream: usize) -> Result<()> {
        let dev = driver::device(device)?;
        let kernel = dev.kernel(self.fatbin, key, self.block, name)?;
        // Each block covers block * unroll accesses per grid-stride step; the elements past the last
        // vector go to the first threads of block 0, which always exists.
        let blocks = geometry::ceil_div(units, (self.block * self.unroll) as i64).max(1);
        let grid = geometry::grid(blocks, dev.sm_count() as i64 * kernel.blocks_per_sm as i64) as u32;
        let cfg = driver::Launch { grid: (grid, 1), block: (self.block, 1), shared: 0 };
        driver::launch(kernel, cfg, stream, p)
    }
}
