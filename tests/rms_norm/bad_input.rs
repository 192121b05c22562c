//! Rejected and empty calls on the GPU.
use super::*;

#[test]
fn overlapping_outputs_are_rejected() {
    let Some(stream) = gpu("overlapping_outputs_are_rejected") else {
        return;
    };
    let (rows, cols) = (4, 8);
    let n = rows * cols;
    let a = RmsNormArgs::new(rows, cols);
    let buf = upload(&stream, &vec![1.0f32; 2 * n]);
    let base = {
        use liger_rs::cudarc::driver::DevicePtr;
        let (ptr, _guard) = buf.device_ptr(&stream);
        ptr
    };
    // Safe Rust cannot hold a shared and a mutable view of the same memory, so the overlap is
    // built from raw pointers: `alias` starts half-way into `buf`'s first n elements.
    // SAFETY: `alias` lies inside `buf` and is leaked (never freed) below.
    let mut alias = unsafe { stream.upgrade_device_ptr::<f32>(base + 4 * (n as u64 / 2), n) };
    let first = buf.slice(..n);
    let mut rstd = poisoned::<f32>(&stream, rows);
    let e = rms_norm_forward(&stream, &a, &first, None, &mut alias, &mut rstd);
    assert_eq!(
        e,
        Err(Error::Aliasing {
            output: "y",
            other: "x"
        })
    );
    let mut y = poisoned::<f32>(&stream, n);
    let e = rms_norm_forward(
        &stream,
        &a.with_strides(cols, cols),
        &first,
        None,
        &mut y,
        &mut alias,
    );
    assert_eq!(
        e,
        Err(Error::Aliasing {
            output: "rstd",
            other: "x"
        })
    );
    let e = rms_norm_backward(&stream, &a, &first, &y, None, &rstd, &mut alias, None);
    assert_eq!(
        e,
        Err(Error::Aliasing {
            output: "dx",
            other: "dy"
        })
    );
    let e = rms_norm_backward_inplace(&stream, &a, &mut alias, &first, None, &rstd, None);
    assert_eq!(
        e,
        Err(Error::Aliasing {
            output: "dy_dx",
            other: "x"
        })
    );
    // Adjacent, not overlapping: accepted.
    let second = buf.slice(n..);
    // SAFETY: as above, the alias covers buf[0..n] exactly and is leaked.
    let mut exact = unsafe { stream.upgrade_device_ptr::<f32>(base, n) };
    assert!(rms_norm_forward(&stream, &a, &second, None, &mut exact, &mut rstd).is_ok());
    stream.synchronize().unwrap();
    let _ = (alias.leak(), exact.leak());
}
