//! The code references in the review documents still point at code. A reference is a
//! backquoted `path:LINE::symbol` or `path:FIRST-LAST::symbol`: the file exists, has those
//! lines, and `symbol` (a name, or any short text) appears among them, so that a reference
//! left behind by an edit, pointing at an existing but unrelated line, fails. `:LINE::symbol`
//! continues the last file named on its line. `path::name` (or `::name` after one) names a
//! function defined in that file (`fn` in Rust, `def` in Python, `name()` in shell). Any
//! source file is checked, not only Rust: `charts/…/values.yaml:…`, `scripts/….sh:…`.
//! SECURITY.md's claims are only as good as these pointers. Every metric the worker
//! registers is in ARCHITECTURE.md's table, and every row of RELIABILITY.md's fault matrix
//! names tests that exist. README's image section names each binary of the image list
//! (`scripts/lib.sh`'s `AETHER_IMAGE_BINS`) with its size, and no count in words.

use std::collections::HashMap;

use aether_e2e::testing::workspace_root as root;

/// The kinds of file a reference may name, by how the name ends.
const SOURCE_EXTENSIONS: &[&str] = &[
    "rs", "py", "sh", "yaml", "yml", "toml", "tpl", "service", "proto", "json",
];

/// Whether `s` names a source file: a path with a folder and a known extension.
fn is_source_path(s: &str) -> bool {
    s.contains('/')
        && !s.contains(char::is_whitespace)
        && s.rsplit_once('.')
            .is_some_and(|(_, ext)| SOURCE_EXTENSIONS.contains(&ext))
}

/// Each backquoted reference of `doc`: (line in the doc, file, what follows the file).
/// A reference without a file (`:12::name`, `::name`) belongs to the last file named on
/// its line.
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
                Some(i) if is_source_path(&span[..i]) => {
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

/// Whether `text` holds `symbol` as a whole: a name is not matched inside a longer name.
fn holds(text: &str, symbol: &str) -> bool {
    let word = |c: char| c.is_alphanumeric() || c == '_';
    text.match_indices(symbol).any(|(at, _)| {
        let before = text[..at].chars().next_back();
        let after = text[at + symbol.len()..].chars().next();
        let glued_before = symbol.starts_with(word) && before.is_some_and(word);
        let glued_after = symbol.ends_with(word) && after.is_some_and(word);
        !glued_before && !glued_after
    })
}

/// Whether `text`, the file `file`, defines the function `name`.
fn defines(file: &str, text: &str, name: &str) -> bool {
    let forms = match file.rsplit_once('.').map(|(_, ext)| ext) {
        Some("rs") => vec![format!("fn {name}("), format!("fn {name}<")],
        Some("py") => vec![format!("def {name}(")],
        Some("sh") => vec![format!("{name}()"), format!("function {name}")],
        _ => vec![name.to_string()],
    };
    forms.iter().any(|d| text.contains(d.as_str()))
}

/// What is wrong with the reference `rest` (after the file) into `text`, the file `file`.
fn problem(file: &str, text: &str, rest: &str) -> Option<String> {
    if let Some(name) = rest.strip_prefix("::") {
        return (!defines(file, text, name)).then(|| format!("no function {name} in {file}"));
    }
    let spec = rest.strip_prefix(':')?;
    let (lines, symbol) = match spec.split_once("::") {
        Some((lines, symbol)) if !symbol.is_empty() => (lines, symbol),
        _ => {
            return Some(format!(
                "{file}{rest}: names no symbol (write `{file}{rest}::name`, a name the lines hold)"
            ));
        }
    };
    let all: Vec<&str> = text.lines().collect();
    let bound = |l: &str| {
        l.parse::<usize>()
            .ok()
            .filter(|l| (1..=all.len()).contains(l))
    };
    let (first, last) = match lines.split_once('-') {
        Some((a, b)) => (bound(a), bound(b)),
        None => (bound(lines), bound(lines)),
    };
    let (Some(first), Some(last)) = (first, last) else {
        return Some(format!(
            "{file}:{lines}: not lines of its {} lines",
            all.len()
        ));
    };
    if first > last {
        return Some(format!("{file}:{lines}: the range runs backwards"));
    }
    if holds(&all[first - 1..last].join("\n"), symbol) {
        return None;
    }
    let elsewhere: Vec<String> = (1..=all.len())
        .filter(|&l| holds(all[l - 1], symbol))
        .take(5)
        .map(|l| l.to_string())
        .collect();
    Some(format!(
        "{file}:{lines}: `{symbol}` is not in those lines ({})",
        if elsewhere.is_empty() {
            "nor anywhere in the file".to_string()
        } else {
            format!("it is on line {}", elsewhere.join(", "))
        }
    ))
}

/// The stale references of `doc`, the text of `doc_name`; `read` gives a file's text.
fn check_text(
    doc_name: &str,
    doc: &str,
    read: &mut dyn FnMut(&str) -> Option<String>,
) -> Vec<String> {
    let mut files: HashMap<String, Option<String>> = HashMap::new();
    let mut bad = Vec::new();
    for (n, file, rest) in references(doc) {
        let text = files.entry(file.clone()).or_insert_with(|| read(&file));
        match text {
            None => bad.push(format!("{doc_name}:{n}: {file} does not exist")),
            Some(text) => {
                if let Some(p) = problem(&file, text, &rest) {
                    bad.push(format!("{doc_name}:{n}: {p}"));
                }
            }
        }
    }
    bad
}

fn check(doc_name: &str) -> Vec<String> {
    let root = root();
    let doc =
        std::fs::read_to_string(root.join(doc_name)).unwrap_or_else(|e| panic!("{doc_name}: {e}"));
    check_text(doc_name, &doc, &mut |file| {
        std::fs::read_to_string(root.join(file)).ok()
    })
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
    let refs = references(
        "a (`x/y.rs:3-4::f`, `:9::g`; `x/y.rs::t`, `::u`) and `not a ref` and `b/c.rs` \
         and `c/v.yaml:7::key`, `127.0.0.1:15090`, `<run-dir>/x.sock`",
    );
    let got: Vec<(String, String)> = refs.into_iter().map(|(_, f, r)| (f, r)).collect();
    let want = [
        ("x/y.rs", ":3-4::f"),
        ("x/y.rs", ":9::g"),
        ("x/y.rs", "::t"),
        ("x/y.rs", "::u"),
        ("c/v.yaml", ":7::key"),
    ];
    assert_eq!(got, want.map(|(f, r)| (f.to_string(), r.to_string())));
}

/// A three-file tree for the checker: a Rust file, a chart's values and a script.
fn sample(file: &str) -> Option<String> {
    match file {
        "a/lib.rs" => Some("// one\nfn probe() {\n    let timeout = 5;\n}\nfn other() {}\n".into()),
        "c/values.yaml" => Some("proxy:\n  runAsUser: 101\n  supplementalGroups: [65532]\n".into()),
        "s/run.py" => Some("def main():\n    pass\n".into()),
        _ => None,
    }
}

#[test]
fn a_reference_passes_only_when_its_symbol_is_in_the_cited_lines() {
    let doc = "\
ok `a/lib.rs:2-4::probe`, `:3::timeout`, `c/values.yaml:3::supplementalGroups`, `s/run.py::main`, `a/lib.rs::other`
moved `a/lib.rs:5::probe`
unrelated `c/values.yaml:2::supplementalGroups`
inside a longer name `a/lib.rs:3::time`
bare `a/lib.rs:2`
past the end `a/lib.rs:4-9::probe`
backwards `a/lib.rs:4-2::probe`
gone `a/gone.rs:1::x`, no function `s/run.py::helper`
";
    let bad = check_text("D.md", doc, &mut |f| sample(f));
    let want = [
        "D.md:2: a/lib.rs:5: `probe` is not in those lines (it is on line 2)",
        "D.md:3: c/values.yaml:2: `supplementalGroups` is not in those lines (it is on line 3)",
        "D.md:4: a/lib.rs:3: `time` is not in those lines (nor anywhere in the file)",
        "D.md:5: a/lib.rs:2: names no symbol (write `a/lib.rs:2::name`, a name the lines hold)",
        "D.md:6: a/lib.rs:4-9: not lines of its 5 lines",
        "D.md:7: a/lib.rs:4-2: the range runs backwards",
        "D.md:8: a/gone.rs does not exist",
        "D.md:8: no function helper in s/run.py",
    ];
    assert_eq!(bad, want);
}

#[test]
fn a_symbol_is_matched_whole_and_may_be_any_text() {
    assert!(holds("let fds = recv_control(sock)", "recv_control"));
    assert!(!holds("let fds = recv_control2(sock)", "recv_control"));
    assert!(!holds("fn my_probe()", "probe"));
    assert!(holds("let mut buf = [0u8; 64];", "[0u8; 64]"));
    assert!(holds("mountPath: {{ $runDir }}", "$runDir"));
}

#[test]
fn every_metric_the_worker_registers_is_documented() {
    let root = root();
    let code = std::fs::read_to_string(root.join("worker/src/metrics.rs")).expect("metrics.rs");
    let doc = std::fs::read_to_string(root.join("ARCHITECTURE.md")).expect("ARCHITECTURE.md");
    // Each row of the `metrics!` table: `    name: Type,` and its help text on the next line.
    let table = code
        .split("\nmetrics! {\n")
        .nth(1)
        .and_then(|rest| rest.split("\n}\n").next())
        .expect("the metrics! table in metrics.rs");
    let names: Vec<&str> = table
        .lines()
        .filter_map(|l| l.strip_prefix("    ")?.split_once(": "))
        .map(|(name, _)| name)
        .filter(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
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

/// The binaries `scripts/lib.sh` lists in `AETHER_IMAGE_BINS`, in order.
fn image_bins(lib: &str) -> Vec<String> {
    let line = lib
        .lines()
        .find_map(|l| l.strip_prefix("AETHER_IMAGE_BINS=("))
        .expect("AETHER_IMAGE_BINS=( in scripts/lib.sh");
    let list = line.split(')').next().expect("the list closes on its line");
    list.split_whitespace().map(str::to_string).collect()
}

/// What is wrong with README's image section (from `### The image` to the next heading)
/// against `bins`: a binary not named as `` `name` `` followed by its size in MiB, or a
/// count of binaries in words, which would go stale when the list grows.
fn image_section_problems(readme: &str, bins: &[String]) -> Vec<String> {
    let Some(start) = readme.find("### The image") else {
        return vec!["README.md has no \"### The image\" section".into()];
    };
    let rest = &readme[start + 3..];
    let section = &rest[..rest.find("\n#").unwrap_or(rest.len())];
    let flat = section.split_whitespace().collect::<Vec<_>>().join(" ");
    let mut bad: Vec<String> = bins
        .iter()
        .filter(|b| {
            let named = format!("`{b}` ");
            !flat.match_indices(&named).any(|(i, _)| {
                let after = &flat[i + named.len()..];
                after.starts_with(|c: char| c.is_ascii_digit())
            })
        })
        .map(|b| format!("README.md's image section gives no size for `{b}`"))
        .collect();
    for word in ["three", "four", "five", "six", "seven", "eight", "nine"] {
        if flat.contains(&format!("{word} binaries")) {
            bad.push(format!(
                "README.md's image section counts \"{word} binaries\" in prose; name the list"
            ));
        }
    }
    if !flat.contains("AETHER_IMAGE_BINS") {
        bad.push("README.md's image section does not name AETHER_IMAGE_BINS".into());
    }
    bad
}

#[test]
fn the_image_section_of_the_readme_names_every_binary_the_image_carries() {
    let root = root();
    let lib = std::fs::read_to_string(root.join("scripts/lib.sh")).expect("scripts/lib.sh");
    let readme = std::fs::read_to_string(root.join("README.md")).expect("README.md");
    let bins = image_bins(&lib);
    assert!(bins.len() >= 5, "AETHER_IMAGE_BINS: {bins:?}");
    let bad = image_section_problems(&readme, &bins);
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[test]
fn the_image_section_check_catches_a_missing_binary_and_a_count_in_words() {
    let bins: Vec<String> = image_bins("AETHER_IMAGE_BINS=(a-one b-two) # x\n");
    assert_eq!(bins, ["a-one", "b-two"]);
    let good = "### The image\n\nthe binaries of `AETHER_IMAGE_BINS` (`a-one` 2.5 MiB,\n`b-two` 1.0)\n## Next";
    assert_eq!(image_section_problems(good, &bins), Vec::<String>::new());
    let missing = good.replace("`b-two` 1.0", "b-two 1.0");
    assert_eq!(image_section_problems(&missing, &bins).len(), 1);
    let counted = good.replace("the binaries", "the five binaries");
    assert_eq!(image_section_problems(&counted, &bins).len(), 1);
}
