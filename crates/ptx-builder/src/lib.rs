//! Compiles a `#![no_std]` device crate to PTX from a build script, whatever toolchain builds
//! the host: the device crate's own `rust-toolchain.toml` names the nightly, this crate makes
//! sure that nightly and its `rust-src` are installed (installing them with rustup unless told
//! not to), copies the crate into a private working directory, runs the nightly's cargo there
//! for `nvptx64-nvidia-cuda` with `-Zbuild-std=core --emit=asm`, and checks that the PTX is
//! self-contained.
//!
//! The copy is what lets a host crate ship its device crate on crates.io: `cargo package`
//! leaves out every subdirectory that holds a `Cargo.toml`, so the host package carries the
//! device crate with its manifest under another name ([`PtxBuild::manifest`]) and the copy
//! restores the name. The copy is kept in sync file by file (unchanged files are not
//! rewritten, files gone from the source are removed), and [`PtxBuild::inputs`] lists what
//! the build reads, for `cargo:rerun-if-changed`.
//!
//! This replaces Rust-CUDA's `cuda_builder` (whose NVVM backend needs LLVM 7) with the stock
//! LLVM nvptx64 backend of the nightly toolchain.
use std::ffi::OsString;
use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The environment variable that turns the automatic toolchain install into an error.
pub const NO_INSTALL_ENV: &str = "LIGER_RS_NO_TOOLCHAIN_INSTALL";

/// Variables the outer cargo sets that must not leak into the device build.
const CLEARED_ENV: &[&str] = &[
    "RUSTC",
    "RUSTC_WRAPPER",
    "RUSTC_WORKSPACE_WRAPPER",
    "RUSTDOC",
    "RUSTFLAGS",
    "RUSTDOCFLAGS",
    "CARGO_ENCODED_RUSTFLAGS",
    "CARGO_ENCODED_RUSTDOCFLAGS",
    "CARGO_BUILD_RUSTFLAGS",
    "RUSTUP_TOOLCHAIN",
    "CARGO_TARGET_DIR",
    "CARGO_BUILD_TARGET",
    "CARGO_BUILD_TARGET_DIR",
    "CARGO_MAKEFLAGS",
    "MAKEFLAGS",
    "MFLAGS",
];

/// The target triple of the device build.
pub const TARGET: &str = "nvptx64-nvidia-cuda";

/// What the device build reads from the crate directory besides the manifest.
const CRATE_ENTRIES: &[&str] = &["Cargo.lock", "rust-toolchain.toml", "src"];

/// How to build one device crate.
#[derive(Debug, Clone)]
pub struct PtxBuild {
    /// Directory of the device crate: its manifest, `Cargo.lock`, `rust-toolchain.toml` and
    /// `src/` (symbolic links are followed). Nothing else in it is read.
    pub crate_dir: PathBuf,
    /// File name of the manifest in `crate_dir`: `Cargo.toml`, or another name where the
    /// device crate ships inside a host package (the copy is built as `Cargo.toml`).
    pub manifest: String,
    /// Private working directory (under the host's `OUT_DIR`): the crate is copied to
    /// `crate/` in it and built into `target/`.
    pub work_dir: PathBuf,
    /// `-C target-cpu`, e.g. `sm_80` (the driver JITs the PTX forward to newer GPUs).
    pub target_cpu: String,
    /// Install a missing toolchain or `rust-src` with rustup (`false`: fail with the command).
    pub install_missing: bool,
}

/// Why the device build failed; the message names the missing piece or the command to run.
#[derive(Debug)]
pub enum BuildError {
    /// `rust-toolchain.toml` is missing or names no `channel`.
    Toolchain(String),
    /// A toolchain or component is missing and installing it is disabled.
    Missing {
        /// What is missing.
        what: String,
        /// The command that installs it.
        command: String,
    },
    /// A command could not run or failed.
    Command {
        /// The command line.
        command: String,
        /// Its output or the reason it did not start.
        output: String,
    },
    /// The PTX is missing or not self-contained.
    Ptx(String),
    /// The device crate could not be copied into the working directory.
    Copy(String),
}

impl fmt::Display for BuildError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BuildError::Toolchain(m) => write!(f, "device toolchain: {m}"),
            BuildError::Missing { what, command } => write!(
                f,
                "{what} is not installed: {command} (or unset {NO_INSTALL_ENV} to let the build install it)"
            ),
            BuildError::Command { command, output } => {
                write!(f, "`{command}` failed:\n{output}")
            }
            BuildError::Ptx(m) => write!(f, "PTX check: {m}"),
            BuildError::Copy(m) => write!(f, "copying the device crate: {m}"),
        }
    }
}

impl std::error::Error for BuildError {}

/// What a successful build produced.
#[derive(Debug, Clone)]
pub struct PtxOutput {
    /// The PTX text.
    pub ptx: String,
    /// The toolchain that built it.
    pub toolchain: String,
    /// Notes for the host build to print as cargo warnings (e.g. "installed nightly-…").
    pub notes: Vec<String>,
}

/// Reads `channel = "…"` from the device crate's `rust-toolchain.toml`.
pub fn pinned_toolchain(crate_dir: &Path) -> Result<String, BuildError> {
    let file = crate_dir.join("rust-toolchain.toml");
    let text = fs::read_to_string(&file)
        .map_err(|e| BuildError::Toolchain(format!("cannot read {}: {e}", file.display())))?;
    text.lines()
        .filter_map(|l| l.trim().strip_prefix("channel"))
        .filter_map(|rest| rest.trim().strip_prefix('='))
        .map(|v| v.trim().trim_matches('"').to_string())
        .find(|v| !v.is_empty())
        .ok_or_else(|| BuildError::Toolchain(format!("no channel in {}", file.display())))
}

fn run(cmd: &mut Command) -> Result<String, BuildError> {
    let line = format!("{cmd:?}");
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|e| BuildError::Command {
            command: line.clone(),
            output: e.to_string(),
        })?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if out.status.success() {
        Ok(text)
    } else {
        Err(BuildError::Command {
            command: line,
            output: text,
        })
    }
}

fn rustup() -> Command {
    let mut c = Command::new(std::env::var("RUSTUP").unwrap_or_else(|_| "rustup".into()));
    for var in CLEARED_ENV {
        c.env_remove(var);
    }
    c
}

/// Path of `tool` (`cargo`, `rustc`) in `toolchain`, or `None` if the toolchain is missing.
fn tool_path(toolchain: &str, tool: &str) -> Option<PathBuf> {
    let out = rustup()
        .args(["which", "--toolchain", toolchain, tool])
        .stderr(Stdio::null())
        .output()
        .ok()?;
    let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    (out.status.success() && path.is_file()).then_some(path)
}

fn has_rust_src(rustc: &Path) -> Result<bool, BuildError> {
    let sysroot = run(Command::new(rustc).args(["--print", "sysroot"]))?;
    Ok(Path::new(sysroot.trim())
        .join("lib/rustlib/src/rust/library/core/Cargo.toml")
        .is_file())
}

/// Makes sure the pinned toolchain and its `rust-src` exist; returns `(cargo, rustc)` paths.
fn ensure_toolchain(
    toolchain: &str,
    install: bool,
    notes: &mut Vec<String>,
) -> Result<(PathBuf, PathBuf), BuildError> {
    if tool_path(toolchain, "rustc").is_none() {
        let args = [
            "toolchain",
            "install",
            toolchain,
            "--profile",
            "minimal",
            "--component",
            "rust-src",
        ];
        if !install {
            return Err(BuildError::Missing {
                what: format!("the device toolchain {toolchain}"),
                command: format!("rustup {}", args.join(" ")),
            });
        }
        run(rustup().args(args))?;
        notes.push(format!(
            "installed the device toolchain {toolchain} with rust-src (rustup {})",
            args.join(" ")
        ));
    }
    let rustc = tool_path(toolchain, "rustc")
        .ok_or_else(|| BuildError::Toolchain(format!("rustup cannot find rustc in {toolchain}")))?;
    if !has_rust_src(&rustc)? {
        let args = ["component", "add", "rust-src", "--toolchain", toolchain];
        if !install {
            return Err(BuildError::Missing {
                what: "rust-src".into(),
                command: format!("rustup {}", args.join(" ")),
            });
        }
        run(rustup().args(args))?;
        notes.push(format!("installed rust-src for {toolchain}"));
    }
    let cargo = tool_path(toolchain, "cargo")
        .ok_or_else(|| BuildError::Toolchain(format!("rustup cannot find cargo in {toolchain}")))?;
    Ok((cargo, rustc))
}

/// Fails unless the PTX defines every function it calls (no `.extern .func`) and has entries.
pub fn check_self_contained(ptx: &str) -> Result<(), BuildError> {
    if let Some(line) = ptx.lines().find(|l| l.contains(".extern .func")) {
        return Err(BuildError::Ptx(format!(
            "unresolved external function: {}",
            line.trim()
        )));
    }
    if !ptx.contains(".entry") {
        return Err(BuildError::Ptx("no kernel entry points".into()));
    }
    Ok(())
}

impl PtxBuild {
    /// The files and directories the build reads (see [`PtxBuild::crate_dir`]), each resolved
    /// through symbolic links where it exists: print each as `cargo:rerun-if-changed`.
    pub fn inputs(&self) -> Vec<PathBuf> {
        std::iter::once(self.manifest.as_str())
            .chain(CRATE_ENTRIES.iter().copied())
            .map(|name| {
                let path = self.crate_dir.join(name);
                fs::canonicalize(&path).unwrap_or(path)
            })
            .collect()
    }

    /// Brings `work_dir/crate` in line with the sources and returns it.
    fn copy_crate(&self) -> Result<PathBuf, BuildError> {
        let entries = std::iter::once((self.manifest.as_str(), "Cargo.toml"))
            .chain(CRATE_ENTRIES.iter().map(|name| (*name, *name)))
            .map(|(from, to)| (self.crate_dir.join(from), OsString::from(to)))
            .collect();
        let dir = self.work_dir.join("crate");
        sync_dir(entries, &dir)?;
        Ok(dir)
    }

    /// Runs the device build and returns the checked PTX.
    pub fn build(&self) -> Result<PtxOutput, BuildError> {
        let toolchain = pinned_toolchain(&self.crate_dir)?;
        let mut notes = Vec::new();
        let (cargo, rustc) = ensure_toolchain(&toolchain, self.install_missing, &mut notes)?;
        let flags = [
            format!("-Ctarget-cpu={}", self.target_cpu),
            "-Zunstable-options".into(),
            "-Cpanic=immediate-abort".into(),
        ]
        .join("\x1f");
        let crate_copy = self.copy_crate()?;
        let target_dir = self.work_dir.join("target");
        let mut cmd = Command::new(&cargo);
        for var in CLEARED_ENV {
            cmd.env_remove(var);
        }
        cmd.current_dir(&crate_copy)
            .env("RUSTC", &rustc)
            .env("CARGO_ENCODED_RUSTFLAGS", flags)
            .args(["rustc", "--release", "--locked", "--target", TARGET])
            .args(["-Zbuild-std=core", "--crate-type=rlib", "--target-dir"])
            .arg(&target_dir)
            .args(["--", "--emit=asm"]);
        run(&mut cmd)?;
        let deps = target_dir.join(TARGET).join("release").join("deps");
        let ptx_file = newest_asm(&deps)?;
        let ptx = fs::read_to_string(&ptx_file)
            .map_err(|e| BuildError::Ptx(format!("cannot read {}: {e}", ptx_file.display())))?;
        check_self_contained(&ptx)?;
        Ok(PtxOutput {
            ptx,
            toolchain,
            notes,
        })
    }
}

/// Makes directory `dst` hold exactly `entries` (source path, name in `dst`): directories are
/// copied recursively, symbolic links in the sources are followed, a file whose bytes are
/// already there is left alone (its modification time, and so cargo's fingerprint of the
/// copy, stays), and anything else in `dst` is removed.
fn sync_dir(entries: Vec<(PathBuf, OsString)>, dst: &Path) -> Result<(), BuildError> {
    let fail = |what: &str, path: &Path, e: std::io::Error| {
        BuildError::Copy(format!("cannot {what} {}: {e}", path.display()))
    };
    fs::create_dir_all(dst).map_err(|e| fail("create", dst, e))?;
    for (src, name) in &entries {
        let to = dst.join(name);
        let old = fs::symlink_metadata(&to).ok();
        if fs::metadata(src)
            .map_err(|e| fail("read", src, e))?
            .is_dir()
        {
            if old.is_some_and(|m| !m.is_dir()) {
                fs::remove_file(&to).map_err(|e| fail("remove", &to, e))?;
            }
            let children = fs::read_dir(src)
                .and_then(|dir| {
                    dir.map(|e| e.map(|e| (e.path(), e.file_name())))
                        .collect::<std::io::Result<_>>()
                })
                .map_err(|e| fail("list", src, e))?;
            sync_dir(children, &to)?;
        } else {
            if old.is_some_and(|m| m.is_dir()) {
                fs::remove_dir_all(&to).map_err(|e| fail("remove", &to, e))?;
            }
            let bytes = fs::read(src).map_err(|e| fail("read", src, e))?;
            if fs::read(&to).ok().as_deref() != Some(bytes.as_slice()) {
                fs::write(&to, bytes).map_err(|e| fail("write", &to, e))?;
            }
        }
    }
    for entry in fs::read_dir(dst).map_err(|e| fail("list", dst, e))? {
        let entry = entry.map_err(|e| fail("list", dst, e))?;
        if entries.iter().all(|(_, name)| *name != entry.file_name()) {
            let path = entry.path();
            let removed = if entry.file_type().is_ok_and(|t| t.is_dir()) {
                fs::remove_dir_all(&path)
            } else {
                fs::remove_file(&path)
            };
            removed.map_err(|e| fail("remove", &path, e))?;
        }
    }
    Ok(())
}

/// The most recently written `*.s` in `deps` (the device crate's PTX).
fn newest_asm(deps: &Path) -> Result<PathBuf, BuildError> {
    let entries = fs::read_dir(deps)
        .map_err(|e| BuildError::Ptx(format!("cannot list {}: {e}", deps.display())))?;
    entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "s"))
        .filter_map(|p| Some((fs::metadata(&p).ok()?.modified().ok()?, p)))
        .max()
        .map(|(_, p)| p)
        .ok_or_else(|| BuildError::Ptx(format!("no .s file in {}", deps.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_channel() {
        let dir = std::env::temp_dir().join(format!("ptx-builder-test-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        fs::write(
            dir.join("rust-toolchain.toml"),
            "[toolchain]\nchannel = \"nightly-2026-05-20\"\ncomponents = [\"rust-src\"]\n",
        )
        .unwrap();
        assert_eq!(pinned_toolchain(&dir).unwrap(), "nightly-2026-05-20");
        fs::write(dir.join("rust-toolchain.toml"), "[toolchain]\n").unwrap();
        assert!(pinned_toolchain(&dir).is_err());
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn rejects_unresolved_functions() {
        let good = ".version 7.0\n.visible .entry k()\n{\n}\n";
        assert!(check_self_contained(good).is_ok());
        let bad = ".extern .func (.param .b32 r) expf\n.visible .entry k()\n{\n}\n";
        let err = check_self_contained(bad).unwrap_err().to_string();
        assert!(err.contains("expf"), "{err}");
        assert!(check_self_contained(".version 7.0\n").is_err());
    }

    #[test]
    fn a_missing_toolchain_is_an_error_naming_the_install_command_when_install_is_off() {
        let dir = std::env::temp_dir().join(format!("ptx-builder-missing-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        fs::write(
            dir.join("rust-toolchain.toml"),
            "[toolchain]\nchannel = \"nightly-2001-01-01\"\n",
        )
        .unwrap();
        let build = PtxBuild {
            crate_dir: dir.clone(),
            manifest: "Cargo.toml".into(),
            work_dir: dir.join("work"),
            target_cpu: "sm_80".into(),
            install_missing: false,
        };
        let msg = build.build().unwrap_err().to_string();
        fs::remove_dir_all(&dir).unwrap();
        assert!(
            msg.starts_with("the device toolchain nightly-2001-01-01 is not installed: rustup toolchain install nightly-2001-01-01 --profile minimal --component rust-src"),
            "{msg}"
        );
        assert!(msg.contains(NO_INSTALL_ENV), "{msg}");
    }

    /// An empty scratch directory for one test.
    fn scratch(test: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("ptx-builder-{test}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn write(path: &Path, text: &str) {
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, text).unwrap();
    }

    fn shipped_build(dir: &Path) -> PtxBuild {
        let src = dir.join("shipped");
        write(&src.join("kernels.toml"), "[package]\nname = \"k\"\n");
        write(&src.join("Cargo.lock"), "version = 4\n");
        write(&src.join("rust-toolchain.toml"), "[toolchain]\n");
        write(&src.join("src/lib.rs"), "mod a;\n");
        write(&src.join("src/a/mod.rs"), "// a\n");
        write(&src.join("notes.md"), "not part of the build\n");
        PtxBuild {
            crate_dir: src,
            manifest: "kernels.toml".into(),
            work_dir: dir.join("work"),
            target_cpu: "sm_80".into(),
            install_missing: false,
        }
    }

    #[test]
    fn the_copy_is_the_crate_under_cargo_toml_and_nothing_else() {
        let dir = scratch("copy");
        let build = shipped_build(&dir);
        let copy = build.work_dir.join("crate");
        write(&copy.join("src/stale.rs"), "// removed upstream\n");
        write(&copy.join("leftover/x"), "\n");
        write(
            &copy.join("src/a"),
            "a file where the source has a directory\n",
        );
        assert_eq!(build.copy_crate().unwrap(), copy);
        let read = |p: &str| fs::read_to_string(copy.join(p)).unwrap();
        assert_eq!(read("Cargo.toml"), "[package]\nname = \"k\"\n");
        assert_eq!(read("Cargo.lock"), "version = 4\n");
        assert_eq!(read("src/lib.rs"), "mod a;\n");
        assert_eq!(read("src/a/mod.rs"), "// a\n");
        let mut names: Vec<_> = fs::read_dir(&copy)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(
            names,
            ["Cargo.lock", "Cargo.toml", "rust-toolchain.toml", "src"]
        );
        assert!(!copy.join("src/stale.rs").exists());
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_second_copy_rewrites_only_what_changed() {
        let dir = scratch("recopy");
        let build = shipped_build(&dir);
        let copy = build.copy_crate().unwrap();
        let old = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000);
        for file in ["src/lib.rs", "src/a/mod.rs"] {
            let f = fs::File::options()
                .write(true)
                .open(copy.join(file))
                .unwrap();
            f.set_modified(old).unwrap();
        }
        write(&build.crate_dir.join("src/a/mod.rs"), "// a, edited\n");
        build.copy_crate().unwrap();
        let modified = |p: &str| fs::metadata(copy.join(p)).unwrap().modified().unwrap();
        assert_eq!(modified("src/lib.rs"), old);
        assert_ne!(modified("src/a/mod.rs"), old);
        let edited = fs::read_to_string(copy.join("src/a/mod.rs")).unwrap();
        assert_eq!(edited, "// a, edited\n");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_missing_manifest_is_an_error_naming_it() {
        let dir = scratch("no-manifest");
        let mut build = shipped_build(&dir);
        build.manifest = "Cargo.toml".into();
        let msg = build.copy_crate().unwrap_err().to_string();
        fs::remove_dir_all(&dir).unwrap();
        assert!(
            msg.starts_with("copying the device crate: cannot read"),
            "{msg}"
        );
        assert!(msg.contains("shipped/Cargo.toml"), "{msg}");
    }

    #[cfg(unix)]
    #[test]
    fn inputs_and_the_copy_follow_symbolic_links() {
        let dir = scratch("links");
        let real = shipped_build(&dir);
        let linked = dir.join("linked");
        fs::create_dir_all(&linked).unwrap();
        for name in ["kernels.toml", "Cargo.lock", "rust-toolchain.toml", "src"] {
            std::os::unix::fs::symlink(real.crate_dir.join(name), linked.join(name)).unwrap();
        }
        let build = PtxBuild {
            crate_dir: linked,
            work_dir: dir.join("linked-work"),
            ..real.clone()
        };
        let resolved = real.inputs();
        assert_eq!(build.inputs(), resolved);
        assert_eq!(
            resolved[0],
            fs::canonicalize(&real.crate_dir)
                .unwrap()
                .join("kernels.toml")
        );
        let copy = build.copy_crate().unwrap();
        assert!(fs::symlink_metadata(copy.join("src")).unwrap().is_dir());
        assert_eq!(
            fs::read_to_string(copy.join("src/a/mod.rs")).unwrap(),
            "// a\n"
        );
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn missing_piece_names_the_command() {
        let err = BuildError::Missing {
            what: "rust-src".into(),
            command: "rustup component add rust-src --toolchain nightly-2026-05-20".into(),
        };
        let msg = err.to_string();
        assert!(msg.starts_with("rust-src is not installed: rustup component add rust-src"));
    }
}
