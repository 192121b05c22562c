//! GPU: RoPE through candle against the plain API, every layout form.
use super::*;

/// How a RoPE case passes cos/sin.
#[derive(Clone, Copy, Debug)]
enum Tables {
    /// `[S, r]`.
    PerPosition,
    /// `[1, S, r]`.
    Shared,
    /// `[B, S, r]`.
    PerBatch,
    /// `[max_pos, r]` with i64 ids.
    IdsI64,
    /// `[max_pos, r]` with i32 ids.
    IdsI32,
}

pub(super) fn cos_sin<T: El>(positions: &[i64], r: usize) -> (Vec<T>, Vec<T>) {
    let (mut cos, mut sin) = (Vec::new(), Vec::new());
    for &p in positions {
        for j in 0..r {
            let theta = p as f64 * 10000f64.powf(-2.0 * (j % (r / 2)) as f64 / r as f64);
            cos.push(Element::from_f64(theta.cos()));
            sin.push(Element::from_f64(theta.sin()));
        }
    }
    (cos, sin)
}

fn rope_case<T: El, C: El + CosSinDtype<T>>(
    dev: &Device,
    rng: &mut Rng,
    tables: Tables,
    transposed_q: bool,
) {
    let stream = stream_of(dev);
    let (b, s, hq, hk, d) = (2, 7, 6, 2, 40);
    let r = if matches!(tables, Tables::PerBatch) {
        24
    } else {
        d
    };
    let case = format!(
        "{} ({} tables) {tables:?} transposed_q={transposed_q} r={r}",
        T::NAME,
        C::NAME
    );
    let args = RopeArgs::new(d)
        .with_batch(b)
        .with_seq_len(s)
        .with_heads(hq, hk)
        .with_rotary_dim(r);
    let (q_h, k_h): (Vec<T>, Vec<T>) = (
        rng.vec(b * s * hq * d, 0.0, 1.0),
        rng.vec(b * s * hk * d, 0.0, 1.0),
    );
    let (dq_h, dk_h): (Vec<T>, Vec<T>) =
        (rng.vec(q_h.len(), 0.0, 1.0), rng.vec(k_h.len(), 0.0, 1.0));
    let max_pos = 50;
    let ids: Vec<i64> = (0..b * s)
        .map(|_| (rng.next_u64() % max_pos) as i64)
        .collect();
    let positions: Vec<i64> = match tables {
        Tables::PerPosition | Tables::Shared => (0..s as i64).collect(),
        Tables::PerBatch => (0..(b * s) as i64).map(|i| 3 * i + 1).collect(),
        Tables::IdsI64 | Tables::IdsI32 => (0..max_pos as i64).collect(),
    };
    let (cos_h, sin_h) = cos_sin::<C>(&positions, r);
    let cs_dims: Vec<usize> = match tables {
        Tables::PerPosition => vec![s, r],
        Tables::Shared => vec![1, s, r],
        Tables::PerBatch => vec![b, s, r],
        Tables::IdsI64 | Tables::IdsI32 => vec![max_pos as usize, r],
    };

    // Plain API on the same stream.
    let (cos_d, sin_d) = (upload(&stream, &cos_h), upload(&stream, &sin_h));
    let ids64_d = upload(&stream, &ids);
    let ids32: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
    let ids32_d = upload(&stream, &ids32);
    let layout = match tables {
        Tables::PerPosition | Tables::Shared => CosSinLayout::PerPosition,
        Tables::PerBatch => CosSinLayout::PerBatch,
        Tables::IdsI64 => CosSinLayout::Gathered(PositionIds::DeviceI64(ids64_d.as_view())),
        Tables::IdsI32 => CosSinLayout::Gathered(PositionIds::DeviceI32(ids32_d.as_view())),
    };
    let (mut q_d, mut k_d) = (upload(&stream, &q_h), upload(&stream, &k_h));
    liger_rs::rope_forward(&stream, &args, &mut q_d, &mut k_d, &cos_d, &sin_d, &layout).unwrap();
    let (mut dq_d, mut dk_d) = (upload(&stream, &dq_h), upload(&stream, &dk_h));
    liger_rs::rope_backward(
        &stream, &args, &mut dq_d, &mut dk_d, &cos_d, &sin_d, &layout,
    )
    .unwrap();

    // candle. With `transposed_q`, q-shaped tensors are [B, H, S, d] contiguous, transposed to
    // [B, S, H, d] (HF's layout after its transpose): non-contiguous.
    let q_base = |data: &[T]| {
        if transposed_q {
            let mut bhsd = data.to_vec();
            for (i, &v) in data.iter().enumerate() {
                let (bi, si, hi, di) = (i / (s * hq * d), i / (hq * d) % s, i / d % hq, i % d);
                bhsd[((bi * hq + hi) * s + si) * d + di] = v;
            }
            tensor(&bhsd, &[b, hq, s, d], dev)
        } else {
            tensor(data, &[b, s, hq, d], dev)
        }
    };
    let q_view = |t: &Tensor| {
        let v = if transposed_q {
            t.transpose(1, 2).unwrap()
        } else {
            t.clone()
        };
        assert_eq!(v.is_contiguous(), !transposed_q);
        v
    };
    let qv = Var::from_tensor(&q_base(&q_h)).unwrap();
    let q = q_view(qv.as_tensor());
    let k = tensor(&k_h, &[b, s, hk, d], dev);
    let (cos, sin) = (tensor(&cos_h, &cs_dims, dev), tensor(&sin_h, &cs_dims, dev));
    let ids_t = match tables {
        Tables::IdsI64 => Some(Tensor::from_slice(&ids, (b, s), dev).unwrap()),
        Tables::IdsI32 => Some(Tensor::from_slice(&ids32, (b, s), dev).unwrap()),
        _ => None,
    };
    let kv = Var::from_tensor(&k).unwrap();
    let (qr, kr) = rope(&q, kv.as_tensor(), &cos, &sin, ids_t.as_ref()).unwrap();
    assert_eq!(
        (qr.dims(), kr.dims()),
        (&[b, s, hq, d][..], &[b, s, hk, d][..])
    );
    assert_same(
        &format!("q, {case}"),
        &host::<T>(&qr),
        &host_buf(&stream, &q_d),
    );
    assert_same(
        &format!("k, {case}"),
        &host::<T>(&kr),
        &host_buf(&stream, &k_d),
    );
    // The inputs are unchanged.
    assert_same(
        &format!("q input, {case}"),
        &host::<T>(&q),
        &q_h.iter().map(|&v| Element::to_f64(v)).collect::<Vec<_>>(),
    );

    let (dq, dk) = (q_view(&q_base(&dq_h)), tensor(&dk_h, &[b, s, hk, d], dev));
    let (gq, gk) = rope_backward(&dq, &dk, &cos, &sin, ids_t.as_ref()).unwrap();
    assert_same(
        &format!("dq, {case}"),
        &host::<T>(&gq),
        &host_buf(&stream, &dq_d),
    );
    assert_same(
        &format!("dk, {case}"),
        &host::<T>(&gk),
        &host_buf(&stream, &dk_d),
    );

    let loss = qr
        .mul(&dq)
        .unwrap()
        .sum_all()
        .unwrap()
        .add(&kr.mul(&dk).unwrap().sum_all().unwrap())
        .unwrap();
    let grads = loss.backward().unwrap();
    assert_same(
        &format!("autograd dq, {case}"),
        &host::<T>(&q_view(grads.get(&qv).expect("grad q"))),
        &host_buf(&stream, &dq_d),
    );
    assert_same(
        &format!("autograd dk, {case}"),
        &host::<T>(grads.get(&kv).expect("grad k")),
        &host_buf(&stream, &dk_d),
    );
}

fn rope_sweep<T: El, C: El + CosSinDtype<T>>(test: &str, seed: u64) {
    let Some(dev) = common::candle_gpu(test) else {
        return;
    };
    let mut rng = Rng::new(seed);
    let mut n = 0;
    for tables in [
        Tables::PerPosition,
        Tables::Shared,
        Tables::PerBatch,
        Tables::IdsI64,
        Tables::IdsI32,
    ] {
        for transposed_q in [false, true] {
            rope_case::<T, C>(&dev, &mut rng, tables, transposed_q);
            n += 1;
        }
    }
    println!("{test}: {n} cases equal to the plain API");
}

#[test]
fn gpu_rope_matches_plain_api_f32() {
    rope_sweep::<f32, f32>("gpu_rope_matches_plain_api_f32", 11);
}

#[test]
fn gpu_rope_matches_plain_api_f16() {
    rope_sweep::<f16, f16>("gpu_rope_matches_plain_api_f16", 12);
}

#[test]
fn gpu_rope_matches_plain_api_bf16() {
    rope_sweep::<bf16, bf16>("gpu_rope_matches_plain_api_bf16", 13);
}

#[test]
fn gpu_rope_with_f32_tables_matches_plain_api_bf16() {
    rope_sweep::<bf16, f32>("gpu_rope_with_f32_tables_matches_plain_api_bf16", 14);
}
