//! The bad-input tables of `tests/bad_input.rs`, run through each launcher's own checks (its
//! [`Table`] and [`check`]) with its buffers as plain values: placed as the GPU walk places
//! them, on the stream's context or on another. So every row's error, or its `Ok`, is checked
//! here without a GPU; the GPU walk adds that a rejected call writes nothing and an accepted
//! one writes every output.
#[path = "../tests/bad_input/tables.rs"]
mod tables;

use crate::Result;
use crate::glu::launch as glu;
use crate::rope::layout::TableRows;
use crate::rope::{Pass, check_fused_disjoint, check_host_ids, fused_spec};
use crate::validate::{Seen, Table, check};
use tables::*;

/// The stream's context, and the context of buffers placed on device 1.
const STREAM: usize = 1;
const OTHER: usize = 2;

/// Where each arena starts, as two allocations far apart.
const ARENA: [u64; 2] = [1 << 32, 1 << 40];

/// A public launcher's checks, without a GPU.
trait Check: Op {
    fn check(self, call: &Call<Self::Args>, t_size: usize) -> Result<()>;
}

/// Runs [`check`] on `table` with the call's buffers placed for a `t_size`-byte `T`; `host`
/// is the length of ids in host memory, if the call has them. `Some(pointers)` back: the
/// call is not empty.
fn run<A, const N: usize>(
    table: Table<N>,
    call: &Call<A>,
    t_size: usize,
    rename: impl Fn(&'static str) -> &'static str,
    host: Option<usize>,
) -> Result<Option<[u64; N]>> {
    let (placed, _) = place(&call.bufs, t_size);
    let mut seen = [None; N];
    let mut ptrs = [0; N];
    for (i, spec) in table.specs.iter().enumerate() {
        if let Some(p) = placed.iter().find(|p| rename(p.name) == spec.name) {
            seen[i] = Some(Seen {
                len: p.len,
                context: [STREAM, OTHER][p.arena],
                elem_bytes: p.kind.size(t_size),
            });
            ptrs[i] = ARENA[p.arena] + p.start as u64;
        } else if spec.name == "position_ids" {
            seen[i] = host.map(|len| Seen {
                len,
                context: STREAM,
                elem_bytes: 0,
            });
        }
    }
    Ok(check(&table, &seen, STREAM, || (ptrs, ()))?.map(|(ptrs, ())| ptrs))
}

impl Check for Rms {
    fn check(self, call: &Call<crate::RmsNormArgs>, t_size: usize) -> Result<()> {
        let has = |name| call.bufs.iter().any(|b| b.name == name);
        let table = match self {
            Rms::Forward => {
                let (_, table) = call.args.forward_table()?;
                return run(table, call, t_size, |n| n, None).map(drop);
            }
            Rms::Backward => call.args.backward_table(false, has("weight"), has("dw"))?,
            Rms::BackwardInplace => call.args.backward_table(true, has("weight"), has("dw"))?,
        };
        run(table.1, call, t_size, |n| n, None).map(drop)
    }
}

impl Check for FusedAdd {
    fn check(self, call: &Call<crate::RmsNormArgs>, t_size: usize) -> Result<()> {
        let has = |name| call.bufs.iter().any(|b| b.name == name);
        let a = &call.args;
        match self {
            FusedAdd::Forward | FusedAdd::ForwardInplace => {
                let in_place = matches!(self, FusedAdd::ForwardInplace);
                let (_, table) = a.fused_add_forward_table(in_place)?;
                run(table, call, t_size, |n| n, None).map(drop)
            }
            FusedAdd::Backward | FusedAdd::BackwardInplace => {
                let in_place = matches!(self, FusedAdd::BackwardInplace);
                let (_, table) = a.fused_add_backward_table(in_place, has("weight"), has("dw"))?;
                run(table, call, t_size, |n| n, None).map(drop)
            }
        }
    }
}

impl Check for Rope {
    fn check(self, call: &Call<RopeCall>, t_size: usize) -> Result<()> {
        let c = &call.args;
        let direction = match self {
            Rope::Forward | Rope::ForwardInto | Rope::ForwardFused => Pass::Forward,
            Rope::Backward | Rope::BackwardInto | Rope::BackwardFused => Pass::Backward,
        };
        let (rows, host) = match &c.layout {
            Layout::PerPosition => (TableRows::PerPosition, None),
            Layout::PerBatch => (TableRows::PerBatch, None),
            Layout::Host(ids) => (TableRows::Gathered, Some(ids)),
            Layout::DeviceI32 | Layout::DeviceI64 => (TableRows::Gathered, None),
            Layout::Multimodal(sections) => (TableRows::Multimodal(*sections), None),
            Layout::MultimodalIds(sections) => (TableRows::MultimodalGathered(*sections), None),
        };
        let (sizes, mut table) = c.args.table(direction, rows, c.into, true)?;
        // A fused call's one buffer holds q and k (as `rope_call_in` checks it).
        if let Some(k_offset) = c.k_offset {
            table.specs[0] = fused_spec(&sizes, k_offset, direction)?;
        }
        let rename = |n| self.rename(n);
        let Some(_) = run(table, call, t_size, rename, host.map(Vec::len))? else {
            return Ok(());
        };
        if let Some(k_offset) = c.k_offset {
            check_fused_disjoint(&sizes, k_offset, direction)?;
        }
        match host {
            Some(ids) => {
                let cos = call
                    .bufs
                    .iter()
                    .find(|b| b.name == "cos")
                    .map_or(0, |b| b.len);
                check_host_ids(ids, c.args.table_rows(rows, &sizes, cos))
            }
            None => Ok(()),
        }
    }
}

impl Check for Swiglu {
    fn check(self, call: &Call<crate::SwigluArgs>, t_size: usize) -> Result<()> {
        fn with<const N: usize>(
            call: &Call<crate::SwigluArgs>,
            t_size: usize,
            launcher: &glu::Launcher<N>,
        ) -> Result<()> {
            let table = call.args.table(&launcher.buffers)?;
            run(table, call, t_size, |n| n, None).map(drop)
        }
        match self {
            Swiglu::Forward => with(call, t_size, &glu::FORWARD),
            Swiglu::ForwardFused => with(call, t_size, &glu::FORWARD_FUSED),
            Swiglu::Backward => with(call, t_size, &glu::BACKWARD),
            Swiglu::BackwardInplace => with(call, t_size, &glu::BACKWARD_INPLACE),
            Swiglu::BackwardFused => with(call, t_size, &glu::BACKWARD_FUSED),
            Swiglu::BackwardFusedInplace => with(call, t_size, &glu::BACKWARD_FUSED_INPLACE),
        }
    }
}

impl Check for Geglu {
    fn check(self, call: &Call<crate::SwigluArgs>, t_size: usize) -> Result<()> {
        // GEGLU's launchers are SwiGLU's with another kernel: the same tables and checks.
        self.0.check(call, t_size)
    }
}

impl Check for Ce {
    fn check(self, call: &Call<crate::CrossEntropyArgs>, t_size: usize) -> Result<()> {
        let kind = crate::cross_entropy::args::Call {
            grad: !matches!(self, Ce::Forward),
            in_place: self.in_place(),
            lse_read: self.backward(),
        };
        run(call.args.table(kind)?, call, t_size, |n| n, None).map(drop)
    }
}

impl Check for Flce {
    fn check(self, call: &Call<crate::LinearCrossEntropyArgs>, t_size: usize) -> Result<()> {
        let has = |name| call.bufs.iter().any(|b| b.name == name);
        let table = call.args.table()?;
        crate::cross_entropy::linear::check_bias(has("bias"), has("dbias"))?;
        run(table, call, t_size, |n| n, None).map(drop)
    }
}

/// Every row of every op in `ops`, for 2- and 4-byte `T`; returns the number of cases.
fn walk<O: Check>(ops: &[O]) -> usize {
    let mut failures = Vec::new();
    let mut cases = 0;
    for &op in ops {
        for r in table(op) {
            let mut call = op.base();
            (r.change)(&mut call);
            for t_size in [2, 4] {
                let got = op.check(&call, t_size);
                let want = r.want.renamed(|n| op.rename(n));
                let passed = match want {
                    Want::Ok => got.is_ok(),
                    want => rejected_as(&got, want),
                };
                if !passed {
                    let arg = op.rename(r.arg);
                    failures.push(format!(
                        "{} `{arg}` {} ({t_size}-byte T): expected {want:?}, got {got:?}",
                        op.name(),
                        r.what
                    ));
                }
                cases += 1;
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    cases
}

#[test]
fn rms_norm_bad_input_is_rejected_by_the_checks_alone() {
    println!("{} cases", walk(&RMS));
}

#[test]
fn fused_add_rms_norm_bad_input_is_rejected_by_the_checks_alone() {
    println!("{} cases", walk(&FUSED_ADD));
}

#[test]
fn rope_bad_input_is_rejected_by_the_checks_alone() {
    println!("{} cases", walk(&ROPE));
}

#[test]
fn swiglu_bad_input_is_rejected_by_the_checks_alone() {
    println!("{} cases", walk(&SWIGLU));
}

#[test]
fn geglu_bad_input_is_rejected_by_the_checks_alone() {
    println!("{} cases", walk(&GEGLU));
}

#[test]
fn cross_entropy_bad_input_is_rejected_by_the_checks_alone() {
    println!("{} cases", walk(&CE));
}

#[test]
fn fused_linear_cross_entropy_bad_input_is_rejected_by_the_checks_alone() {
    println!("{} cases", walk(&FLCE));
}
