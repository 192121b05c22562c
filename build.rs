//! Compiles `kernels-gpu` to PTX with its pinned nightly and hands it to the library through
//! `OUT_DIR`: `kernels.ptx` built for sm_80 and `kernels_sm90.ptx` built for sm_90a (Hopper's
//! architecture-specific target), where the RMSNorm dW reduction waits for the backward with
//! sm_90's `griddepcontrol` instructions, so the host can launch it as a programmatic dependent
//! launch, the backward can merge its dW partial rows within thread-block clusters, and the
//! attention forward multiplies with `wgmma` (see `crates/ptx-builder` and `src/module.rs`).
//!
//! The device crate is read through `packaging/kernels-gpu/`: symbolic links to the files of
//! `kernels-gpu/`, its `Cargo.toml` as `manifest.toml`. `cargo package` leaves `kernels-gpu/`
//! out (it holds a `Cargo.toml`) but ships the links as the files they point at, so a checkout
//! and the published package build the same files the same way.
//!
//! The nightly builds in `liger-rs-kernels/` of the target directory, which every profile and
//! feature set built there shares (`OUT_DIR` is per profile): the builder keeps each PTX there
//! under a key of everything it was built from, so the kernels build once per version of their
//! sources and toolchain, and a changed kernel rebuilds incrementally.
//!
//! On docs.rs (`DOCS_RS` set) the build is offline and only rustdoc runs, so no device
//! toolchain is installed there and both PTX files are left empty.
use liger_ptx_builder::{NO_INSTALL_ENV, PtxBuild, target_dir_of};
use std::path::PathBuf;

/// The device crate as the package ships it, relative to the package root.
const SHIPPED_CRATE: &str = "packaging/kernels-gpu";
/// Its manifest's name there.
const SHIPPED_MANIFEST: &str = "manifest.toml";
/// The device crate in a checkout (absent from the package).
const CHECKOUT_CRATE: &str = "kernels-gpu";
/// Each device build: its `-C target-cpu` and the file in `OUT_DIR` that receives its PTX.
const BUILDS: [(&str, &str); 2] = [("sm_80", "kernels.ptx"), ("sm_90a", "kernels_sm90.ptx")];

fn main() {
    let root =
        PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    println!("cargo:rerun-if-env-changed=DOCS_RS");
    if std::env::var_os("DOCS_RS").is_some() {
        for (_, file) in BUILDS {
            std::fs::write(out.join(file), "").expect("write the PTX files to OUT_DIR");
        }
        return;
    }
    // Where OUT_DIR is not laid out as Cargo lays it out, each profile builds in its own.
    let shared = target_dir_of(&out).map_or_else(|| out.clone(), |t| t.join("liger-rs-kernels"));
    let build = PtxBuild {
        crate_dir: root.join(SHIPPED_CRATE),
        manifest: SHIPPED_MANIFEST.into(),
        // Both set per build below.
        work_dir: shared.clone(),
        target_cpu: String::new(),
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
    // One after the other: the first installs a missing toolchain, which the second then finds.
    for (cpu, file) in BUILDS {
        let build = PtxBuild {
            work_dir: shared.join(format!("kernels-gpu-{cpu}")),
            target_cpu: cpu.into(),
            ..build.clone()
        };
        match build.build() {
            Ok(result) => {
                for note in &result.notes {
                    println!("cargo:warning={note}");
                }
                std::fs::write(out.join(file), result.ptx).expect("write the PTX to OUT_DIR");
            }
            Err(e) => {
                for line in e.to_string().lines() {
                    println!("cargo:warning={line}");
                }
                panic!("building the device kernels (kernels-gpu) for {cpu} failed: {e}");
            }
        }
    }
}
