//! The registry file's schema (the agent's `--registry-file`, and what `aether-registrar
//! apply` reads), its parsing and its validation into the model's [`RegistryView`].
//! Pure: bytes in, a view or a [`FileError`] naming the file and the field out. Reading
//! the file, watching it and reloading it belong to the callers.
//!
//! # File schema
//!
//! ```json
//! {
//!   "services": [
//!     {
//!       "name": "web",                 // DNS label: [a-z0-9]([-a-z0-9]*[a-z0-9])?, ≤ 63
//!       "namespace": "default",        // DNS label
//!       "ports": [80, 8080],           // service ports, 1..=65535, no repeats, ≥ 1
//!       "vip": "10.96.0.10",           // optional virtual IP
//!       "endpoints": [
//!         {
//!           "address": "10.0.0.5",     // IP of the endpoint
//!           "port": 8080,              // port on the endpoint, 1..=65535
//!           "service_port": 80,        // which service port it serves; optional when
//!                                      // the service has one port
//!           "node": "node-a",          // optional
//!           "pod": "web-5d8f",         // optional
//!           "state": "healthy",        // optional: "healthy" (default) or "draining"
//!           "mtls": true               // optional, default false: the endpoint accepts
//!                                      // mTLS with SPIFFE SVIDs, so agents with
//!                                      // identity on originate mTLS to it
//!         }
//!       ]
//!     }
//!   ]
//! }
//! ```
//! (JSON has no comments; they are explanation here.) A service is keyed by namespace and
//! name; the same key twice is an error.
//!
//! Unknown fields are ignored, and named: [`parse_noting`] and [`service_from_str`] return
//! each one's path (`services[3].endpoints[0].quic`) for the caller to log. A newer file
//! (a field a later release adds) must not stop an older agent during a roll, which holds
//! both releases on one node; a typo is still said, as a warning naming the field.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::{Endpoint, EndpointState, RegistryView, Service};

#[derive(Debug, thiserror::Error)]
pub enum FileError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}:{line}:{column}: {message}")]
    Json {
        path: PathBuf,
        line: usize,
        column: usize,
        message: String,
    },
    #[error("{path}: {message}")]
    Invalid { path: PathBuf, message: String },
    #[error(
        "{path} is {size} bytes, over the limit of {limit} bytes (--registry-max-bytes); not read"
    )]
    TooLarge {
        path: PathBuf,
        size: u64,
        limit: u64,
    },
}

impl FileError {
    pub fn json(path: &Path, e: &serde_json::Error) -> Self {
        Self::Json {
            path: path.to_owned(),
            line: e.line(),
            column: e.column(),
            message: e.to_string(),
        }
    }

    /// A JSON error in the part of `file` that starts at byte `offset`, located in the
    /// whole file.
    pub fn json_at(path: &Path, file: &[u8], offset: usize, e: &serde_json::Error) -> Self {
        let before = &file[..offset.min(file.len())];
        let lines = before.iter().filter(|b| **b == b'\n').count();
        let col0 = before.len()
            - before
                .iter()
                .rposition(|b| *b == b'\n')
                .map_or(0, |p| p + 1);
        let (line, column) = if e.line() <= 1 {
            (lines + 1, col0 + e.column())
        } else {
            (lines + e.line(), e.column())
        };
        // serde_json ends its message with the position in what it parsed; say the file's.
        let text = e.to_string();
        let bare = text
            .strip_suffix(&format!(" at line {} column {}", e.line(), e.column()))
            .unwrap_or(&text);
        Self::Json {
            path: path.to_owned(),
            line,
            column,
            message: format!("{bare} at line {line} column {column}"),
        }
    }
}

/// The whole file.
#[derive(Deserialize)]
pub struct FileDoc {
    #[serde(default)]
    pub services: Vec<FileService>,
}

/// One service as written in the file, before [`validate`].
#[derive(Deserialize)]
pub struct FileService {
    pub name: String,
    pub namespace: String,
    pub ports: Vec<u16>,
    #[serde(default)]
    pub vip: Option<IpAddr>,
    #[serde(default)]
    pub endpoints: Vec<FileEndpoint>,
}

/// One endpoint as written in the file.
#[derive(Deserialize)]
pub struct FileEndpoint {
    pub address: IpAddr,
    pub port: u16,
    #[serde(default)]
    pub service_port: Option<u16>,
    #[serde(default)]
    pub node: String,
    #[serde(default)]
    pub pod: String,
    #[serde(default)]
    pub state: EndpointState,
    /// The endpoint accepts mTLS with SPIFFE SVIDs.
    #[serde(default)]
    pub mtls: bool,
}

/// Parses and validates a registry file's content; unknown fields are ignored silently.
pub fn parse(path: &Path, bytes: &[u8]) -> Result<RegistryView, FileError> {
    parse_noting(path, bytes, &mut Ignored::default())
}

/// The fields a parse ignored, by path in the file, the first [`Ignored::KEPT`] of them.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Ignored {
    /// Paths such as `services[3].endpoints[0].quic`.
    pub paths: Vec<String>,
    /// How many there were in all.
    pub count: usize,
}

impl Ignored {
    /// Paths kept for the message: a file written by a newer release may carry a new
    /// field on each of 100,000 endpoints.
    pub const KEPT: usize = 8;

    fn note(&mut self, path: impl FnOnce() -> String) {
        self.count += 1;
        if self.paths.len() < Self::KEPT {
            self.paths.push(path());
        }
    }
}

impl std::fmt::Display for Ignored {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.paths.join(", "))?;
        if self.count > self.paths.len() {
            write!(f, " and {} more", self.count - self.paths.len())?;
        }
        Ok(())
    }
}

/// [`parse`], noting the fields it ignored in `ignored`.
pub fn parse_noting(
    path: &Path,
    bytes: &[u8],
    ignored: &mut Ignored,
) -> Result<RegistryView, FileError> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let doc: FileDoc = serde_ignored::deserialize(&mut de, |p| ignored.note(|| field_path(&p)))
        .and_then(|doc| de.end().map(|()| doc))
        .map_err(|e| FileError::json(path, &e))?;
    let mut services = BTreeMap::new();
    for (i, s) in doc.services.into_iter().enumerate() {
        let service = validate(path, i, s)?;
        match services.entry(service.key()) {
            std::collections::btree_map::Entry::Vacant(v) => {
                v.insert(service);
            }
            std::collections::btree_map::Entry::Occupied(_) => {
                return Err(listed_twice(path, i, &service.name, &service.namespace));
            }
        }
    }
    Ok(RegistryView { services })
}

/// Parses the JSON text of `services[i]`, noting the fields it ignored.
pub fn service_from_str(
    text: &str,
    i: usize,
    ignored: &mut Ignored,
) -> Result<FileService, serde_json::Error> {
    let mut de = serde_json::Deserializer::from_str(text);
    let service = serde_ignored::deserialize(&mut de, |p| {
        ignored.note(|| format!("services[{i}].{}", field_path(&p)))
    })?;
    de.end()?;
    Ok(service)
}

/// `endpoints[0].quic`: a path as the file's errors write one.
fn field_path(p: &serde_ignored::Path) -> String {
    use serde_ignored::Path;
    match p {
        Path::Root => String::new(),
        Path::Seq { parent, index } => format!("{}[{index}]", field_path(parent)),
        Path::Map { parent, key } => match field_path(parent) {
            up if up.is_empty() => key.clone(),
            up => format!("{up}.{key}"),
        },
        Path::Some { parent }
        | Path::NewtypeStruct { parent }
        | Path::NewtypeVariant { parent } => field_path(parent),
    }
}

/// The error for `services[i]`, a key an earlier service of the file already has.
pub fn listed_twice(path: &Path, i: usize, name: &str, namespace: &str) -> FileError {
    FileError::Invalid {
        path: path.to_owned(),
        message: format!("services[{i}] ({name}.{namespace}): service listed twice"),
    }
}

/// Checks one service of the file (`services[i]`) and converts it into the model's.
pub fn validate(path: &Path, i: usize, s: FileService) -> Result<Service, FileError> {
    let invalid = |message: String| FileError::Invalid {
        path: path.to_owned(),
        message,
    };
    // Error context is formatted only for an error: a 10,000-service file would
    // otherwise build 110,000 location strings per reload.
    let at = || format!("services[{i}] ({}.{})", s.name, s.namespace);
    for (what, v) in [("name", &s.name), ("namespace", &s.namespace)] {
        if !is_dns_label(v) {
            return Err(invalid(format!(
                "{}: {what} {v:?} is not a DNS label",
                at()
            )));
        }
    }
    if s.ports.is_empty() {
        return Err(invalid(format!("{}: ports is empty", at())));
    }
    for (k, p) in s.ports.iter().enumerate() {
        if *p == 0 || s.ports[..k].contains(p) {
            return Err(invalid(format!("{}: port {p} is 0 or listed twice", at())));
        }
    }
    let mut endpoints = Vec::with_capacity(s.endpoints.len());
    for (j, e) in s.endpoints.into_iter().enumerate() {
        let eat = || format!("{}.endpoints[{j}]", at());
        if e.port == 0 {
            return Err(invalid(format!("{}: port is 0", eat())));
        }
        let service_port = match (e.service_port, s.ports.as_slice()) {
            (Some(p), ports) if ports.contains(&p) => p,
            (Some(p), _) => {
                return Err(invalid(format!(
                    "{}: service_port {p} is not a port of the service",
                    eat()
                )));
            }
            (None, [only]) => *only,
            (None, _) => {
                return Err(invalid(format!(
                    "{}: service_port is required for a service with several ports",
                    eat()
                )));
            }
        };
        endpoints.push(Endpoint {
            address: e.address,
            port: e.port,
            service_port,
            node: e.node,
            pod: e.pod,
            state: e.state,
            mtls: e.mtls,
        });
    }
    Ok(Service {
        name: s.name,
        namespace: s.namespace,
        ports: s.ports,
        vip: s.vip,
        endpoints,
    })
}

/// A DNS label as Kubernetes names namespaces and services: lower-case letters, digits
/// and `-`, neither first nor last, at most 63 bytes.
pub fn is_dns_label(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(json: &str, expected: Result<&str, &str>) {
        let got = parse(Path::new("/etc/aether/registry.json"), json.as_bytes());
        match (got, expected) {
            (Ok(view), Ok(want)) => {
                let s: Vec<String> = view
                    .services
                    .values()
                    .map(|s| {
                        let eps: Vec<String> = s
                            .endpoints
                            .iter()
                            .map(|e| {
                                format!("{}:{}@{}:{:?}", e.address, e.port, e.service_port, e.state)
                            })
                            .collect();
                        format!(
                            "{}.{} {:?} {:?} [{}]",
                            s.name,
                            s.namespace,
                            s.ports,
                            s.vip,
                            eps.join(" ")
                        )
                    })
                    .collect();
                assert_eq!(s.join("\n"), want);
            }
            (Err(e), Err(want)) => {
                assert!(e.to_string().contains(want), "error {e:?} lacks {want:?}")
            }
            (got, want) => panic!("got {got:?}, want {want:?}"),
        }
    }

    #[test]
    fn parses_and_sorts_services() {
        check(
            r#"{"services":[
                {"name":"web","namespace":"prod","ports":[80],"endpoints":[{"address":"10.0.0.1","port":8080}]},
                {"name":"api","namespace":"prod","ports":[80,81],"vip":"10.96.0.1","endpoints":[
                  {"address":"10.0.0.2","port":9000,"service_port":81,"state":"draining","node":"n","pod":"p"}]}
            ]}"#,
            Ok(
                "api.prod [80, 81] Some(10.96.0.1) [10.0.0.2:9000@81:Draining]\nweb.prod [80] None [10.0.0.1:8080@80:Healthy]",
            ),
        );
        check("{}", Ok(""));
    }

    #[test]
    fn unknown_fields_are_ignored_and_named() {
        // A field a later release adds, at each level, as a newer file carries it.
        let newer = r#"{"version":2,"services":[
            {"name":"web","namespace":"d","ports":[80],"prots":1,"endpoints":[
              {"address":"10.0.0.1","port":8080},
              {"address":"10.0.0.2","port":8080,"quic":"10.0.0.9:4443","quic_sni":"x"}]}]}"#;
        let mut ignored = Ignored::default();
        let view = parse_noting(Path::new("r.json"), newer.as_bytes(), &mut ignored).unwrap();
        assert_eq!(view.services.len(), 1);
        let web = view.services.values().next().unwrap();
        assert_eq!(
            web.endpoints.len(),
            2,
            "the endpoint with new fields is kept"
        );
        assert_eq!(
            ignored.paths,
            [
                "version",
                "services[0].prots",
                "services[0].endpoints[1].quic",
                "services[0].endpoints[1].quic_sni"
            ]
        );
        assert_eq!(ignored.count, 4);

        // One service's text, as the agent reloads it.
        let mut ignored = Ignored::default();
        let text = r#"{"name":"w","namespace":"d","ports":[80],"endpoints":[{"address":"10.0.0.1","port":1,"quic":"h:1"}]}"#;
        let s = service_from_str(text, 7, &mut ignored).unwrap();
        assert_eq!(s.endpoints.len(), 1);
        assert_eq!(ignored.paths, ["services[7].endpoints[0].quic"]);

        // The message is capped, with the rest counted.
        let mut many = Ignored::default();
        for k in 0..20 {
            many.note(|| format!("f{k}"));
        }
        assert_eq!(many.paths.len(), Ignored::KEPT);
        assert!(many.to_string().ends_with("f7 and 12 more"), "{many}");

        // Trailing bytes after the document are still an error.
        assert!(parse(Path::new("r.json"), b"{} x").is_err());
    }

    #[test]
    fn rejects_bad_input_with_location() {
        check(
            "{\"services\": [\n  {\"name\": }",
            Err("/etc/aether/registry.json:2:12"),
        );
        check(
            r#"{"services":[{"name":"Web","namespace":"d","ports":[80]}]}"#,
            Err("name \"Web\" is not a DNS label"),
        );
        check(
            r#"{"services":[{"name":"w","namespace":"d","ports":[80]},{"name":"w","namespace":"d","ports":[81]}]}"#,
            Err("listed twice"),
        );
        check(
            r#"{"services":[{"name":"w","namespace":"d","ports":[80,80]}]}"#,
            Err("port 80 is 0 or listed twice"),
        );
        check(
            r#"{"services":[{"name":"w","namespace":"d","ports":[]}]}"#,
            Err("ports is empty"),
        );
        check(
            r#"{"services":[{"name":"w","namespace":"d","ports":[80,81],"endpoints":[{"address":"10.0.0.1","port":1}]}]}"#,
            Err("services[0] (w.d).endpoints[0]: service_port is required"),
        );
        check(
            r#"{"services":[{"name":"w","namespace":"d","ports":[80],"endpoints":[{"address":"10.0.0.1","port":1,"service_port":90}]}]}"#,
            Err("service_port 90 is not a port"),
        );
        check(
            r#"{"services":[{"name":"w","namespace":"d","ports":[80],"endpoints":[{"address":"10.0.0.1","port":1,"state":"gone"}]}]}"#,
            Err("unknown variant `gone`"),
        );
    }

    #[test]
    fn dns_labels() {
        for ok in ["a", "web-1", "0", &"a".repeat(63)] {
            assert!(is_dns_label(ok), "{ok}");
        }
        for bad in ["", "-a", "a-", "A", "a.b", "a_b", &"a".repeat(64)] {
            assert!(!is_dns_label(bad), "{bad}");
        }
    }

    #[test]
    fn a_json_error_inside_a_part_is_located_in_the_whole_file() {
        let file = b"{\"services\": [\n  {\"name\": 1}]}";
        let offset = 17;
        let e = serde_json::from_slice::<FileService>(&file[offset..file.len() - 2])
            .err()
            .expect("a bad part");
        let got = FileError::json_at(Path::new("r.json"), file, offset, &e).to_string();
        assert!(got.starts_with("r.json:2:"), "{got}");
    }
}
