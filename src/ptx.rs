//! An embedded PTX build cut into one module per kernel: the driver JIT-compiles a whole module
//! when it is loaded, so a context that loads only the kernels it launches compiles only those
//! (each kernel's machine code is the same as in the whole build: ptxas compiles every entry
//! on its own).
use std::collections::HashMap;

/// A PTX build as the declarations that every module needs and each kernel's entry.
pub(crate) struct Split {
    /// The build's lines outside every entry, comments left out: the header (`.version`,
    /// `.target`, `.address_size`) and the module-scope declarations (the dynamic shared
    /// memory), in order.
    preamble: String,
    /// Each entry's text, from its `.visible .entry` line to its closing brace, by name.
    entries: HashMap<&'static str, &'static str>,
}

impl Split {
    /// Cuts `ptx` (LLVM's layout: an entry starts with `.visible .entry NAME(` at the start of a
    /// line and ends where its braces close).
    pub(crate) fn new(ptx: &'static str) -> Split {
        let mut preamble = String::new();
        let mut entries = HashMap::new();
        // The entry being read: its name, where it starts, its brace depth, whether its body
        // has opened.
        let mut entry: Option<(&'static str, usize, usize, bool)> = None;
        let mut offset = 0;
        for line in ptx.split_inclusive('\n') {
            let start = offset;
            offset += line.len();
            let (name, begin, mut depth, mut opened) = match entry {
                Some(e) => e,
                None => match line
                    .strip_prefix(".visible .entry ")
                    .and_then(|rest| rest.split_once('('))
                {
                    Some((name, _)) => (name, start, 0, false),
                    None => {
                        if !line.trim_start().starts_with("//") {
                            preamble.push_str(line);
                        }
                        continue;
                    }
                },
            };
            for b in line.bytes() {
                match b {
                    b'{' => (depth, opened) = (depth + 1, true),
                    b'}' => depth = depth.saturating_sub(1),
                    _ => {}
                }
            }
            entry = if opened && depth == 0 {
                entries.insert(name, &ptx[begin..offset]);
                None
            } else {
                Some((name, begin, depth, opened))
            };
        }
        Split { preamble, entries }
    }

    /// The module of the kernel called `name`: the preamble and its entry.
    pub(crate) fn module(&self, name: &str) -> Option<String> {
        let entry = self.entries.get(name)?;
        Some(format!("{}{entry}", self.preamble))
    }

    /// The kernels' names.
    #[cfg(test)]
    pub(crate) fn names(&self) -> impl Iterator<Item = &'static str> + '_ {
        self.entries.keys().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{PTX, PTX_SM90};

    #[test]
    fn every_kernel_is_a_module_of_its_own_with_the_whole_preamble() {
        for ptx in [PTX, PTX_SM90] {
            let split = Split::new(ptx);
            assert_eq!(split.entries.len(), ptx.matches(".visible .entry ").count());
            // Only the header and the dynamic shared memory are outside the entries: no
            // module-scope data or device function that an entry's module would also need.
            let preamble: Vec<&str> = split.preamble.lines().filter(|l| !l.is_empty()).collect();
            assert_eq!(preamble.len(), 4, "{preamble:?}");
            for (line, start) in preamble.iter().zip([
                ".version ",
                ".target sm_",
                ".address_size 64",
                ".extern .shared .align 8 .b8 gpu_launch_sized_workgroup_mem[];",
            ]) {
                assert!(line.starts_with(start), "{line}");
            }
            // The entries and the preamble are the whole build, but for comments.
            let text = |s: &str| -> usize {
                s.lines()
                    .filter(|l| !l.trim_start().starts_with("//"))
                    .map(|l| l.len() + 1)
                    .sum()
            };
            let entries: usize = split.entries.values().map(|e| text(e)).sum();
            assert_eq!(entries + text(&split.preamble), text(ptx));
            for name in split.names() {
                let module = split.module(name).unwrap();
                assert_eq!(module.matches(".entry ").count(), 1, "{name}");
                assert!(module.starts_with(&split.preamble));
                assert!(module.trim_end().ends_with('}'), "{name}");
            }
        }
    }

    #[test]
    fn entries_end_where_their_braces_close() {
        let ptx = ".version 7.0\n.target sm_80\n\t// .globl\ta\n.visible .entry a(\n\t.param .u64 p\n)\n{\n\t{\n\tret;\n\t}\n}\n\t// .globl\tb\n.visible .entry b()\n{\n\tret;\n}\n";
        let split = Split::new(ptx);
        assert_eq!(split.preamble, ".version 7.0\n.target sm_80\n");
        assert_eq!(
            split.module("a").unwrap(),
            ".version 7.0\n.target sm_80\n.visible .entry a(\n\t.param .u64 p\n)\n{\n\t{\n\tret;\n\t}\n}\n"
        );
        assert_eq!(
            split.module("b").unwrap(),
            ".version 7.0\n.target sm_80\n.visible .entry b()\n{\n\tret;\n}\n"
        );
        assert_eq!(split.module("c"), None);
    }
}
