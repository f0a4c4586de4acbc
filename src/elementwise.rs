//! Launches of the flat elementwise kernels of `cuda/elementwise.cuh` (swiglu, geglu): a grid-stride
//! loop over 16-byte vectors, or single elements where a pointer is not 16-byte aligned.
use crate::driver::{self, Fatbin, Result};
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

/// A family's kernels: `block` threads per block, each taking `unroll` accesses per grid-stride step.
pub struct Family {
    pub fatbin: &'static Fatbin,
    pub block: u32,
    pub unroll: u32,
}

impl Family {
    /// Launches kernel `name()` (cached under `key`, which must identify it) over `units` accesses,
    /// with `p` as its parameter block.
    ///
    /// # Safety
    /// `p` must be the block the kernel takes, with every pointer valid for the accesses it makes.
    pub unsafe fn launch<P>(&self, key: u64, name: impl FnOnce() -> String, units: i64, p: &P, device: i32, stream: usize) -> Result<()> {
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
