//! SwiGLU's gate: SiLU on [`sigmoid_pair`] (the numerics in the module docs of `glu/`), its
//! kernel bodies and every SwiGLU entry.

/// `silu(z) = z·σ(z)`, with silu(−∞) = −0.
#[inline(always)]
fn silu_of(z: f32, sig: f32) -> f32 {
    if sig == 0.0 { -0.0 } else { z * sig }
}

/// `silu'(z) = σ·(1 + z·(1 − σ))`, with the limits 0 at −∞ and 1 at +∞.
#[inline(always)]
fn silu_grad_of(z: f32, sig: f32, one_minus: f32) -> f32 {
    let z_one_minus = if one_minus == 0.0 { 0.0 } else { z * one_minus };
    if sig == 0.0 {
        0.0
    } else {
        sig * (1.0 + z_one_minus)
    }
}

/// SwiGLU's kernel bodies.
pub(crate) mod bodies {
    use super::super::*;
    use super::{silu_grad_of, silu_of};
    glu_bodies!(sigmoid_pair, silu_of, silu_grad_of, each_item, false);
}

glu_kernels!(silu::bodies, Silu, F32);
glu_kernels!(silu::bodies, Silu, F16);
glu_kernels!(silu::bodies, Silu, Bf16);
