//! The two patch formats the server accepts: JSON patch (RFC 6902, with JSON pointers
//! per RFC 6901) and JSON merge patch (RFC 7386). Pure functions over `serde_json` values;
//! a JSON patch applies all of its operations or none.

use serde_json::Value;

/// Why a JSON patch was not applied. The server answers the first with 400 and the
/// second with 422, as the real one does (a patch it cannot decode is a bad request; a
/// decoded patch that does not apply is an unprocessable entity).
#[derive(Debug, PartialEq)]
pub enum PatchError {
    Malformed(String),
    NotApplied(String),
}

/// Applies an RFC 6902 patch (`add`, `remove`, `replace`, `move`, `copy`, `test`) to a copy
/// of `doc`. Messages follow the Go library the API server uses (evanphx/json-patch).
pub fn json_patch(doc: &Value, patch: &Value) -> Result<Value, PatchError> {
    let Value::Array(ops) = patch else {
        return Err(PatchError::Malformed(
            "json: cannot unmarshal object into Go value of type jsonpatch.Patch".into(),
        ));
    };
    let mut doc = doc.clone();
    for op in ops {
        let name = op
            .get("op")
            .and_then(Value::as_str)
            .ok_or_else(|| malformed(op, "op"))?;
        let path = op
            .get("path")
            .and_then(Value::as_str)
            .ok_or_else(|| malformed(op, "path"))?;
        let path = Pointer::parse(path)?;
        let value = || {
            op.get("value")
                .cloned()
                .ok_or_else(|| malformed(op, "value"))
        };
        let from = || -> Result<Pointer, PatchError> {
            Pointer::parse(
                op.get("from")
                    .and_then(Value::as_str)
                    .ok_or_else(|| malformed(op, "from"))?,
            )
        };
        match name {
            "add" => add(&mut doc, &path, value()?)?,
            "remove" => {
                remove(&mut doc, &path)?;
            }
            "replace" => {
                let target = get_mut(&mut doc, &path.0).ok_or_else(|| {
                    PatchError::NotApplied(format!(
                        "replace operation does not apply: doc is missing key: {}: missing value",
                        path.text()
                    ))
                })?;
                *target = value()?;
            }
            "move" => {
                let from = from()?;
                if path.0.len() > from.0.len() && path.0.starts_with(&from.0) {
                    return Err(PatchError::NotApplied(format!(
                        "move operation does not apply: from {} is a prefix of path {}",
                        from.text(),
                        path.text()
                    )));
                }
                let v = remove(&mut doc, &from)?;
                add(&mut doc, &path, v)?;
            }
            "copy" => {
                let from = from()?;
                let v = get(&doc, &from.0)
                    .cloned()
                    .ok_or_else(|| PatchError::NotApplied(format!("copy operation does not apply: doc is missing from path: {}: missing value", from.text())))?;
                add(&mut doc, &path, v)?;
            }
            "test" => {
                let expected = value()?;
                if get(&doc, &path.0) != Some(&expected) {
                    return Err(PatchError::NotApplied(format!(
                        "testing value {} failed: test failed",
                        path.text()
                    )));
                }
            }
            other => return Err(PatchError::Malformed(format!("Unexpected kind: {other}"))),
        }
    }
    Ok(doc)
}

/// Applies an RFC 7386 merge patch: objects merge key by key, `null` removes a key, and
/// anything else (arrays included) replaces the target.
pub fn merge_patch(doc: &Value, patch: &Value) -> Value {
    let Value::Object(patch) = patch else {
        return patch.clone();
    };
    let mut out = match doc {
        Value::Object(m) => m.clone(),
        _ => serde_json::Map::new(),
    };
    for (k, v) in patch {
        if v.is_null() {
            out.remove(k);
        } else {
            let merged = merge_patch(out.get(k).unwrap_or(&Value::Null), v);
            out.insert(k.clone(), merged);
        }
    }
    Value::Object(out)
}

fn malformed(op: &Value, field: &str) -> PatchError {
    PatchError::Malformed(format!("operation {op} is missing {field:?}"))
}

/// A parsed JSON pointer: its reference tokens, unescaped (`~1` is `/`, `~0` is `~`).
struct Pointer(Vec<String>);

impl Pointer {
    fn parse(text: &str) -> Result<Pointer, PatchError> {
        if text.is_empty() {
            return Ok(Pointer(Vec::new()));
        }
        let Some(rest) = text.strip_prefix('/') else {
            return Err(PatchError::Malformed(format!(
                "JSON pointer must be empty or start with a \"/\": {text:?}"
            )));
        };
        Ok(Pointer(
            rest.split('/')
                .map(|t| t.replace("~1", "/").replace("~0", "~"))
                .collect(),
        ))
    }

    fn text(&self) -> String {
        self.0
            .iter()
            .map(|t| format!("/{}", t.replace('~', "~0").replace('/', "~1")))
            .collect()
    }

    fn split_last(&self) -> Option<(&[String], &str)> {
        self.0
            .split_last()
            .map(|(last, parent)| (parent, last.as_str()))
    }
}

/// An array index as RFC 6901 spells it: digits without a leading zero.
fn index(token: &str) -> Option<usize> {
    let well_formed = token == "0"
        || (!token.starts_with('0')
            && !token.is_empty()
            && token.bytes().all(|b| b.is_ascii_digit()));
    well_formed.then(|| token.parse().ok()).flatten()
}

fn get<'a>(doc: &'a Value, tokens: &[String]) -> Option<&'a Value> {
    tokens.iter().try_fold(doc, |v, t| match v {
        Value::Object(m) => m.get(t),
        Value::Array(a) => a.get(index(t)?),
        _ => None,
    })
}

fn get_mut<'a>(doc: &'a mut Value, tokens: &[String]) -> Option<&'a mut Value> {
    tokens.iter().try_fold(doc, |v, t| match v {
        Value::Object(m) => m.get_mut(t),
        Value::Array(a) => a.get_mut(index(t)?),
        _ => None,
    })
}

fn add(doc: &mut Value, path: &Pointer, value: Value) -> Result<(), PatchError> {
    let Some((parent, last)) = path.split_last() else {
        *doc = value;
        return Ok(());
    };
    let missing = || {
        PatchError::NotApplied(format!(
            "add operation does not apply: doc is missing path: {:?}: missing value",
            path.text()
        ))
    };
    match get_mut(doc, parent).ok_or_else(missing)? {
        Value::Object(m) => {
            m.insert(last.to_owned(), value);
        }
        Value::Array(a) => {
            let i = if last == "-" {
                a.len()
            } else {
                index(last).ok_or_else(missing)?
            };
            if i > a.len() {
                return Err(PatchError::NotApplied(format!(
                    "add operation does not apply: index {i} out of bounds: {}",
                    path.text()
                )));
            }
            a.insert(i, value);
        }
        _ => return Err(missing()),
    }
    Ok(())
}

fn remove(doc: &mut Value, path: &Pointer) -> Result<Value, PatchError> {
    let missing = || {
        PatchError::NotApplied(format!(
            "unable to remove nonexistent key: {}: missing value",
            path.text()
        ))
    };
    let (parent, last) = path.split_last().ok_or_else(missing)?;
    match get_mut(doc, parent).ok_or_else(missing)? {
        Value::Object(m) => m.remove(last).ok_or_else(missing),
        Value::Array(a) => match index(last) {
            Some(i) if i < a.len() => Ok(a.remove(i)),
            _ => Err(missing()),
        },
        _ => Err(missing()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn node() -> Value {
        json!({"metadata": {"name": "n1", "annotations": {"a/b": "1", "m~n": "2"}},
               "spec": {"taints": [{"key": "x", "effect": "NoSchedule"}, {"key": "t", "effect": "NoSchedule"}]}})
    }

    /// Applies `patch` to `node()` and compares the result (a value, or the error's text
    /// and whether it is a 400 or a 422).
    fn check(patch: Value, expected: Result<Value, (u16, &str)>) {
        let got = json_patch(&node(), &patch).map_err(|e| match e {
            PatchError::Malformed(m) => (400, m),
            PatchError::NotApplied(m) => (422, m),
        });
        assert_eq!(got, expected.map_err(|(c, m)| (c, m.to_owned())), "{patch}");
    }

    #[test]
    fn json_patch_operations() {
        let mut one_taint = node();
        one_taint["spec"]["taints"]
            .as_array_mut()
            .unwrap()
            .remove(1);
        check(
            json!([{"op": "test", "path": "/spec/taints/1", "value": {"key": "t", "effect": "NoSchedule"}},
                     {"op": "remove", "path": "/spec/taints/1"}]),
            Ok(one_taint),
        );
        check(
            json!([{"op": "test", "path": "/spec/taints/0/key", "value": "t"}, {"op": "remove", "path": "/spec/taints/0"}]),
            Err((422, "testing value /spec/taints/0/key failed: test failed")),
        );
        check(
            json!([{"op": "remove", "path": "/spec/taints/2"}]),
            Err((
                422,
                "unable to remove nonexistent key: /spec/taints/2: missing value",
            )),
        );
        check(
            json!([{"op": "remove", "path": "/spec/nope"}]),
            Err((
                422,
                "unable to remove nonexistent key: /spec/nope: missing value",
            )),
        );
        check(
            json!([{"op": "remove", "path": "/spec/taints/01"}]),
            Err((
                422,
                "unable to remove nonexistent key: /spec/taints/01: missing value",
            )),
        );

        let mut escaped = node();
        escaped["metadata"]["annotations"] = json!({"a/b": "3", "m~n": "2"});
        check(
            json!([{"op": "test", "path": "/metadata/annotations/m~0n", "value": "2"},
                     {"op": "replace", "path": "/metadata/annotations/a~1b", "value": "3"}]),
            Ok(escaped),
        );

        let mut appended = node();
        appended["spec"]["taints"]
            .as_array_mut()
            .unwrap()
            .push(json!({"key": "y"}));
        appended["spec"]["unschedulable"] = json!(true);
        check(
            json!([{"op": "add", "path": "/spec/taints/-", "value": {"key": "y"}},
                     {"op": "add", "path": "/spec/unschedulable", "value": true}]),
            Ok(appended),
        );
        check(
            json!([{"op": "add", "path": "/spec/taints/3", "value": {}}]),
            Err((
                422,
                "add operation does not apply: index 3 out of bounds: /spec/taints/3",
            )),
        );
        check(
            json!([{"op": "add", "path": "/status/x", "value": 1}]),
            Err((
                422,
                "add operation does not apply: doc is missing path: \"/status/x\": missing value",
            )),
        );

        let mut moved = node();
        let t = moved["spec"]["taints"].as_array_mut().unwrap().remove(0);
        moved["spec"]["first"] = t.clone();
        check(
            json!([{"op": "move", "from": "/spec/taints/0", "path": "/spec/first"}]),
            Ok(moved),
        );
        let mut copied = node();
        copied["spec"]["first"] = t;
        check(
            json!([{"op": "copy", "from": "/spec/taints/0", "path": "/spec/first"}]),
            Ok(copied),
        );
        check(
            json!([{"op": "replace", "path": "/spec/nope", "value": 1}]),
            Err((
                422,
                "replace operation does not apply: doc is missing key: /spec/nope: missing value",
            )),
        );
        check(
            json!([{"op": "frobnicate", "path": "/spec"}]),
            Err((400, "Unexpected kind: frobnicate")),
        );
        check(
            json!([{"op": "add", "path": "spec", "value": 1}]),
            Err((
                400,
                "JSON pointer must be empty or start with a \"/\": \"spec\"",
            )),
        );
        check(
            json!({"op": "add"}),
            Err((
                400,
                "json: cannot unmarshal object into Go value of type jsonpatch.Patch",
            )),
        );
    }

    #[test]
    fn a_failed_operation_leaves_the_document_unchanged() {
        let doc = node();
        let patch = json!([{"op": "remove", "path": "/spec/taints/0"}, {"op": "test", "path": "/metadata/name", "value": "n2"}]);
        assert!(json_patch(&doc, &patch).is_err());
        assert_eq!(doc, node());
    }

    #[test]
    fn merge_patches() {
        let doc = json!({"a": {"b": 1, "c": 2}, "l": [1, 2], "s": "x"});
        assert_eq!(
            merge_patch(
                &doc,
                &json!({"a": {"b": null, "d": 3}, "l": [3], "n": {"x": 1}})
            ),
            json!({"a": {"c": 2, "d": 3}, "l": [3], "s": "x", "n": {"x": 1}})
        );
        assert_eq!(merge_patch(&doc, &json!([1])), json!([1]));
    }
}
