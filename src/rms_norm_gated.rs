//! Gated RMSNorm of Qwen3.5 (HF `Qwen3_5RMSNormGated`; the formulas are in `cuda/rms_norm_gated.cu`): CUDA
//! launchers and the CPU kernels, the reference the GPU is tested against. With `n = x * rsqrt(mean(x^2) +
//! eps)` rounded to x's dtype as HF rounds it, statistics in f32 (f64 for f64 input), `y = w * n * silu(z)`
//! is computed in f64 and rounded once to x's dtype.
use crate::cpu::{self, Disjoint, Element};
use crate::driver::{Device, LaunchConfig, Result};
use crate::geometry;
use crate::kernels::{self, Launch, Plan, Tag};
use crate::params::{BastileDType, RmsNormGatedBackward, RmsNormGatedForward, RowGeometry};

fn dtypes(x: i32, w: i32) -> Result<(BastileDType, BastileDType)> {
    Ok((BastileDType::from_raw(x)?, BastileDType::from_raw(w)?))
}

/// Runs `$kernel::<X, W>(p)` on the block's dtypes.
macro_rules! on_dtypes {
    ($p:expr, $kernel:ident) => {{
        let (xd, wd) = dtypes($p.dtype, $p.w_dtype)?;
        // SAFETY: the C++ layer checked shapes, strides and dtypes of every pointer in the block.
        crate::with_dtypes!(xd, wd, |X, W, _Y| unsafe { $kernel::<X, W>($p) });
        Ok(())
    }};
}

/// The tags of the kernel of a direction and dtypes for rows laid out as `geo`.
fn tags(dir: Tag, x: BastileDType, w: BastileDType, geo: &RowGeometry) -> Vec<Tag> {
    let mut tags = vec![dir, x.tag(), w.tag()];
    tags.extend(geo.layout_tags());
    tags
}

impl Launch for RmsNormGatedForward {
    fn plan(&self, dev: &'static Device) -> Result<Plan> {
        let (x, w) = dtypes(self.dtype, self.w_dtype)?;
        let mut p = *self;
        let tensors = [(p.x, x), (p.z, x), (p.y.cast_const(), x), (p.weight, w)];
        p.geo = geometry::for_tensors(geometry::rows_warp_first, p.cols, x, &tensors, &[p.z_stride]);
        let kernel = kernels::kernel::<Self>(dev, &tags(Tag::Fwd, x, w, &p.geo), p.geo.block as u32)?;
        // Every row group its block, as rms_norm's forward; the kernel loops past 2^31 - 1 blocks.
        let grid = p.geo.blocks_for(p.rows).min(i32::MAX as i64);
        Ok(Plan::single(kernel, LaunchConfig { grid: (grid as u32, 1), block: (p.geo.block as u32, 1), shared: 0 }, p))
    }

    fn cpu(&self) -> Result<()> {
        on_dtypes!(self, forward_cpu)
    }
}

impl Launch for RmsNormGatedBackward {
    /// The rows kernel writes f32 partial sums of the weight gradient into the scratch ([partials, cols]),
    /// which the reduce kernel folds.
    fn plan(&self, dev: &'static Device) -> Result<Plan> {
        let (x, w) = dtypes(self.dtype, self.w_dtype)?;
        let mut p = *self;
        let tensors = [(p.grad_y, x), (p.x, x), (p.z, x), (p.grad_x.cast_const(), x), (p.grad_z.cast_const(), x), (p.weight, w)];
        p.geo = geometry::for_tensors(geometry::rows, p.cols, x, &tensors, &[p.z_stride]);
        let kernel = kernels::kernel::<Self>(dev, &tags(Tag::Bwd, x, w, &p.geo), p.geo.block as u32)?;
        let reduce = kernels::kernel::<Self>(dev, &[Tag::Bwd, Tag::Reduce, w.tag()], geometry::FOLD_BLOCK.0 * geometry::FOLD_BLOCK.1)?;
        // One resident wave, as rms_norm's backward: each block folds all its rows into one partial.
        let wave = dev.sm_count() as i64 * kernel.blocks_per_sm.min(geometry::BACKWARD_BLOCKS_PER_SM) as i64;
        let grid = p.geo.blocks_for(p.rows).min(wave);
        p.partials = grid * p.geo.partials_per_block();
        let cfg = LaunchConfig { grid: (grid as u32, 1), block: (p.geo.block as u32, 1), shared: p.geo.fold_bytes(p.cols) as u32 };
        let reduce_cfg = LaunchConfig { grid: (geometry::ceil_div(p.cols, 32) as u32, 1), block: geometry::FOLD_BLOCK, shared: 0 };
        Ok(Plan::with_fold(p.partials * p.cols * 4, p, |p| &mut p.partial, (kernel, cfg), (reduce, reduce_cfg)))
    }

    fn cpu(&self) -> Result<()> {
        on_dtypes!(self, backward_cpu)
    }
}

/// Elements of z: `rows` rows of `cols`, `stride` apart.
fn z_len(rows: usize, cols: usize, stride: i64) -> usize {
    if rows == 0 {
        0
    } else {
        (rows - 1) * stride as usize + cols
    }
}

fn sigmoid(z: f64) -> f64 {
    1.0 / (1.0 + (-z).exp())
}

/// The statistic as the kernels keep it: f32, unless the input is f64.
fn rstd_value<X: Element>(r: f64) -> f64 {
    if X::DTYPE == BastileDType::BASTILE_F64 {
        r
    } else {
        <f32 as Element>::round(r)
    }
}

unsafe fn forward_cpu<X: Element, W: Element>(p: &RmsNormGatedForward) {
    let (rows, cols, zs, eps) = (p.rows as usize, p.cols as usize, p.z_stride as usize, p.eps);
    let x = cpu::slice::<X>(p.x, rows * cols);
    let z = cpu::slice::<X>(p.z, z_len(rows, cols, p.z_stride));
    let w: Vec<f64> = cpu::slice::<W>(p.weight, cols).iter().map(|v| v.to_f64()).collect();
    let y = Disjoint::new(cpu::slice_mut::<X>(p.y, rows * cols));
    let mut rstd = vec![0f64; rows];
    let rstd_rows = Disjoint::new(&mut rstd);
    cpu::parallel_for(rows, cpu::GRAIN.div_ceil(cols.max(1)), |range| {
        // SAFETY: the ranges of parallel_for do not overlap.
        let (yc, rc) = (y.part(range.start * cols..range.end * cols), rstd_rows.part(range.clone()));
        for ((yr, row), rs) in yc.chunks_mut(cols).zip(range).zip(rc) {
            let (xr, zr) = (&x[row * cols..][..cols], &z[row * zs..][..cols]);
            let ss: f64 = xr.iter().map(|v| v.to_f64() * v.to_f64()).sum();
            *rs = rstd_value::<X>(1.0 / (ss / cols as f64 + eps).sqrt());
            for (((yv, xv), zv), wv) in yr.iter_mut().zip(xr).zip(zr).zip(&w) {
                let zf = zv.to_f64();
                *yv = X::from_f64(wv * X::round(xv.to_f64() * *rs) * (zf * sigmoid(zf)));
            }
        }
    });
    if p.rstd.is_null() {
        return;
    }
    if X::DTYPE == BastileDType::BASTILE_F64 {
        cpu::slice_mut::<f64>(p.rstd, rows).copy_from_slice(&rstd);
    } else {
        for (o, r) in cpu::slice_mut::<f32>(p.rstd, rows).iter_mut().zip(&rstd) {
            *o = *r as f32;
        }
    }
}

unsafe fn backward_cpu<X: Element, W: Element>(p: &RmsNormGatedBackward) {
    let (rows, cols, zs) = (p.rows as usize, p.cols as usize, p.z_stride as usize);
    let x = cpu::slice::<X>(p.x, rows * cols);
    let z = cpu::slice::<X>(p.z, z_len(rows, cols, p.z_stride));
    let gy = cpu::slice::<X>(p.grad_y, rows * cols);
    let w: Vec<f64> = cpu::slice::<W>(p.weight, cols).iter().map(|v| v.to_f64()).collect();
    let gx = Disjoint::new(cpu::slice_mut::<X>(p.grad_x, rows * cols));
    let gz = Disjoint::new(cpu::slice_mut::<X>(p.grad_z, rows * cols));
    let rstd: Vec<f64> = if X::DTYPE == BastileDType::BASTILE_F64 {
        cpu::slice::<f64>(p.rstd, rows).to_vec()
    } else {
        cpu::slice::<f32>(p.rstd, rows).iter().map(|&r| r as f64).collect()
    };
    // Chunking depends on the shape alone, so the weight gradient's summation order (and value) does not
    // depend on the thread count.
    let chunk = rows.div_ceil(256).max(16);
    let partials = cpu::parallel_map(rows.div_ceil(chunk), |c| {
        let chunk_rows = c * chunk..((c + 1) * chunk).min(rows);
        let elements = chunk_rows.start * cols..chunk_rows.end * cols;
        let mut dw = vec![0f64; cols];
        // SAFETY: each chunk writes its own rows.
        let (gxc, gzc) = (gx.part(elements.clone()), gz.part(elements));
        for ((gxr, gzr), row) in gxc.chunks_mut(cols).zip(gzc.chunks_mut(cols)).zip(chunk_rows) {
            let (xr, zr, gr, r) = (&x[row * cols..][..cols], &z[row * zs..][..cols], &gy[row * cols..][..cols], rstd[row]);
            // dy * silu(z), the gradient of w * n.
            let gated: Vec<f64> = gr.iter().zip(zr).map(|(g, zv)| g.to_f64() * zv.to_f64() * sigmoid(zv.to_f64())).collect();
            let dot: f64 = (0..cols).map(|j| gated[j] * w[j] * xr[j].to_f64()).sum();
            let c3 = r * r * r * dot / cols as f64;
            for j in 0..cols {
                let (xv, zv, g) = (xr[j].to_f64(), zr[j].to_f64(), gr[j].to_f64());
                let (n, s) = (X::round(xv * r), sigmoid(zv));
                gxr[j] = X::from_f64(r * gated[j] * w[j] - xv * c3);
                gzr[j] = X::from_f64(g * w[j] * n * s * (1.0 + zv * (1.0 - s)));
                dw[j] += gated[j] * n;
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
    use crate::kernels::Kernels;
    use crate::testing::{cast, noise, rel_err, rel_err_floor, unit, widen};
    use half::{bf16, f16};
    use BastileDType::*;

    const EPS: f64 = 1e-6;

    /// silu and its derivative in another form than the kernels': z / (1 + e^-z), and
    /// (1 + e^-z + z e^-z) / (1 + e^-z)^2.
    fn silu(z: f64) -> f64 {
        z / (1.0 + (-z).exp())
    }
    fn silu_grad(z: f64) -> f64 {
        let e = (-z).exp();
        (1.0 + e + z * e) / ((1.0 + e) * (1.0 + e))
    }

    fn rms(r: &[f64]) -> f64 {
        (r.iter().map(|v| v * v).sum::<f64>() / r.len() as f64 + EPS).sqrt()
    }

    /// y in f64 with no intermediate rounding.
    fn reference_forward(x: &[f64], z: &[f64], w: &[f64]) -> Vec<f64> {
        let cols = w.len();
        let mut y = Vec::with_capacity(x.len());
        for (xr, zr) in x.chunks(cols).zip(z.chunks(cols)) {
            let m = rms(xr);
            y.extend((0..cols).map(|j| w[j] * xr[j] / m * silu(zr[j])));
        }
        y
    }

    /// (grad_x, grad_z, grad_w) in f64, grad_x from the full Jacobian of each row's norm: O(cols^2),
    /// independent of the kernels' closed form.
    fn reference_backward(x: &[f64], z: &[f64], w: &[f64], gy: &[f64]) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let cols = w.len();
        let (mut gx, mut gz, mut gw) = (vec![0.0; x.len()], vec![0.0; x.len()], vec![0.0; cols]);
        for row in 0..x.len() / cols {
            let (xr, zr, gr) = (&x[row * cols..][..cols], &z[row * cols..][..cols], &gy[row * cols..][..cols]);
            let m = rms(xr);
            for k in 0..cols {
                // d n_i / d x_k = delta_ik / m - x_i x_k / (cols m^3)
                gx[row * cols + k] = (0..cols)
                    .map(|i| gr[i] * w[i] * silu(zr[i]) * ((i == k) as u8 as f64 / m - xr[i] * xr[k] / (cols as f64 * m.powi(3))))
                    .sum();
                gz[row * cols + k] = gr[k] * w[k] * xr[k] / m * silu_grad(zr[k]);
                gw[k] += gr[k] * xr[k] / m * silu(zr[k]);
            }
        }
        (gx, gz, gw)
    }

    /// Outputs of both CPU kernels.
    struct Run<X, W> {
        y: Vec<X>,
        gx: Vec<X>,
        gz: Vec<X>,
        gw: Vec<W>,
    }

    /// Runs both CPU kernels on x, z (rows `z_stride` apart), w and dy.
    fn run<X: Element, W: Element>(x: &[X], z: &[X], z_stride: usize, w: &[W], gy: &[X]) -> Run<X, W> {
        let (cols, n) = (w.len(), x.len());
        let rows = n / cols;
        let nan = X::from_f64(f64::NAN);
        let (mut y, mut gx, mut gz, mut gw) = (vec![nan; n], vec![nan; n], vec![nan; n], vec![W::from_f64(f64::NAN); cols]);
        let mut rstd = vec![0f64; rows]; // room for f32 or f64 statistics
        let (dtype, w_dtype) = (X::DTYPE as i32, W::DTYPE as i32);
        let (rows, cols, z_stride) = (rows as i64, cols as i64, z_stride as i64);
        let (x, z, weight) = (x.as_ptr().cast(), z.as_ptr().cast(), w.as_ptr().cast());
        let rstd_ptr = rstd.as_mut_ptr().cast();
        RmsNormGatedForward { x, z, weight, y: y.as_mut_ptr().cast(), rstd: rstd_ptr, rows, cols, z_stride, eps: EPS, dtype,
                              w_dtype, ..Default::default() }
            .cpu()
            .unwrap();
        RmsNormGatedBackward { grad_y: gy.as_ptr().cast(), x, z, weight, rstd: rstd_ptr, grad_x: gx.as_mut_ptr().cast(),
                               grad_z: gz.as_mut_ptr().cast(), grad_w: gw.as_mut_ptr().cast(), rows, cols, z_stride, dtype,
                               w_dtype, ..Default::default() }
            .cpu()
            .unwrap();
        Run { y, gx, gz, gw }
    }

    /// z of `rows` rows `stride` apart (the gaps NaN, which no result may see) and the same rows packed.
    fn strided_gate<X: Element>(rows: usize, cols: usize, stride: usize, seed: u64) -> (Vec<X>, Vec<X>) {
        let packed: Vec<X> = cast(&noise(rows * cols, seed, 6.0));
        let mut z = vec![X::from_f64(f64::NAN); rows.saturating_sub(1) * stride + cols];
        for r in 0..rows {
            z[r * stride..][..cols].copy_from_slice(&packed[r * cols..][..cols]);
        }
        (z, packed)
    }

    /// The CPU kernels against the f64 references on the same (rounded) inputs, z read `z_stride` apart.
    fn check<X: Element, W: Element>(rows: usize, cols: usize, z_stride: usize) {
        let (xd, wd) = (X::DTYPE, W::DTYPE);
        // n and each result are rounded once each, plus f32 statistics: a few unit roundoffs.
        let tol = 4.0 * unit(xd).max(unit(wd));
        let x: Vec<X> = cast(&noise(rows * cols, 1, 2.0));
        let (z, zp) = strided_gate::<X>(rows, cols, z_stride, 2);
        let w: Vec<W> = cast(&noise(cols, 3, 2.0));
        let gy: Vec<X> = cast(&noise(rows * cols, 4, 2.0));
        let out = run(&x, &z, z_stride, &w, &gy);
        let (xf, zf, wf, gf) = (widen(&x), widen(&zp), widen(&w), widen(&gy));
        let what = format!("{xd:?}/{wd:?} {rows}x{cols}, z stride {z_stride}");
        let ey = rel_err(&widen(&out.y), &reference_forward(&xf, &zf, &wf));
        assert!(ey < tol, "{what}: forward error {ey}");
        let (rgx, rgz, rgw) = reference_backward(&xf, &zf, &wf, &gf);
        // grad_x = r * g - (a term that cancels it): measured against the size of r * g.
        let scale = (0..rows * cols)
            .map(|i| (gf[i] * wf[i % cols] * silu(zf[i]) / rms(&xf[i / cols * cols..][..cols])).powi(2))
            .sum::<f64>()
            .sqrt();
        let ex = rel_err_floor(&widen(&out.gx), &rgx, scale);
        let (ez, ew) = (rel_err(&widen(&out.gz), &rgz), rel_err(&widen(&out.gw), &rgw));
        assert!(ex < tol && ez < tol && ew < tol, "{what}: grad_x error {ex}, grad_z {ez}, grad_w {ew}");
    }

    #[test]
    fn cpu_kernels_match_f64_reference() {
        for &(rows, cols) in &[(1, 1), (7, 3), (33, 128), (5, 1000), (2, 2560)] {
            for z_stride in [cols, cols + 5] {
                check::<f64, f64>(rows, cols, z_stride);
                check::<f32, f32>(rows, cols, z_stride);
                check::<f16, f16>(rows, cols, z_stride);
                check::<bf16, bf16>(rows, cols, z_stride);
                check::<bf16, f32>(rows, cols, z_stride);
                check::<f32, bf16>(rows, cols, z_stride);
                check::<f16, bf16>(rows, cols, z_stride);
            }
        }
    }

    /// y = to_bf16(w * to_bf16(x * r) * silu(z)): n rounded where HF rounds it, the rest once; computed here
    /// element by element, and told apart from a y whose n is not rounded.
    #[test]
    fn rounds_where_hf_does() {
        let (rows, cols) = (3, 64);
        let x: Vec<bf16> = cast(&noise(rows * cols, 5, 3.0));
        let z: Vec<bf16> = cast(&noise(rows * cols, 6, 6.0));
        let w: Vec<f32> = noise(cols, 7, 2.0).iter().map(|&v| v as f32).collect();
        let y = run(&x, &z, cols, &w, &x).y;
        let mut unrounded = 0;
        for (row, xr) in x.chunks(cols).enumerate() {
            let r = (1.0 / rms(&widen(xr))) as f32 as f64;
            for j in 0..cols {
                let (xv, zv, wv) = (xr[j].to_f64(), z[row * cols + j].to_f64(), w[j] as f64);
                let round = <bf16 as Element>::from_f64;
                let want = round(wv * round(xv * r).to_f64() * silu(zv));
                assert_eq!(y[row * cols + j], want, "({row},{j})");
                unrounded += (round(wv * xv * r * silu(zv)) != want) as usize;
            }
        }
        assert!(unrounded > 0);
    }

    #[test]
    fn strided_gate_reads_only_its_rows() {
        let (rows, cols) = (9, 40);
        let x: Vec<f32> = cast(&noise(rows * cols, 8, 2.0));
        let (z, zp) = strided_gate::<f32>(rows, cols, cols + 24, 9);
        let w: Vec<bf16> = cast(&noise(cols, 10, 2.0));
        let (strided, packed) = (run(&x, &z, cols + 24, &w, &x), run(&x, &zp, cols, &w, &x));
        assert_eq!((strided.y, strided.gx, strided.gz, strided.gw), (packed.y, packed.gx, packed.gz, packed.gw));
    }

    #[test]
    fn weight_gradient_is_deterministic_and_sums_all_rows() {
        // Many rows, so that the reduction spans many parallel chunks.
        check::<f32, f32>(4099, 16, 16);
        let x: Vec<f32> = cast(&noise(4099 * 16, 11, 2.0));
        let w: Vec<f32> = cast(&noise(16, 12, 2.0));
        assert_eq!(run(&x, &x, 16, &w, &x).gw, run(&x, &x, 16, &w, &x).gw);
    }

    #[test]
    fn bad_dtype_codes_are_errors() {
        let p = RmsNormGatedForward { dtype: 9, ..Default::default() };
        assert!(p.cpu().unwrap_err().contains("unknown dtype"));
    }

    fn kernel_name(dir: Tag, x: BastileDType, w: BastileDType, geo: &RowGeometry) -> &'static str {
        let tags = tags(dir, x, w, geo);
        if dir == Tag::Fwd {
            RmsNormGatedForward::KERNELS[RmsNormGatedForward::find(&tags).unwrap()].1
        } else {
            RmsNormGatedBackward::KERNELS[RmsNormGatedBackward::find(&tags).unwrap()].1
        }
    }

    /// Every geometry the policies give, for every CUDA dtype pair, has its kernel.
    #[test]
    fn every_geometry_has_a_kernel() {
        for c in (1..=1100).chain([2048, 4096, 5120, 8192, 16384, 20000, 1 << 20]) {
            for x in [BASTILE_F32, BASTILE_F16, BASTILE_BF16] {
                for vectorizable in [true, false] {
                    let (fwd, bwd) = (geometry::rows_warp_first(c, x.size(), vectorizable), geometry::rows(c, x.size(), vectorizable));
                    for w in [BASTILE_F32, BASTILE_F16, BASTILE_BF16] {
                        kernel_name(Tag::Fwd, x, w, &fwd);
                        kernel_name(Tag::Bwd, x, w, &bwd);
                    }
                }
            }
        }
    }

    /// Qwen3.5's head_v_dim of 128: four lanes a row in the forward, sixteen in the backward; a gate whose
    /// row stride breaks 16-byte vectors takes the scalar kernels.
    #[test]
    fn kernels_follow_the_geometry() {
        let aligned = 256 as *const std::ffi::c_void;
        let geo = |policy: fn(i64, usize, bool) -> RowGeometry, stride: i64| {
            geometry::for_tensors(policy, 128, BASTILE_BF16, &[(aligned, BASTILE_BF16)], &[stride])
        };
        let (fwd, bwd) = (geo(geometry::rows_warp_first, 128), geo(geometry::rows, 128));
        assert_eq!((fwd.group, bwd.group), (4, 16));
        assert_eq!(kernel_name(Tag::Fwd, BASTILE_BF16, BASTILE_BF16, &fwd), "rms_norm_gated_fwd_bf16_bf16_vec_cached4");
        assert_eq!(kernel_name(Tag::Bwd, BASTILE_BF16, BASTILE_F32, &bwd), "rms_norm_gated_bwd_bf16_f32_vec_cached1");
        let odd = geo(geometry::rows, 132);
        assert_eq!(kernel_name(Tag::Bwd, BASTILE_BF16, BASTILE_BF16, &odd), "rms_norm_gated_bwd_bf16_bf16_scalar_streamed");
    }
}
