//! The worker's module graph is one-way: no module imports one that imports it back,
//! directly or through others. Read from the source: every `crate::` and `super::` path
//! (in `use` items, braces expanded, and inline), resolved to the deepest module file it
//! names. The model's own purity is a Cargo rule, checked in `model/tests/structure.rs`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// `worker/src/a/b.rs` (or `a/b/mod.rs`) is module `a::b`; `lib.rs` and `main.rs` are "".
fn module_of(rel: &Path) -> String {
    let s = rel.with_extension("").to_string_lossy().replace('/', "::");
    let s = s.strip_suffix("::mod").unwrap_or(&s).to_string();
    if s == "lib" || s == "main" {
        String::new()
    } else {
        s
    }
}

fn files(dir: &Path, root: &Path, out: &mut Vec<(String, String)>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            files(&p, root, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push((
                module_of(p.strip_prefix(root).unwrap()),
                std::fs::read_to_string(&p).unwrap(),
            ));
        }
    }
}

/// Expands `a::{b, c::{d, e}}` into `a::b`, `a::c::d`, `a::c::e`.
fn expand(prefix: &str, tree: &str, out: &mut Vec<String>) {
    let tree = tree.trim();
    if let Some(open) = tree.find('{') {
        let head = tree[..open].trim().trim_end_matches("::");
        let inner = &tree[open + 1..tree.rfind('}').unwrap()];
        let base = join(prefix, head);
        let (mut depth, mut start) = (0, 0);
        for (i, c) in inner.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    expand(&base, &inner[start..i], out);
                    start = i + 1;
                }
                _ => {}
            }
        }
        expand(&base, &inner[start..], out);
    } else if !tree.is_empty() {
        let item = tree.split(" as ").next().unwrap().trim();
        out.push(join(prefix, item));
    }
}

fn join(a: &str, b: &str) -> String {
    match (a.is_empty(), b.is_empty()) {
        (true, _) => b.to_string(),
        (_, true) => a.to_string(),
        _ => format!("{a}::{b}"),
    }
}

/// Every `crate::`/`super::`/`self::` path in `src`, and every `use` of a child module
/// by its bare name (`pub use server::serve` in a `mod.rs`), as `self::` paths.
fn paths(src: &str, children: &BTreeSet<String>) -> Vec<String> {
    let code: String = src
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n");
    let mut out = Vec::new();
    // `use` items, braces and all.
    let mut rest = code.as_str();
    while let Some(i) = rest.find("use ") {
        let before = rest[..i].chars().last();
        let after = &rest[i + 4..];
        let end = after.find(';').unwrap_or(after.len());
        if before.is_none_or(|c| c.is_whitespace() || c == '{' || c == ';') {
            let tree = after[..end].trim();
            let first = tree.split("::").next().unwrap_or("");
            if tree.starts_with("crate::")
                || tree.starts_with("super::")
                || tree.starts_with("self::")
            {
                expand("", tree, &mut out);
            } else if children.contains(first) {
                expand("self", tree, &mut out);
            }
        }
        rest = &after[end.min(after.len())..];
    }
    // Inline paths such as `crate::acks::wait_for(...)`.
    for start in ["crate::", "super::"] {
        let mut from = 0;
        while let Some(i) = code[from..].find(start) {
            let at = from + i;
            let prev = code[..at].chars().last();
            if prev.is_none_or(|c| !(c.is_alphanumeric() || c == '_' || c == ':')) {
                let path: String = code[at..]
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
                    .collect();
                out.push(path.trim_end_matches(':').to_string());
            }
            from = at + start.len();
        }
    }
    out
}

/// The module a path names: resolve `crate::`/`super::`, then the longest prefix that is
/// a module of the crate.
fn resolve(from: &str, path: &str, modules: &BTreeSet<String>) -> Option<String> {
    let mut segs: Vec<&str> = path.split("::").collect();
    let mut base: Vec<&str> = if from.is_empty() {
        vec![]
    } else {
        from.split("::").collect()
    };
    match segs.first() {
        Some(&"crate") => {
            base.clear();
            segs.remove(0);
        }
        Some(&"super") => {
            while segs.first() == Some(&"super") {
                segs.remove(0);
                base.pop();
            }
        }
        Some(&"self") => {
            segs.remove(0);
        }
        _ => return None,
    }
    let full: Vec<&str> = base.into_iter().chain(segs).collect();
    (0..=full.len())
        .rev()
        .map(|n| full[..n].join("::"))
        .find(|m| modules.contains(m))
}

/// The import cycles among `files` (module path, source), one line each.
fn cycles(all: &[(String, String)]) -> (BTreeMap<String, BTreeSet<String>>, Vec<String>) {
    let modules: BTreeSet<String> = all.iter().map(|(m, _)| m.clone()).collect();
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (m, src) in all {
        let children: BTreeSet<String> = modules
            .iter()
            .filter_map(|c| {
                c.strip_prefix(&if m.is_empty() {
                    String::new()
                } else {
                    format!("{m}::")
                })
                .map(String::from)
            })
            .filter(|c| !c.contains("::") && !c.is_empty())
            .collect();
        // An inline `mod tests` is a module of its own: its `super` is this file's module.
        let (body, tests) = match src.find("mod tests {") {
            Some(i) => (&src[..i], &src[i..]),
            None => (src.as_str(), ""),
        };
        let scanned = paths(body, &children).into_iter().map(|p| (m.clone(), p));
        let tests_mod = join(m, "tests");
        let scanned = scanned.chain(
            paths(tests, &BTreeSet::new())
                .into_iter()
                .map(|p| (tests_mod.clone(), p)),
        );
        for (from, p) in scanned {
            if let Some(to) = resolve(&from, &p, &modules)
                && to != *m
                && !to.is_empty()
            {
                edges.entry(m.clone()).or_default().insert(to);
            }
        }
    }
    // A cycle is a path from a module back to itself.
    let mut found = Vec::new();
    for start in edges.keys() {
        let mut stack = vec![(start.clone(), vec![start.clone()])];
        let mut seen = BTreeSet::new();
        while let Some((at, trail)) = stack.pop() {
            for next in edges.get(&at).into_iter().flatten() {
                if next == start {
                    found.push(trail.join(" -> ") + " -> " + start);
                } else if seen.insert(next.clone()) {
                    let mut t = trail.clone();
                    t.push(next.clone());
                    stack.push((next.clone(), t));
                }
            }
        }
    }
    (edges, found)
}

#[test]
fn the_check_finds_a_cycle_through_a_parent_module() {
    let m = |name: &str, src: &str| (name.to_string(), src.to_string());
    let (_, found) = cycles(&[
        m("", "pub mod xds;"),
        m(
            "xds",
            "pub mod stream;\npub use stream::State;\npub trait Protocol {}",
        ),
        m("xds::stream", "use super::Protocol;\npub struct State;"),
    ]);
    assert_eq!(
        found,
        [
            "xds -> xds::stream -> xds",
            "xds::stream -> xds -> xds::stream"
        ]
    );
    let (_, found) = cycles(&[
        m("a", "use crate::b::{self, c::{D, E}};"),
        m("b", "pub mod c;"),
        m("b::c", "fn f() { crate::a::g() }"),
    ]);
    assert_eq!(found.len(), 2, "{found:?}");
}

#[test]
fn no_module_of_the_worker_imports_one_that_imports_it_back() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut all = Vec::new();
    files(&root, &root, &mut all);
    let (edges, found) = cycles(&all);
    assert!(
        edges
            .get("xds::server")
            .is_some_and(|e| e.contains("xds::stream") && e.contains("acks")),
        "the parser sees imports: {edges:#?}"
    );
    assert!(
        found.is_empty(),
        "import cycles in worker/src:\n{}",
        found.join("\n")
    );
}
