//! Multimodal (Qwen2-VL) tables: HF's section selection, gathered rows.
use super::*;

/// HF's `apply_multimodal_rotary_pos_emb` table selection, written as HF writes it: split
/// each `[3, tokens, r]` table's rows into chunks of `mrope_section * 2` and take chunk `j`
/// from table `j mod 3`; the result is a `[tokens, r]` per-batch table.
fn hf_multimodal_table<T: Copy>(
    three: &[T],
    tokens: usize,
    r: usize,
    sections: [usize; 3],
) -> Vec<T> {
    let chunks: Vec<usize> = sections.iter().chain(&sections).copied().collect();
    let mut out = Vec::with_capacity(tokens * r);
    for t in 0..tokens {
        let mut start = 0;
        for (j, &len) in chunks.iter().enumerate() {
            let table = &three[(j % 3) * tokens * r..][..tokens * r];
            out.extend_from_slice(&table[t * r + start..][..len]);
            start += len;
        }
    }
    out
}

/// Three `[tokens, r]` HF-style tables (t, h, w) from 3-row position ids, as Qwen2-VL's rotary
/// embedding computes them.
fn multimodal_tables<T: Element>(rng: &mut Rng, tokens: usize, r: usize) -> (Vec<T>, Vec<T>) {
    let ids: Vec<i64> = (0..3 * tokens)
        .map(|_| (rng.next_u64() % 50) as i64)
        .collect();
    cos_sin::<T>(&ids, r, false)
}

#[test]
fn reference_multimodal_is_hf_apply_multimodal_rotary_pos_emb() {
    // Rotating with the per-batch table HF assembles equals the multimodal layout, bit for bit.
    let cases = [
        (2, 3, 3, 1, 8, 8, [1, 2, 1]),
        (1, 5, 2, 3, 12, 12, [0, 3, 3]),
        (2, 4, 1, 2, 16, 12, [6, 0, 0]),
        (1, 7, 2, 2, 128, 128, [16, 24, 24]),
    ];
    for (n, &(b, s, hq, hk, d, r, sections)) in cases.iter().enumerate() {
        let tokens = b * s;
        let mut rng = Rng::new(1200 + n as u64);
        let (cos3, sin3) = multimodal_tables::<f64>(&mut rng, tokens, r);
        let cos = hf_multimodal_table(&cos3, tokens, r, sections);
        let sin = hf_multimodal_table(&sin3, tokens, r, sections);
        let args = RopeArgs::new(d)
            .with_batch(b)
            .with_seq_len(s)
            .with_heads(hq, hk)
            .with_rotary_dim(r);
        let q: Vec<f64> = uniform(&mut rng, tokens * hq * d);
        let k: Vec<f64> = uniform(&mut rng, tokens * hk * d);
        for backward in [false, true] {
            let rotate = if backward { ref_backward } else { ref_forward };
            let (mut q_hf, mut k_hf) = (q.clone(), k.clone());
            rotate(
                &args,
                &mut q_hf,
                &mut k_hf,
                &cos,
                &sin,
                CosSinRows::PerBatch,
            )
            .unwrap();
            let (mut q_m, mut k_m) = (q.clone(), k.clone());
            let rows = CosSinRows::Multimodal { sections };
            rotate(&args, &mut q_m, &mut k_m, &cos3, &sin3, rows).unwrap();
            assert_eq!((q_m, k_m), (q_hf, k_hf), "case {n}, backward={backward}");
        }
    }
    // The sections must split rotary_dim / 2, and the tables hold 3 × tokens rows.
    let args = RopeArgs::new(8).with_seq_len(2);
    let (mut q, mut k) = (vec![0.0f64; 16], vec![0.0f64; 16]);
    let table = vec![0.0f64; 3 * 2 * 8];
    let bad = CosSinRows::Multimodal {
        sections: [1, 1, 1],
    };
    expect_invalid(
        ref_forward(&args, &mut q, &mut k, &table, &table, bad),
        "layout.sections",
        "summing to rotary_dim / 2 = 4",
    );
    let ok = CosSinRows::Multimodal {
        sections: [1, 2, 1],
    };
    expect_invalid(
        ref_forward(&args, &mut q, &mut k, &table[..32], &table[..32], ok),
        "cos",
        "length 48 (3 × batch × seq_len × rotary_dim)",
    );
}

#[test]
fn reference_multimodal_gathered_is_multimodal_on_the_gathered_rows() {
    // Rows read through [3, B, S] ids from one table equal the [3, B, S, r] tables of those
    // rows, bit for bit, in every form.
    let (b, s, hq, hk, d, r, sections) = (2, 5, 3, 2, 12, 10, [2, 1, 2]);
    let tokens = b * s;
    let max_pos = 40;
    for (n, &bits) in FORM_BITS.iter().enumerate() {
        let mut rng = Rng::new(1300 + n as u64);
        let args = in_form(
            RopeArgs::new(d)
                .with_batch(b)
                .with_seq_len(s)
                .with_heads(hq, hk)
                .with_rotary_dim(r),
            bits,
        );
        let ids: Vec<i64> = (0..3 * tokens)
            .map(|_| (rng.next_u64() % max_pos) as i64)
            .collect();
        let (cos, sin) = cos_sin::<f64>(&(0..max_pos as i64).collect::<Vec<_>>(), r, false);
        let (cos3, sin3) = cos_sin::<f64>(&ids, r, false);
        let (cos, sin) = (table_in_form(&args, &cos), table_in_form(&args, &sin));
        let (cos3, sin3) = (table_in_form(&args, &cos3), table_in_form(&args, &sin3));
        let q: Vec<f64> = uniform(&mut rng, tokens * hq * d);
        let k: Vec<f64> = uniform(&mut rng, tokens * hk * d);
        for backward in [false, true] {
            let rotate = if backward { ref_backward } else { ref_forward };
            let (mut q3, mut k3) = (q.clone(), k.clone());
            let rows = CosSinRows::Multimodal { sections };
            rotate(&args, &mut q3, &mut k3, &cos3, &sin3, rows).unwrap();
            let (mut qg, mut kg) = (q.clone(), k.clone());
            let rows = CosSinRows::MultimodalGathered {
                sections,
                ids: &ids,
            };
            rotate(&args, &mut qg, &mut kg, &cos, &sin, rows).unwrap();
            assert_eq!((qg, kg), (q3, k3), "form {bits:?}, backward={backward}");
        }
    }
    // The ids are [3, B, S] and each names a row of the table.
    let args = RopeArgs::new(4).with_seq_len(2);
    let (mut q, mut k) = (vec![0.0f64; 8], vec![0.0f64; 8]);
    let table = vec![0.0f64; 5 * 4];
    let ok = |ids| CosSinRows::MultimodalGathered {
        sections: [1, 0, 1],
        ids,
    };
    assert!(
        ref_forward(
            &args,
            &mut q,
            &mut k,
            &table,
            &table,
            ok(&[0, 1, 2, 3, 4, 0])
        )
        .is_ok()
    );
    expect_invalid(
        ref_forward(&args, &mut q, &mut k, &table, &table, ok(&[0, 1, 2, 3])),
        "position_ids",
        "length 6 (3 × batch × seq_len)",
    );
    expect_invalid(
        ref_forward(
            &args,
            &mut q,
            &mut k,
            &table,
            &table,
            ok(&[0, 1, 2, 3, 5, 0]),
        ),
        "position_ids",
        "position_ids[4] = 5",
    );
}

/// A multimodal shape: `(B, S, Hq, Hk, d, r, sections)`.
type MultimodalShape = (usize, usize, usize, usize, usize, usize, [usize; 3]);

/// In place in the default form, the vector kernels take the shapes whose halves and section
/// starts are whole 16-byte vectors (`[16, 24, 24]` and `[8, 8, 16]` for every type,
/// `[20, 20, 0]` for f32 alone), the general kernels the rest and every other form; shape `i`
/// gathers through `[i32, i64, host][i % 3]` ids.
const MULTIMODAL_SHAPES: [MultimodalShape; 7] = [
    (1, 1, 1, 1, 2, 2, [1, 0, 0]),
    (2, 7, 3, 5, 6, 6, [1, 1, 1]),
    (3, 11, 6, 2, 80, 32, [4, 6, 6]),
    (2, 9, 7, 3, 92, 92, [0, 23, 23]),
    (2, 64, 28, 4, 128, 128, [16, 24, 24]),
    (1, 257, 2, 2, 128, 80, [20, 20, 0]),
    (2, 33, 4, 2, 64, 64, [8, 8, 16]),
];

/// One GPU case of multimodal tables, in a form of `FORM_BITS`: forward and backward, in
/// place and out of place, against the reference.
fn run_multimodal_case<T: Dtype, C: CosSinDtype<T>>(
    stream: &Arc<CudaStream>,
    shape: MultimodalShape,
    bits: (bool, bool, bool),
    ids_form: Option<Form>,
    seed: u64,
) {
    let (b, s, hq, hk, d, r, sections) = shape;
    let args = in_form(
        RopeArgs::new(d)
            .with_batch(b)
            .with_seq_len(s)
            .with_heads(hq, hk)
            .with_rotary_dim(r),
        bits,
    );
    let desc = format!(
        "B={b} S={s} Hq={hq} Hk={hk} d={d} r={r} sections={sections:?} {} (interleaved, half, \
         head-major) = {bits:?} ids={ids_form:?} seed={seed} ({} tables)",
        T::NAME,
        C::NAME
    );
    let mut rng = Rng::new(seed);
    // Three [B, S, r] tables, or one [max_pos, r] table and [3, B, S] ids into it.
    let max_pos = 50;
    let ids: Vec<i64> = (0..3 * b * s)
        .map(|_| (rng.next_u64() % max_pos) as i64)
        .collect();
    let (cos, sin) = match ids_form {
        None => multimodal_tables::<C>(&mut rng, b * s, r),
        Some(_) => cos_sin::<C>(&(0..max_pos as i64).collect::<Vec<_>>(), r, true),
    };
    let (cos, sin) = (table_in_form(&args, &cos), table_in_form(&args, &sin));
    let (cos_d, sin_d) = (upload(stream, &cos), upload(stream, &sin));
    let ids32: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
    let (ids32_d, ids64_d) = (upload_ids(stream, &ids32), upload_ids(stream, &ids));
    let position_ids = match ids_form {
        Some(Form::Ids32) => PositionIds::DeviceI32(ids32_d.as_view()),
        Some(Form::Host) => PositionIds::Host(&ids),
        _ => PositionIds::DeviceI64(ids64_d.as_view()),
    };
    let layout = match ids_form {
        None => CosSinLayout::Multimodal { sections },
        Some(_) => CosSinLayout::MultimodalGathered {
            sections,
            position_ids,
        },
    };
    let ref_rows = match ids_form {
        None => CosSinRows::Multimodal { sections },
        Some(_) => CosSinRows::MultimodalGathered {
            sections,
            ids: &ids,
        },
    };
    check_directions(
        stream,
        &args,
        (&cos, &sin, &cos_d, &sin_d),
        (ref_rows, &layout),
        &mut rng,
        &desc,
    );
}

fn multimodal_sweep<T: Dtype, C: CosSinDtype<T>>(test: &str, seed_base: u64) {
    let Some(stream) = gpu(test) else { return };
    let mut failures = Failures::new(test);
    for (i, &(b, s, hq, hk, d, r, sections)) in MULTIMODAL_SHAPES.iter().enumerate() {
        // Sanitizer-sized: at most 9 positions.
        let shape = (b, sized(s, s.min(9)), hq, hk, d, r, sections);
        // The default form on every shape, and the other forms rotating with the shape; the
        // three tables, and one table through i32, i64 and host ids.
        let gathered = [Form::Ids32, Form::Ids64, Form::Host][i % 3];
        for (j, bits) in [FORM_BITS[0], FORM_BITS[1 + i % (FORM_BITS.len() - 1)]]
            .into_iter()
            .enumerate()
        {
            for ids_form in [None, Some(gathered)] {
                let seed = seed_base + 8 * i as u64 + 2 * j as u64 + ids_form.is_some() as u64;
                failures.run(|| run_multimodal_case::<T, C>(&stream, shape, bits, ids_form, seed));
            }
        }
    }
    failures.finish();
}

#[test]
fn gpu_multimodal_matches_reference_f32() {
    multimodal_sweep::<f32, f32>("gpu_multimodal_matches_reference_f32", 80_000);
}

#[test]
fn gpu_multimodal_matches_reference_f16() {
    multimodal_sweep::<f16, f16>("gpu_multimodal_matches_reference_f16", 81_000);
}

#[test]
fn gpu_multimodal_matches_reference_bf16() {
    multimodal_sweep::<bf16, bf16>("gpu_multimodal_matches_reference_bf16", 82_000);
}

#[test]
fn gpu_multimodal_with_f32_tables_matches_reference_bf16() {
    multimodal_sweep::<bf16, f32>(
        "gpu_multimodal_with_f32_tables_matches_reference_bf16",
        83_000,
    );
}

#[test]
fn multimodal_rejects_bad_sections_and_tables() {
    let test = "multimodal_rejects_bad_sections_and_tables";
    let Some(stream) = gpu(test) else { return };
    let args = RopeArgs::new(8).with_seq_len(2);
    let (mut q, mut k) = (
        upload(&stream, &[0.5f32; 16]),
        upload(&stream, &[0.5f32; 16]),
    );
    let table = upload(&stream, &[1.0f32; 48]);
    let short = upload(&stream, &[1.0f32; 32]);
    let bad = CosSinLayout::Multimodal {
        sections: [2, 2, 1],
    };
    expect_invalid(
        rope_forward(&stream, &args, &mut q, &mut k, &table, &table, &bad),
        "layout.sections",
        "summing to rotary_dim / 2 = 4",
    );
    let ok = CosSinLayout::Multimodal {
        sections: [2, 2, 0],
    };
    expect_invalid(
        rope_backward(&stream, &args, &mut q, &mut k, &short, &short, &ok),
        "cos",
        "length 48 (3 × batch × seq_len × rotary_dim)",
    );
    rope_forward(&stream, &args, &mut q, &mut k, &table, &short, &ok)
        .map(|()| panic!("a short sin was accepted"))
        .unwrap_or_else(|e| assert!(e.to_string().contains("`sin`"), "{e}"));
    // [3, B, S] ids into one table: 6 of them, each a row of the 6-row table.
    let ids = upload_ids(&stream, &[0i64, 1, 2, 3, 4]);
    let gathered = |position_ids| CosSinLayout::MultimodalGathered {
        sections: [2, 1, 1],
        position_ids,
    };
    expect_invalid(
        rope_forward(
            &stream,
            &args,
            &mut q,
            &mut k,
            &table,
            &table,
            &gathered(PositionIds::DeviceI64(ids.as_view())),
        ),
        "position_ids",
        "length 6 (3 × batch × seq_len)",
    );
    let host = [0i64, 1, 2, 3, 4, 6];
    expect_invalid(
        rope_forward(
            &stream,
            &args,
            &mut q,
            &mut k,
            &table,
            &table,
            &gathered(PositionIds::Host(&host)),
        ),
        "position_ids",
        "position_ids[5] = 6",
    );
    assert_eq!(download(&stream, &q), vec![0.5f32; 16]);
}
