//! Fused per-head RMSNorm of q and k followed by rotary embedding (Qwen3 attention's `q_norm`,
//! `k_norm` and `apply_rotary_pos_emb`): CUDA launchers for `cuda/qk_norm_rope.cu` and the CPU
//! kernels (the reference the GPU is tested against). Per row (one token, one head) of D elements:
//! `n = to_N(w * to_X(x * rsqrt(mean(x^2) + eps)))` with N = promote(x, w) and statistics in f32
//! (f64 for f64 input), or with `cast_after_weight` (Gemma 3 and 4) `n = to_X((w + weight_offset) * x *
//! rsqrt(...))` in f32 and N = X, then `out = to_R(to_R(n * cos) + to_R(rotate_half(n) * sin))` with
//! R = promote(N, cos), `rotate_half(v) = cat(-v[D/2:], v[:D/2])`.
use crate::cpu::{self, promote, Element};
use crate::driver::{Device, LaunchConfig, Result};
use crate::geometry;
use crate::kernels::{self, Launch, Plan, Tag};
use crate::params::{BastileDType, QkNormRopeBackward, QkNormRopeForward, QkNormRopeShape, RowGeometry};
use crate::rms_norm::{casts_after_weight, weight_value};
use half::{bf16, f16};
use std::ffi::c_void;

/// Element types of x (q and k), the weights and cos/sin.
type DTypes = (BastileDType, BastileDType, BastileDType);

fn dtypes(x: i32, w: i32, c: i32) -> Result<DTypes> {
    Ok((BastileDType::from_raw(x)?, BastileDType::from_raw(w)?, BastileDType::from_raw(c)?))
}

/// The dtype of the normalised q and k: promote(x, w), or x's when the cast comes after the weight.
fn normed_dtype((x, w, _): DTypes, after_weight: bool) -> BastileDType {
    if after_weight {
        x
    } else {
        promote(x, w)
    }
}

/// HF's dtype of the result: promote(normed, cos).
fn out_dtype(d: DTypes, after_weight: bool) -> BastileDType {
    promote(normed_dtype(d, after_weight), d.2)
}

/// Threads of a block: enough rows per block for small heads, and room in `__launch_bounds__(256)`.
const BLOCK: i32 = 128;

/// The vec variant when every tensor allows V-element vectors (V = 16 bytes of x) at every row
/// start and each half row is at most 32 vectors; otherwise a warp per row, element by element.
/// `tensors`: (pointer, dtype, element strides of the row starts).
fn cuda_geometry(head_dim: i64, x: BastileDType, tensors: &[(*const c_void, BastileDType, &[i64])]) -> RowGeometry {
    let v = 16 / x.size() as i64;
    let half = head_dim / 2;
    let aligned = tensors
        .iter()
        .all(|&(ptr, dt, strides)| geometry::aligned(ptr, v as usize * dt.size()) && strides.iter().all(|s| s % v == 0));
    if aligned && half % v == 0 && half / v <= 32 {
        let group = ((half / v) as u32).next_power_of_two() as i32;
        RowGeometry { vec: v as i32, per_thread: 1, group, block: BLOCK }
    } else {
        RowGeometry { vec: 1, per_thread: 0, group: 32, block: BLOCK }
    }
}

/// The geometry for q, k, their weights and the tables (`inputs`, in that order) and `outputs`.
fn geometry_of(
    s: &QkNormRopeShape,
    (x, w, c): DTypes,
    inputs: [*const c_void; 6],
    outputs: &[(*const c_void, BastileDType, &[i64])],
) -> RowGeometry {
    let [q, k, qw, kw, cos, sin] = inputs;
    let mut tensors: Vec<(*const c_void, BastileDType, &[i64])> =
        vec![(q, x, &s.q_stride), (k, x, &s.k_stride), (qw, w, &[]), (kw, w, &[]), (cos, c, &s.cos_stride), (sin, c, &s.sin_stride)];
    tensors.extend_from_slice(outputs);
    cuda_geometry(s.head_dim, x, &tensors)
}

fn tags(dir: Tag, (x, w, c): DTypes, after_weight: bool, geo: &RowGeometry) -> Vec<Tag> {
    let mut tags = vec![dir, x.tag(), w.tag(), c.tag(), if geo.vec > 1 { Tag::Vec } else { Tag::Scalar }];
    tags.extend(after_weight.then_some(Tag::CastAfterWeight));
    tags
}

fn tokens(s: &QkNormRopeShape) -> i64 {
    s.batch * s.seq
}

/// The kernels index rows and tokens in 32 bits (element offsets are 64-bit).
fn check_rows(s: &QkNormRopeShape) -> Result<()> {
    if tokens(s) * (s.q_heads + s.k_heads) >= 1 << 31 {
        return Err("bastile.qk_norm_rope: more than 2^31 (token, head) rows are not supported".into());
    }
    if s.head_dim % 2 != 0 || s.head_dim <= 0 {
        return Err(format!("bastile.qk_norm_rope: head_dim must be even and positive, got {}", s.head_dim));
    }
    Ok(())
}

impl Launch for QkNormRopeForward {
    fn plan(&self, dev: &'static Device) -> Result<Plan> {
        let d = dtypes(self.x_dtype, self.w_dtype, self.c_dtype)?;
        let cw = casts_after_weight("qk_norm_rope", self.cast_after_weight, self.weight_offset)?;
        check_rows(&self.shape)?;
        let (mut p, s, o) = (*self, &self.shape, out_dtype(d, cw));
        let inputs = [p.q, p.k, p.q_weight, p.k_weight, p.cos, p.sin];
        p.geo = geometry_of(s, d, inputs, &[(p.q_out, o, &[s.head_dim]), (p.k_out, o, &[s.head_dim])]);
        let kernel = kernels::kernel::<Self>(dev, &tags(Tag::Fwd, d, cw, &p.geo), p.geo.block as u32)?;
        let rows = tokens(s) * (s.q_heads + s.k_heads);
        let grid = geometry::grid(p.geo.blocks_for(rows), dev.sm_count() as i64 * kernel.blocks_per_sm as i64) as u32;
        Ok(Plan::single(kernel, LaunchConfig { grid: (grid, 1), block: (p.geo.block as u32, 1), shared: 0 }, p))
    }

    fn cpu(&self) -> Result<()> {
        forward_cpu(self)
    }
}

fn partials_per_block(geo: &RowGeometry) -> i64 {
    if geo.vec > 1 {
        1
    } else {
        geo.rows_per_block()
    }
}

impl Launch for QkNormRopeBackward {
    /// The rows kernel writes f32 partial sums of the weight gradients into the scratch
    /// ([2, partials, head_dim]: q's, then k's), which the reduce kernel folds.
    fn plan(&self, dev: &'static Device) -> Result<Plan> {
        let d = dtypes(self.x_dtype, self.w_dtype, self.c_dtype)?;
        let cw = casts_after_weight("qk_norm_rope", self.cast_after_weight, self.weight_offset)?;
        check_rows(&self.shape)?;
        let (mut p, s, o, (x, w, _)) = (*self, &self.shape, out_dtype(d, cw), d);
        let inputs = [p.q, p.k, p.q_weight, p.k_weight, p.cos, p.sin];
        let gradients = [
            (p.grad_q, o, &p.grad_q_stride[..]),
            (p.grad_k, o, &p.grad_k_stride[..]),
            (p.grad_q_in as *const c_void, x, &[s.head_dim][..]),
            (p.grad_k_in as *const c_void, x, &[s.head_dim][..]),
        ];
        p.geo = geometry_of(s, d, inputs, &gradients);
        let kernel = kernels::kernel::<Self>(dev, &tags(Tag::Bwd, d, cw, &p.geo), p.geo.block as u32)?;
        let reduce = kernels::kernel::<Self>(dev, &[Tag::Bwd, Tag::Reduce, w.tag()], geometry::FOLD_BLOCK.0 * geometry::FOLD_BLOCK.1)?;
        // One resident wave: each block folds all its rows of one weight into one partial (per group
        // in the scalar variant).
        let rows = tokens(s) * s.q_heads.max(s.k_heads);
        let grid = p.geo.blocks_for(rows).min(dev.sm_count() as i64 * kernel.blocks_per_sm as i64);
        p.partials = grid * partials_per_block(&p.geo);
        // The vec variant folds its groups' shares in shared memory: [groups][head_dim] f32.
        let shared = if p.geo.vec > 1 { p.geo.rows_per_block() * s.head_dim * 4 } else { 0 };
        let cfg = LaunchConfig { grid: (grid as u32, 1), block: (p.geo.block as u32, 1), shared: shared as u32 };
        let reduce_cfg = LaunchConfig { grid: (geometry::ceil_div(s.head_dim, 32) as u32, 2), block: geometry::FOLD_BLOCK, shared: 0 };
        Ok(Plan::with_fold(2 * p.partials * s.head_dim * 4, p, |p| &mut p.partial, (kernel, cfg), (reduce, reduce_cfg)))
    }

    fn cpu(&self) -> Result<()> {
        backward_cpu(self)
    }
}

// ------------------------------------------------------------------------------------------ CPU

/// A tensor of a dtype known at run time: the CPU kernels are the reference, not the fast path, so
/// they dispatch per element instead of instantiating every combination of three dtypes.
#[derive(Clone, Copy)]
struct Typed {
    ptr: *mut c_void,
    dt: BastileDType,
}

// SAFETY: the CPU kernels write disjoint rows from different threads.
unsafe impl Send for Typed {}
unsafe impl Sync for Typed {}

impl Typed {
    fn new(ptr: *const c_void, dt: BastileDType) -> Self {
        Typed { ptr: ptr as *mut c_void, dt }
    }

    /// # Safety
    /// Element `i` must be in bounds.
    unsafe fn get(self, i: i64) -> f64 {
        use BastileDType::*;
        let i = i as isize;
        match self.dt {
            BASTILE_F32 => *self.ptr.cast::<f32>().offset(i) as f64,
            BASTILE_F16 => (*self.ptr.cast::<f16>().offset(i)).to_f64(),
            BASTILE_BF16 => (*self.ptr.cast::<bf16>().offset(i)).to_f64(),
            BASTILE_F64 => *self.ptr.cast::<f64>().offset(i),
        }
    }

    /// # Safety
    /// Element `i` must be in bounds and written by no other thread.
    unsafe fn set(self, i: i64, v: f64) {
        use BastileDType::*;
        let i = i as isize;
        match self.dt {
            BASTILE_F32 => *self.ptr.cast::<f32>().offset(i) = <f32 as Element>::from_f64(v),
            BASTILE_F16 => *self.ptr.cast::<f16>().offset(i) = <f16 as Element>::from_f64(v),
            BASTILE_BF16 => *self.ptr.cast::<bf16>().offset(i) = <bf16 as Element>::from_f64(v),
            BASTILE_F64 => *self.ptr.cast::<f64>().offset(i) = v,
        }
    }
}

/// `v` stored in `dt` and read back, as torch rounds an intermediate.
fn round(dt: BastileDType, v: f64) -> f64 {
    use BastileDType::*;
    match dt {
        BASTILE_F32 => <f32 as Element>::round(v),
        BASTILE_F16 => <f16 as Element>::round(v),
        BASTILE_BF16 => <bf16 as Element>::round(v),
        BASTILE_F64 => v,
    }
}

/// One tensor's rows: (batch, seq, head) element strides, head count, and where its row r
/// (token-major) starts.
struct Rows {
    heads: i64,
    stride: [i64; 3],
    seq: i64,
}

impl Rows {
    /// (batch, position, element offset) of row r.
    fn locate(&self, r: i64) -> (i64, i64, i64) {
        let (token, head) = (r / self.heads, r % self.heads);
        let (b, s) = (token / self.seq, token % self.seq);
        (b, s, b * self.stride[0] + s * self.stride[1] + head * self.stride[2])
    }
}

/// `x * rs` as the weight multiplies it: rounded to x's dtype, or (cast after weight) to the statistics'.
fn scaled(xd: BastileDType, sd: BastileDType, after_weight: bool, v: f64) -> f64 {
    round(if after_weight { sd } else { xd }, v)
}

pub fn forward_cpu(p: &QkNormRopeForward) -> Result<()> {
    let (xd, wd, cd) = dtypes(p.x_dtype, p.w_dtype, p.c_dtype)?;
    let cw = casts_after_weight("qk_norm_rope", p.cast_after_weight, p.weight_offset)?;
    check_rows(&p.shape)?;
    let (nd, sd) = (normed_dtype((xd, wd, cd), cw), xd.stats());
    let rd = promote(nd, cd);
    let (s, eps) = (&p.shape.clone(), p.eps);
    let d = s.head_dim;
    let half = d / 2;
    let (cos, sin) = (Typed::new(p.cos, cd), Typed::new(p.sin, cd));
    let sides = [
        (p.q, p.q_weight, p.q_out, p.q_rstd, s.q_heads, s.q_stride),
        (p.k, p.k_weight, p.k_out, p.k_rstd, s.k_heads, s.k_stride),
    ];
    for (x, w, out, rstd, heads, stride) in sides {
        let (x, w, out, rstd) = (Typed::new(x, xd), Typed::new(w, wd), Typed::new(out, rd), Typed::new(rstd, sd));
        let rows = Rows { heads, stride, seq: s.seq };
        // SAFETY: the weight has head_dim elements.
        let ws: Vec<f64> = (0..d).map(|j| weight_value(unsafe { w.get(j) }, p.weight_offset, sd == BastileDType::BASTILE_F64)).collect();
        cpu::parallel_for((tokens(s) * heads) as usize, cpu::GRAIN.div_ceil(d as usize), |range| {
            for r in range.map(|r| r as i64) {
                let (b, t, off) = rows.locate(r);
                let cs = |st: [i64; 2]| b * st[0] + t * st[1];
                let (co, so) = (cs(s.cos_stride), cs(s.sin_stride));
                // SAFETY: the C++ layer checked shapes and strides; row r of out and rstd is this range's.
                unsafe {
                    let xs: Vec<f64> = (0..d).map(|j| x.get(off + j)).collect();
                    let ss: f64 = xs.iter().map(|v| v * v).sum();
                    let rs = round(sd, 1.0 / (ss / d as f64 + eps).sqrt());
                    if !rstd.ptr.is_null() {
                        rstd.set(r, rs);
                    }
                    // The product in the statistics' precision (f32 in the GPU's registers), then to N.
                    let n: Vec<f64> =
                        xs.iter().zip(&ws).map(|(x, w)| round(nd, round(sd, w * scaled(xd, sd, cw, x * rs)))).collect();
                    for j in 0..half {
                        let (lo, hi) = (n[j as usize], n[(j + half) as usize]);
                        let o_lo = round(rd, lo * cos.get(co + j)) + round(rd, -hi * sin.get(so + j));
                        let o_hi = round(rd, hi * cos.get(co + j + half)) + round(rd, lo * sin.get(so + j + half));
                        out.set(r * d + j, o_lo);
                        out.set(r * d + j + half, o_hi);
                    }
                }
            }
        });
    }
    Ok(())
}

pub fn backward_cpu(p: &QkNormRopeBackward) -> Result<()> {
    let (xd, wd, cd) = dtypes(p.x_dtype, p.w_dtype, p.c_dtype)?;
    let cw = casts_after_weight("qk_norm_rope", p.cast_after_weight, p.weight_offset)?;
    check_rows(&p.shape)?;
    let (sd, gd) = (xd.stats(), out_dtype((xd, wd, cd), cw));
    let s = &p.shape.clone();
    let d = s.head_dim;
    let half = d / 2;
    let (cos, sin) = (Typed::new(p.cos, cd), Typed::new(p.sin, cd));
    let sides = [
        (p.grad_q, p.grad_q_stride, p.q, p.q_weight, p.q_rstd, p.grad_q_in, p.grad_q_weight, s.q_heads, s.q_stride),
        (p.grad_k, p.grad_k_stride, p.k, p.k_weight, p.k_rstd, p.grad_k_in, p.grad_k_weight, s.k_heads, s.k_stride),
    ];
    for (g, g_stride, x, w, rstd, gx, gw, heads, stride) in sides {
        let (g, x, w) = (Typed::new(g, gd), Typed::new(x, xd), Typed::new(w, wd));
        let (rstd, gx, gw) = (Typed::new(rstd, sd), Typed::new(gx, xd), Typed::new(gw, wd));
        let (xrows, grows) = (Rows { heads, stride, seq: s.seq }, Rows { heads, stride: g_stride, seq: s.seq });
        // SAFETY (all accesses below): the C++ layer checked shapes and strides; each chunk writes
        // only its own rows of grad_x.
        let ws: Vec<f64> = (0..d).map(|j| weight_value(unsafe { w.get(j) }, p.weight_offset, sd == BastileDType::BASTILE_F64)).collect();
        let rows = tokens(s) * heads;
        // Chunking depends on the shape alone, so the weight gradient's summation order (and
        // value) does not depend on the thread count.
        let chunk = (rows / 256).max(16);
        let partials = cpu::parallel_map(geometry::ceil_div(rows, chunk) as usize, |c| {
            let c = c as i64;
            let mut dw = vec![0f64; d as usize];
            let mut gn = vec![0f64; d as usize];
            for r in c * chunk..((c + 1) * chunk).min(rows) {
                let (b, t, off) = xrows.locate(r);
                let goff = grows.locate(r).2;
                let cs = |st: [i64; 2]| b * st[0] + t * st[1];
                let (co, so) = (cs(s.cos_stride), cs(s.sin_stride));
                unsafe {
                    for j in 0..half {
                        let (g_lo, g_hi) = (g.get(goff + j), g.get(goff + j + half));
                        gn[j as usize] = g_lo * cos.get(co + j) + g_hi * sin.get(so + j + half);
                        gn[(j + half) as usize] = g_hi * cos.get(co + j + half) - g_lo * sin.get(so + j);
                    }
                    let rs = rstd.get(r);
                    let xs: Vec<f64> = (0..d).map(|j| x.get(off + j)).collect();
                    let dot: f64 = (0..d as usize).map(|j| gn[j] * ws[j] * xs[j]).sum();
                    let c3 = rs * rs * rs * dot / d as f64;
                    for j in 0..d as usize {
                        gx.set(r * d + j as i64, rs * gn[j] * ws[j] - xs[j] * c3);
                        dw[j] += gn[j] * scaled(xd, sd, cw, xs[j] * rs);
                    }
                }
            }
            dw
        });
        for j in 0..d as usize {
            // SAFETY: grad_w has head_dim elements.
            unsafe { gw.set(j as i64, partials.iter().map(|dw| dw[j]).sum()) };
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::Kernels;
    use crate::testing::{noise, rel_err_floor, unit};
    use BastileDType::*;

    /// A buffer of `dt` elements (stored as raw bytes, 8 per element to fit any dtype).
    struct Buf {
        data: Vec<u64>,
        dt: BastileDType,
    }

    impl Buf {
        fn from(v: &[f64], dt: BastileDType) -> Buf {
            let b = Buf { data: vec![0; v.len()], dt };
            for (i, x) in v.iter().enumerate() {
                unsafe { b.typed().set(i as i64, *x) };
            }
            b
        }
        fn nan(n: usize, dt: BastileDType) -> Buf {
            Buf::from(&vec![f64::NAN; n], dt)
        }
        fn typed(&self) -> Typed {
            Typed::new(self.data.as_ptr().cast(), self.dt)
        }
        fn ptr(&self) -> *const c_void {
            self.data.as_ptr().cast()
        }
        fn mut_ptr(&mut self) -> *mut c_void {
            self.data.as_mut_ptr().cast()
        }
        fn values(&self) -> Vec<f64> {
            (0..self.data.len()).map(|i| unsafe { self.typed().get(i as i64) }).collect()
        }
    }

    struct Case {
        batch: usize,
        seq: usize,
        hq: usize,
        hk: usize,
        d: usize,
        /// cos/sin differ per batch row (packed sequences) instead of one [seq, d] table.
        per_batch_cos: bool,
    }

    /// The row's forward map as matrices, independent of the kernels' pairwise formulas: the
    /// rotation M (out = M n) and the normalisation's Jacobian J (dn = J dx).
    fn rotation(c: &[f64], s: &[f64]) -> Vec<Vec<f64>> {
        let d = c.len();
        let h = d / 2;
        let mut m = vec![vec![0.0; d]; d];
        for i in 0..d {
            m[i][i] = c[i];
            // rotate_half(n)[i] = -n[i + h] for i < h, n[i - h] otherwise.
            if i < h {
                m[i][i + h] = -s[i];
            } else {
                m[i][i - h] = s[i];
            }
        }
        m
    }

    fn matvec(m: &[Vec<f64>], v: &[f64]) -> Vec<f64> {
        m.iter().map(|row| row.iter().zip(v).map(|(a, b)| a * b).sum()).collect()
    }

    fn transpose(m: &[Vec<f64>]) -> Vec<Vec<f64>> {
        (0..m[0].len()).map(|j| m.iter().map(|row| row[j]).collect()).collect()
    }

    /// Runs the CPU kernels on q and k living inside one fused [batch, seq, hq + 2 hk, d] buffer
    /// (strided, as HF's slices of a fused projection), and checks them against the matrices.
    /// `offset`: None rounds as Qwen3's norm, Some(o) casts after the weight plus o.
    fn check(case: &Case, (xd, wd, cd): DTypes, offset: Option<f32>) {
        let (cw, weight_offset) = (offset.is_some(), offset.unwrap_or(0.0));
        let Case { batch, seq, hq, hk, d, per_batch_cos } = *case;
        let eps = 1e-6;
        let heads = hq + 2 * hk;
        let fused = Buf::from(&noise(batch * seq * heads * d, 1, 2.0), xd);
        let stride = [(seq * heads * d) as i64, (heads * d) as i64, d as i64];
        let (qw, kw) = (Buf::from(&noise(d, 2, 2.0), wd), Buf::from(&noise(d, 3, 2.0), wd));
        let cs_rows = if per_batch_cos { batch * seq } else { seq };
        let angle: Vec<f64> = noise(cs_rows * d, 4, 2.0).iter().map(|a| a * 3.0).collect();
        let cos = Buf::from(&angle.iter().map(|a| a.cos()).collect::<Vec<_>>(), cd);
        let sin = Buf::from(&angle.iter().map(|a| a.sin()).collect::<Vec<_>>(), cd);
        let cs_stride = [if per_batch_cos { (seq * d) as i64 } else { 0 }, d as i64];
        let out_dt = out_dtype((xd, wd, cd), cw);
        let shape = QkNormRopeShape {
            batch: batch as i64,
            seq: seq as i64,
            q_heads: hq as i64,
            k_heads: hk as i64,
            head_dim: d as i64,
            q_stride: stride,
            k_stride: stride,
            cos_stride: cs_stride,
            sin_stride: cs_stride,
        };
        let (mut q_out, mut k_out) = (Buf::nan(batch * seq * hq * d, out_dt), Buf::nan(batch * seq * hk * d, out_dt));
        let (mut q_rstd, mut k_rstd) = (Buf::nan(batch * seq * hq, xd.stats()), Buf::nan(batch * seq * hk, xd.stats()));
        let k_ptr = unsafe { fused.typed().ptr.cast::<u8>().add(hq * d * xd.size()) };
        let p = QkNormRopeForward {
            q: fused.ptr(),
            k: k_ptr.cast(),
            q_weight: qw.ptr(),
            k_weight: kw.ptr(),
            cos: cos.ptr(),
            sin: sin.ptr(),
            q_out: q_out.mut_ptr(),
            k_out: k_out.mut_ptr(),
            q_rstd: q_rstd.mut_ptr(),
            k_rstd: k_rstd.mut_ptr(),
            shape,
            eps,
            x_dtype: xd as i32,
            w_dtype: wd as i32,
            c_dtype: cd as i32,
            cast_after_weight: cw as i32,
            weight_offset,
            ..Default::default()
        };
        forward_cpu(&p).unwrap();

        let gq_all = noise(batch * seq * hq * d * 2, 5, 2.0); // grad_q read through a transposed-like stride
        let gk = noise(batch * seq * hk * d, 6, 2.0);
        let (gq_buf, gk_buf) = (Buf::from(&gq_all, out_dt), Buf::from(&gk, out_dt));
        let (mut gq_in, mut gk_in) = (Buf::nan(batch * seq * hq * d, xd), Buf::nan(batch * seq * hk * d, xd));
        let (mut gqw, mut gkw) = (Buf::nan(d, wd), Buf::nan(d, wd));
        let b = QkNormRopeBackward {
            grad_q: gq_buf.ptr(),
            grad_k: gk_buf.ptr(),
            q: p.q,
            k: p.k,
            q_weight: p.q_weight,
            k_weight: p.k_weight,
            cos: p.cos,
            sin: p.sin,
            q_rstd: p.q_rstd,
            k_rstd: p.k_rstd,
            grad_q_in: gq_in.mut_ptr(),
            grad_k_in: gk_in.mut_ptr(),
            grad_q_weight: gqw.mut_ptr(),
            grad_k_weight: gkw.mut_ptr(),
            // grad_q: every other head slot of a [batch, seq, 2 hq, d] buffer.
            grad_q_stride: [(seq * 2 * hq * d) as i64, (2 * hq * d) as i64, (2 * d) as i64],
            grad_k_stride: [(seq * hk * d) as i64, (hk * d) as i64, d as i64],
            shape,
            x_dtype: xd as i32,
            w_dtype: wd as i32,
            c_dtype: cd as i32,
            cast_after_weight: cw as i32,
            weight_offset,
            ..Default::default()
        };
        backward_cpu(&b).unwrap();

        // Reference, row by row, in f64 on the same (rounded) inputs.
        let (xs, cosv, sinv) = (fused.values(), cos.values(), sin.values());
        let (gq_vals, gk_vals) = (gq_buf.values(), gk_buf.values());
        let tol = 6.0 * [xd, wd, cd, out_dt].iter().map(|&t| unit(t)).fold(0.0, f64::max);
        for (is_k, heads_n, w, out, rstd, gin, gw) in
            [(false, hq, &qw, &q_out, &q_rstd, &gq_in, &gqw), (true, hk, &kw, &k_out, &k_rstd, &gk_in, &gkw)]
        {
            let wv: Vec<f64> = w.values().iter().map(|v| v + weight_offset as f64).collect();
            let (outv, rstdv, ginv) = (out.values(), rstd.values(), gin.values());
            let mut gw_ref = vec![0.0; d];
            let (mut y_ref, mut gx_ref, mut scale) = (vec![], vec![], 0.0);
            for r in 0..batch * seq * heads_n {
                let (token, head) = (r / heads_n, r % heads_n);
                let (bi, si) = (token / seq, token % seq);
                let slot = if is_k { hq + head } else { head };
                let x = &xs[(token * heads + slot) * d..][..d];
                let cs_row = if per_batch_cos { bi * seq + si } else { si };
                let m = rotation(&cosv[cs_row * d..][..d], &sinv[cs_row * d..][..d]);
                let rs = 1.0 / (x.iter().map(|v| v * v).sum::<f64>() / d as f64 + eps).sqrt();
                assert!((rstdv[r] - rs).abs() <= 2.0 * unit(xd.stats()) * rs, "rstd row {r}");
                let n: Vec<f64> = x.iter().zip(&wv).map(|(a, w)| a * rs * w).collect();
                y_ref.extend(matvec(&m, &n));
                let g: Vec<f64> = if is_k {
                    gk_vals[r * d..][..d].to_vec()
                } else {
                    gq_vals[(token * 2 * hq + 2 * head) * d..][..d].to_vec()
                };
                let gn = matvec(&transpose(&m), &g);
                for k in 0..d {
                    let mut acc = 0.0;
                    for i in 0..d {
                        let dn = wv[i] * (if i == k { rs } else { 0.0 } - x[i] * x[k] * rs.powi(3) / d as f64);
                        acc += gn[i] * dn;
                    }
                    gx_ref.push(acc);
                    gw_ref[k] += gn[k] * x[k] * rs;
                    scale += (rs * gn[k] * wv[k]).powi(2);
                }
            }
            let e_y = rel_err_floor(&outv, &y_ref, 0.0);
            let e_x = rel_err_floor(&ginv, &gx_ref, scale.sqrt());
            let e_w = rel_err_floor(&gw.values(), &gw_ref, 0.0);
            assert!(
                e_y < tol && e_x < tol && e_w < tol,
                "{xd:?}/{wd:?}/{cd:?} {offset:?} k={is_k} d={d}: out {e_y}, grad_x {e_x}, grad_w {e_w} (tol {tol})"
            );
        }
    }

    #[test]
    fn cpu_kernels_match_f64_matrices() {
        let cases = [
            Case { batch: 2, seq: 3, hq: 4, hk: 2, d: 8, per_batch_cos: false },
            Case { batch: 2, seq: 5, hq: 2, hk: 2, d: 64, per_batch_cos: true },
            Case { batch: 1, seq: 3, hq: 4, hk: 1, d: 128, per_batch_cos: false },
            Case { batch: 3, seq: 1, hq: 1, hk: 1, d: 2, per_batch_cos: true },
        ];
        let combos = [
            (BASTILE_F64, BASTILE_F64, BASTILE_F64),
            (BASTILE_F32, BASTILE_F32, BASTILE_F32),
            (BASTILE_BF16, BASTILE_BF16, BASTILE_BF16),
            (BASTILE_F16, BASTILE_F16, BASTILE_F16),
            (BASTILE_BF16, BASTILE_F32, BASTILE_BF16),
            (BASTILE_F16, BASTILE_BF16, BASTILE_F32),
        ];
        for case in &cases {
            for &dt in &combos {
                for offset in [None, Some(0.0), Some(1.0)] {
                    check(case, dt, offset);
                }
            }
        }
    }

    #[test]
    fn weight_gradient_sums_many_chunks() {
        let case = Case { batch: 4, seq: 300, hq: 3, hk: 2, d: 16, per_batch_cos: true };
        check(&case, (BASTILE_F32, BASTILE_F32, BASTILE_F32), None);
        check(&case, (BASTILE_BF16, BASTILE_F32, BASTILE_BF16), Some(1.0));
    }

    #[test]
    fn bad_dtype_codes_rounding_modes_and_odd_head_dim_are_errors() {
        let mut p = QkNormRopeForward { x_dtype: 9, ..Default::default() };
        assert!(forward_cpu(&p).unwrap_err().contains("unknown dtype"));
        p.x_dtype = BASTILE_F32 as i32;
        p.weight_offset = 1.0;
        assert!(forward_cpu(&p).unwrap_err().contains("qk_norm_rope: weight_offset 1 needs cast_after_weight"));
        p.cast_after_weight = 2;
        assert!(forward_cpu(&p).unwrap_err().contains("cast_after_weight must be 0 or 1, got 2"));
        p.cast_after_weight = 1;
        p.shape.head_dim = 3;
        assert!(forward_cpu(&p).unwrap_err().contains("even"));
    }

    #[test]
    fn geometry_keeps_rotation_pairs_in_one_lane() {
        let aligned = 4096 as *const c_void;
        let strides: &[i64] = &[1 << 20, 3072, 128];
        let geo = |d: i64, x: BastileDType, ptr: *const c_void, st: &[i64]| cuda_geometry(d, x, &[(ptr, x, st)]);
        // bf16: 8-element vectors, one of each half per lane.
        assert_eq!((geo(128, BASTILE_BF16, aligned, strides).group, geo(128, BASTILE_BF16, aligned, strides).vec), (8, 8));
        assert_eq!(geo(64, BASTILE_BF16, aligned, strides).group, 4);
        assert_eq!(geo(256, BASTILE_BF16, aligned, strides).group, 16);
        assert_eq!(geo(192, BASTILE_BF16, aligned, strides).group, 16); // 12 lanes busy
        assert_eq!((geo(128, BASTILE_F32, aligned, strides).group, geo(128, BASTILE_F32, aligned, strides).vec), (16, 4));
        // Misaligned pointers or strides, odd half rows and long rows go element by element.
        for g in [
            geo(128, BASTILE_BF16, 4098 as *const c_void, strides),
            geo(128, BASTILE_BF16, aligned, &[1 << 20, 3073, 128]),
            geo(12, BASTILE_BF16, aligned, &[24]),
            geo(1024, BASTILE_BF16, aligned, &[1024]),
        ] {
            assert_eq!((g.vec, g.group), (1, 32));
        }
    }

    /// Both variants exist for every CUDA dtype triple, in both directions, with the weight gradients'
    /// folds.
    #[test]
    fn every_launch_has_a_kernel() {
        let dts = [BASTILE_F32, BASTILE_F16, BASTILE_BF16];
        let triples = dts.map(|x| dts.map(|w| dts.map(|c| (x, w, c))));
        for d in triples.iter().flatten().flatten().copied() {
            for geo in [cuda_geometry(128, d.0, &[]), cuda_geometry(6, d.0, &[])] {
                for cw in [false, true] {
                    QkNormRopeForward::find(&tags(Tag::Fwd, d, cw, &geo)).unwrap();
                    QkNormRopeBackward::find(&tags(Tag::Bwd, d, cw, &geo)).unwrap();
                }
            }
            QkNormRopeBackward::find(&[Tag::Bwd, Tag::Reduce, d.1.tag()]).unwrap();
        }
        let g = cuda_geometry(6, BASTILE_F16, &[]);
        let d = (BASTILE_F16, BASTILE_F16, BASTILE_F32);
        assert_eq!(QkNormRopeBackward::KERNELS[QkNormRopeBackward::find(&tags(Tag::Bwd, d, false, &g)).unwrap()].1,
                   "qk_norm_rope_bwd_f16_f16_f32_scalar");
        let g = cuda_geometry(128, BASTILE_BF16, &[]);
        let d = (BASTILE_BF16, BASTILE_F32, BASTILE_BF16);
        assert_eq!(QkNormRopeForward::KERNELS[QkNormRopeForward::find(&tags(Tag::Fwd, d, true, &g)).unwrap()].1,
                   "qk_norm_rope_fwd_bf16_f32_bf16_vec_cast_after_weight");
    }
}
