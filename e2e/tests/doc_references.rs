//! The code references in the review documents still point at code: every
//! `path.rs:LINE[-LINE]` names a file that exists and lines it has, and every
//! `path.rs::name` (or `::name` after one) names a function defined in that file.
//! SECURITY.md's claims are only as good as these pointers. And every metric the worker
//! registers is in ARCHITECTURE.md's table.

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
                Some(i) if span[..i].ends_with(".rs") && span[..i].contains('/') => (span[..i].to_string(), span[i..].to_string()),
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
    let doc = std::fs::read_to_string(root.join(doc_name)).unwrap_or_else(|e| panic!("{doc_name}: {e}"));
    let mut files: HashMap<String, Option<String>> = HashMap::new();
    let mut bad = Vec::new();
    for (n, file, rest) in references(&doc) {
        let text = files.entry(file.clone()).or_insert_with(|| std::fs::read_to_string(root.join(&file)).ok());
        let Some(text) = text else {
            bad.push(format!("{doc_name}:{n}: {file} does not exist"));
            continue;
        };
        if let Some(name) = rest.strip_prefix("::") {
            let defined = [format!("fn {name}("), format!("fn {name}<")].iter().any(|d| text.contains(d.as_str()));
            if !defined {
                bad.push(format!("{doc_name}:{n}: no fn {name} in {file}"));
            }
        } else if let Some(lines) = rest.strip_prefix(':') {
            let count = text.lines().count();
            for l in lines.split('-') {
                match l.parse::<usize>() {
                    Ok(l) if (1..=count).contains(&l) => {}
                    _ => bad.push(format!("{doc_name}:{n}: {file}{rest}: line {l} is not in its {count} lines")),
                }
            }
        }
    }
    bad
}

#[test]
fn every_code_reference_in_the_review_documents_points_at_code() {
    let mut bad = Vec::new();
    for doc in ["SECURITY.md", "ARCHITECTURE.md", "README.md"] {
        bad.extend(check(doc));
    }
    assert!(bad.is_empty(), "stale references:\n{}", bad.join("\n"));
}

#[test]
fn references_are_found_with_and_without_a_file() {
    let refs = references("a (`x/y.rs:3-4`, `:9`; `x/y.rs::t`, `::u`) and `not a ref` and `b/c.rs`");
    let got: Vec<(String, String)> = refs.into_iter().map(|(_, f, r)| (f, r)).collect();
    let want = [("x/y.rs", ":3-4"), ("x/y.rs", ":9"), ("x/y.rs", "::t"), ("x/y.rs", "::u")];
    assert_eq!(got, want.map(|(f, r)| (f.to_string(), r.to_string())));
}

#[test]
fn every_metric_the_worker_registers_is_documented() {
    let root = root();
    let code = std::fs::read_to_string(root.join("worker/src/metrics.rs")).expect("metrics.rs");
    let doc = std::fs::read_to_string(root.join("ARCHITECTURE.md")).expect("ARCHITECTURE.md");
    let names: Vec<&str> =
        code.split("r.register(\"").skip(1).map(|rest| rest.split('"').next().expect("a quoted name")).collect();
    assert!(names.len() >= 10, "found only {names:?} in metrics.rs");
    let missing: Vec<_> = names.iter().filter(|n| !doc.contains(&format!("`aether_{n}`"))).collect();
    assert!(missing.is_empty(), "metrics missing from ARCHITECTURE.md's table: {missing:?}");
}
