//! The probe stays standard-library only: its manifest lists no dependency of any kind.

#[test]
fn manifest_declares_no_dependency() {
    let manifest = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"))
        .expect("read Cargo.toml");
    let offending: Vec<&str> = manifest
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with('[') && l.contains("dependencies"))
        .collect();
    assert!(
        offending.is_empty(),
        "agent-ready must stay std-only; found {offending:?}"
    );
}

#[test]
fn binary_links_no_crate_but_std() {
    // cargo passes every linked crate to rustc with --extern; a std-only binary's build
    // leaves only std's own crates in its dependency info file.
    let exe = env!("CARGO_BIN_EXE_agent-ready");
    let deps_dir = std::path::Path::new(exe)
        .parent()
        .expect("target dir")
        .join("deps");
    let dep_files: Vec<_> = std::fs::read_dir(&deps_dir)
        .expect("deps dir")
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("agent_ready-"))
                && p.extension().is_some_and(|x| x == "d")
        })
        .collect();
    assert!(
        !dep_files.is_empty(),
        "no dep-info file for agent-ready in {}",
        deps_dir.display()
    );
    for f in dep_files {
        let text = std::fs::read_to_string(&f).expect("read dep-info");
        assert!(
            !text.contains(".cargo/registry"),
            "{} lists a registry crate:\n{text}",
            f.display()
        );
    }
}
