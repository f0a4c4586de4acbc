//! RMSNorm: CUDA launchers for `cuda/rms_norm.cu` and the CPU kernels (the reference the GPU is
//! tested against). With `n = x * rsqrt(mean(x^2) + eps)`, statistics in f32 (f64 for f64 input):
//! HF `LlamaRMSNorm`/`Qwen3RMSNorm` compute `y = w * to_x_dtype(n)` in `promote(x, w)`, and with
//! `cast_after_weight` HF `GptOssRMSNorm` computes `y = to_x_dtype(w * n)`, the product in f32; Gemma's
//! `(1 + w)` is that with a `weight_offset` of 1, added to the weight in f32.
use crate::cpu::{self, Disjoint, Element};
use crate::driver::{Device, LaunchConfig, Result};
use crate::geometry;
use crate::kernels::{self, Launch, Plan, Tag};
#[cfg(test)]
use crate::kernels::Kernels;
use crate::params::{BastileDType, RmsNormBackward, RmsNormForward, RowGeometry};

/// The dtypes of x, the weight and y (grad_y's) and the rounding mode, as both directions' blocks say them.
macro_rules! types {
    ($($block:ty),*) => {$(
        impl $block {
            fn types(&self) -> Result<(BastileDType, BastileDType, BastileDType, bool)> {
                let after_weight = casts_after_weight("rms_norm", self.cast_after_weight, self.weight_offset)?;
                let dtype = BastileDType::from_raw;
                Ok((dtype(self.x_dtype)?, dtype(self.w_dtype)?, dtype(self.y_dtype)?, after_weight))
            }
        }
    )*};
}
types!(RmsNormForward, RmsNormBackward);

/// Runs `$kernel::<X, W, Y>(p, cast_after_weight)` on the block's dtypes, Y that of y and grad_y.
macro_rules! on_dtypes {
    ($p:expr, $kernel:ident) => {{
        let (xd, wd, _, after_weight) = $p.types()?;
        // SAFETY: the C++ layer checked shapes and dtypes of every pointer in the block.
        crate::with_dtypes!(xd, wd, |X, W, Y| unsafe {
            if after_weight {
                $kernel::<X, W, X>($p, after_weight)
            } else {
                $kernel::<X, W, Y>($p, after_weight)
            }
        });
        Ok(())
    }};
}

/// The rounding mode of a block's `cast_after_weight` flag and `weight_offset` (rms_norm's, which
/// qk_norm_rope's norm shares), or why they are invalid for `op`.
pub(crate) fn casts_after_weight(op: &str, flag: i32, weight_offset: f32) -> Result<bool> {
    match (flag, weight_offset) {
        (0, o) if o != 0.0 => Err(format!("bastile.{op}: weight_offset {o} needs cast_after_weight")),
        (0, _) => Ok(false),
        (1, _) => Ok(true),
        _ => Err(format!("bastile.{op}: cast_after_weight must be 0 or 1, got {flag}")),
    }
}

/// The weight as it multiplies: plus the offset, the sum at the statistics' precision.
pub(crate) fn weight_value(w: f64, offset: f32, f64_stats: bool) -> f64 {
    match (offset, f64_stats) {
        (0.0, _) => w,
        (o, false) => <f32 as Element>::round(w + o as f64),
        (o, true) => w + o as f64,
    }
}

/// Rows each forward group takes at a time: two for rows of a warp or less, so that both rows' loads
/// are in flight together (the `r2` variants; the backward takes one).
fn rows_at_once(dir: Tag, geo: &RowGeometry) -> i64 {
    if dir == Tag::Fwd && (1..=4).contains(&geo.per_thread) && geo.group <= 32 {
        2
    } else {
        1
    }
}

/// The tags of the kernel of a direction, rounding mode and dtypes for rows laid out as `geo`.
fn tags(dir: Tag, after_weight: bool, x: BastileDType, w: BastileDType, geo: &RowGeometry) -> Vec<Tag> {
    let mut tags = vec![dir, x.tag(), w.tag()];
    tags.extend(geo.layout_tags());
    tags.extend((rows_at_once(dir, geo) == 2).then_some(Tag::TwoRows));
    tags.extend(after_weight.then_some(Tag::CastAfterWeight));
    tags
}

impl Launch for RmsNormForward {
    fn plan(&self, dev: &'static Device) -> Result<Plan> {
        let (x, w, y, after_weight) = self.types()?;
        let mut p = *self;
        p.geo = geometry::for_tensors(geometry::rows_warp_first, p.cols, x, &[(p.x, x), (p.y, y), (p.weight, w)], &[]);
        let kernel = kernels::kernel::<Self>(dev, &tags(Tag::Fwd, after_weight, x, w, &p.geo), p.geo.block as u32)?;
        // Every row group its block (an experimental kernel of this layout, H100, bf16, 8192x2048: 24.9 us
        // against 25.7 us as one resident wave); the kernel loops past 2^31 - 1 blocks.
        let grid = p.geo.blocks_for(geometry::ceil_div(p.rows, rows_at_once(Tag::Fwd, &p.geo))).min(i32::MAX as i64);
        Ok(Plan::single(kernel, LaunchConfig { grid: (grid as u32, 1), block: (p.geo.block as u32, 1), shared: 0 }, p))
    }

    fn cpu(&self) -> Result<()> {
        on_dtypes!(self, forward_cpu)
    }
}

impl Launch for RmsNormBackward {
    /// The rows kernel writes f32 partial sums of the weight gradient into the scratch ([partials, cols]),
    /// which the reduce kernel folds.
    fn plan(&self, dev: &'static Device) -> Result<Plan> {
        let (x, w, y, after_weight) = self.types()?;
        let mut p = *self;
        p.geo = geometry::for_tensors(geometry::rows, p.cols, x, &[(p.x, x), (p.grad_x, x), (p.grad_y, y), (p.weight, w)], &[]);
        let kernel = kernels::kernel::<Self>(dev, &tags(Tag::Bwd, after_weight, x, w, &p.geo), p.geo.block as u32)?;
        let reduce = kernels::kernel::<Self>(dev, &[Tag::Bwd, Tag::Reduce, w.tag()], geometry::FOLD_BLOCK.0 * geometry::FOLD_BLOCK.1)?;
        // One resident wave of at most BACKWARD_BLOCKS_PER_SM: each block folds all its rows into one partial.
        let wave = dev.sm_count() as i64 * kernel.blocks_per_sm.min(geometry::BACKWARD_BLOCKS_PER_SM) as i64;
        let grid = p.geo.blocks_for(p.rows).min(wave);
        p.partials = grid * p.geo.partials_per_block();
        let shared = p.geo.fold_bytes(p.cols);
        let cfg = LaunchConfig { grid: (grid as u32, 1), block: (p.geo.block as u32, 1), shared: shared as u32 };
        let reduce_cfg = LaunchConfig { grid: (geometry::ceil_div(p.cols, 32) as u32, 1), block: geometry::FOLD_BLOCK, shared: 0 };
        Ok(Plan::with_fold(p.partials * p.cols * 4, p, |p| &mut p.partial, (kernel, cfg), (reduce, reduce_cfg)))
    }

    fn cpu(&self) -> Result<()> {
        on_dtypes!(self, backward_cpu)
    }
}

/// `x * r` as the weight multiplies it: rounded to x's dtype, or (cast after weight) kept at the
/// statistics' precision, f32 unless the input is f64.
fn normed<X: Element>(x: f64, r: f64, after_weight: bool, f64_stats: bool) -> f64 {
    match (after_weight, f64_stats) {
        (false, _) => X::round(x * r),
        (true, false) => <f32 as Element>::round(x * r),
        (true, true) => x * r,
    }
}

unsafe fn forward_cpu<X: Element, W: Element, Y: Element>(p: &RmsNormForward, after_weight: bool) {
    let (rows, cols) = (p.rows as usize, p.cols as usize);
    let x = cpu::slice::<X>(p.x, rows * cols);
    let w = cpu::slice::<W>(p.weight, cols);
    let y = Disjoint::new(cpu::slice_mut::<Y>(p.y, rows * cols));
    let f64_stats = X::DTYPE.stats() == BastileDType::BASTILE_F64;
    let eps = p.eps;
    let w: Vec<f64> = w.iter().map(|v| weight_value(v.to_f64(), p.weight_offset, f64_stats)).collect();
    let mut rstd = vec![0f64; rows];
    let rstd_rows = Disjoint::new(&mut rstd);
    cpu::parallel_for(rows, cpu::GRAIN.div_ceil(cols.max(1)), |range| {
        let elements = range.start * cols..range.end * cols;
        // SAFETY: the ranges of parallel_for do not overlap.
        let (yc, rc) = (y.part(elements.clone()), rstd_rows.part(range));
        for ((yr, xr), rs) in yc.chunks_mut(cols).zip(x[elements].chunks(cols)).zip(rc) {
            let ss: f64 = xr.iter().map(|v| v.to_f64() * v.to_f64()).sum();
            let r = 1.0 / (ss / cols as f64 + eps).sqrt();
            *rs = if f64_stats { r } else { <f32 as Element>::round(r) };
            for ((yv, xv), wv) in yr.iter_mut().zip(xr).zip(&w) {
                *yv = Y::from_f64(*wv * normed::<X>(xv.to_f64(), *rs, after_weight, f64_stats));
            }
        }
    });
    if p.rstd.is_null() {
        return;
    }
    if f64_stats {
        cpu::slice_mut::<f64>(p.rstd, rows).copy_from_slice(&rstd);
    } else {
        for (o, r) in cpu::slice_mut::<f32>(p.rstd, rows).iter_mut().zip(&rstd) {
            *o = *r as f32;
        }
    }
}

unsafe fn backward_cpu<X: Element, W: Element, Y: Element>(p: &RmsNormBackward, after_weight: bool) {
    let (rows, cols) = (p.rows as usize, p.cols as usize);
    let x = cpu::slice::<X>(p.x, rows * cols);
    let gy = cpu::slice::<Y>(p.grad_y, rows * cols);
    let w = cpu::slice::<W>(p.weight, cols);
    let gx = Disjoint::new(cpu::slice_mut::<X>(p.grad_x, rows * cols));
    let f64_stats = X::DTYPE.stats() == BastileDType::BASTILE_F64;
    let rstd: Vec<f64> = if f64_stats {
        cpu::slice::<f64>(p.rstd, rows).to_vec()
    } else {
        cpu::slice::<f32>(p.rstd, rows).iter().map(|&r| r as f64).collect()
    };
    let wf: Vec<f64> = w.iter().map(|v| weight_value(v.to_f64(), p.weight_offset, f64_stats)).collect();
    // Chunking depends on the shape alone, so the weight gradient's summation order (and value)
    // does not depend on the thread count.
    let chunk = rows.div_ceil(256).max(16);
    let partials = cpu::parallel_map(rows.div_ceil(chunk), |c| {
        let chunk_rows = c * chunk..((c + 1) * chunk).min(rows);
        let mut dw = vec![0f64; cols];
        // SAFETY: each chunk writes its own rows.
        let gxc = gx.part(chunk_rows.start * cols..chunk_rows.end * cols);
        for (gxr, row) in gxc.chunks_mut(cols).zip(chunk_rows) {
            let (xr, gr, r) = (&x[row * cols..][..cols], &gy[row * cols..][..cols], rstd[row]);
            let dot: f64 = xr.iter().zip(gr).zip(&wf).map(|((xv, g), wv)| g.to_f64() * wv * xv.to_f64()).sum();
            let c3 = r * r * r * dot / cols as f64;
            for j in 0..cols {
                let (xv, g) = (xr[j].to_f64(), gr[j].to_f64());
                gxr[j] = X::from_f64(r * g * wf[j] - xv * c3);
                dw[j] += g * normed::<X>(xv, r, after_weight, f64_stats);
            }
        }
        dw
    });
    let gw = cpu::slice_mut::<W>(p.grad_w, cols);
    for (j, o) in gw.iter_mut().enumerate() {
        *o = W::from_f64(partials.iter().map(|d| d[j]).sum());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::promote;
    use crate::testing::{cast, noise, rel_err, rel_err_floor, unit, widen};
    use half::{bf16, f16};
    use BastileDType::*;

    /// Dtype of y and grad_y: promote(x, w), or x's when the cast comes after the weight.
    fn out_dtype(x: BastileDType, w: BastileDType, cast_after_weight: bool) -> BastileDType {
        if cast_after_weight {
            x
        } else {
            promote(x, w)
        }
    }

    /// Reference forward in f64 with no intermediate rounding.
    fn reference_forward(x: &[f64], w: &[f64], cols: usize, eps: f64) -> Vec<f64> {
        x.chunks(cols)
            .flat_map(|r| {
                let rs = 1.0 / (r.iter().map(|v| v * v).sum::<f64>() / cols as f64 + eps).sqrt();
                r.iter().zip(w).map(move |(v, wv)| v * rs * wv).collect::<Vec<_>>()
            })
            .collect()
    }

    /// Reference backward from the full Jacobian of each row: O(cols^2), independent of the kernel's
    /// closed form.
    fn reference_backward(x: &[f64], w: &[f64], gy: &[f64], cols: usize, eps: f64) -> (Vec<f64>, Vec<f64>) {
        let mut gx = vec![0.0; x.len()];
        let mut gw = vec![0.0; cols];
        for (row, xr) in x.chunks(cols).enumerate() {
            let gr = &gy[row * cols..][..cols];
            let ms = xr.iter().map(|v| v * v).sum::<f64>() / cols as f64 + eps;
            let r = 1.0 / ms.sqrt();
            for k in 0..cols {
                let mut s = 0.0;
                for i in 0..cols {
                    let dn = if i == k { r } else { 0.0 } - xr[i] * xr[k] * r * r * r / cols as f64;
                    s += gr[i] * w[i] * dn;
                }
                gx[row * cols + k] = s;
                gw[k] += gr[k] * xr[k] * r;
            }
        }
        (gx, gw)
    }

    /// The forward's block for x [rows, cols] and w, writing y (of dtype `yd`) and rstd unless it is null.
    fn forward_block<X: Element, W: Element>(
        x: &[X],
        w: &[W],
        y: *mut std::ffi::c_void,
        rstd: *mut std::ffi::c_void,
        eps: f64,
        yd: BastileDType,
        after_weight: bool,
        weight_offset: f32,
    ) -> RmsNormForward {
        let (x_dtype, w_dtype, y_dtype) = (X::DTYPE as i32, W::DTYPE as i32, yd as i32);
        let (rows, cols) = ((x.len() / w.len()) as i64, w.len() as i64);
        let (x, weight, cast_after_weight) = (x.as_ptr().cast(), w.as_ptr().cast(), after_weight as i32);
        RmsNormForward { x, weight, y, rstd, rows, cols, eps, x_dtype, w_dtype, y_dtype, cast_after_weight, weight_offset,
                         ..Default::default() }
    }

    /// Runs forward and backward of the CPU kernels for one dtype pair and checks them against the
    /// f64 references on the same (rounded) inputs, the weight there plus `offset` exactly.
    /// `Y` is the output type: promote(X, W), or X when the cast comes after the weight.
    fn check<X: Element, W: Element, Y: Element>(xd: BastileDType, wd: BastileDType, rows: usize, cols: usize,
                                                 after_weight: bool, offset: f32) {
        let eps = 1e-6;
        // Four unit roundoffs of the coarsest dtype involved: each result is rounded at most twice.
        let yd = out_dtype(xd, wd, after_weight);
        let tol = 4.0 * unit(xd).max(unit(wd)).max(unit(yd));
        let x: Vec<X> = cast(&noise(rows * cols, 1, 2.0));
        let w: Vec<W> = cast(&noise(cols, 2, 2.0));
        let gy: Vec<Y> = cast(&noise(rows * cols, 3, 2.0));
        let (xf, gf) = (widen(&x), widen(&gy));
        let wf: Vec<f64> = widen(&w).iter().map(|v| v + offset as f64).collect();
        let mut y = vec![Y::from_f64(f64::NAN); rows * cols];
        let mut rstd = vec![0f64; rows]; // large enough for f32 or f64 statistics
        let mut p = forward_block(&x, &w, y.as_mut_ptr().cast(), rstd.as_mut_ptr().cast(), eps, yd, after_weight, offset);
        p.cpu().unwrap();
        let err = rel_err(&widen(&y), &reference_forward(&xf, &wf, cols, eps));
        assert!(err < tol, "{xd:?}/{wd:?}/{after_weight} {rows}x{cols}: forward error {err}");

        let mut gx = vec![X::from_f64(f64::NAN); rows * cols];
        let mut gw = vec![W::from_f64(f64::NAN); cols];
        let b = RmsNormBackward {
            grad_y: gy.as_ptr().cast(),
            x: p.x,
            weight: p.weight,
            rstd: p.rstd,
            grad_x: gx.as_mut_ptr().cast(),
            grad_w: gw.as_mut_ptr().cast(),
            rows: rows as i64,
            cols: cols as i64,
            x_dtype: xd as i32,
            w_dtype: wd as i32,
            y_dtype: p.y_dtype,
            cast_after_weight: p.cast_after_weight,
            weight_offset: offset,
            ..Default::default()
        };
        b.cpu().unwrap();
        let (rgx, rgw) = reference_backward(&xf, &wf, &gf, cols, eps);
        // grad_x = r*g*w - (cancelling term): measure against the size of r*g*w.
        let scale: f64 = (0..rows * cols)
            .map(|i| {
                let xr = &xf[i / cols * cols..][..cols];
                let r = 1.0 / (xr.iter().map(|v| v * v).sum::<f64>() / cols as f64 + eps).sqrt();
                (r * gf[i] * wf[i % cols]).powi(2)
            })
            .sum::<f64>()
            .sqrt();
        let (ex, ew) = (rel_err_floor(&widen(&gx), &rgx, scale), rel_err(&widen(&gw), &rgw));
        // Cast after weight sums dy * n with n at the statistics' precision, not rounded to x's dtype:
        // only w's rounding (and f32's) remains, which tells the modes apart for 16-bit x and f32 w.
        let tol_w = if after_weight { tol.min(16.0 * unit(wd).max(unit(xd).min(unit(BASTILE_F32)))) } else { tol };
        assert!(ex < tol && ew < tol_w, "{xd:?}/{wd:?}/{after_weight} {rows}x{cols}: grad_x error {ex}, grad_w error {ew}");
        p.rstd = std::ptr::null_mut();
        p.cpu().unwrap(); // inference path: no statistics written
    }

    #[test]
    fn cpu_kernels_match_f64_reference() {
        for &(rows, cols) in &[(1, 1), (7, 3), (33, 128), (5, 1000), (3, 2560)] {
            check::<f64, f64, f64>(BASTILE_F64, BASTILE_F64, rows, cols, false, 0.0);
            check::<f32, f32, f32>(BASTILE_F32, BASTILE_F32, rows, cols, false, 0.0);
            check::<f16, f16, f16>(BASTILE_F16, BASTILE_F16, rows, cols, false, 0.0);
            check::<bf16, bf16, bf16>(BASTILE_BF16, BASTILE_BF16, rows, cols, false, 0.0);
            check::<bf16, f32, f32>(BASTILE_BF16, BASTILE_F32, rows, cols, false, 0.0);
            check::<f32, bf16, f32>(BASTILE_F32, BASTILE_BF16, rows, cols, false, 0.0);
            check::<f16, bf16, f32>(BASTILE_F16, BASTILE_BF16, rows, cols, false, 0.0);
            // Cast after weight (GPT-OSS): y and grad_y in x's dtype.
            check::<f64, f64, f64>(BASTILE_F64, BASTILE_F64, rows, cols, true, 0.0);
            check::<f32, f32, f32>(BASTILE_F32, BASTILE_F32, rows, cols, true, 0.0);
            check::<bf16, bf16, bf16>(BASTILE_BF16, BASTILE_BF16, rows, cols, true, 0.0);
            check::<bf16, f32, bf16>(BASTILE_BF16, BASTILE_F32, rows, cols, true, 0.0);
            check::<f16, f32, f16>(BASTILE_F16, BASTILE_F32, rows, cols, true, 0.0);
            check::<f32, bf16, f32>(BASTILE_F32, BASTILE_BF16, rows, cols, true, 0.0);
            // Gemma's (1 + w).
            check::<f64, f64, f64>(BASTILE_F64, BASTILE_F64, rows, cols, true, 1.0);
            check::<f32, f32, f32>(BASTILE_F32, BASTILE_F32, rows, cols, true, 1.0);
            check::<bf16, bf16, bf16>(BASTILE_BF16, BASTILE_BF16, rows, cols, true, 1.0);
            check::<f16, f16, f16>(BASTILE_F16, BASTILE_F16, rows, cols, true, 1.0);
            check::<bf16, f32, bf16>(BASTILE_BF16, BASTILE_F32, rows, cols, true, 1.0);
        }
    }

    /// Where each mode rounds, element by element, computed here in f32 as torch does it.
    #[test]
    fn modes_round_where_hf_does() {
        let (rows, cols, eps) = (3, 64, 1e-6f64);
        let x: Vec<bf16> = cast(&noise(rows * cols, 4, 3.0));
        let w: Vec<f32> = noise(cols, 5, 2.0).iter().map(|&v| v as f32).collect();
        for after_weight in [false, true] {
            let yd = out_dtype(BASTILE_BF16, BASTILE_F32, after_weight);
            let mut y = vec![0f32; rows * cols]; // f32 output, or bf16 in its first half
            let p = forward_block(&x, &w, y.as_mut_ptr().cast(), std::ptr::null_mut(), eps, yd, after_weight, 0.0);
            p.cpu().unwrap();
            let got: Vec<f32> = if after_weight {
                unsafe { cpu::slice::<bf16>(p.y, rows * cols) }.iter().map(|v| v.to_f32()).collect()
            } else {
                y.clone()
            };
            for (row, xr) in x.chunks(cols).enumerate() {
                // The statistic as the kernels keep it (f32); everything after it in f32 arithmetic.
                let ss: f64 = xr.iter().map(|v| v.to_f64() * v.to_f64()).sum::<f64>() / cols as f64;
                let r = (1.0 / (ss + eps).sqrt()) as f32;
                for j in 0..cols {
                    let n = xr[j].to_f32() * r;
                    let want = if after_weight { bf16::from_f32(w[j] * n).to_f32() } else { w[j] * bf16::from_f32(n).to_f32() };
                    assert_eq!(got[row * cols + j], want, "cast after weight {after_weight} ({row},{j})");
                }
            }
        }
    }

    /// Gemma's RMSNorm as torch computes it: n and (1 + w) in f32, their product rounded once to x's dtype.
    #[test]
    fn offset_rounds_where_gemma_does() {
        let (rows, cols, eps) = (3, 64, 1e-6f64);
        let x: Vec<bf16> = cast(&noise(rows * cols, 6, 3.0));
        let w: Vec<bf16> = cast(&noise(cols, 7, 0.5));
        let mut y = vec![bf16::from_f32(f32::NAN); rows * cols];
        forward_block(&x, &w, y.as_mut_ptr().cast(), std::ptr::null_mut(), eps, BASTILE_BF16, true, 1.0).cpu().unwrap();
        for (row, xr) in x.chunks(cols).enumerate() {
            let ss: f64 = xr.iter().map(|v| v.to_f64() * v.to_f64()).sum::<f64>() / cols as f64;
            let r = (1.0 / (ss + eps).sqrt()) as f32;
            for j in 0..cols {
                let want = bf16::from_f32(xr[j].to_f32() * r * (1.0 + w[j].to_f32()));
                assert_eq!(y[row * cols + j], want, "({row},{j})");
            }
        }
        let p = forward_block(&x, &w, y.as_mut_ptr().cast(), std::ptr::null_mut(), eps, BASTILE_BF16, false, 1.0);
        assert!(p.cpu().unwrap_err().contains("weight_offset 1 needs cast_after_weight"));
    }

    #[test]
    fn weight_gradient_is_deterministic_and_sums_all_rows() {
        // Many rows, so that the reduction spans many parallel chunks.
        check::<f32, f32, f32>(BASTILE_F32, BASTILE_F32, 4099, 16, false, 0.0);
    }

    #[test]
    fn bad_dtype_codes_are_errors() {
        let p = RmsNormForward { x_dtype: 9, ..Default::default() };
        assert!(p.cpu().unwrap_err().contains("unknown dtype"));
    }

    fn kernel_name(dir: Tag, after_weight: bool, x: BastileDType, w: BastileDType, geo: &RowGeometry) -> &'static str {
        let tags = tags(dir, after_weight, x, w, geo);
        let index = if dir == Tag::Fwd { RmsNormForward::find(&tags) } else { RmsNormBackward::find(&tags) };
        let table = if dir == Tag::Fwd { RmsNormForward::KERNELS } else { RmsNormBackward::KERNELS };
        table[index.unwrap()].1
    }

    /// Every geometry the policies give, for every CUDA dtype pair and mode, has its kernel.
    #[test]
    fn every_geometry_has_a_kernel() {
        let cols = (1..=1100).chain([2048, 2560, 2880, 4096, 5120, 8192, 16384, 20000, 1 << 20]);
        for c in cols {
            for x in [BASTILE_F32, BASTILE_F16, BASTILE_BF16] {
                for vectorizable in [true, false] {
                    let fwd = geometry::rows_warp_first(c, x.size(), vectorizable);
                    let bwd = geometry::rows(c, x.size(), vectorizable);
                    for w in [BASTILE_F32, BASTILE_F16, BASTILE_BF16] {
                        for after_weight in [false, true] {
                            kernel_name(Tag::Fwd, after_weight, x, w, &fwd);
                            kernel_name(Tag::Bwd, after_weight, x, w, &bwd);
                        }
                    }
                }
            }
        }
    }

    /// The kernel each direction takes for a few shapes: short rows two at a time in the forward only.
    #[test]
    fn kernels_follow_the_geometry() {
        let g = geometry::rows_warp_first(4096, 2, true);
        assert_eq!(kernel_name(Tag::Fwd, false, BASTILE_BF16, BASTILE_F32, &g), "rms_norm_fwd_bf16_f32_vec_cached4");
        assert_eq!(kernel_name(Tag::Fwd, true, BASTILE_BF16, BASTILE_F32, &g), "rms_norm_fwd_bf16_f32_vec_cached4_cast_after_weight");
        let g = geometry::rows(1001, 2, true);
        assert_eq!(kernel_name(Tag::Bwd, false, BASTILE_F16, BASTILE_F16, &g), "rms_norm_bwd_f16_f16_scalar_streamed");
        let g = geometry::rows_warp_first(1024, 2, true);
        assert_eq!(kernel_name(Tag::Fwd, false, BASTILE_BF16, BASTILE_BF16, &g), "rms_norm_fwd_bf16_bf16_vec_cached4_two_rows");
        assert_eq!(kernel_name(Tag::Bwd, false, BASTILE_BF16, BASTILE_BF16, &g), "rms_norm_bwd_bf16_bf16_vec_cached4");
        let g = geometry::rows(1 << 20, 2, true);
        assert_eq!(kernel_name(Tag::Bwd, true, BASTILE_F16, BASTILE_F32, &g), "rms_norm_bwd_f16_f32_vec_streamed_cast_after_weight");
    }
}
