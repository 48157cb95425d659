//! The code references in the review documents still point at code: every
//! `path.rs:LINE[-LINE]` names a file that exists and lines it has, and every
//! `path.rs::name` (or `::name` after one) names a function defined in that file.
//! SECURITY.md's claims are only as good as these pointers. Every metric the worker
//! registers is in ARCHITECTURE.md's table, and every row of RELIABILITY.md's fault matrix
//! names tests that exist.

use std::collections::HashMap;

use aether_e2e::testing::workspace_root as root;

/// Each backquoted reference of `doc`: (line in the doc, file, what follows the file).
/// A reference without a file (`:12`, `::name`) belongs to the last file named on its line.
fn references(doc: &str) -> Vec<(usize, String, String)> {
    let mut out = Vec::new();
    for (n, line) in doc.lines().enumerate() {
        let mut last: Option<String> = None;
        for span in line.split('`').skip(1).step_by(2) {
            let (file, rest) = match span.find(':') {
                Some(0) => match &last {
                    Some(f) => (f.clone(), span.to_string()),
                    None => continue,
                },
                Some(i) if span[..i].ends_with(".rs") && span[..i].contains('/') => {
                    (span[..i].to_string(), span[i..].to_string())
                }
                _ => continue,
            };
            last = Some(file.clone());
            out.push((n + 1, file, rest));
        }
    }
    out
}

fn check(doc_name: &str) -> Vec<String> {
    let root = root();
    let doc =
        std::fs::read_to_string(root.join(doc_name)).unwrap_or_else(|e| panic!("{doc_name}: {e}"));
    let mut files: HashMap<String, Option<String>> = HashMap::new();
    let mut bad = Vec::new();
    for (n, file, rest) in references(&doc) {
        let text = files
            .entry(file.clone())
            .or_insert_with(|| std::fs::read_to_string(root.join(&file)).ok());
        let Some(text) = text else {
            bad.push(format!("{doc_name}:{n}: {file} does not exist"));
            continue;
        };
        if let Some(name) = rest.strip_prefix("::") {
            let defined = [format!("fn {name}("), format!("fn {name}<")]
                .iter()
                .any(|d| text.contains(d.as_str()));
            if !defined {
                bad.push(format!("{doc_name}:{n}: no fn {name} in {file}"));
            }
        } else if let Some(lines) = rest.strip_prefix(':') {
            let count = text.lines().count();
            for l in lines.split('-') {
                match l.parse::<usize>() {
                    Ok(l) if (1..=count).contains(&l) => {}
                    _ => bad.push(format!(
                        "{doc_name}:{n}: {file}{rest}: line {l} is not in its {count} lines"
                    )),
                }
            }
        }
    }
    bad
}

#[test]
fn every_code_reference_in_the_review_documents_points_at_code() {
    let mut bad = Vec::new();
    for doc in [
        "SECURITY.md",
        "ARCHITECTURE.md",
        "README.md",
        "RELIABILITY.md",
    ] {
        bad.extend(check(doc));
    }
    assert!(bad.is_empty(), "stale references:\n{}", bad.join("\n"));
}

#[test]
fn references_are_found_with_and_without_a_file() {
    let refs =
        references("a (`x/y.rs:3-4`, `:9`; `x/y.rs::t`, `::u`) and `not a ref` and `b/c.rs`");
    let got: Vec<(String, String)> = refs.into_iter().map(|(_, f, r)| (f, r)).collect();
    let want = [
        ("x/y.rs", ":3-4"),
        ("x/y.rs", ":9"),
        ("x/y.rs", "::t"),
        ("x/y.rs", "::u"),
    ];
    assert_eq!(got, want.map(|(f, r)| (f.to_string(), r.to_string())));
}

#[test]
fn every_metric_the_worker_registers_is_documented() {
    let root = root();
    let code = std::fs::read_to_string(root.join("worker/src/metrics.rs")).expect("metrics.rs");
    let doc = std::fs::read_to_string(root.join("ARCHITECTURE.md")).expect("ARCHITECTURE.md");
    // `r.register("name", ...)`, the name on the same line or the next (as formatted).
    let names: Vec<&str> = code
        .split("r.register(")
        .skip(1)
        .filter_map(|rest| rest.trim_start().strip_prefix('"'))
        .map(|rest| rest.split('"').next().expect("a quoted name"))
        .collect();
    assert!(names.len() >= 10, "found only {names:?} in metrics.rs");
    let missing: Vec<_> = names
        .iter()
        .filter(|n| !doc.contains(&format!("`aether_{n}`")))
        .collect();
    assert!(
        missing.is_empty(),
        "metrics missing from ARCHITECTURE.md's table: {missing:?}"
    );
}

/// Whether `file` defines `name` as a test: `#[test]`, `#[tokio::test…]` or a
/// `#[…::test]` among the attributes right above `fn name`.
fn is_test_fn(text: &str, name: &str) -> bool {
    let lines: Vec<&str> = text.lines().collect();
    let Some(at) = lines
        .iter()
        .position(|l| l.contains(&format!("fn {name}(")) || l.contains(&format!("fn {name}<")))
    else {
        return false;
    };
    lines[..at]
        .iter()
        .rev()
        .map(|l| l.trim())
        .take_while(|l| l.starts_with("#[") || l.starts_with("///") || l.starts_with("//"))
        .any(|l| l.starts_with("#[test") || (l.starts_with("#[") && l.contains("::test")))
}

/// The fault matrix: rows 1 to 23, once each, and every row names at least one test,
/// each a test function of the file it names (the line references themselves are checked
/// with the other documents above).
#[test]
fn every_fault_matrix_row_names_tests_that_exist() {
    let root = root();
    let doc = std::fs::read_to_string(root.join("RELIABILITY.md")).expect("RELIABILITY.md");
    let mut rows = Vec::new();
    let mut bad = Vec::new();
    for line in doc.lines() {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        let Some(n) = cells.get(1).and_then(|c| c.parse::<usize>().ok()) else {
            continue;
        };
        rows.push(n);
        let Some(tests) = cells.get(4) else {
            bad.push(format!("row {n}: no Tests column"));
            continue;
        };
        let named: Vec<(String, String)> = references(tests)
            .into_iter()
            .filter_map(|(_, file, rest)| {
                rest.strip_prefix("::").map(|name| (file, name.to_string()))
            })
            .collect();
        if named.is_empty() {
            bad.push(format!("row {n}: names no test"));
        }
        for (file, name) in named {
            match std::fs::read_to_string(root.join(&file)) {
                Ok(text) if is_test_fn(&text, &name) => {}
                Ok(_) => bad.push(format!(
                    "row {n}: {file}::{name} is not a test function there"
                )),
                Err(e) => bad.push(format!("row {n}: {file}: {e}")),
            }
        }
    }
    assert_eq!(
        rows,
        (1..=23).collect::<Vec<_>>(),
        "RELIABILITY.md must have rows 1 to 23 in order"
    );
    assert!(bad.is_empty(), "RELIABILITY.md:\n{}", bad.join("\n"));
}

#[test]
fn a_test_function_is_told_from_a_helper() {
    let text = "#[test]\n/// Doc.\nfn a() {}\nfn b() {}\n#[tokio::test(flavor = \"current_thread\")]\nasync fn c() {}\n";
    assert!(is_test_fn(text, "a"));
    assert!(!is_test_fn(text, "b"));
    assert!(is_test_fn(text, "c"));
    assert!(!is_test_fn(text, "d"));
}
