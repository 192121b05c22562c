//! Compiles `kernels-gpu` to PTX with its pinned nightly and hands it to the library through
//! `OUT_DIR/kernels.ptx` (see `crates/ptx-builder`).
use liger_ptx_builder::{NO_INSTALL_ENV, PtxBuild};
use std::path::PathBuf;

fn main() {
    let root =
        PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let build = PtxBuild {
        crate_dir: root.join("kernels-gpu"),
        manifest: "Cargo.toml".into(),
        work_dir: out.join("kernels-gpu"),
        target_cpu: "sm_80".into(),
        install_missing: std::env::var_os(NO_INSTALL_ENV).is_none(),
    };
    for input in build.inputs() {
        println!("cargo:rerun-if-changed={}", input.display());
    }
    println!("cargo:rerun-if-env-changed={NO_INSTALL_ENV}");
    match build.build() {
        Ok(result) => {
            for note in &result.notes {
                println!("cargo:warning={note}");
            }
            std::fs::write(out.join("kernels.ptx"), result.ptx).expect("write OUT_DIR/kernels.ptx");
        }
        Err(e) => {
            for line in e.to_string().lines() {
                println!("cargo:warning={line}");
            }
            panic!("building the device kernels (kernels-gpu) failed: {e}");
        }
    }
}
