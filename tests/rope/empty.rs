//! Empty calls: every form validated, nothing launched. Every rejected call (each argument,
//! length, form, position ids, overlap and context) is a row of `tests/bad_input.rs`'s table walk.
use super::*;

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
