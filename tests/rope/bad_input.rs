//! Rejected calls (nothing launched, nothing written), empty calls, overlapping buffers.
use super::*;

#[test]
fn bad_input_is_rejected_before_launch() {
    let Some(stream) = gpu("bad_input_is_rejected_before_launch") else {
        return;
    };
    let (b, s, hq, hk, d) = (2, 3, 4, 2, 8);
    let a = RopeArgs::new(d)
        .with_batch(b)
        .with_seq_len(s)
        .with_heads(hq, hk);
    let zeros = |n: usize| upload(&stream, &vec![0.0f32; n]);
    let (mut q, mut k) = (zeros(b * s * hq * d), zeros(b * s * hk * d));
    let (cos, sin) = (zeros(s * d), zeros(s * d));
    let pp = CosSinLayout::PerPosition;
    let call =
        |a: &RopeArgs,
         q: &mut CudaSlice<f32>,
         k: &mut CudaSlice<f32>,
         cos: &CudaSlice<f32>,
         sin: &CudaSlice<f32>,
         layout: &CosSinLayout<'_>| { rope_forward(&stream, a, q, k, cos, sin, layout) };
    assert!(call(&a, &mut q, &mut k, &cos, &sin, &pp).is_ok());

    // The shape itself.
    let shape_errors = [
        (
            RopeArgs::new(7)
                .with_batch(b)
                .with_seq_len(s)
                .with_heads(hq, hk),
            "args.head_dim",
            "even value ≥ 2",
        ),
        (
            RopeArgs::new(0)
                .with_batch(b)
                .with_seq_len(s)
                .with_heads(hq, hk),
            "args.head_dim",
            "even value ≥ 2",
        ),
        (
            a.with_rotary_dim(5),
            "args.rotary_dim",
            "2 ..= head_dim = 8",
        ),
        (
            a.with_rotary_dim(0),
            "args.rotary_dim",
            "2 ..= head_dim = 8",
        ),
        (
            a.with_rotary_dim(10),
            "args.rotary_dim",
            "2 ..= head_dim = 8",
        ),
        (
            RopeArgs::new(d)
                .with_batch(b)
                .with_seq_len(s)
                .with_heads(0, hk),
            "args.q_heads",
            "at least 1",
        ),
        (
            RopeArgs::new(d)
                .with_batch(b)
                .with_seq_len(s)
                .with_heads(hq, 0),
            "args.k_heads",
            "at least 1",
        ),
        (
            RopeArgs::new(d)
                .with_batch(usize::MAX)
                .with_seq_len(s)
                .with_heads(hq, hk),
            "args",
            "within usize",
        ),
        (
            RopeArgs::new(d)
                .with_batch(b)
                .with_seq_len(s)
                .with_heads(1 << 40, hk),
            "args",
            "< 2^31",
        ),
    ];
    for (args, arg, needle) in shape_errors {
        expect_invalid(call(&args, &mut q, &mut k, &cos, &sin, &pp), arg, needle);
    }

    // q/k lengths: a k with another batch or sequence length, a q with other heads.
    let mut k_other_seq = zeros(b * (s + 1) * hk * d);
    expect_invalid(
        call(&a, &mut q, &mut k_other_seq, &cos, &sin, &pp),
        "k",
        "length 96 (batch × seq_len × k_heads × head_dim)",
    );
    let mut q_other_heads = zeros(b * s * (hq + 1) * d);
    expect_invalid(
        call(&a, &mut q_other_heads, &mut k, &cos, &sin, &pp),
        "q",
        "length 192",
    );

    // cos/sin lengths for each form; sin unlike cos.
    let short = zeros(s * d - 2);
    expect_invalid(
        call(&a, &mut q, &mut k, &short, &sin, &pp),
        "cos",
        "length 24 (seq_len × rotary_dim)",
    );
    expect_invalid(
        call(&a, &mut q, &mut k, &cos, &short, &pp),
        "sin",
        "length 24 (the length of cos)",
    );
    expect_invalid(
        call(&a, &mut q, &mut k, &cos, &sin, &CosSinLayout::PerBatch),
        "cos",
        "length 48 (batch × seq_len × rotary_dim)",
    );
    // Partial rotary: rows are rotary_dim long, so a head_dim-wide table is rejected.
    expect_invalid(
        call(&a.with_rotary_dim(4), &mut q, &mut k, &cos, &sin, &pp),
        "cos",
        "length 12",
    );
    let ids_ok = [0i64, 1, 2, 0, 1, 2];
    let gathered = CosSinLayout::Gathered(PositionIds::Host(&ids_ok));
    let ragged = zeros(3 * d + 1);
    expect_invalid(
        call(&a, &mut q, &mut k, &ragged, &ragged, &gathered),
        "cos",
        "rows of rotary_dim = 8",
    );
    let empty = zeros(1);
    expect_invalid(
        rope_forward(
            &stream,
            &a,
            &mut q,
            &mut k,
            &empty.slice(0..0),
            &sin,
            &gathered,
        ),
        "cos",
        "max_pos ≥ 1",
    );
    assert!(call(&a, &mut q, &mut k, &cos, &sin, &gathered).is_ok());

    // Position ids: length (host and device) and host range.
    let host_short = CosSinLayout::Gathered(PositionIds::Host(&ids_ok[..5]));
    expect_invalid(
        call(&a, &mut q, &mut k, &cos, &sin, &host_short),
        "position_ids",
        "length 6 (batch × seq_len)",
    );
    let dev_long = upload_ids(&stream, &[0i32; 7]);
    let dev_long = CosSinLayout::Gathered(PositionIds::DeviceI32(dev_long.as_view()));
    expect_invalid(
        call(&a, &mut q, &mut k, &cos, &sin, &dev_long),
        "position_ids",
        "length 6",
    );
    let too_big = [0i64, 1, 2, 3, 0, 0];
    expect_invalid(
        call(
            &a,
            &mut q,
            &mut k,
            &cos,
            &sin,
            &CosSinLayout::Gathered(PositionIds::Host(&too_big)),
        ),
        "position_ids",
        "position_ids[3] = 3",
    );
    let negative = [0i64, 1, 2, 0, -2, 0];
    expect_invalid(
        call(
            &a,
            &mut q,
            &mut k,
            &cos,
            &sin,
            &CosSinLayout::Gathered(PositionIds::Host(&negative)),
        ),
        "position_ids",
        "ids in 0 ..= 2",
    );

    // The backward names its own buffers.
    let mut short_dq = zeros(b * s * hq * d - 1);
    expect_invalid(
        rope_backward(&stream, &a, &mut short_dq, &mut k, &cos, &sin, &pp),
        "dq",
        "length 192",
    );
    expect_invalid(
        rope_backward(&stream, &a, &mut q, &mut k_other_seq, &cos, &sin, &pp),
        "dk",
        "length 96",
    );
    stream.synchronize().unwrap();
}

#[test]
fn zero_tokens_launch_nothing() {
    // B = 0 or S = 0: every form is validated against its (possibly empty) length, then the
    // call returns Ok without a launch (a zero-block launch would be a driver error).
    let Some(stream) = gpu("zero_tokens_launch_nothing") else {
        return;
    };
    let (mut q_buf, mut k_buf) = (upload(&stream, &[1.0f32; 8]), upload(&stream, &[1.0f32; 8]));
    let table = upload(&stream, &[0.0f32; 40]); // 5 rows of 8
    let no_ids: [i64; 0] = [];
    for (b, s) in [(0, 5), (3, 0)] {
        let args = RopeArgs::new(8)
            .with_batch(b)
            .with_seq_len(s)
            .with_heads(2, 1);
        let (mut q, mut k) = (q_buf.slice_mut(0..0), k_buf.slice_mut(0..0));
        let per_position = table.slice(0..s * 8);
        let per_batch = table.slice(0..0);
        let forms = [
            (CosSinLayout::PerPosition, &per_position),
            (CosSinLayout::PerBatch, &per_batch),
            (
                CosSinLayout::Gathered(PositionIds::Host(&no_ids)),
                &table.as_view(),
            ),
        ];
        for (layout, cos) in &forms {
            let result = rope_forward(&stream, &args, &mut q, &mut k, *cos, *cos, layout);
            assert!(result.is_ok(), "{b}×{s} {layout:?}: {result:?}");
            let result = rope_backward(&stream, &args, &mut q, &mut k, *cos, *cos, layout);
            assert!(result.is_ok(), "{b}×{s} {layout:?}: {result:?}");
        }
        // Lengths are still checked: [S, r] with S = 5 is 40 elements, not 0.
        if s > 0 {
            let empty = table.slice(0..0);
            let pp = CosSinLayout::PerPosition;
            let result = rope_forward(&stream, &args, &mut q, &mut k, &empty, &empty, &pp);
            expect_invalid(result, "cos", "length 40");
        }
    }
    assert_eq!(download(&stream, &q_buf), vec![1.0f32; 8]);
    assert_eq!(download(&stream, &k_buf), vec![1.0f32; 8]);
}

#[test]
fn overlapping_buffers_are_rejected() {
    let Some(stream) = gpu("overlapping_buffers_are_rejected") else {
        return;
    };
    let (b, s, hq, hk, d) = (1, 2, 2, 2, 4);
    let a = RopeArgs::new(d)
        .with_batch(b)
        .with_seq_len(s)
        .with_heads(hq, hk);
    let n = b * s * hq * d; // 16, also the length of k
    let buf = upload(&stream, &vec![0.0f32; 5 * n]);
    let base = {
        let (ptr, _guard) = buf.device_ptr(&stream);
        ptr
    };
    // Safe Rust cannot hold a shared and a mutable view of the same memory, so overlaps are
    // built from raw pointers into `buf`.
    // SAFETY: every alias lies inside `buf` and is leaked (never freed) below.
    let alias = |offset: usize, len: usize| unsafe {
        stream.upgrade_device_ptr::<f32>(base + 4 * offset as u64, len)
    };
    let (mut q, mut k_over_q) = (alias(0, n), alias(n / 2, n));
    let cos = buf.slice(2 * n..2 * n + s * d);
    let sin = buf.slice(3 * n..3 * n + s * d);
    let pp = CosSinLayout::PerPosition;
    let e = rope_forward(&stream, &a, &mut q, &mut k_over_q, &cos, &sin, &pp);
    assert_eq!(
        e,
        Err(Error::Aliasing {
            output: "q",
            other: "k"
        })
    );
    let mut k = alias(n, n);
    // q starts where cos does and ends before k's neighbour sin: it overlaps cos alone.
    let mut q_over_cos = alias(2 * n, n);
    let e = rope_forward(&stream, &a, &mut q_over_cos, &mut k, &cos, &sin, &pp);
    assert_eq!(
        e,
        Err(Error::Aliasing {
            output: "q",
            other: "cos"
        })
    );
    let mut dk_over_sin = alias(3 * n + 4, n);
    let e = rope_backward(&stream, &a, &mut q, &mut dk_over_sin, &cos, &sin, &pp);
    assert_eq!(
        e,
        Err(Error::Aliasing {
            output: "dk",
            other: "sin"
        })
    );
    // Device position ids (2 × i64) inside k.
    // SAFETY: the ids are only compared as addresses: the call is rejected before a launch.
    let ids_in_k = unsafe { buf.slice(n..n + 4).transmute::<i64>(2) }.expect("4 f32 = 2 i64");
    let layout = CosSinLayout::Gathered(PositionIds::DeviceI64(ids_in_k));
    let e = rope_forward(&stream, &a, &mut q, &mut k, &cos, &sin, &layout);
    assert_eq!(
        e,
        Err(Error::Aliasing {
            output: "k",
            other: "position_ids"
        })
    );
    // Adjacent, not overlapping: accepted (cos and sin may share memory: both are inputs).
    let e = rope_forward(&stream, &a, &mut q, &mut k, &cos, &cos, &pp);
    assert!(e.is_ok(), "{e:?}");
    stream.synchronize().unwrap();
    let _ = (
        q.leak(),
        k.leak(),
        k_over_q.leak(),
        q_over_cos.leak(),
        dk_over_sin.leak(),
    );
}
