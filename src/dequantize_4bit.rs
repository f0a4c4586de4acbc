//! bitsandbytes' 4-bit weights to a dense dtype (the arithmetic is in `cuda/dequantize_4bit.cu`): the launch
//! of its kernels and the CPU kernel, which computes in f32 as bitsandbytes does, so both are bit for bit
//! bitsandbytes' `dequantize_4bit`.
use crate::cpu::{self, Disjoint, Element};
use crate::driver::{Device, LaunchConfig, Result};
use crate::geometry;
use crate::kernels::{self, Launch, Plan, Tag};
use crate::params::{BastileDType, Dequantize4bit, Quantized4bit, DEQUANTIZE_4BIT_BLOCK, DEQUANTIZE_4BIT_UNITS};

impl Dequantize4bit {
    fn parts(&self) -> &[Quantized4bit] {
        &self.parts[..self.count as usize]
    }

    fn dtype(&self) -> Result<BastileDType> {
        match BastileDType::from_raw(self.dtype)? {
            BastileDType::BASTILE_F64 => Err("bastile.dequantize_4bit: float64 output is not supported".into()),
            dt => Ok(dt),
        }
    }

    /// Whether 8-element units apply: every part a whole number of them, under one scale each, its codes
    /// 4-byte aligned, and `out` aligned for a unit's store (a part starts a whole number of units in).
    fn vectors(&self, dt: BastileDType) -> bool {
        self.parts().iter().all(|q| q.n % 8 == 0 && q.blocksize % 8 == 0 && geometry::aligned(q.packed.cast(), 4))
            && geometry::aligned(self.out, 8 * dt.size())
    }
}

/// A weight's scales as bitsandbytes computes them in f32.
enum Scales<'a> {
    Plain(&'a [f32]),
    Nested { codes: &'a [u8], absmax: &'a [f32], code: &'a [f32], blocksize: usize, offset: f32 },
}

impl Scales<'_> {
    /// # Safety
    /// The pointers of `q` hold what include/dequantize_4bit.h says.
    unsafe fn of(q: &Quantized4bit) -> Scales<'_> {
        let blocks = (q.n as usize).div_ceil(q.blocksize as usize);
        if q.nested_absmax.is_null() {
            return Scales::Plain(cpu::slice(q.absmax, blocks));
        }
        let nested = blocks.div_ceil(q.nested_blocksize as usize);
        Scales::Nested {
            codes: cpu::slice(q.absmax, blocks),
            absmax: cpu::slice(q.nested_absmax.cast(), nested),
            code: cpu::slice(q.nested_code.cast(), 256),
            blocksize: q.nested_blocksize as usize,
            offset: *q.offset,
        }
    }

    fn get(&self, b: usize) -> f32 {
        match self {
            Scales::Plain(absmax) => absmax[b],
            Scales::Nested { codes, absmax, code, blocksize, offset } => code[codes[b] as usize] * absmax[b / blocksize] + offset,
        }
    }
}

unsafe fn dequantize_cpu<T: Element>(p: &Dequantize4bit) {
    let mut out = p.out.cast::<T>();
    for q in p.parts() {
        let n = q.n as usize;
        let (packed, code) = (cpu::slice::<u8>(q.packed.cast(), n.div_ceil(2)), cpu::slice::<f32>(q.code.cast(), 16));
        let scales = Scales::of(q);
        let dst = Disjoint::new(cpu::slice_mut::<T>(out.cast(), n));
        let blocksize = q.blocksize as usize;
        cpu::parallel_for(n, cpu::GRAIN, |r| {
            // SAFETY: the ranges of parallel_for do not overlap.
            for (i, w) in r.clone().zip(dst.part(r)) {
                let byte = packed[i / 2];
                let nibble = if i % 2 == 0 { byte >> 4 } else { byte & 15 };
                *w = T::from_f64((code[nibble as usize] * scales.get(i / blocksize)) as f64);
            }
        });
        out = out.add(n);
    }
}

impl Launch for Dequantize4bit {
    fn plan(&self, dev: &'static Device) -> Result<Plan> {
        let dt = self.dtype()?;
        let (access, unit) = if self.vectors(dt) { (Tag::Vec, 8) } else { (Tag::Scalar, 1) };
        let kernel = kernels::kernel::<Self>(dev, &[dt.tag(), access], DEQUANTIZE_4BIT_BLOCK)?;
        let units: i64 = self.parts().iter().map(|q| geometry::ceil_div(q.n, unit)).sum();
        let blocks = geometry::ceil_div(units, (DEQUANTIZE_4BIT_BLOCK * DEQUANTIZE_4BIT_UNITS) as i64).max(1);
        let grid = geometry::grid(blocks, dev.sm_count() as i64 * kernel.blocks_per_sm as i64) as u32;
        Ok(Plan::single(kernel, LaunchConfig { grid: (grid, 1), block: (DEQUANTIZE_4BIT_BLOCK, 1), shared: 0 }, *self))
    }

    fn cpu(&self) -> Result<()> {
        let dt = self.dtype()?;
        // SAFETY: the C++ layer checked every pointer of every part against its tensor.
        crate::with_dtypes!(dt, dt, |T, _W, _Y| unsafe { dequantize_cpu::<T>(self) });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::Kernels;
    use half::{bf16, f16};
    use BastileDType::*;

    /// bitsandbytes' NF4 code (its `get_4bit_type("nf4")`, as f32).
    const NF4: [f32; 16] = [
        -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
        -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
        0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
    ];

    fn part(packed: &[u8], absmax: *const std::ffi::c_void, n: i64, blocksize: i64) -> Quantized4bit {
        Quantized4bit { packed: packed.as_ptr(), absmax, code: NF4.as_ptr(), n, blocksize, ..Default::default() }
    }

    fn run<T: Element>(parts: &[Quantized4bit]) -> Vec<T> {
        let n: i64 = parts.iter().map(|q| q.n).sum();
        let mut out = vec![T::from_f64(f64::NAN); n as usize];
        let mut p = Dequantize4bit { out: out.as_mut_ptr().cast(), count: parts.len() as i32, dtype: T::DTYPE as i32, ..Default::default() };
        p.parts[..parts.len()].copy_from_slice(parts);
        p.cpu().unwrap();
        out
    }

    #[test]
    fn codes_times_scales_rounded_once() {
        // Byte 0x1f: element 0 takes code 1, element 1 code 15; an odd n leaves the last low nibble unread.
        let packed = [0x1f_u8, 0x70, 0xe0];
        let absmax = [3.0f32, 0.1];
        let got = run::<bf16>(&[part(&packed, absmax.as_ptr().cast(), 5, 4)]);
        let want = [NF4[1] * 3.0, NF4[15] * 3.0, NF4[7] * 3.0, NF4[0] * 3.0, NF4[14] * 0.1];
        assert_eq!(got, want.map(bf16::from_f32));
        let got = run::<f32>(&[part(&packed, absmax.as_ptr().cast(), 5, 4)]);
        assert_eq!(got, want);
    }

    #[test]
    fn nested_scales_add_the_offset_after_the_product() {
        let packed = [0xf0_u8; 4];
        let (codes, nested_absmax, nested_code) = ([2u8, 1, 0, 3], [0.5f32, 0.25], [0.1f32, 0.3, 0.7, 0.9]);
        let mut full = [0f32; 256];
        full[..4].copy_from_slice(&nested_code);
        let offset = 0.01f32;
        let q = Quantized4bit {
            nested_absmax: nested_absmax.as_ptr(),
            nested_code: full.as_ptr(),
            offset: &offset,
            nested_blocksize: 2,
            ..part(&packed, codes.as_ptr().cast(), 8, 2)
        };
        let got = run::<f16>(&[q]);
        let scales = [0.7f32 * 0.5 + offset, 0.3 * 0.5 + offset, 0.1 * 0.25 + offset, 0.9 * 0.25 + offset];
        let want: Vec<f16> = (0..8).map(|i| f16::from_f32(NF4[if i % 2 == 0 { 15 } else { 0 }] * scales[i / 2])).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn parts_follow_each_other() {
        let (a, b) = ([0x12_u8, 0x34], [0xab_u8]);
        let (sa, sb) = ([2.0f32], [-1.0f32]);
        let got = run::<f32>(&[part(&a, sa.as_ptr().cast(), 4, 4), part(&b, sb.as_ptr().cast(), 2, 64)]);
        assert_eq!(got, [NF4[1] * 2.0, NF4[2] * 2.0, NF4[3] * 2.0, NF4[4] * 2.0, -NF4[10], -NF4[11]]);
    }

    #[test]
    fn vectors_need_whole_aligned_units() {
        let packed = [0u32; 8];
        let bytes: &[u8] = unsafe { std::slice::from_raw_parts(packed.as_ptr().cast(), 32) };
        let out = [0u128; 16];
        let mut p = Dequantize4bit { out: out.as_ptr() as *mut _, count: 1, dtype: BASTILE_BF16 as i32, ..Default::default() };
        p.parts[0] = part(bytes, std::ptr::null(), 64, 64);
        assert!(p.vectors(BASTILE_BF16));
        for q in [part(bytes, std::ptr::null(), 60, 64), part(bytes, std::ptr::null(), 64, 12), part(&bytes[2..], std::ptr::null(), 56, 64)] {
            p.parts[0] = q;
            assert!(!p.vectors(BASTILE_BF16));
        }
    }

    #[test]
    fn float64_is_refused_and_every_launch_has_a_kernel() {
        let p = Dequantize4bit { dtype: BASTILE_F64 as i32, ..Default::default() };
        assert!(p.cpu().unwrap_err().contains("float64"));
        for dt in [BASTILE_F32, BASTILE_F16, BASTILE_BF16] {
            for access in [Tag::Vec, Tag::Scalar] {
                Dequantize4bit::find(&[dt.tag(), access]).unwrap();
            }
        }
    }
}
