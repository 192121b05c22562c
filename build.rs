//! Compiles `kernels-gpu` to PTX with its pinned nightly and hands it to the library through
//! `OUT_DIR/kernels.ptx` (see `crates/ptx-builder`).
//!
//! The device crate is read through `packaging/kernels-gpu/`: symbolic links to the files of
//! `kernels-gpu/`, its `Cargo.toml` as `manifest.toml`. `cargo package` leaves `kernels-gpu/`
//! out (it holds a `Cargo.toml`) but ships the links as the files they point at, so a checkout
//! and the published package build the same files the same way.
//!
//! On docs.rs (`DOCS_RS` set) the build is offline and only rustdoc runs, so no device
//! toolchain is installed there and `kernels.ptx` is left empty.
use liger_ptx_builder::{NO_INSTALL_ENV, PtxBuild};
use std::path::PathBuf;

/// The device crate as the package ships it, relative to the package root.
const SHIPPED_CRATE: &str = "packaging/kernels-gpu";
/// Its manifest's name there.
const SHIPPED_MANIFEST: &str = "manifest.toml";
/// The device crate in a checkout (absent from the package).
const CHECKOUT_CRATE: &str = "kernels-gpu";

fn main() {
    let root =
        PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    println!("cargo:rerun-if-env-changed=DOCS_RS");
    if std::env::var_os("DOCS_RS").is_some() {
        std::fs::write(out.join("kernels.ptx"), "").expect("write OUT_DIR/kernels.ptx");
        return;
    }
    let build = PtxBuild {
        crate_dir: root.join(SHIPPED_CRATE),
        manifest: SHIPPED_MANIFEST.into(),
        work_dir: out.join("kernels-gpu"),
        target_cpu: "sm_80".into(),
        install_missing: std::env::var_os(NO_INSTALL_ENV).is_none(),
    };
    let checkout = PtxBuild {
        crate_dir: root.join(CHECKOUT_CRATE),
        manifest: "Cargo.toml".into(),
        ..build.clone()
    };
    if checkout.crate_dir.join("Cargo.toml").is_file() && build.inputs() != checkout.inputs() {
        panic!(
            "{SHIPPED_CRATE}/ must hold symbolic links to {CHECKOUT_CRATE}/ ({SHIPPED_MANIFEST} \
             to Cargo.toml, and Cargo.lock, rust-toolchain.toml, src); on Windows, clone with \
             `git clone -c core.symlinks=true`"
        );
    }
    println!("cargo:rerun-if-changed={}", build.crate_dir.display());
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
