//! CPU kernels' element types. CPU kernels compute in f64 and round where torch would round
//! (through the input dtype, then to the output dtype), so they are the reference the GPU
//! kernels are tested against.
use crate::params::BastileDType;
use half::{bf16, f16};

pub trait Element: Copy + Send + Sync + 'static {
    const DTYPE: BastileDType;
    fn to_f64(self) -> f64;
    fn from_f64(v: f64) -> Self;
    /// `v` stored in this type and read back.
    fn round(v: f64) -> f64 {
        Self::from_f64(v).to_f64()
    }
}

impl Element for f64 {
    const DTYPE: BastileDType = BastileDType::BASTILE_F64;
    fn to_f64(self) -> f64 {
        self
    }
    fn from_f64(v: f64) -> Self {
        v
    }
}
impl Element for f32 {
    const DTYPE: BastileDType = BastileDType::BASTILE_F32;
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn from_f64(v: f64) -> Self {
        v as f32
    }
}
/// The 16-bit types round through f32, as torch rounds an f32 intermediate.
macro_rules! half_element {
    ($($t:ident: $dtype:ident),*) => {$(
        impl Element for $t {
            const DTYPE: BastileDType = BastileDType::$dtype;
            fn to_f64(self) -> f64 {
                self.to_f64()
            }
            fn from_f64(v: f64) -> Self {
                $t::from_f32(v as f32)
            }
        }
    )*};
}
half_element!(f16: BASTILE_F16, bf16: BASTILE_BF16);

/// Runs `$body` with type aliases `$x`, `$w`, `$y` bound to the Rust types of an input dtype,
/// a weight dtype and their torch promotion (equal types stay; f64 wins; any other pair is f32).
#[macro_export]
macro_rules! with_dtypes {
    ($xd:expr, $wd:expr, |$x:ident, $w:ident, $y:ident| $body:expr) => {{
        use half::{bf16, f16};
        use $crate::params::BastileDType::*;
        match ($xd, $wd) {
            (BASTILE_F32, BASTILE_F32) => { type $x = f32; type $w = f32; type $y = f32; $body }
            (BASTILE_F32, BASTILE_F16) => { type $x = f32; type $w = f16; type $y = f32; $body }
            (BASTILE_F32, BASTILE_BF16) => { type $x = f32; type $w = bf16; type $y = f32; $body }
            (BASTILE_F32, BASTILE_F64) => { type $x = f32; type $w = f64; type $y = f64; $body }
            (BASTILE_F16, BASTILE_F32) => { type $x = f16; type $w = f32; type $y = f32; $body }
            (BASTILE_F16, BASTILE_F16) => { type $x = f16; type $w = f16; type $y = f16; $body }
            (BASTILE_F16, BASTILE_BF16) => { type $x = f16; type $w = bf16; type $y = f32; $body }
            (BASTILE_F16, BASTILE_F64) => { type $x = f16; type $w = f64; type $y = f64; $body }
            (BASTILE_BF16, BASTILE_F32) => { type $x = bf16; type $w = f32; type $y = f32; $body }
            (BASTILE_BF16, BASTILE_F16) => { type $x = bf16; type $w = f16; type $y = f32; $body }
            (BASTILE_BF16, BASTILE_BF16) => { type $x = bf16; type $w = bf16; type $y = bf16; $body }
            (BASTILE_BF16, BASTILE_F64) => { type $x = bf16; type $w = f64; type $y = f64; $body }
            (BASTILE_F64, BASTILE_F32) => { type $x = f64; type $w = f32; type $y = f64; $body }
            (BASTILE_F64, BASTILE_F16) => { type $x = f64; type $w = f16; type $y = f64; $body }
            (BASTILE_F64, BASTILE_BF16) => { type $x = f64; type $w = bf16; type $y = f64; $body }
            (BASTILE_F64, BASTILE_F64) => { type $x = f64; type $w = f64; type $y = f64; $body }
        }
    }};
}

/// torch.result_type of two floating dtypes.
pub fn promote(a: BastileDType, b: BastileDType) -> BastileDType {
    use BastileDType::*;
    match (a, b) {
        _ if a == b => a,
        (BASTILE_F64, _) | (_, BASTILE_F64) => BASTILE_F64,
        _ => BASTILE_F32,
    }
}

/// Slice view of `len` elements at `ptr`.
///
/// # Safety
/// `ptr` must point to `len` valid, initialised elements of `T` that outlive the slice.
pub unsafe fn slice<'a, T>(ptr: *const std::ffi::c_void, len: usize) -> &'a [T] {
    if len == 0 {
        &[]
    } else {
        std::slice::from_raw_parts(ptr.cast(), len)
    }
}

/// # Safety
/// As [`slice`], and nothing else may access the memory while the slice lives.
pub unsafe fn slice_mut<'a, T>(ptr: *mut std::ffi::c_void, len: usize) -> &'a mut [T] {
    if len == 0 {
        &mut []
    } else {
        std::slice::from_raw_parts_mut(ptr.cast(), len)
    }
}
