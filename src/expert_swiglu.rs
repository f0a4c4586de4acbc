//! The experts' gate/up grouped GEMM with its gated activation (formulas in `include/expert_swiglu.h`): the
//! launches of `cuda/expert_swiglu.cu` (the Hopper GEMM, the rows fallback), which path a call takes, and the CPU kernel, the reference the GPU
//! is tested against (sums in f64, each result rounded once, h from the rounded halves as `swiglu` makes it).
use crate::cpu::{self, Disjoint, Element};
use crate::driver::{Device, Result};
use crate::experts::{self, Gemm, Operands, Weight};
use crate::kernels::{Decide, Launch, Plan};
use crate::params::{
    BastileDType, ExpertSwiglu, ExpertSwigluPlan, EXPERT_SWIGLU_MAX_EXPERTS, EXPERT_SWIGLU_MAX_STAGES,
    EXPERT_SWIGLU_ROWS_BLOCK, EXPERT_SWIGLU_TILE_COLS,
};
use crate::swiglu::Activation;

const OP: &str = "expert_swiglu";

impl Decide for ExpertSwigluPlan {
    fn decide(&mut self) -> Result<()> {
        self.hopper = (experts::hopper(self.fits, self.device, self.experts, EXPERT_SWIGLU_MAX_EXPERTS)
            && self.inter > 0
            && self.inter % EXPERT_SWIGLU_TILE_COLS as i64 == 0
            && experts::tail_fits(self.rank))
            .into();
        Ok(())
    }
}

impl Launch for ExpertSwiglu {
    fn plan(&self, dev: &'static Device) -> Result<Plan> {
        let dtype = BastileDType::from_raw(self.dtype)?;
        if self.hopper == 0 {
            let (kernel, cfg) = experts::rows::<Self>(dev, dtype, self.pairs * self.inter, EXPERT_SWIGLU_ROWS_BLOCK)?;
            return Ok(Plan::single(kernel, cfg, *self));
        }
        let kernel = experts::gemm_kernel::<Self>(OP, dev, dtype, Activation::of(self.activation)?.tag())?;
        // lora_weight has the weight's rows, K-major
        let rows = self.experts as i64 * 2 * self.inter;
        let tail = (self.rank > 0).then_some(Operands { x: self.lora_x, weight: self.lora_weight, k: self.rank, layout: Weight::K { rows } });
        let (gemm, cfg) = Gemm {
            main: Operands { x: self.x, weight: self.weight, k: self.in_, layout: Weight::K { rows } },
            tail,
            pairs: self.pairs,
            experts: self.experts,
            col_tiles: self.inter / EXPERT_SWIGLU_TILE_COLS as i64,
        }
        .launch(OP, dev, &kernel, EXPERT_SWIGLU_MAX_STAGES)?;
        Ok(Plan::single(kernel, cfg, ExpertSwiglu { gemm, ..*self }))
    }

    fn cpu(&self) -> Result<()> {
        let dt = BastileDType::from_raw(self.dtype)?;
        let act = Activation::of(self.activation)?;
        // SAFETY: offsets holds `experts` int32 (checked by the C++ layer).
        let ends = unsafe { experts::ends(OP, self.offsets, self.experts, self.pairs)? };
        // SAFETY: the C++ layer checked every pointer of the block against its tensor's shape and dtype.
        crate::with_dtypes!(dt, dt, |T, _W, _Y| unsafe { forward_cpu::<T>(self, act, &ends) });
        Ok(())
    }
}

unsafe fn forward_cpu<T: Element>(p: &ExpertSwiglu, act: Activation, ends: &[usize]) {
    let (pairs, k, inter, rank) = (p.pairs as usize, p.in_ as usize, p.inter as usize, p.rank as usize);
    let (wide, rows) = (T::DTYPE == BastileDType::BASTILE_F64, 2 * inter);
    let x = cpu::slice::<T>(p.x, pairs * k);
    let w = cpu::slice::<T>(p.weight, ends.len() * rows * k);
    let (lx, lw) = (experts::low_rank::<T>(p.lora_x, pairs, rank), experts::low_rank::<T>(p.lora_weight, ends.len() * rows, rank));
    let gate_up = Disjoint::new(cpu::slice_mut::<T>(p.gate_up, pairs * rows));
    let h = Disjoint::new(cpu::slice_mut::<T>(p.h, pairs * inter));
    cpu::parallel_for(pairs, (cpu::GRAIN / (rows * (k + rank)).max(1)).max(1), |range| {
        for r in range {
            let e = ends.partition_point(|&end| end <= r);
            let (w, lw) = (&w[e * rows * k..][..rows * k], &lw[e * rows * rank..][..rows * rank]);
            // SAFETY: the ranges of parallel_for do not overlap.
            let out = gate_up.part(r * rows..(r + 1) * rows);
            experts::row_products(&x[r * k..][..k], w, &lx[r * rank..][..rank], lw, out);
            let (g, u) = out.split_at(inter);
            for ((y, g), u) in h.part(r * inter..(r + 1) * inter).iter_mut().zip(g).zip(u) {
                *y = T::from_f64(T::round(act.value(g.to_f64(), wide)) * u.to_f64());
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::params::BastileDType::*;
    use crate::params::SWIGLU_SILU;

    fn block(x: &[f64], w: &[f64], offsets: &[i32], gate_up: &mut [f64], h: &mut [f64], inter: i64) -> ExpertSwiglu {
        ExpertSwiglu {
            x: x.as_ptr().cast(),
            weight: w.as_ptr().cast(),
            offsets: offsets.as_ptr(),
            gate_up: gate_up.as_mut_ptr().cast(),
            h: h.as_mut_ptr().cast(),
            pairs: gate_up.len() as i64 / (2 * inter),
            in_: x.len() as i64 / (gate_up.len() as i64 / (2 * inter)),
            inter,
            experts: offsets.len() as i32,
            dtype: BASTILE_F64 as i32,
            activation: SWIGLU_SILU as i32,
            ..Default::default()
        }
    }

    /// Rows of two experts (the first with none) against sums written out by hand.
    #[test]
    fn each_row_takes_its_experts_weight() {
        // 3 rows of 2, experts 0 (no rows), 1 (rows 0-1), 2 (row 2); inter 1: weight rows gate, up per expert.
        let x = [1.0, 2.0, 3.0, 4.0, -1.0, 0.5];
        let w = [9.0, 9.0, 9.0, 9.0, 1.0, 0.0, 0.0, 1.0, 2.0, 1.0, 1.0, -1.0];
        let (mut gate_up, mut h) = ([0.0; 6], [0.0; 3]);
        block(&x, &w, &[0, 2, 3], &mut gate_up, &mut h, 1).cpu().unwrap();
        assert_eq!(gate_up, [1.0, 2.0, 3.0, 4.0, -1.5, -1.5]);
        let silu = |g: f64| g / (1.0 + (-g).exp());
        for (r, y) in h.iter().enumerate() {
            let want = silu(gate_up[2 * r]) * gate_up[2 * r + 1];
            assert!((y - want).abs() <= 1e-14 * want.abs(), "{y} {want}");
        }
    }

    #[test]
    fn offsets_that_miss_rows_are_refused() {
        let x = [1.0; 4];
        let w = [1.0; 8];
        let (mut gate_up, mut h) = ([0.0; 4], [0.0; 2]);
        for offsets in [[1, 1], [2, 1], [0, 3]] {
            let err = block(&x, &w, &offsets, &mut gate_up, &mut h, 1).cpu().unwrap_err();
            assert!(err.starts_with("bastile.expert_swiglu: "), "{err}");
        }
    }
}
