//! Launches of the flat elementwise kernels of `cuda/elementwise.cuh` (swiglu, geglu, the fused
//! cross-entropy's gradient scaling): a grid-stride loop over 16-byte vectors, or single elements
//! where a pointer is not 16-byte aligned, or a warp a row where a sum over each row is wanted too. Their lists
//! are `BASTILE_ELEMENTWISE_KERNELS`.
use crate::cpu::{self, Disjoint, Element};
use crate::driver::{self, Device, Result};
use crate::geometry;
use crate::kernels::{self, Kernels, Plan, Tag};
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

/// An op's launch shape: `block` threads a block, each taking `unroll` accesses per grid-stride step.
pub struct Elementwise {
    pub block: u32,
    pub unroll: u32,
}

impl Elementwise {
    /// The launch of `params`' kernel `<op>_<dir>_<dtype>_<vec|scalar>` over `n` elements of `dt`
    /// (output elements: pairs for geglu), `vec` elements an access ([`vector_width`], or 1).
    pub fn plan<P: Kernels>(&self, dev: &Device, params: P, dir: Tag, dt: BastileDType, vec: i64, n: i64) -> Result<Plan> {
        // Each block covers block * unroll accesses per grid-stride step; the elements past the last
        // vector go to the first threads of block 0, which always exists.
        self.launch(dev, params, dir, dt, vec, geometry::ceil_div(n / vec, (self.block * self.unroll) as i64))
    }

    /// The launch of a kernel's row path (`for_each_row`: a warp a row) over `n` elements in rows of `cols`:
    /// vectors only where a row is whole ones, so that no vector spans two rows' sums.
    pub fn plan_rows<P: Kernels>(&self, dev: &Device, params: P, dir: Tag, dt: BastileDType, vec: i64, n: i64, cols: i64)
                                 -> Result<Plan> {
        let vec = if cols % vec == 0 { vec } else { 1 };
        self.launch(dev, params, dir, dt, vec, geometry::ceil_div(n / cols.max(1), (self.block / 32) as i64))
    }

    fn launch<P: Kernels>(&self, dev: &Device, params: P, dir: Tag, dt: BastileDType, vec: i64, blocks: i64) -> Result<Plan> {
        let access = if vec > 1 { Tag::Vec } else { Tag::Scalar };
        let kernel = kernels::kernel::<P>(dev, &[dir, dt.tag(), access], self.block)?;
        let blocks = blocks.max(1);
        let grid = geometry::grid(blocks, dev.sm_count() as i64 * kernel.blocks_per_sm as i64) as u32;
        Ok(Plan::single(kernel, driver::LaunchConfig { grid: (grid, 1), block: (self.block, 1), shared: 0 }, params))
    }
}

/// Each row's sum of `term(e)` over its `cols` elements e (flat indices), in f64, into `dot` [rows] of T's
/// statistics dtype (f32, or f64 for f64): the CPU kernels' reference for the GPU's rows (`for_each_row`).
/// SAFETY: `dot` holds `rows` elements of that dtype.
pub unsafe fn row_dots<T: Element>(dot: *mut c_void, rows: usize, cols: usize, term: impl Fn(usize) -> f64 + Sync) {
    let sum = |r: usize| (r * cols..(r + 1) * cols).map(&term).sum::<f64>();
    if T::DTYPE == BastileDType::BASTILE_F64 {
        write(cpu::slice_mut::<f64>(dot, rows), cols, sum, |v| v);
    } else {
        write(cpu::slice_mut::<f32>(dot, rows), cols, sum, |v| v as f32);
    }
    fn write<D: Send>(out: &mut [D], cols: usize, sum: impl Fn(usize) -> f64 + Sync, cast: impl Fn(f64) -> D + Sync) {
        let rows = out.len();
        let out = Disjoint::new(out);
        cpu::parallel_for(rows, (cpu::GRAIN / cols.max(1)).max(1), |r| {
            // SAFETY: the ranges of parallel_for do not overlap.
            for (o, i) in unsafe { out.part(r.clone()) }.iter_mut().zip(r) {
                *o = cast(sum(i));
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::params::{GegluBackward, GegluForward, GradScale, SwigluBackward, SwigluForward};
    use BastileDType::*;

    #[test]
    fn vector_width_follows_alignment() {
        let (aligned, odd) = (4096 as *const c_void, 4098 as *const c_void);
        assert_eq!(vector_width(BASTILE_BF16, &[aligned, aligned]), 8);
        assert_eq!(vector_width(BASTILE_F32, &[aligned]), 4);
        assert_eq!(vector_width(BASTILE_F16, &[aligned, odd]), 1);
    }

    /// Every kernel a plan can ask for is listed: each direction, CUDA dtype and access.
    #[test]
    fn every_launch_has_a_kernel() {
        fn all<P: Kernels>(dir: Tag) {
            for dt in [BASTILE_F32, BASTILE_F16, BASTILE_BF16] {
                for access in [Tag::Vec, Tag::Scalar] {
                    P::find(&[dir, dt.tag(), access]).unwrap();
                }
            }
        }
        all::<SwigluForward>(Tag::Fwd);
        all::<SwigluBackward>(Tag::Bwd);
        all::<GegluForward>(Tag::Fwd);
        all::<GegluBackward>(Tag::Bwd);
        all::<GradScale>(Tag::Scale);
    }
}
