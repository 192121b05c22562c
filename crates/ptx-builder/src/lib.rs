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
//! Each PTX built is kept in the working directory under a key of everything it was built
//! from, so builds that share a working directory (every Cargo profile and feature set of one
//! target directory: [`target_dir_of`]) build each version of the device crate once, and a
//! changed kernel rebuilds incrementally in the nightly's own target directory there.
//!
//! This replaces Rust-CUDA's `cuda_builder` (whose NVVM backend needs LLVM 7) with the stock
//! LLVM nvptx64 backend of the nightly toolchain.
use std::ffi::OsString;
use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::SystemTime;

mod sha256;

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

/// This crate's source, part of every cache key: it holds the flags and the command line of
/// the device build, so a builder that builds differently never reads another's PTX.
const BUILDER_SOURCE: &str = include_str!("lib.rs");

/// PTX files a working directory keeps (the most recently used): enough for the versions of a
/// device crate that builds switch between, bounded for one that is edited often.
const KEPT_PTX: usize = 8;

/// The target directory that holds a build script's `OUT_DIR`, read from the path: `OUT_DIR` is
/// `<dir>/<profile>/build/<package>-<hash>/out` (or `…/build/<package>/<hash>/out`), and this
/// returns `<dir>`: the target directory, or its `<triple>/` where `--target` is given. Every profile and feature set built there has its own
/// `OUT_DIR` below it, so a [`PtxBuild::work_dir`] in it is shared by all of them. `None` where
/// `out_dir` is not laid out so.
///
/// ```
/// use std::path::Path;
/// use liger_ptx_builder::target_dir_of;
/// let out = Path::new("/work/target/release/build/host-0123abcd/out");
/// assert_eq!(target_dir_of(out), Some(Path::new("/work/target")));
/// let cross = Path::new("/work/target/x86_64-unknown-linux-gnu/debug/build/host-0123abcd/out");
/// assert_eq!(target_dir_of(cross), Some(Path::new("/work/target/x86_64-unknown-linux-gnu")));
/// assert_eq!(target_dir_of(Path::new("/tmp/out")), None);
/// ```
pub fn target_dir_of(out_dir: &Path) -> Option<&Path> {
    // Cargo names the directory of build script runs `build`, whatever the directory names above.
    let build = out_dir
        .ancestors()
        .skip(2)
        .take(2)
        .find(|dir| dir.file_name().is_some_and(|name| name == "build"))?;
    build
        .parent()?
        .parent()
        .filter(|dir| dir.parent().is_some())
}

/// How to build one device crate.
#[derive(Debug, Clone)]
pub struct PtxBuild {
    /// Directory of the device crate: its manifest, `Cargo.lock`, `rust-toolchain.toml` and
    /// `src/` (symbolic links are followed). Nothing else in it is read.
    pub crate_dir: PathBuf,
    /// File name of the manifest in `crate_dir`: `Cargo.toml`, or another name where the
    /// device crate ships inside a host package (the copy is built as `Cargo.toml`).
    pub manifest: String,
    /// Working directory: the crate is copied to `crate/` in it and built into `target/`, and
    /// each PTX built is kept in `ptx/`, named by the SHA-256 of everything the build reads
    /// (the files of the copy, the nightly's `rustc -vV`, `target_cpu`, and this crate's
    /// source, which holds the flags), so that a build of the same inputs reads it back
    /// instead of building. Any number of builds of one device crate and `target_cpu` may
    /// share it, at once too: they copy and build one at a time (a lock on `lock` in it), and
    /// a kept PTX file appears whole or not at all (written aside, then renamed). A shared
    /// one belongs in the host's target directory ([`target_dir_of`]), so that every
    /// profile's build script finds the others' PTX.
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
    /// The working directory's lock could not be taken, or a built PTX not kept there.
    Cache(String),
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
            BuildError::Cache(m) => write!(f, "working directory: {m}"),
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

    /// The device build's `RUSTFLAGS`.
    fn rustflags(&self) -> [String; 3] {
        [
            format!("-Ctarget-cpu={}", self.target_cpu),
            "-Zunstable-options".into(),
            "-Cpanic=immediate-abort".into(),
        ]
    }

    /// The cache key of building the crate at `entries` (as [`sync_dir`] takes them) with the
    /// toolchain whose `rustc -vV` is `rustc_version`.
    fn cache_key(
        &self,
        rustc_version: &str,
        entries: Vec<(PathBuf, OsString)>,
    ) -> Result<String, BuildError> {
        let mut hash = sha256::Sha256::new();
        for part in [BUILDER_SOURCE, rustc_version, TARGET]
            .into_iter()
            .chain(self.rustflags().iter().map(String::as_str))
        {
            hash_bytes(&mut hash, part.as_bytes());
        }
        hash_tree(&mut hash, entries)?;
        Ok(hash.hex())
    }

    /// What [`sync_dir`] copies into `crate/`: the manifest as `Cargo.toml`, and the entries.
    fn crate_entries(&self) -> Vec<(PathBuf, OsString)> {
        std::iter::once((self.manifest.as_str(), "Cargo.toml"))
            .chain(CRATE_ENTRIES.iter().map(|name| (*name, *name)))
            .map(|(from, to)| (self.crate_dir.join(from), OsString::from(to)))
            .collect()
    }

    /// Brings `work_dir/crate` in line with the sources and returns it.
    fn copy_crate(&self) -> Result<PathBuf, BuildError> {
        let dir = self.work_dir.join("crate");
        sync_dir(self.crate_entries(), &dir)?;
        Ok(dir)
    }

    /// Returns the checked PTX: the one kept in [`PtxBuild::work_dir`] for these inputs, or
    /// else a fresh build's, which is then kept there.
    pub fn build(&self) -> Result<PtxOutput, BuildError> {
        let toolchain = pinned_toolchain(&self.crate_dir)?;
        let mut notes = Vec::new();
        let (cargo, rustc) = ensure_toolchain(&toolchain, self.install_missing, &mut notes)?;
        let rustc_version = run(Command::new(&rustc).arg("-vV"))?;
        let ptx = self.cached(&rustc_version, |copy| self.compile(&cargo, &rustc, copy))?;
        Ok(PtxOutput {
            ptx,
            toolchain,
            notes,
        })
    }

    /// The checked PTX kept for these inputs, or else what `compile` returns for the crate's
    /// copy, checked and then kept.
    fn cached(
        &self,
        rustc_version: &str,
        compile: impl FnOnce(&Path) -> Result<String, BuildError>,
    ) -> Result<String, BuildError> {
        let cache = PtxCache(self.work_dir.join("ptx"));
        let wanted = self.cache_key(rustc_version, self.crate_entries())?;
        let ptx = match cache.get(&wanted) {
            Some(ptx) => ptx,
            None => {
                let _lock = lock(&self.work_dir)?;
                let crate_copy = self.copy_crate()?;
                // Keyed by the copy, which no other build changes while the lock is held: the
                // sources may have changed since `wanted` was taken.
                let key = self.cache_key(rustc_version, dir_entries(&crate_copy)?)?;
                match cache.get(&key) {
                    Some(ptx) => ptx,
                    None => {
                        let ptx = compile(&crate_copy)?;
                        check_self_contained(&ptx)?;
                        cache.put(&key, &ptx)?;
                        ptx
                    }
                }
            }
        };
        Ok(ptx)
    }

    /// Runs the nightly's cargo on `crate_copy` and returns the PTX it wrote.
    fn compile(&self, cargo: &Path, rustc: &Path, crate_copy: &Path) -> Result<String, BuildError> {
        let flags = self.rustflags().join("\x1f");
        let target_dir = self.work_dir.join("target");
        let mut cmd = Command::new(cargo);
        for var in CLEARED_ENV {
            cmd.env_remove(var);
        }
        // Profile and unstable settings would change the PTX without changing its cache key.
        for (var, _) in std::env::vars_os() {
            let name = var.to_string_lossy();
            if name.starts_with("CARGO_PROFILE_") || name.starts_with("CARGO_UNSTABLE_") {
                cmd.env_remove(&var);
            }
        }
        // An unchanged crate root with a changed manifest or lock can leave an older unit's
        // `.s` the newest in `deps`: touching the root makes this build write the newest one.
        let root = crate_copy.join("src").join("lib.rs");
        fs::File::options()
            .write(true)
            .open(&root)
            .and_then(|f| f.set_modified(SystemTime::now()))
            .map_err(|e| BuildError::Ptx(format!("cannot touch {}: {e}", root.display())))?;
        cmd.current_dir(crate_copy)
            .env("RUSTC", rustc)
            .env("CARGO_ENCODED_RUSTFLAGS", flags)
            .args(["rustc", "--release", "--locked", "--target", TARGET])
            .args(["-Zbuild-std=core", "--crate-type=rlib", "--target-dir"])
            .arg(&target_dir)
            .args(["--", "--emit=asm"]);
        run(&mut cmd)?;
        let deps = target_dir.join(TARGET).join("release").join("deps");
        let ptx_file = newest_asm(&deps)?;
        fs::read_to_string(&ptx_file)
            .map_err(|e| BuildError::Ptx(format!("cannot read {}: {e}", ptx_file.display())))
    }
}

/// Feeds `bytes` to `hash` after their length, so that consecutive parts cannot run together.
fn hash_bytes(hash: &mut sha256::Sha256, bytes: &[u8]) {
    hash.update(&(bytes.len() as u64).to_le_bytes());
    hash.update(bytes);
}

/// Feeds the tree of `entries` (source path, name) to `hash` in name order: each entry's kind,
/// name and, for a file, its bytes (symbolic links are followed, as [`sync_dir`] does).
fn hash_tree(
    hash: &mut sha256::Sha256,
    mut entries: Vec<(PathBuf, OsString)>,
) -> Result<(), BuildError> {
    entries.sort_by(|a, b| a.1.cmp(&b.1));
    for (path, name) in entries {
        let read_fail =
            |e: std::io::Error| BuildError::Copy(format!("cannot read {}: {e}", path.display()));
        let is_dir = fs::metadata(&path).map_err(read_fail)?.is_dir();
        hash_bytes(hash, if is_dir { b"dir" } else { b"file" });
        hash_bytes(hash, name.as_encoded_bytes());
        if is_dir {
            hash_tree(hash, dir_entries(&path)?)?;
            hash_bytes(hash, b"end");
        } else {
            hash_bytes(hash, &fs::read(&path).map_err(read_fail)?);
        }
    }
    Ok(())
}

/// The entries of directory `dir` as (path, name).
fn dir_entries(dir: &Path) -> Result<Vec<(PathBuf, OsString)>, BuildError> {
    fs::read_dir(dir)
        .and_then(|entries| {
            entries
                .map(|e| e.map(|e| (e.path(), e.file_name())))
                .collect()
        })
        .map_err(|e| BuildError::Copy(format!("cannot list {}: {e}", dir.display())))
}

/// Takes the lock of `work_dir` (released when the file is dropped, or when the process ends
/// however it ends), waiting while another build holds it.
fn lock(work_dir: &Path) -> Result<fs::File, BuildError> {
    let path = work_dir.join("lock");
    let fail =
        |e: std::io::Error| BuildError::Cache(format!("cannot lock {}: {e}", path.display()));
    fs::create_dir_all(work_dir).map_err(fail)?;
    let file = fs::File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(fail)?;
    file.lock().map_err(fail)?;
    Ok(file)
}

/// The PTX files kept in a working directory's `ptx/`, one per cache key.
struct PtxCache(PathBuf);

impl PtxCache {
    fn path(&self, key: &str) -> PathBuf {
        self.0.join(format!("{key}.ptx"))
    }

    /// The PTX kept under `key`, if any and self-contained (and marks it used); safe without
    /// the lock, since a file is renamed into place whole.
    fn get(&self, key: &str) -> Option<String> {
        let path = self.path(key);
        let ptx = fs::read_to_string(&path).ok()?;
        check_self_contained(&ptx).ok()?;
        // Best effort: a kept file that cannot be marked is merely pruned sooner.
        if let Ok(file) = fs::File::options().write(true).open(&path) {
            let _ = file.set_modified(SystemTime::now());
        }
        Some(ptx)
    }

    /// Keeps `ptx` under `key` (written aside, then renamed into place), then removes all but
    /// the [`KEPT_PTX`] most recently used files. Only under the working directory's lock.
    fn put(&self, key: &str, ptx: &str) -> Result<(), BuildError> {
        let fail = |what: &str, path: &Path, e: std::io::Error| {
            BuildError::Cache(format!("cannot {what} {}: {e}", path.display()))
        };
        fs::create_dir_all(&self.0).map_err(|e| fail("create", &self.0, e))?;
        let (path, partial) = (self.path(key), self.0.join(format!("{key}.partial")));
        fs::write(&partial, ptx).map_err(|e| fail("write", &partial, e))?;
        fs::rename(&partial, &path).map_err(|e| fail("rename into", &path, e))?;
        let mut kept: Vec<_> = dir_entries(&self.0)?
            .into_iter()
            .map(|(path, _)| {
                let used = fs::metadata(&path).and_then(|m| m.modified());
                (used.unwrap_or(SystemTime::UNIX_EPOCH), path)
            })
            .collect();
        kept.sort_by(|a, b| b.cmp(a));
        for (_, old) in kept.into_iter().skip(KEPT_PTX) {
            // A file another build is reading stays readable to it where the system allows.
            let _ = fs::remove_file(old);
        }
        Ok(())
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
mod tests;
