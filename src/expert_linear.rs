//! The experts' grouped product of rows with their expert's weight (formulas in `include/expert_linear.h`): the
//! launches of `cuda/expert_linear.cu` (the Hopper GEMM, the rows fallback), which path a call takes, and the CPU
//! kernel, the reference the GPU is tested against (sums in f64, each result rounded once).
use crate::cpu::{self, Disjoint, Element};
use crate::driver::{Device, Result};
use crate::experts::{self, Gemm, Operands, Weight};
use crate::kernels::{Decide, Launch, Plan, Tag};
use crate::params::{
    BastileDType, ExpertLinear, ExpertLinearPlan, BASTILE_GEMM_TILE_K, EXPERT_LINEAR_MAX_EXPERTS, EXPERT_LINEAR_MAX_STAGES,
    EXPERT_LINEAR_ROWS_BLOCK, EXPERT_LINEAR_TILE_COLS,
};

const OP: &str = "expert_linear";

impl Decide for ExpertLinearPlan {
    fn decide(&mut self) -> Result<()> {
        let padding = col_tiles(self.out) * EXPERT_LINEAR_TILE_COLS as i64 - self.out;
        self.hopper = (experts::hopper(self.fits, self.device, self.experts, EXPERT_LINEAR_MAX_EXPERTS)
            && self.out > 0
            && self.out % 8 == 0
            && padding * 8 <= self.out
            && (self.n_major == 0 || self.in_ % BASTILE_GEMM_TILE_K as i64 == 0)
            && experts::tail_fits(self.rank))
            .into();
        Ok(())
    }
}

/// The GEMM's column tiles of an expert, the last one's columns past `out` dropped.
fn col_tiles(out: i64) -> i64 {
    crate::geometry::ceil_div(out, EXPERT_LINEAR_TILE_COLS as i64)
}

impl Launch for ExpertLinear {
    fn plan(&self, dev: &'static Device) -> Result<Plan> {
        let dtype = BastileDType::from_raw(self.dtype)?;
        if self.hopper == 0 {
            let (kernel, cfg) = experts::rows::<Self>(dev, dtype, self.pairs * self.out, EXPERT_LINEAR_ROWS_BLOCK)?;
            return Ok(Plan::single(kernel, cfg, *self));
        }
        let experts = self.experts as i64;
        // lora_weight comes in the weight's layout (the C++ layer's copy where it did not).
        let (major, layout, tail_layout) = match self.n_major {
            0 => (Tag::Kmajor, Weight::K { rows: experts * self.out }, Weight::K { rows: experts * self.out }),
            _ => (
                Tag::Nmajor,
                Weight::N { rows: experts * self.in_, cols: self.out },
                Weight::N { rows: experts * self.rank, cols: self.out },
            ),
        };
        let kernel = experts::gemm_kernel::<Self>(OP, dev, dtype, major)?;
        let tail = (self.rank > 0).then_some(Operands { x: self.lora_x, weight: self.lora_weight, k: self.rank, layout: tail_layout });
        let (gemm, cfg) = Gemm {
            main: Operands { x: self.x, weight: self.weight, k: self.in_, layout },
            tail,
            pairs: self.pairs,
            experts: self.experts,
            col_tiles: col_tiles(self.out),
        }
        .launch(OP, dev, &kernel, EXPERT_LINEAR_MAX_STAGES)?;
        Ok(Plan::single(kernel, cfg, ExpertLinear { gemm, ..*self }))
    }

    fn cpu(&self) -> Result<()> {
        let dt = BastileDType::from_raw(self.dtype)?;
        // SAFETY: offsets holds `experts` int32 (checked by the C++ layer).
        let ends = unsafe { experts::ends(OP, self.offsets, self.experts, self.pairs)? };
        // SAFETY: the C++ layer checked every pointer of the block against its tensor's shape and dtype.
        crate::with_dtypes!(dt, dt, |T, _W, _Y| unsafe { forward_cpu::<T>(self, &ends) });
        Ok(())
    }
}

unsafe fn forward_cpu<T: Element>(p: &ExpertLinear, ends: &[usize]) {
    let (pairs, k, out, rank) = (p.pairs as usize, p.in_ as usize, p.out as usize, p.rank as usize);
    let x = cpu::slice::<T>(p.x, pairs * k);
    let w = cpu::slice::<T>(p.weight, ends.len() * out * k);
    let (lx, lw) = (experts::low_rank::<T>(p.lora_x, pairs, rank), experts::low_rank::<T>(p.lora_weight, ends.len() * out, rank));
    let y = Disjoint::new(cpu::slice_mut::<T>(p.y, pairs * out));
    cpu::parallel_for(pairs, (cpu::GRAIN / (out * (k + rank)).max(1)).max(1), |rows| {
        for r in rows {
            let e = ends.partition_point(|&end| end <= r);
            let (w, lw) = (&w[e * out * k..][..out * k], &lw[e * out * rank..][..out * rank]);
            // SAFETY: the ranges of parallel_for do not overlap.
            experts::row_products(&x[r * k..][..k], w, &lx[r * rank..][..rank], lw, y.part(r * out..(r + 1) * out));
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::params::BastileDType::*;

    fn block(x: &[f64], w: &[f64], offsets: &[i32], y: &mut [f64], out: i64) -> ExpertLinear {
        let pairs = y.len() as i64 / out;
        ExpertLinear {
            x: x.as_ptr().cast(),
            weight: w.as_ptr().cast(),
            offsets: offsets.as_ptr(),
            y: y.as_mut_ptr().cast(),
            pairs,
            in_: x.len() as i64 / pairs,
            out,
            experts: offsets.len() as i32,
            dtype: BASTILE_F64 as i32,
            ..Default::default()
        }
    }

    /// Rows of two experts (the first with none) against sums written out by hand.
    #[test]
    fn each_row_takes_its_experts_weight() {
        // 3 rows of 2, experts 0 (no rows), 1 (rows 0-1), 2 (row 2); out 2: weight [3, 2, 2].
        let x = [1.0, 2.0, 3.0, 4.0, -1.0, 0.5];
        let w = [9.0, 9.0, 9.0, 9.0, 1.0, 0.0, 0.0, 1.0, 2.0, 1.0, 1.0, -1.0];
        let mut y = [0.0; 6];
        block(&x, &w, &[0, 2, 3], &mut y, 2).cpu().unwrap();
        assert_eq!(y, [1.0, 2.0, 3.0, 4.0, -1.5, -1.5]);
    }

    #[test]
    fn offsets_that_miss_rows_are_refused() {
        let x = [1.0; 4];
        let w = [1.0; 4];
        let mut y = [0.0; 2];
        for offsets in [[1, 1], [2, 1], [0, 3]] {
            let err = block(&x, &w, &offsets, &mut y, 1).cpu().unwrap_err();
            assert!(err.starts_with("bastile.expert_linear: "), "{err}");
        }
    }
}
