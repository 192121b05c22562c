//! Compiles a `#![no_std]` device crate to PTX from a build script, whatever toolchain builds
//! the host: the device crate's own `rust-toolchain.toml` names the nightly, this crate makes
//! sure that nightly and its `rust-src` are installed (installing them with rustup unless told
//! not to), runs its cargo for `nvptx64-nvidia-cuda` with `-Zbuild-std=core --emit=asm` in a
//! private target directory, and checks that the PTX is self-contained.
//!
//! This replaces Rust-CUDA's `cuda_builder` (whose NVVM backend needs LLVM 7) with the stock
//! LLVM nvptx64 backend of the nightly toolchain.
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

/// How to build one device crate.
#[derive(Debug, Clone)]
pub struct PtxBuild {
    /// Directory of the device crate (holds `Cargo.toml` and `rust-toolchain.toml`).
    pub crate_dir: PathBuf,
    /// Private target directory for the device build (under the host's `OUT_DIR`).
    pub target_dir: PathBuf,
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
        let mut cmd = Command::new(&cargo);
        for var in CLEARED_ENV {
            cmd.env_remove(var);
        }
        cmd.current_dir(&self.crate_dir)
            .env("RUSTC", &rustc)
            .env("CARGO_ENCODED_RUSTFLAGS", flags)
            .args(["rustc", "--release", "--locked", "--target", TARGET])
            .args(["-Zbuild-std=core", "--crate-type=rlib", "--target-dir"])
            .arg(&self.target_dir)
            .args(["--", "--emit=asm"]);
        run(&mut cmd)?;
        let deps = self.target_dir.join(TARGET).join("release").join("deps");
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
            target_dir: dir.join("target"),
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
