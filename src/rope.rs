//! Rotary position embedding: CUDA launchers for `cuda/rope.cu` and the CPU kernels (the reference
//! the GPU is tested against). Semantics of HF `apply_rotary_pos_emb` and of its autograd; see
//! `cuda/rope.cu` for the formulas and the rounding.
use crate::cpu::{self, Element};
use crate::driver::{Device, LaunchConfig, Result};
use crate::geometry;
use crate::kernels::{self, Launch, Plan, Tag};
use crate::params::{BastileDType, Rope, RopeTensor, ROPE_BLOCK, ROPE_HEADS_AT_ONCE};

/// Most threads of a block (the kernels' `__launch_bounds__`), and of one token's group.
const BLOCK: i64 = ROPE_BLOCK as i64;
/// Threads a block aims for: several tokens' groups when one is small (H100, bf16, 2x4096 tokens x 24
/// heads x 128: 96-thread blocks of two tokens measured among the best in a same-process sweep).
const TARGET_BLOCK: i64 = 128;
/// Most threads along the vector pairs of one head; longer heads loop.
const MAX_PAIR_THREADS: i64 = 128;
/// Heads a thread loads before it stores any.
const HEADS_AT_ONCE: i64 = ROPE_HEADS_AT_ONCE as i64;

/// Dtypes of the input, of cos/sin and of the output (the forward's promote(input, cos), the
/// backward's the input's).
fn dtypes(p: &Rope) -> Result<(BastileDType, BastileDType, BastileDType)> {
    Ok((BastileDType::from_raw(p.in_dtype)?, BastileDType::from_raw(p.cs_dtype)?, BastileDType::from_raw(p.out_dtype)?))
}

/// Elements per access: 16 bytes of the widest dtype involved (8 only for 16-bit pairs of one dtype,
/// the kernels that exist), halved until every pointer and stride and the pairs (`rot / 2`) are
/// multiples of it, and the passed elements (`head_dim - rot`) of twice it: the kernel's items, two
/// vectors each, never straddle the two parts of a head, in either layout of the pairs.
fn vector(p: &Rope, i: BastileDType, c: BastileDType, o: BastileDType) -> i64 {
    let mut vec = 16 / i.size().max(c.size()).max(o.size()) as i64;
    if vec == 8 && i != c {
        vec = 4;
    }
    let tensors = [(&p.q, i), (&p.k, i), (&p.q_out, o), (&p.k_out, o), (&p.cos, c), (&p.sin, c)];
    let fits = |v: i64, t: &RopeTensor, d: BastileDType| {
        geometry::aligned(t.data, v as usize * d.size())
            && [t.batch_stride, t.seq_stride, t.head_stride].iter().all(|s| s % v == 0)
    };
    let items_fit = |v: i64| (p.rot / 2) % v == 0 && (p.head_dim - p.rot) % (2 * v) == 0;
    while vec > 1 && !(items_fit(vec) && tensors.iter().all(|&(t, d)| fits(vec, t, d))) {
        vec /= 2;
    }
    vec
}

/// `p` with `vec`, `pair_threads`, `head_lanes` and `block` filled in: a token's threads cover a head's
/// items (vector pairs, then pairs of passed vectors) once, and each lane takes up to [`HEADS_AT_ONCE`]
/// heads a round (one load of the cos/sin vectors serves them all).
fn with_geometry(mut p: Rope, vec: i64) -> Rope {
    let items = (p.rot / 2 / vec + (p.head_dim - p.rot) / (2 * vec)).max(1);
    let heads = (p.q_heads + p.k_heads).max(1);
    let pair_threads = items.min(MAX_PAIR_THREADS);
    let head_lanes = geometry::ceil_div(heads, HEADS_AT_ONCE).min(BLOCK / pair_threads);
    let per_token = pair_threads * head_lanes;
    p.vec = vec as i32;
    p.pair_threads = pair_threads as i32;
    p.head_lanes = head_lanes as i32;
    p.block = (per_token * (TARGET_BLOCK / per_token).max(1)) as i32;
    p
}

fn direction(p: &Rope) -> Tag {
    if p.backward != 0 {
        Tag::Bwd
    } else {
        Tag::Fwd
    }
}

fn tags(p: &Rope, i: BastileDType, c: BastileDType) -> [Tag; 4] {
    let width = match p.vec {
        1 => Tag::V1,
        2 => Tag::V2,
        4 => Tag::V4,
        _ => Tag::V8,
    };
    [direction(p), i.tag(), c.tag(), width]
}

impl Launch for Rope {
    fn plan(&self, dev: &'static Device) -> Result<Plan> {
        let (i, c, o) = dtypes(self)?;
        if self.q_heads.max(self.k_heads) > i32::MAX as i64 {
            return Err("bastile.rope: more than 2^31 - 1 heads".into());
        }
        let p = with_geometry(*self, vector(self, i, c, o));
        let kernel = kernels::kernel::<Self>(dev, &tags(&p, i, c), p.block as u32)?;
        let tokens_per_block = (p.block / (p.pair_threads * p.head_lanes)) as i64;
        let blocks = geometry::ceil_div(p.batch * p.seq, tokens_per_block).max(1);
        let grid = geometry::grid(blocks, dev.sm_count() as i64 * kernel.blocks_per_sm as i64) as u32;
        Ok(Plan::single(kernel, LaunchConfig { grid: (grid, 1), block: (p.block as u32, 1), shared: 0 }, p))
    }

    fn cpu(&self) -> Result<()> {
        let (i, c, _) = dtypes(self)?;
        let backward = self.backward != 0;
        // SAFETY: the C++ layer checked shapes, strides and dtypes of every pointer in `p`.
        crate::with_dtypes!(i, c, |I, C, M| unsafe {
            if backward {
                rotate_cpu::<I, C, M, I>(self, backward)
            } else {
                rotate_cpu::<I, C, M, M>(self, backward)
            }
        });
        Ok(())
    }
}

/// Address of element `e` of head `h` of token (b, s).
fn at(t: &RopeTensor, b: i64, s: i64, h: i64, e: i64) -> usize {
    (b * t.batch_stride + s * t.seq_stride + h * t.head_stride + e) as usize
}

/// The parameter block shared by the CPU kernel's threads.
struct Shared<'a>(&'a Rope);
// SAFETY: the kernel only reads the block; through its pointers each token writes its own elements.
unsafe impl Sync for Shared<'_> {}
impl Shared<'_> {
    fn get(&self) -> &Rope {
        self.0
    }
}

/// As the CUDA kernel, in f64 with the same roundings: each product to `M` then `O`, the sum to `O`.
///
/// # Safety
/// Every pointer of `p` must address its tensor with the given strides, in the dtypes `I`, `C`, `O`;
/// distinct (token, head, element) of an output must be distinct elements, overlapping no input.
unsafe fn rotate_cpu<I: Element, C: Element, M: Element, O: Element>(p: &Rope, backward: bool) {
    let shared = Shared(p);
    let term = |a: f64, b: f64| O::round(M::round(a * b));
    let token_elements = ((p.q_heads + p.k_heads) * p.head_dim).max(1) as usize;
    cpu::parallel_for((p.batch * p.seq) as usize, cpu::GRAIN.div_ceil(token_elements), |tokens| {
        let p = shared.get();
        for tok in tokens.map(|t| t as i64) {
            let (b, s, half) = (tok / p.seq, tok % p.seq, p.rot / 2);
            let table = |t: &RopeTensor, e: i64| (*(t.data as *const C).add(at(t, b, s, 0, e))).to_f64();
            let heads = (0..p.q_heads).map(|h| (&p.q, &p.q_out, h)).chain((0..p.k_heads).map(|h| (&p.k, &p.k_out, h)));
            for (src, dst, h) in heads {
                let (x, y) = (src.data as *const I, dst.data as *mut O);
                for j in 0..half {
                    // The pair's elements, and the table entries of the second.
                    let (e1, e2, t2) = if p.interleaved != 0 { (2 * j, 2 * j + 1, j) } else { (j, j + half, j + half) };
                    let (c1, c2) = (table(&p.cos, j), table(&p.cos, t2));
                    let (s1, s2) = (table(&p.sin, j), table(&p.sin, t2));
                    let x1 = (*x.add(at(src, b, s, h, e1))).to_f64();
                    let x2 = (*x.add(at(src, b, s, h, e2))).to_f64();
                    let (o1, o2) = if backward {
                        (term(x1, c1) + term(x2, s2), term(x2, c2) - term(x1, s1))
                    } else {
                        (term(x1, c1) - term(x2, s1), term(x2, c2) + term(x1, s2))
                    };
                    *y.add(at(dst, b, s, h, e1)) = O::from_f64(o1);
                    *y.add(at(dst, b, s, h, e2)) = O::from_f64(o2);
                }
                for e in p.rot..p.head_dim {
                    *y.add(at(dst, b, s, h, e)) = O::from_f64((*x.add(at(src, b, s, h, e))).to_f64());
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::promote;
    use crate::kernels::Kernels;
    use crate::testing::{cast, noise, unit_roundoff as unit, widen};
    use half::{bf16, f16};
    use BastileDType::*;

    struct Shape {
        batch: usize,
        seq: usize,
        q_heads: usize,
        k_heads: usize,
        dim: usize,
        /// Rotated elements of each head, cos/sin's width.
        rot: usize,
        /// GLM's pairs (2j, 2j + 1) (else rotate_half's (i, i + rot / 2)).
        interleaved: bool,
        /// cos/sin differ per batch row (else one table broadcast over the batch).
        per_batch: bool,
        /// q/k stored [batch, seq, heads, dim] and seen as [batch, heads, seq, dim] (HF's views).
        transposed: bool,
    }

    /// Row-major strides of [batch, seq, heads] storage (or [batch, heads, seq]) as a RopeTensor.
    fn layout(data: *mut std::ffi::c_void, sh: &Shape, heads: usize, transposed: bool) -> RopeTensor {
        let (s, h, d) = (sh.seq as i64, heads as i64, sh.dim as i64);
        if transposed {
            RopeTensor { data, batch_stride: s * h * d, seq_stride: h * d, head_stride: d }
        } else {
            RopeTensor { data, batch_stride: h * s * d, seq_stride: d, head_stride: s * d }
        }
    }

    /// The forward as a matrix on a head of `n` elements, out[i] = sum_j m[i][j] x[j], from the (possibly
    /// unrelated) cos and sin as HF's formulas define it: `x * cos + rotate_half(x) * sin` on the first
    /// rot = cos.len() elements, the rest passed (Phi-3's torch.cat); interleaved, GLM's rotate_half and
    /// its tables' first half repeated twice each. The backward is its transpose.
    fn forward_matrix(n: usize, c: &[f64], s: &[f64], interleaved: bool) -> Vec<Vec<f64>> {
        let (rot, h) = (c.len(), c.len() / 2);
        let table = |t: &[f64], i: usize| if interleaved { t[i / 2] } else { t[i] };
        // rotate_half(x)[i] = sum_j r[i][j] x[j].
        let mut r = vec![vec![0.0; rot]; rot];
        for i in 0..h {
            let (a, b) = if interleaved { (2 * i, 2 * i + 1) } else { (i, i + h) };
            r[a][b] = -1.0;
            r[b][a] = 1.0;
        }
        let mut m = vec![vec![0.0; n]; n];
        for i in 0..n {
            if i >= rot {
                m[i][i] = 1.0;
                continue;
            }
            m[i][i] = table(c, i);
            for j in 0..rot {
                m[i][j] += table(s, i) * r[i][j];
            }
        }
        m
    }

    fn check<I: Element, C: Element>(id: BastileDType, cd: BastileDType, sh: &Shape, backward: bool) {
        let od = if backward { id } else { promote(id, cd) };
        let (b, s, d, rot) = (sh.batch, sh.seq, sh.dim, sh.rot);
        let tb = if sh.per_batch { b } else { 1 };
        let q: Vec<I> = cast(&noise(b * s * sh.q_heads * d, 1, 2.0));
        let k: Vec<I> = cast(&noise(b * s * sh.k_heads * d, 2, 2.0));
        let cos: Vec<C> = cast(&noise(tb * s * rot, 3, 2.0));
        let sin: Vec<C> = cast(&noise(tb * s * rot, 4, 2.0));
        let nan = |n| vec![f64::NAN; n];
        crate::with_dtypes!(od, od, |O, _W, _Y| {
            let mut qo: Vec<O> = cast(&nan(q.len()));
            let mut ko: Vec<O> = cast(&nan(k.len()));
            let table = |data: *const C| RopeTensor {
                data: data as *mut _,
                batch_stride: if sh.per_batch { (s * rot) as i64 } else { 0 },
                seq_stride: rot as i64,
                head_stride: 0,
            };
            let p = Rope {
                q: layout(q.as_ptr() as *mut _, sh, sh.q_heads, sh.transposed),
                k: layout(k.as_ptr() as *mut _, sh, sh.k_heads, sh.transposed),
                // Outputs in the other layout: strides of inputs and outputs are independent.
                q_out: layout(qo.as_mut_ptr().cast(), sh, sh.q_heads, !sh.transposed),
                k_out: layout(ko.as_mut_ptr().cast(), sh, sh.k_heads, !sh.transposed),
                cos: table(cos.as_ptr()),
                sin: table(sin.as_ptr()),
                batch: b as i64,
                seq: s as i64,
                q_heads: sh.q_heads as i64,
                k_heads: sh.k_heads as i64,
                head_dim: d as i64,
                rot: rot as i64,
                interleaved: sh.interleaved as i32,
                in_dtype: id as i32,
                cs_dtype: cd as i32,
                out_dtype: od as i32,
                backward: backward as i32,
                ..Default::default()
            };
            p.cpu().unwrap();
            // Each result is a sum of two products, each rounded at most three times, then rounded:
            // a few units of the output dtype relative to the terms' size (a passed element is exact).
            let tol = 8.0 * unit(od).max(unit(promote(id, cd)));
            let (qf, kf, cf, sf) = (widen(&q), widen(&k), widen(&cos), widen(&sin));
            let (qof, kof) = (widen(&qo), widen(&ko));
            for (x, out, heads, tin, tout) in
                [(&qf, &qof, sh.q_heads, &p.q, &p.q_out), (&kf, &kof, sh.k_heads, &p.k, &p.k_out)]
            {
                for bi in 0..b as i64 {
                    for si in 0..s as i64 {
                        let row = ((if sh.per_batch { bi } else { 0 }) * s as i64 + si) as usize * rot;
                        let m = forward_matrix(d, &cf[row..row + rot], &sf[row..row + rot], sh.interleaved);
                        let entry = |i: usize, j: usize| if backward { m[j][i] } else { m[i][j] };
                        for h in 0..heads as i64 {
                            let xv: Vec<f64> = (0..d as i64).map(|e| x[at(tin, bi, si, h, e)]).collect();
                            for e in 0..d {
                                let got = out[at(tout, bi, si, h, e as i64)];
                                let want: f64 = (0..d).map(|j| entry(e, j) * xv[j]).sum();
                                let scale: f64 = (0..d).map(|j| (entry(e, j) * xv[j]).abs()).sum();
                                assert!(
                                    (got - want).abs() <= tol * scale,
                                    "{id:?}/{cd:?} {rot}/{d} interleaved={} backward={backward} b={bi} s={si} \
                                     h={h} e={e}: {got} vs {want}",
                                    sh.interleaved
                                );
                            }
                        }
                    }
                }
            }
        });
    }

    fn shapes() -> Vec<Shape> {
        let shape = |batch, seq, q_heads, k_heads, dim, rot, interleaved, per_batch, transposed| Shape {
            batch,
            seq,
            q_heads,
            k_heads,
            dim,
            rot,
            interleaved,
            per_batch,
            transposed,
        };
        vec![
            shape(2, 5, 4, 2, 8, 8, false, true, true),
            shape(1, 3, 1, 1, 2, 2, false, false, false),
            shape(3, 4, 2, 1, 128, 128, false, false, true),
            shape(2, 2, 3, 0, 6, 6, false, true, false),
            // Partial (Phi-4-mini's 96 of 128), interleaved (GLM-4's 64 of 128, and full), odd tails.
            shape(2, 3, 4, 2, 128, 96, false, true, true),
            shape(2, 3, 4, 2, 128, 64, true, false, true),
            shape(1, 4, 2, 1, 16, 16, true, true, false),
            shape(2, 2, 3, 1, 10, 4, false, false, false),
            shape(2, 2, 3, 1, 10, 2, true, true, true),
        ]
    }

    #[test]
    fn cpu_kernels_match_f64_reference() {
        for sh in &shapes() {
            for backward in [false, true] {
                check::<f64, f64>(BASTILE_F64, BASTILE_F64, sh, backward);
                check::<f32, f32>(BASTILE_F32, BASTILE_F32, sh, backward);
                check::<f16, f16>(BASTILE_F16, BASTILE_F16, sh, backward);
                check::<bf16, bf16>(BASTILE_BF16, BASTILE_BF16, sh, backward);
                check::<bf16, f32>(BASTILE_BF16, BASTILE_F32, sh, backward);
                check::<f32, bf16>(BASTILE_F32, BASTILE_BF16, sh, backward);
                check::<f16, bf16>(BASTILE_F16, BASTILE_BF16, sh, backward);
            }
        }
    }

    #[test]
    fn rounding_matches_hf_expression() {
        // bf16: q*cos and rotate_half(q)*sin are each rounded to bf16, then their sum.
        let x = [bf16::from_f32(1.0), bf16::from_f32(1.0 / 256.0)];
        let c = [bf16::from_f32(1.0 + 1.0 / 128.0); 2];
        let s = [bf16::from_f32(0.75); 2];
        let mut out = [bf16::ZERO; 2];
        let t = |data: *const bf16| RopeTensor { data: data as *mut _, batch_stride: 0, seq_stride: 0, head_stride: 2 };
        let p = Rope {
            q: t(x.as_ptr()),
            q_out: t(out.as_mut_ptr()),
            cos: t(c.as_ptr()),
            sin: t(s.as_ptr()),
            batch: 1,
            seq: 1,
            q_heads: 1,
            head_dim: 2,
            rot: 2,
            in_dtype: BASTILE_BF16 as i32,
            cs_dtype: BASTILE_BF16 as i32,
            out_dtype: BASTILE_BF16 as i32,
            ..Default::default()
        };
        p.cpu().unwrap();
        let r = |v: f32| bf16::from_f32(v).to_f32();
        let want0 = r(r(1.0 * (1.0 + 1.0 / 128.0)) - r(1.0 / 256.0 * 0.75));
        let want1 = r(r(1.0 / 256.0 * (1.0 + 1.0 / 128.0)) + r(0.75));
        assert_eq!((out[0].to_f32(), out[1].to_f32()), (want0, want1));
    }

    #[test]
    fn vector_width_follows_alignment() {
        let t = |addr: usize, stride: i64| RopeTensor {
            data: addr as *mut _,
            batch_stride: stride,
            seq_stride: stride,
            head_stride: 128,
        };
        let mut p = Rope {
            q: t(4096, 2048),
            k: t(8192, 1024),
            q_out: t(4096, 2048),
            k_out: t(8192, 1024),
            cos: t(64, 128),
            sin: t(1024, 128),
            head_dim: 128,
            rot: 128,
            ..Default::default()
        };
        assert_eq!(vector(&p, BASTILE_BF16, BASTILE_BF16, BASTILE_BF16), 8);
        assert_eq!(vector(&p, BASTILE_BF16, BASTILE_F32, BASTILE_F32), 4);
        assert_eq!(vector(&p, BASTILE_BF16, BASTILE_F16, BASTILE_F32), 4);
        p.k.seq_stride = 1028; // a view with a 4-element offset between tokens
        assert_eq!(vector(&p, BASTILE_BF16, BASTILE_BF16, BASTILE_BF16), 4);
        p.cos.data = 66 as *mut _;
        assert_eq!(vector(&p, BASTILE_BF16, BASTILE_BF16, BASTILE_BF16), 1);
        p.cos.data = 64 as *mut _;
        p.head_dim = 72; // half a head is 36 elements
        p.rot = 72;
        assert_eq!(vector(&p, BASTILE_F16, BASTILE_F16, BASTILE_F16), 4);
        // Partial: the pairs (rot / 2) are whole vectors and the passed elements whole items of two, in
        // either layout.
        (p.head_dim, p.rot, p.k.seq_stride) = (128, 96, 1024);
        assert_eq!(vector(&p, BASTILE_BF16, BASTILE_BF16, BASTILE_BF16), 8);
        p.interleaved = 1;
        p.rot = 64;
        assert_eq!(vector(&p, BASTILE_BF16, BASTILE_BF16, BASTILE_BF16), 8);
        p.rot = 120; // 60 pairs
        assert_eq!(vector(&p, BASTILE_BF16, BASTILE_BF16, BASTILE_BF16), 4);
        p.rot = 124; // 4 elements passed
        assert_eq!(vector(&p, BASTILE_BF16, BASTILE_BF16, BASTILE_BF16), 2);
        (p.head_dim, p.rot) = (104, 96); // 48 pairs, but 8 passed elements: one item of two 4-element vectors
        assert_eq!(vector(&p, BASTILE_BF16, BASTILE_BF16, BASTILE_BF16), 4);
    }

    #[test]
    fn plan_covers_pairs_and_heads() {
        for (dim, rot, q_heads, k_heads, vec) in [
            (128, 128, 16, 8, 8),
            (128, 128, 32, 8, 8),
            (64, 64, 1, 1, 8),
            (256, 256, 16, 8, 4),
            (6, 6, 3, 0, 1),
            (4096, 4096, 2, 2, 1),
            (128, 64, 32, 2, 8),
            (128, 2, 4, 4, 2),
        ] {
            let p = Rope { head_dim: dim, rot, q_heads, k_heads, ..Default::default() };
            let p = with_geometry(p, vec);
            let (pt, lanes, block) = (p.pair_threads as i64, p.head_lanes as i64, p.block as i64);
            assert!(
                pt >= 1 && lanes >= 1 && block <= BLOCK && block % (pt * lanes) == 0,
                "{dim} {rot} {q_heads} {k_heads}: {pt} {lanes} {block}"
            );
            assert!(pt <= (rot / 2 / vec + (dim - rot) / 2 / vec).max(1) && lanes <= (q_heads + k_heads).max(1));
        }
        // Qwen3-style GQA at head_dim 128: 6 lanes of 4 heads, two tokens per 96-thread block.
        let p = with_geometry(Rope { head_dim: 128, rot: 128, q_heads: 16, k_heads: 8, ..Default::default() }, 8);
        assert_eq!((p.pair_threads, p.head_lanes, p.block), (8, 6, 96));
        // 40 heads: 10 lanes, one token per block.
        let p = with_geometry(Rope { q_heads: 32, ..p }, 8);
        assert_eq!((p.pair_threads, p.head_lanes, p.block), (8, 10, 80));
        // Two heads: one lane, 16 tokens per block.
        let p = with_geometry(Rope { head_dim: 128, rot: 128, q_heads: 1, k_heads: 1, ..Default::default() }, 8);
        assert_eq!((p.pair_threads, p.head_lanes, p.block), (8, 1, 128));
        // Many heads of a long head dim: lanes capped by the block, the rest in rounds.
        let p = with_geometry(Rope { head_dim: 4096, rot: 4096, q_heads: 64, k_heads: 64, ..Default::default() }, 8);
        assert_eq!((p.pair_threads, p.head_lanes, p.block), (128, 2, 256));
        // GLM-4-9B (half the head rotated, 32/2 heads): 4 items of pairs and 4 of passed elements a head.
        let p = with_geometry(Rope { head_dim: 128, rot: 64, q_heads: 32, k_heads: 2, ..Default::default() }, 8);
        assert_eq!((p.pair_threads, p.head_lanes, p.block), (8, 9, 72));
    }

    #[test]
    fn bad_dtype_code_is_an_error() {
        let p = Rope { in_dtype: 9, ..Default::default() };
        assert!(p.cpu().unwrap_err().contains("unknown dtype"));
    }

    /// Every width `vector` can choose has its kernel, for every CUDA dtype pair and direction.
    #[test]
    fn every_launch_has_a_kernel() {
        let dts = [BASTILE_F32, BASTILE_F16, BASTILE_BF16];
        for (i, c) in dts.iter().flat_map(|&i| dts.iter().map(move |&c| (i, c))) {
            let q = RopeTensor { data: 4096 as *mut _, ..Default::default() };
            let p = Rope { q, head_dim: 128, rot: 128, ..Default::default() };
            let widest = vector(&Rope { q_out: p.q, k_out: p.q, k: p.q, cos: p.q, sin: p.q, ..p }, i, c, promote(i, c));
            for backward in [0, 1] {
                for vec in (0..4).map(|k| 1 << k).filter(|&v| v <= widest) {
                    let p = with_geometry(Rope { backward, ..p }, vec);
                    Rope::find(&tags(&p, i, c)).unwrap();
                }
            }
        }
        let p = with_geometry(Rope { head_dim: 128, rot: 128, backward: 1, ..Default::default() }, 1);
        assert_eq!(Rope::KERNELS[Rope::find(&tags(&p, BASTILE_F16, BASTILE_F32)).unwrap()].1, "rope_bwd_f16_f32_v1");
    }
}
