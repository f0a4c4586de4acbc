//! Helpers the ops' unit tests share: inputs and error measures.
use crate::cpu::Element;
use crate::params::BastileDType;

/// Deterministic pseudo-random values in [-half_width, half_width).
pub fn noise(n: usize, seed: u64, half_width: f64) -> Vec<f64> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) * half_width
        })
        .collect()
}

pub fn cast<T: Element>(v: &[f64]) -> Vec<T> {
    v.iter().map(|&x| T::from_f64(x)).collect()
}

pub fn widen<T: Element>(v: &[T]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64()).collect()
}

/// ||a - b|| / max(||b||, floor): `floor` is the size of the terms that cancel in b, where b
/// itself can be near zero (a one-element row's gradient is).
pub fn rel_err_floor(a: &[f64], b: &[f64], floor: f64) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum::<f64>().sqrt().max(floor);
    num.sqrt() / den.max(1e-300)
}

pub fn rel_err(a: &[f64], b: &[f64]) -> f64 {
    rel_err_floor(a, b, 0.0)
}

/// The unit roundoff of a dtype, 2^-53 to 2^-8.
pub fn unit_roundoff(d: BastileDType) -> f64 {
    2f64.powi(-match d {
        BastileDType::BASTILE_F64 => 53,
        BastileDType::BASTILE_F32 => 24,
        BastileDType::BASTILE_F16 => 11,
        BastileDType::BASTILE_BF16 => 8,
    })
}

/// The unit roundoff with f64's raised to 2^-50: f64 results are compared with f64 references that
/// round as often as they do, so a few f64 units apart.
pub fn unit(d: BastileDType) -> f64 {
    unit_roundoff(d).max(2f64.powi(-50))
}
