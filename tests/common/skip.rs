//! Skipped GPU tests, for the integration tests (`tests/common`) and the library's unit tests
//! alike (`src/lib.rs` includes this file): a skip prints one line, is counted, and each test
//! binary ends with one line saying how many of its tests skipped, so that tests which pass
//! without having run are visible. Where GPUs must run the tests, the environment variable
//! [`REQUIRE_GPU_ENV`] turns those skips into failures.
use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Once, OnceLock};

/// `LIGER_RS_REQUIRE_GPU=N`: `N` GPUs are present and every test that needs at most `N` must
/// run (a skip for want of them fails the test); any other non-empty value means 1.
pub const REQUIRE_GPU_ENV: &str = "LIGER_RS_REQUIRE_GPU";

/// What a skipped test lacked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// This many GPUs (devices 0 to `n − 1`).
    Gpus(usize),
    /// An H200 with the sm_90 build loaded as device 0: the test checks choices that depend on
    /// that GPU's occupancy. On any other GPU it does not apply, so it skips even where
    /// [`REQUIRE_GPU_ENV`] is set.
    H200,
    /// The full-size shapes, where `LIGER_RS_TEST_SHAPES=small` asked for small ones and the
    /// test has no small form (its point is its size). Skips even where [`REQUIRE_GPU_ENV`]
    /// is set.
    FullShapes,
}

static SKIPPED: AtomicUsize = AtomicUsize::new(0);
static FIRST_REASON: OnceLock<String> = OnceLock::new();
static SUMMARY: Once = Once::new();

/// The GPUs [`REQUIRE_GPU_ENV`] says are present, if it is set.
fn required_gpus() -> Option<usize> {
    let value = std::env::var(REQUIRE_GPU_ENV).ok()?;
    let value = value.trim();
    match value.parse() {
        Ok(n) => Some(n),
        Err(_) if value.is_empty() => None,
        Err(_) => Some(1),
    }
}

/// Skips `test` because of `why` (it lacks `need`): panics (the test fails) where
/// [`REQUIRE_GPU_ENV`] says the GPUs it needs are present; otherwise writes
/// `SKIP <test>: <why>` to stderr and counts the skip for the summary line printed as the
/// process exits.
pub fn skip(test: &str, why: &str, need: Need) {
    if let (Need::Gpus(n), Some(present)) = (need, required_gpus())
        && n <= present
    {
        panic!(
            "{test}: {why}, but {REQUIRE_GPU_ENV} says {present} GPU(s) are present and the \
             test needs {n}"
        );
    }
    // Straight to stderr: libtest captures print!/eprint! of passing tests.
    let _ = writeln!(std::io::stderr(), "SKIP {test}: {why}");
    let _ = FIRST_REASON.set(why.to_string());
    SKIPPED.fetch_add(1, Ordering::Relaxed);
    SUMMARY.call_once(|| {
        // SAFETY: registers a function without arguments that only writes to stderr; a failed
        // registration only loses the summary line.
        unsafe { atexit(summary) };
    });
}

unsafe extern "C" {
    /// The C library's exit hook (every platform's C runtime has it): libtest's harness returns
    /// from `main` or calls `std::process::exit`, and both run these hooks after its last line.
    fn atexit(hook: extern "C" fn()) -> std::ffi::c_int;
}

/// The summary line of the skips in this process.
extern "C" fn summary() {
    let n = SKIPPED.load(Ordering::Relaxed);
    let tests = if n == 1 { "test" } else { "tests" };
    let first = FIRST_REASON.get().map_or("", String::as_str);
    let advice = match required_gpus() {
        None => {
            format!("set {REQUIRE_GPU_ENV}=1 (or the number of GPUs) where a GPU must run them")
        }
        Some(k) => format!(
            "with {REQUIRE_GPU_ENV}={k} only tests that need more GPUs, an H200 or the \
             full-size shapes skip"
        ),
    };
    let _ = writeln!(
        std::io::stderr(),
        "liger-rs: {n} GPU {tests} skipped (first reason: {first}); {advice}"
    );
}
