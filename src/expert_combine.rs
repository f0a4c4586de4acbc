//! A mixture of experts' pairs joined into their tokens and the gradient sent back to the pairs (the formulas
//! are in `include/expert_combine.h`), and the pairs grouped by expert before: the launches of
//! `cuda/expert_combine.cu` and the CPU kernels, the reference the GPU is tested against. The CPU computes in f64,
//! rounds each weighted product to the promoted type (as torch rounds `rows * weights`) and each result once.
use crate::cpu::{self, Disjoint, Element};
use crate::driver::{self, Device, Result};
use crate::geometry;
use crate::kernels::{self, Kernels, Launch, Plan, Tag};
use crate::params::{BastileDType, ExpertCombineBackward, ExpertCombineForward, ExpertGroup, EXPERT_COMBINE_BLOCK,
                    EXPERT_GROUP_MAX_EXPERTS};
use std::ffi::c_void;

/// One launch over `rows` rows of `dim` elements: 16-byte vectors of the rows' dtype where `dim` and every
/// pointer allow them (`rows_like` hold the rows' dtype, `promoted` the promoted type's, vectors of as many
/// elements), the kernel's tags after its access `variant`; `p.group` is set here.
#[allow(clippy::too_many_arguments)]
fn plan<P: Kernels>(dev: &Device, mut p: P, group_of: fn(&mut P) -> &mut i32, dir: Tag, dt: BastileDType,
                    wt: BastileDType, variant: &[Tag], rows_like: &[*const c_void], promoted: &[*const c_void],
                    rows: i64, dim: i64) -> Result<Plan> {
    if dt == BastileDType::BASTILE_F64 {
        return Err(format!("bastile.{}: float64 is supported on CPU only", P::OP));
    }
    let width = (16 / dt.size()) as i64;
    let wide = width as usize * cpu::promote(dt, wt).size();
    let vectors = dim % width == 0
        && rows_like.iter().all(|&q| geometry::aligned(q, 16))
        && promoted.iter().all(|&q| geometry::aligned(q, wide));
    let vec = if vectors { width } else { 1 };
    let g = geometry::lane_group(dim / vec);
    *group_of(&mut p) = g;
    let access = if vec > 1 { Tag::Vec } else { Tag::Scalar };
    let kernel = kernels::kernel::<P>(dev, &[&[dir, dt.tag(), wt.tag(), access], variant].concat(), EXPERT_COMBINE_BLOCK)?;
    Ok(Plan::single(kernel, geometry::lane_group_launch(rows, g, EXPERT_COMBINE_BLOCK), p))
}

impl Launch for ExpertCombineForward {
    fn plan(&self, dev: &'static Device) -> Result<Plan> {
        let (dt, wt) = (BastileDType::from_raw(self.dtype)?, BastileDType::from_raw(self.weights_dtype)?);
        // The kernel that holds a token's k pairs in registers, for k <= 8; more are read one by one, where the
        // kernel holding 4 takes the fewest registers.
        let held = if (5..=8).contains(&self.k) { Tag::Held8 } else { Tag::Held4 };
        let bias = if self.bias.is_null() { Tag::Plain } else { Tag::Bias };
        plan(dev, *self, |p| &mut p.group, Tag::Fwd, dt, wt, &[held, bias], &[self.rows, self.bias], &[self.out],
             self.tokens, self.dim)
    }

    fn cpu(&self) -> Result<()> {
        let (dt, wt) = (BastileDType::from_raw(self.dtype)?, BastileDType::from_raw(self.weights_dtype)?);
        // SAFETY: the C++ layer checked every pointer of the block against its tensor's shape and dtype.
        crate::with_dtypes!(dt, wt, |T, W, Y| unsafe { forward_cpu::<T, W, Y>(self) })
    }
}

impl Launch for ExpertCombineBackward {
    fn plan(&self, dev: &'static Device) -> Result<Plan> {
        let (dt, wt) = (BastileDType::from_raw(self.dtype)?, BastileDType::from_raw(self.weights_dtype)?);
        let rows_like = [self.rows, self.grad_rows as *const c_void];
        plan(dev, *self, |p| &mut p.group, Tag::Bwd, dt, wt, &[], &rows_like, &[self.grad], self.tokens * self.k, self.dim)
    }

    fn cpu(&self) -> Result<()> {
        let (dt, wt) = (BastileDType::from_raw(self.dtype)?, BastileDType::from_raw(self.weights_dtype)?);
        // SAFETY: as in the forward.
        crate::with_dtypes!(dt, wt, |T, W, Y| unsafe { backward_cpu::<T, W, Y>(self) })
    }
}

/// Pairs a block of the grouping takes at least, and the most blocks (the scan reads each block's counts of an
/// expert one after another).
const GROUP_SPAN: i64 = 1024;
const GROUP_BLOCKS: i64 = 256;

impl Launch for ExpertGroup {
    fn plan(&self, dev: &'static Device) -> Result<Plan> {
        if self.experts > EXPERT_GROUP_MAX_EXPERTS as i64 {
            return Err(format!("bastile.expert_group: {} experts are more than the CUDA kernels count ({})",
                               self.experts, EXPERT_GROUP_MAX_EXPERTS));
        }
        let blocks = geometry::ceil_div(self.pairs, GROUP_SPAN).clamp(1, GROUP_BLOCKS);
        let mut p = ExpertGroup { blocks: blocks as i32, span: geometry::ceil_div(self.pairs, blocks), ..*self };
        let step = |tag, grid: i64| -> Result<_> {
            let kernel = kernels::kernel::<ExpertGroup>(dev, &[Tag::Group, tag], EXPERT_COMBINE_BLOCK)?;
            let shared = (self.experts * 4) as u32;
            Ok((kernel, driver::LaunchConfig { grid: (grid as u32, 1), block: (EXPERT_COMBINE_BLOCK, 1), shared }))
        };
        let launches = [step(Tag::Count, blocks)?, step(Tag::Scan, 1)?, step(Tag::Scatter, blocks)?];
        Ok(Plan::new(blocks * self.experts * 4, move |memory, stream| {
            p.counts = memory.cast();
            for (kernel, cfg) in launches {
                // SAFETY: the block the kernels were compiled for, checked by the C++ layer; the scratch holds the
                // counts.
                unsafe { driver::launch(kernel, cfg, stream, &p)? };
            }
            Ok(())
        }))
    }

    fn cpu(&self) -> Result<()> {
        // SAFETY: the C++ layer checked every pointer of the block against its tensor's shape and dtype.
        unsafe { group_cpu(self) }
    }
}

/// The counting sort, on one thread: each expert's end, then each pair's row in the pairs' order.
unsafe fn group_cpu(p: &ExpertGroup) -> Result<()> {
    let (pairs, experts) = (p.pairs as usize, p.experts as usize);
    let chosen = cpu::slice::<i64>(p.chosen.cast(), pairs);
    cpu::check_indices("expert_group", "chosen", chosen, experts, false)?;
    let offsets = cpu::slice_mut::<i32>(p.offsets.cast(), experts);
    offsets.fill(0);
    for &e in chosen {
        offsets[e as usize] += 1;
    }
    let mut next = vec![0i32; experts];
    let mut end = 0;
    for (start, offset) in next.iter_mut().zip(offsets.iter_mut()) {
        *start = end;
        end += *offset;
        *offset = end;
    }
    let (order, expert) = (cpu::slice_mut::<i64>(p.order.cast(), pairs), cpu::slice_mut::<i64>(p.expert.cast(), pairs));
    let position = cpu::slice_mut::<i64>(p.position.cast(), pairs);
    for (pair, &e) in chosen.iter().enumerate() {
        let row = next[e as usize] as usize;
        next[e as usize] += 1;
        (order[row], expert[row], position[pair]) = (pair as i64, e, row as i64);
    }
    Ok(())
}

/// Rows of `width` elements a CPU task takes at least.
fn grain(width: usize) -> usize {
    (cpu::GRAIN / width.max(1)).max(1)
}

unsafe fn forward_cpu<T: Element, W: Element, Y: Element>(p: &ExpertCombineForward) -> Result<()> {
    let (tokens, k, dim) = (p.tokens as usize, p.k as usize, p.dim as usize);
    let pairs = tokens * k;
    let position = cpu::slice::<i64>(p.position.cast(), pairs);
    cpu::check_indices("expert_combine", "position", position, pairs, false)?;
    let rows = cpu::slice::<T>(p.rows, pairs * dim);
    let bias = if p.bias.is_null() {
        None
    } else {
        let expert = cpu::slice::<i64>(p.expert.cast(), pairs);
        cpu::check_indices("expert_combine", "expert", expert, p.experts.max(0) as usize, false)?;
        Some((cpu::slice::<T>(p.bias, p.experts as usize * dim), expert))
    };
    let weights = (!p.weights.is_null()).then(|| cpu::slice::<W>(p.weights, pairs));
    let out = Disjoint::new(cpu::slice_mut::<Y>(p.out, tokens * dim));
    cpu::parallel_for(tokens, grain(k * dim), |range| {
        for t in range {
            // SAFETY: the ranges of parallel_for do not overlap.
            let out = out.part(t * dim..(t + 1) * dim);
            for (c, o) in out.iter_mut().enumerate() {
                let mut acc = 0.0;
                for pair in t * k..(t + 1) * k {
                    let r = position[pair] as usize;
                    let x = rows[r * dim + c].to_f64();
                    let x = bias.map_or(x, |(b, e)| T::round(x + b[e[pair] as usize * dim + c].to_f64()));
                    acc += weights.map_or(x, |w| Y::round(w[pair].to_f64() * x));
                }
                *o = Y::from_f64(acc);
            }
        }
    });
    Ok(())
}

unsafe fn backward_cpu<T: Element, W: Element, Y: Element>(p: &ExpertCombineBackward) -> Result<()> {
    let (tokens, k, dim) = (p.tokens as usize, p.k as usize, p.dim as usize);
    let pairs = tokens * k;
    let order = cpu::slice::<i64>(p.order.cast(), pairs);
    cpu::check_indices("expert_dispatch", "order", order, pairs, true)?;
    let grad = cpu::slice::<Y>(p.grad, tokens * dim);
    let weights = (!p.weights.is_null()).then(|| cpu::slice::<W>(p.weights, pairs));
    let rows = (!p.rows.is_null()).then(|| cpu::slice::<T>(p.rows, pairs * dim));
    let grad_rows = Disjoint::new(cpu::slice_mut::<T>(p.grad_rows, pairs * dim));
    let grad_weights = Disjoint::new(cpu::slice_mut::<W>(p.grad_weights, if rows.is_some() { pairs } else { 0 }));
    cpu::parallel_for(pairs, grain(dim), |range| {
        for r in range {
            let pair = order[r] as usize;
            let g = &grad[pair / k * dim..(pair / k + 1) * dim];
            let w = weights.map_or(1.0, |w| w[pair].to_f64());
            // SAFETY: the ranges of parallel_for do not overlap, and order is a permutation (checked above).
            for (o, g) in grad_rows.part(r * dim..(r + 1) * dim).iter_mut().zip(g) {
                *o = T::from_f64(w * g.to_f64());
            }
            if let Some(rows) = rows {
                let d: f64 = g.iter().zip(&rows[r * dim..(r + 1) * dim]).map(|(g, x)| g.to_f64() * x.to_f64()).sum();
                grad_weights.part(pair..pair + 1)[0] = W::from_f64(d);
            }
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::params::BastileDType::*;
    use crate::testing::{cast, noise};

    /// 3 tokens, k = 2, rows of 5 in an order that is not the pairs' (as sorting by expert leaves them).
    const ORDER: [i64; 6] = [4, 0, 5, 2, 1, 3];

    fn position() -> Vec<i64> {
        let mut position = vec![0; ORDER.len()];
        for (r, &pair) in ORDER.iter().enumerate() {
            position[pair as usize] = r as i64;
        }
        position
    }

    /// Both directions against the formulas in f64, the inputs rounded to T (rows) and W (weights); `unit` the
    /// promoted type's unit roundoff.
    fn check<T: Element, W: Element, Y: Element>(unit: f64) {
        let (tokens, k, dim) = (3usize, 2usize, 5usize);
        let rows: Vec<T> = cast(&noise(tokens * k * dim, 1, 2.0));
        let weights: Vec<W> = cast(&noise(tokens * k, 2, 1.0));
        let grad: Vec<Y> = cast(&noise(tokens * dim, 3, 1.0));
        let position = position();
        let mut out = vec![Y::from_f64(f64::NAN); tokens * dim];
        let (mut grad_rows, mut grad_weights) = (vec![T::from_f64(f64::NAN); rows.len()], vec![W::from_f64(f64::NAN); weights.len()]);
        let (d, wd) = (T::DTYPE as i32, W::DTYPE as i32);
        let (t, kk, dm) = (tokens as i64, k as i64, dim as i64);
        ExpertCombineForward { rows: rows.as_ptr().cast(), position: position.as_ptr(), weights: weights.as_ptr().cast(),
            out: out.as_mut_ptr().cast(), tokens: t, k: kk, dim: dm, dtype: d, weights_dtype: wd, ..Default::default() }
            .cpu().unwrap();
        ExpertCombineBackward { grad: grad.as_ptr().cast(), order: ORDER.as_ptr(), weights: weights.as_ptr().cast(),
            rows: rows.as_ptr().cast(), grad_rows: grad_rows.as_mut_ptr().cast(), grad_weights: grad_weights.as_mut_ptr().cast(),
            tokens: t, k: kk, dim: dm, dtype: d, weights_dtype: wd, group: 0 }.cpu().unwrap();
        let near = |what: &str, got: f64, want: f64, scale: f64| {
            assert!((got - want).abs() <= 4.0 * unit * scale, "{what}: {got}, exact {want}")
        };
        for tk in 0..tokens {
            for c in 0..dim {
                let terms: Vec<f64> = (0..k).map(|j| weights[tk * k + j].to_f64() * rows[position[tk * k + j] as usize * dim + c].to_f64()).collect();
                near("out", out[tk * dim + c].to_f64(), terms.iter().sum(), terms.iter().map(|x| x.abs()).sum());
            }
        }
        for (r, &pair) in ORDER.iter().enumerate() {
            let (pair, tk) = (pair as usize, pair as usize / k);
            let mut dot = (0.0, 0.0);
            for c in 0..dim {
                let (g, x) = (grad[tk * dim + c].to_f64(), rows[r * dim + c].to_f64());
                let want = weights[pair].to_f64() * g;
                near("grad_rows", grad_rows[r * dim + c].to_f64(), want, want.abs());
                dot = (dot.0 + g * x, dot.1 + (g * x).abs());
            }
            near("grad_weights", grad_weights[pair].to_f64(), dot.0, dot.1);
        }
    }

    /// Every kernel a plan can ask for is listed: each pair of dtypes and access, and the forward's each held
    /// count and bias.
    #[test]
    fn every_launch_has_a_kernel() {
        let pairs = [(BASTILE_F32, BASTILE_F32), (BASTILE_F16, BASTILE_F16), (BASTILE_F16, BASTILE_F32),
                     (BASTILE_BF16, BASTILE_BF16), (BASTILE_BF16, BASTILE_F32)];
        for (dt, wt) in pairs {
            for access in [Tag::Vec, Tag::Scalar] {
                ExpertCombineBackward::find(&[Tag::Bwd, dt.tag(), wt.tag(), access]).unwrap();
                for held in [Tag::Held4, Tag::Held8] {
                    for bias in [Tag::Plain, Tag::Bias] {
                        ExpertCombineForward::find(&[Tag::Fwd, dt.tag(), wt.tag(), access, held, bias]).unwrap();
                    }
                }
            }
        }
    }

    #[test]
    fn cpu_kernels_match_the_formulas() {
        check::<f64, f64, f64>(2f64.powi(-53));
        check::<f32, f32, f32>(2f64.powi(-24));
        check::<half::bf16, half::bf16, half::bf16>(2f64.powi(-8));
        check::<half::bf16, f32, f32>(2f64.powi(-8));
        check::<half::f16, f32, f32>(2f64.powi(-11));
    }

    /// The forward with a bias of each pair's expert: what it gives without one on the rows plus their bias, rounded.
    fn bias_is_added_first<T: Element, W: Element, Y: Element>() {
        let (tokens, k, dim, experts) = (3usize, 2usize, 5usize, 3usize);
        let rows: Vec<T> = cast(&noise(tokens * k * dim, 1, 2.0));
        let bias: Vec<T> = cast(&noise(experts * dim, 4, 2.0));
        let expert = [2i64, 0, 2, 1, 1, 0]; // each pair's
        let weights: Vec<W> = cast(&noise(tokens * k, 2, 1.0));
        // row r is pair ORDER[r]'s
        let sums: Vec<T> = (0..rows.len())
            .map(|e| T::from_f64(rows[e].to_f64() + bias[expert[ORDER[e / dim] as usize] as usize * dim + e % dim].to_f64()))
            .collect();
        let position = position();
        let run = |rows: &[T], bias: Option<&[T]>| {
            let mut out = vec![Y::from_f64(f64::NAN); tokens * dim];
            ExpertCombineForward { rows: rows.as_ptr().cast(), position: position.as_ptr(), weights: weights.as_ptr().cast(),
                out: out.as_mut_ptr().cast(), bias: bias.map_or(std::ptr::null(), |b| b.as_ptr().cast()),
                expert: expert.as_ptr(), experts: experts as i64, tokens: tokens as i64, k: k as i64, dim: dim as i64,
                dtype: T::DTYPE as i32, weights_dtype: W::DTYPE as i32, group: 0 }.cpu().unwrap();
            out.iter().map(|v| v.to_f64().to_bits()).collect::<Vec<_>>()
        };
        assert_eq!(run(&rows, Some(&bias)), run(&sums, None), "{:?}", T::DTYPE);
    }

    #[test]
    fn bias_of_each_rows_expert_is_added_first() {
        bias_is_added_first::<f64, f64, f64>();
        bias_is_added_first::<f32, f32, f32>();
        bias_is_added_first::<half::bf16, half::bf16, half::bf16>();
        bias_is_added_first::<half::bf16, f32, f32>();
        bias_is_added_first::<half::f16, f32, f32>();
    }

    #[test]
    fn indices_outside_the_rows_or_repeated_are_errors() {
        let (rows, mut out) = ([0f32; 4], [0f32; 2]);
        let position = [0i64, 4];
        let err = ExpertCombineForward { rows: rows.as_ptr().cast(), position: position.as_ptr(), out: out.as_mut_ptr().cast(),
            tokens: 1, k: 2, dim: 1, dtype: BASTILE_F32 as i32, weights_dtype: BASTILE_F32 as i32, ..Default::default() }
            .cpu().unwrap_err();
        assert_eq!(err, "bastile.expert_combine: position holds 4, outside 0..2");
        let (bias, expert, position) = ([0f32; 2], [0i64, 2], [0i64, 1]);
        let err = ExpertCombineForward { rows: rows.as_ptr().cast(), position: position.as_ptr(), out: out.as_mut_ptr().cast(),
            bias: bias.as_ptr().cast(), expert: expert.as_ptr(), experts: 2, tokens: 1, k: 2, dim: 1,
            dtype: BASTILE_F32 as i32, weights_dtype: BASTILE_F32 as i32, ..Default::default() }
            .cpu().unwrap_err();
        assert_eq!(err, "bastile.expert_combine: expert holds 2, outside 0..2");
        let (grad, order, mut grad_rows) = ([0f32; 1], [1i64, 1], [0f32; 2]);
        let err = ExpertCombineBackward { grad: grad.as_ptr().cast(), order: order.as_ptr(), grad_rows: grad_rows.as_mut_ptr().cast(),
            tokens: 1, k: 2, dim: 1, dtype: BASTILE_F32 as i32, weights_dtype: BASTILE_F32 as i32, ..Default::default() }
            .cpu().unwrap_err();
        assert_eq!(err, "bastile.expert_dispatch: order holds 1 twice; it must hold each of 0..2 once");
    }

    fn grouped(chosen: &[i64], experts: i64) -> Result<(Vec<i64>, Vec<i32>, Vec<i64>, Vec<i64>)> {
        let n = chosen.len();
        let (mut order, mut expert, mut position) = (vec![-1; n], vec![-1; n], vec![-1; n]);
        let mut offsets = vec![-1; experts as usize];
        ExpertGroup { chosen: chosen.as_ptr(), order: order.as_mut_ptr(), expert: expert.as_mut_ptr(),
            position: position.as_mut_ptr(), offsets: offsets.as_mut_ptr(), counts: std::ptr::null_mut(), pairs: n as i64,
            experts, span: 0, blocks: 0 }.cpu()?;
        Ok((order, offsets, expert, position))
    }

    #[test]
    fn grouping_is_a_stable_sort_by_expert() {
        // 4 tokens, k = 2: expert 1 gets no pair, token 1 chose expert 3 twice
        let chosen = [2i64, 0, 3, 3, 0, 2, 4, 0];
        let (order, offsets, expert, position) = grouped(&chosen, 5).unwrap();
        assert_eq!(order, [1, 4, 7, 0, 5, 2, 3, 6]);
        assert_eq!(offsets, [3, 3, 5, 7, 8]);
        assert_eq!(expert, [0, 0, 0, 2, 2, 3, 3, 4]);
        for (row, &pair) in order.iter().enumerate() {
            assert_eq!(position[pair as usize], row as i64);
        }
    }

    #[test]
    fn grouping_refuses_an_expert_outside_the_experts() {
        assert_eq!(grouped(&[0, 5], 5).unwrap_err(), "bastile.expert_group: chosen holds 5, outside 0..5");
        assert_eq!(grouped(&[-1], 5).unwrap_err(), "bastile.expert_group: chosen holds -1, outside 0..5");
    }

    #[test]
    fn every_grouping_step_has_a_kernel() {
        for step in [Tag::Count, Tag::Scan, Tag::Scatter] {
            ExpertGroup::find(&[Tag::Group, step]).unwrap();
        }
    }
}
