//! Asynchronous copies from global to shared memory (`cp.async`, sm_80 and later): a thread
//! starts 16-byte copies, groups them, and waits for its own groups; a barrier then makes the
//! bytes visible to the other threads of the block.
use core::arch::asm;

/// Starts copying 16 bytes from global `src` to shared `dst` (`cp.async.cg`, through L2 only),
/// or writes 16 zero bytes when `!valid` (reading nothing).
///
/// # Safety
/// `dst` is a 16-byte aligned shared address; `src` a 16-byte aligned global address of 16
/// readable bytes when `valid` (any mapped address otherwise). The bytes may be read by this
/// thread after [`wait_all`] (or [`wait_one_pending`] for an older group), by the block's
/// other threads only after a barrier as well.
#[inline(always)]
pub(crate) unsafe fn cp_async_16(dst: u32, src: u64, valid: bool) {
    let n: u32 = if valid { 16 } else { 0 };
    unsafe {
        asm!(
            "cp.async.cg.shared.global [{d}], [{s}], 16, {n};",
            d = in(reg32) dst, s = in(reg64) src, n = in(reg32) n,
            options(nostack)
        );
    }
}

/// Closes the group of `cp.async` copies started since the last call.
#[inline(always)]
pub(crate) fn commit() {
    // SAFETY: orders only this thread's asynchronous copies.
    unsafe { asm!("cp.async.commit_group;", options(nostack)) }
}

/// Waits until every committed group of this thread's copies has landed.
#[inline(always)]
pub(crate) fn wait_all() {
    // SAFETY: as `commit`; the implied memory clobber keeps shared reads after it.
    unsafe { asm!("cp.async.wait_group 0;", options(nostack)) }
}

/// Waits until at most the newest committed group of this thread's copies is still in flight.
#[inline(always)]
pub(crate) fn wait_one_pending() {
    // SAFETY: as `wait_all`.
    unsafe { asm!("cp.async.wait_group 1;", options(nostack)) }
}

/// The `.shared` window address of a pointer into this block's dynamic shared memory.
#[inline(always)]
pub(crate) fn shared_addr<T>(p: *const T) -> u32 {
    let a: u64;
    // SAFETY: a register conversion of a shared-memory pointer.
    unsafe {
        asm!("cvta.to.shared.u64 {a}, {p};", a = out(reg64) a, p = in(reg64) p,
             options(pure, nomem, nostack))
    };
    a as u32
}
