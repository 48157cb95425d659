//! Field and label selectors, parsed from a list's or a watch's query and matched against
//! an object's JSON, with the API server's semantics: a field the object lacks reads as
//! the empty string, and only the fields the server indexes for a resource are accepted.

use serde_json::Value;

use super::resource::Resource;

/// The conjunction of a selector's requirements; an empty one matches everything.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Selector(Vec<Requirement>);

#[derive(Clone, Debug, PartialEq)]
struct Requirement {
    key: String,
    op: Op,
}

#[derive(Clone, Debug, PartialEq)]
enum Op {
    Equals(String),
    NotEquals(String),
    In(Vec<String>),
    NotIn(Vec<String>),
    Exists,
    DoesNotExist,
}

/// The fields the real API server accepts in a field selector, per resource (the
/// `GetAttrs` of each resource's strategy: pods and nodes have their own, services
/// `spec.clusterIP` and `spec.type`, endpoint slices and leases only the metadata's); any
/// other is a 400.
fn field_supported(resource: Resource, field: &str) -> bool {
    const COMMON: &[&str] = &["metadata.name", "metadata.namespace"];
    const PODS: &[&str] = &[
        "spec.nodeName",
        "spec.restartPolicy",
        "spec.schedulerName",
        "spec.serviceAccountName",
        "spec.hostNetwork",
        "status.phase",
        "status.podIP",
        "status.nominatedNodeName",
    ];
    const NODES: &[&str] = &["spec.unschedulable"];
    const SERVICES: &[&str] = &["spec.clusterIP", "spec.type"];
    COMMON.contains(&field)
        || match resource {
            Resource::Pods => PODS.contains(&field),
            Resource::Nodes => NODES.contains(&field),
            Resource::Services => SERVICES.contains(&field),
            Resource::EndpointSlices | Resource::Leases => false,
        }
}

impl Selector {
    /// A `fieldSelector`: `a=b`, `a==b` or `a!=b`, comma-separated; backslash escapes a
    /// comma, an equals sign or a backslash in a value.
    pub fn fields(resource: Resource, text: &str) -> Result<Selector, String> {
        let mut out = Vec::new();
        for term in split_top_level(text) {
            let term = term.trim();
            if term.is_empty() {
                continue;
            }
            let (key, op) = if let Some((k, v)) = split_unescaped(term, "!=") {
                (k, Op::NotEquals(unescape(v)))
            } else if let Some((k, v)) = split_unescaped(term, "==") {
                (k, Op::Equals(unescape(v)))
            } else if let Some((k, v)) = split_unescaped(term, "=") {
                (k, Op::Equals(unescape(v)))
            } else {
                return Err(format!(
                    "invalid selector: '{text}'; can't understand '{term}'"
                ));
            };
            let key = key.trim();
            if !field_supported(resource, key) {
                return Err(format!("field label not supported: {key}"));
            }
            out.push(Requirement {
                key: key.to_owned(),
                op,
            });
        }
        Ok(Selector(out))
    }

    /// A `labelSelector`: equality (`k=v`, `k==v`, `k!=v`), existence (`k`, `!k`) and
    /// sets (`k in (a,b)`, `k notin (a,b)`), comma-separated.
    pub fn labels(text: &str) -> Result<Selector, String> {
        let mut out = Vec::new();
        for term in split_top_level(text) {
            let term = term.trim();
            if term.is_empty() {
                continue;
            }
            let bad = || format!("unable to parse requirement: {term:?}");
            let req = if let Some(key) = term.strip_prefix('!') {
                Requirement {
                    key: key.trim().to_owned(),
                    op: Op::DoesNotExist,
                }
            } else if let Some((k, v)) = term.split_once("!=") {
                Requirement {
                    key: k.trim().to_owned(),
                    op: Op::NotEquals(v.trim().to_owned()),
                }
            } else if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
                Requirement {
                    key: k.trim().to_owned(),
                    op: Op::Equals(v.trim().to_owned()),
                }
            } else if let Some(open) = term.find('(') {
                let close = term.rfind(')').filter(|c| *c > open).ok_or_else(bad)?;
                let values = term[open + 1..close]
                    .split(',')
                    .map(|v| v.trim().to_owned())
                    .collect();
                let mut head = term[..open].split_whitespace();
                let (Some(key), Some(word), None) = (head.next(), head.next(), head.next()) else {
                    return Err(bad());
                };
                let op = match word {
                    "in" => Op::In(values),
                    "notin" => Op::NotIn(values),
                    _ => return Err(bad()),
                };
                Requirement {
                    key: key.to_owned(),
                    op,
                }
            } else {
                Requirement {
                    key: term.to_owned(),
                    op: Op::Exists,
                }
            };
            if req.key.is_empty() {
                return Err(bad());
            }
            out.push(req);
        }
        Ok(Selector(out))
    }

    /// Whether the object's fields (a dotted path from the object's root) satisfy every
    /// requirement.
    pub fn matches_fields(&self, object: &Value) -> bool {
        self.0.iter().all(|r| {
            let value = field(object, &r.key);
            r.op.matches(Some(value.as_str()))
        })
    }

    /// Whether the object's `metadata.labels` satisfy every requirement.
    pub fn matches_labels(&self, object: &Value) -> bool {
        let labels = &object["metadata"]["labels"];
        self.0
            .iter()
            .all(|r| r.op.matches(labels.get(&r.key).and_then(Value::as_str)))
    }
}

impl Op {
    fn matches(&self, value: Option<&str>) -> bool {
        match self {
            Op::Equals(v) => value == Some(v.as_str()),
            Op::NotEquals(v) => value != Some(v.as_str()),
            Op::In(vs) => value.is_some_and(|x| vs.iter().any(|v| v == x)),
            Op::NotIn(vs) => !value.is_some_and(|x| vs.iter().any(|v| v == x)),
            Op::Exists => value.is_some(),
            Op::DoesNotExist => value.is_none(),
        }
    }
}

/// A field's value as the server's field set spells it: strings as they are, booleans and
/// numbers printed, anything absent as "".
fn field(object: &Value, path: &str) -> String {
    let mut v = object;
    for part in path.split('.') {
        v = &v[part];
    }
    match v {
        Value::String(s) => s.clone(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        _ => String::new(),
    }
}

/// Splits at commas outside parentheses and not escaped by a backslash.
fn split_top_level(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut depth, mut start, mut escaped) = (0usize, 0usize, false);
    for (i, c) in text.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' => escaped = true,
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                out.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&text[start..]);
    out
}

/// Splits at the first unescaped `sep`.
fn split_unescaped<'a>(term: &'a str, sep: &str) -> Option<(&'a str, &'a str)> {
    let mut escaped = false;
    for (i, c) in term.char_indices() {
        if escaped {
            escaped = false;
        } else if c == '\\' {
            escaped = true;
        } else if term[i..].starts_with(sep) {
            return Some((&term[..i], &term[i + sep.len()..]));
        }
    }
    None
}

fn unescape(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    let mut chars = value.chars();
    while let Some(c) = chars.next() {
        if c == '\\' {
            out.extend(chars.next());
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod() -> Value {
        json!({"metadata": {"name": "a", "namespace": "ns", "labels": {"app": "web", "tier": "front"}},
               "spec": {"nodeName": "n1", "hostNetwork": true}, "status": {"phase": "Running"}})
    }

    fn check_fields(selector: &str, expected: Result<bool, &str>) {
        let got = Selector::fields(Resource::Pods, selector).map(|s| s.matches_fields(&pod()));
        assert_eq!(got, expected.map_err(str::to_owned), "{selector}");
    }

    fn check_labels(selector: &str, expected: Result<bool, ()>) {
        let got = Selector::labels(selector)
            .map(|s| s.matches_labels(&pod()))
            .map_err(|_| ());
        assert_eq!(got, expected, "{selector}");
    }

    #[test]
    fn field_selectors() {
        check_fields("", Ok(true));
        check_fields("spec.nodeName=n1", Ok(true));
        check_fields("spec.nodeName==n1", Ok(true));
        check_fields("spec.nodeName=n2", Ok(false));
        check_fields("spec.nodeName!=n2,metadata.namespace=ns", Ok(true));
        check_fields("status.podIP=", Ok(true));
        check_fields("spec.hostNetwork=true", Ok(true));
        check_fields("metadata.name=a\\,b", Ok(false));
        check_fields(
            "spec.containers=x",
            Err("field label not supported: spec.containers"),
        );
        check_fields(
            "spec.nodeName",
            Err("invalid selector: 'spec.nodeName'; can't understand 'spec.nodeName'"),
        );
        assert!(Selector::fields(Resource::Nodes, "metadata.name=n1").is_ok());
        assert!(Selector::fields(Resource::Nodes, "spec.nodeName=n1").is_err());
        assert!(
            Selector::fields(
                Resource::Services,
                "spec.type=ClusterIP,metadata.namespace=ns"
            )
            .is_ok()
        );
        assert_eq!(
            Selector::fields(Resource::EndpointSlices, "addressType=IPv4"),
            Err("field label not supported: addressType".to_owned())
        );
        assert!(Selector::fields(Resource::Leases, "metadata.name=registrar").is_ok());
    }

    #[test]
    fn label_selectors() {
        check_labels("", Ok(true));
        check_labels("app=web", Ok(true));
        check_labels("app==web,tier!=back", Ok(true));
        check_labels("app=db", Ok(false));
        check_labels("app", Ok(true));
        check_labels("!app", Ok(false));
        check_labels("!missing", Ok(true));
        check_labels("app in (db, web),tier notin (back)", Ok(true));
        check_labels("app notin (web)", Ok(false));
        check_labels("app in (web", Err(()));
        check_labels("app within (web)", Err(()));
        let slice = json!({"metadata": {"name": "web-abc12", "labels": {"kubernetes.io/service-name": "web", "endpointslice.kubernetes.io/managed-by": "c"}}});
        let matches = |selector| Selector::labels(selector).unwrap().matches_labels(&slice);
        assert!(matches("kubernetes.io/service-name=web"));
        assert!(!matches("kubernetes.io/service-name=db"));
        assert!(matches(
            "kubernetes.io/service-name in (db,web),!kubernetes.io/headless"
        ));
    }
}
