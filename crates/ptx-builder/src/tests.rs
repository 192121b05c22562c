//! The builder's unit tests: toolchain pinning, the copy's sync, the cache and the PTX checks.
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

/// PTX that passes [`check_self_contained`], naming `what`.
fn fake_ptx(what: &str) -> String {
    format!("// {what}\n.visible .entry k()\n{{\n}}\n")
}

#[test]
fn keys_cover_every_input_and_only_the_inputs() {
    let dir = scratch("keys");
    let build = shipped_build(&dir);
    let key = |b: &PtxBuild, rustc: &str| b.cache_key(rustc, b.crate_entries()).unwrap();
    let base = key(&build, "rustc 1.0.0-nightly");
    // The copy (manifest renamed to Cargo.toml) has the key of its sources.
    let copy = build.copy_crate().unwrap();
    assert_eq!(
        build
            .cache_key("rustc 1.0.0-nightly", dir_entries(&copy).unwrap())
            .unwrap(),
        base
    );
    write(
        &build.crate_dir.join("notes.md"),
        "not read by the build either\n",
    );
    assert_eq!(key(&build, "rustc 1.0.0-nightly"), base);
    assert_ne!(key(&build, "rustc 1.0.1-nightly"), base);
    let sm90 = PtxBuild {
        target_cpu: "sm_90".into(),
        ..build.clone()
    };
    assert_ne!(key(&sm90, "rustc 1.0.0-nightly"), base);
    let mut changed = Vec::new();
    write(&build.crate_dir.join("src/a/mod.rs"), "// b\n");
    changed.push(key(&build, "rustc 1.0.0-nightly"));
    write(&build.crate_dir.join("src/a/mod.rs"), "// a\n");
    assert_eq!(key(&build, "rustc 1.0.0-nightly"), base);
    write(&build.crate_dir.join("src/a/b.rs"), "");
    changed.push(key(&build, "rustc 1.0.0-nightly"));
    fs::rename(
        build.crate_dir.join("src/a/b.rs"),
        build.crate_dir.join("src/b.rs"),
    )
    .unwrap();
    changed.push(key(&build, "rustc 1.0.0-nightly"));
    write(&build.crate_dir.join("Cargo.lock"), "version = 3\n");
    changed.push(key(&build, "rustc 1.0.0-nightly"));
    for (i, k) in changed.iter().enumerate() {
        assert_ne!(*k, base, "change {i}");
        assert!(changed[..i].iter().all(|other| other != k), "change {i}");
    }
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_same_inputs_build_once_whichever_build_asks() {
    let dir = scratch("once");
    let build = shipped_build(&dir);
    let builds = std::sync::atomic::AtomicUsize::new(0);
    let compile = |copy: &Path| {
        builds.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let source = fs::read_to_string(copy.join("src/a/mod.rs")).unwrap();
        Ok(fake_ptx(source.trim()))
    };
    // Four builds at once (threads stand in for concurrent cargo invocations): one
    // compiles, the others wait for its lock and read its PTX.
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|_| s.spawn(|| build.cached("rustc x", compile).unwrap()))
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), fake_ptx("// a"));
        }
    });
    assert_eq!(builds.load(std::sync::atomic::Ordering::SeqCst), 1);
    // Another profile's build script: its own copy of the sources, the same work dir.
    let other = PtxBuild {
        crate_dir: dir.join("elsewhere"),
        ..build.clone()
    };
    sync_dir(build.crate_entries(), &other.crate_dir).unwrap();
    fs::rename(
        other.crate_dir.join("Cargo.toml"),
        other.crate_dir.join("kernels.toml"),
    )
    .unwrap();
    assert_eq!(other.cached("rustc x", compile).unwrap(), fake_ptx("// a"));
    assert_eq!(builds.load(std::sync::atomic::Ordering::SeqCst), 1);
    // A changed kernel builds again, and going back to the old one does not.
    write(&build.crate_dir.join("src/a/mod.rs"), "// a, edited\n");
    assert_eq!(
        build.cached("rustc x", compile).unwrap(),
        fake_ptx("// a, edited")
    );
    assert_eq!(builds.load(std::sync::atomic::Ordering::SeqCst), 2);
    assert_eq!(other.cached("rustc x", compile).unwrap(), fake_ptx("// a"));
    assert_eq!(builds.load(std::sync::atomic::Ordering::SeqCst), 2);
    // A failed build keeps nothing.
    write(&build.crate_dir.join("src/a/mod.rs"), "// broken\n");
    let fail = |_: &Path| Err(BuildError::Ptx("no kernel entry points".into()));
    assert!(build.cached("rustc x", fail).is_err());
    assert_eq!(fs::read_dir(build.work_dir.join("ptx")).unwrap().count(), 2);
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_work_dir_keeps_the_most_recently_used_ptx() {
    let dir = scratch("kept");
    let cache = PtxCache(dir.join("ptx"));
    let at = |secs| std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs);
    for i in 0..KEPT_PTX as u64 + 2 {
        cache
            .put(&format!("key{i}"), &fake_ptx(&i.to_string()))
            .unwrap();
        let file = fs::File::options()
            .write(true)
            .open(cache.path(&format!("key{i}")));
        file.unwrap().set_modified(at(1_000_000 + i)).unwrap();
    }
    // key0 and key1 were the oldest when key8 and key9 came: gone; a read marks key2 used.
    assert_eq!(cache.get("key0"), None);
    assert_eq!(cache.get("key1"), None);
    assert_eq!(cache.get("key2"), Some(fake_ptx("2")));
    cache.put("key10", &fake_ptx("10")).unwrap();
    assert_eq!(cache.get("key2"), Some(fake_ptx("2")));
    assert_eq!(cache.get("key3"), None);
    let names: Vec<_> = dir_entries(&cache.0)
        .unwrap()
        .into_iter()
        .map(|(_, n)| n)
        .collect();
    assert_eq!(names.len(), KEPT_PTX);
    assert!(
        names.iter().all(|n| n.to_string_lossy().ends_with(".ptx")),
        "{names:?}"
    );
    // A file that is not whole PTX is not read back.
    fs::write(cache.path("key10"), "").unwrap();
    assert_eq!(cache.get("key10"), None);
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_lock_is_held_until_dropped() {
    let dir = scratch("lock");
    let held = lock(&dir).unwrap();
    let other = fs::File::options()
        .write(true)
        .open(dir.join("lock"))
        .unwrap();
    assert!(matches!(
        other.try_lock(),
        Err(fs::TryLockError::WouldBlock)
    ));
    drop(held);
    other.try_lock().unwrap();
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_target_dir_is_the_one_above_the_profiles() {
    let of = |out: &'static str| target_dir_of(Path::new(out));
    let target = Some(Path::new("/p/target"));
    assert_eq!(of("/p/target/debug/build/h-1/out"), target);
    // Cargo's new build-dir layout: a directory per package, one per hash below it.
    assert_eq!(of("/p/target/debug/build/h/1/out"), target);
    // A `build` further up names no build-script directory.
    assert_eq!(of("/build/x/y/z/out"), None);
    assert_eq!(of("/build/h-1/out"), None);
    assert_eq!(of("out"), None);
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
