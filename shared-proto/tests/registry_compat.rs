//! The registry API stays backward compatible across one version: the current
//! `registry.proto` is diffed against v1's committed descriptor set. No message, enum
//! value, field or method of v1 may be removed, renumbered or retyped; new ones may be
//! added.
//!
//! `AETHER_REGENERATE_FIXTURES=1` rewrites the committed set from the current file; do
//! that only when cutting a new version of the API.
#![cfg(feature = "registry-api")]

use std::collections::BTreeMap;

use prost::Message;
use prost_types::{DescriptorProto, FileDescriptorSet};

const COMMITTED: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/proto/aether/registry/v1/registry.v1.binpb"
);

fn current() -> FileDescriptorSet {
    let fds = protox::compile(
        ["aether/registry/v1/registry.proto"],
        [concat!(env!("CARGO_MANIFEST_DIR"), "/proto")],
    )
    .expect("registry.proto compiles");
    FileDescriptorSet::decode(fds.encode_to_vec().as_slice()).expect("a descriptor set decodes")
}

/// Every message of `set`, by full name, nested ones included.
fn messages(set: &FileDescriptorSet) -> BTreeMap<String, DescriptorProto> {
    fn walk(prefix: &str, m: &DescriptorProto, out: &mut BTreeMap<String, DescriptorProto>) {
        let name = format!("{prefix}.{}", m.name());
        for n in &m.nested_type {
            walk(&name, n, out);
        }
        out.insert(name, m.clone());
    }
    let mut out = BTreeMap::new();
    for f in &set.file {
        for m in &f.message_type {
            walk(&format!(".{}", f.package()), m, &mut out);
        }
    }
    out
}

/// What `new` breaks of `old`, one line each; empty when compatible.
fn incompatibilities(old: &FileDescriptorSet, new: &FileDescriptorSet) -> Vec<String> {
    let mut out = Vec::new();
    let (old_m, new_m) = (messages(old), messages(new));
    for (name, om) in &old_m {
        let Some(nm) = new_m.get(name) else {
            out.push(format!("message {name} removed"));
            continue;
        };
        for of in &om.field {
            match nm.field.iter().find(|f| f.number() == of.number()) {
                None => out.push(format!(
                    "{name}: field {} = {} removed",
                    of.name(),
                    of.number()
                )),
                Some(nf) => {
                    if nf.name() != of.name() {
                        out.push(format!(
                            "{name}: field {} renamed {} (number {})",
                            of.name(),
                            nf.name(),
                            of.number()
                        ));
                    }
                    if (nf.r#type(), nf.type_name(), nf.label())
                        != (of.r#type(), of.type_name(), of.label())
                    {
                        out.push(format!(
                            "{name}: field {} = {} changed type",
                            of.name(),
                            of.number()
                        ));
                    }
                    if nf.oneof_index.is_some() != of.oneof_index.is_some() {
                        out.push(format!(
                            "{name}: field {} moved in or out of a oneof",
                            of.name()
                        ));
                    }
                }
            }
            if let Some(moved) = nm
                .field
                .iter()
                .find(|f| f.name() == of.name() && f.number() != of.number())
            {
                out.push(format!(
                    "{name}: field {} renumbered {} -> {}",
                    of.name(),
                    of.number(),
                    moved.number()
                ));
            }
        }
    }
    let enums = |set: &FileDescriptorSet| -> BTreeMap<String, BTreeMap<i32, String>> {
        let mut e = BTreeMap::new();
        for f in &set.file {
            for en in &f.enum_type {
                e.insert(
                    format!(".{}.{}", f.package(), en.name()),
                    en.value
                        .iter()
                        .map(|v| (v.number(), v.name().to_owned()))
                        .collect(),
                );
            }
        }
        e
    };
    let (old_e, new_e) = (enums(old), enums(new));
    for (name, values) in &old_e {
        for (number, value) in values {
            if new_e.get(name).and_then(|v| v.get(number)) != Some(value) {
                out.push(format!(
                    "enum {name}: value {value} = {number} removed or renamed"
                ));
            }
        }
    }
    for of in &old.file {
        for os in &of.service {
            let ns = new
                .file
                .iter()
                .flat_map(|f| &f.service)
                .find(|s| s.name() == os.name());
            for om in &os.method {
                let nm = ns.and_then(|s| s.method.iter().find(|m| m.name() == om.name()));
                match nm {
                    None => out.push(format!("rpc {}.{} removed", os.name(), om.name())),
                    Some(nm) => {
                        let sig = |m: &prost_types::MethodDescriptorProto| {
                            (
                                m.input_type().to_owned(),
                                m.output_type().to_owned(),
                                m.client_streaming(),
                                m.server_streaming(),
                            )
                        };
                        if sig(nm) != sig(om) {
                            out.push(format!(
                                "rpc {}.{} changed its signature",
                                os.name(),
                                om.name()
                            ));
                        }
                    }
                }
            }
        }
    }
    out
}

#[test]
fn the_current_registry_api_keeps_everything_of_v1() {
    let now = current();
    if std::env::var_os("AETHER_REGENERATE_FIXTURES").is_some() {
        std::fs::write(COMMITTED, now.encode_to_vec()).unwrap();
    }
    let v1 = FileDescriptorSet::decode(shared_proto::registry::V1_DESCRIPTOR_SET)
        .expect("the committed v1 set decodes");
    assert!(
        messages(&v1).len() >= 10,
        "the committed v1 set holds the API's messages"
    );
    let broken = incompatibilities(&v1, &now);
    assert!(
        broken.is_empty(),
        "registry.proto breaks v1:\n{}",
        broken.join("\n")
    );
}

#[test]
fn the_diff_catches_a_removed_a_renumbered_and_a_retyped_field() {
    let v1 = current();
    let edit = |f: &dyn Fn(&mut DescriptorProto)| {
        let mut next = v1.clone();
        let file = next
            .file
            .iter_mut()
            .find(|f| f.package() == "aether.registry.v1")
            .unwrap();
        f(file
            .message_type
            .iter_mut()
            .find(|m| m.name() == "WatchEndpointsRequest")
            .unwrap());
        incompatibilities(&v1, &next)
    };
    let removed = edit(&|m| m.field.retain(|f| f.name() != "instance"));
    assert!(
        removed.iter().any(|e| e.contains("instance = 3 removed")),
        "{removed:?}"
    );
    let renumbered = edit(&|m| {
        m.field
            .iter_mut()
            .filter(|f| f.name() == "instance")
            .for_each(|f| f.number = Some(9))
    });
    assert!(
        renumbered.iter().any(|e| e.contains("renumbered 3 -> 9")),
        "{renumbered:?}"
    );
    let retyped = edit(&|m| {
        m.field
            .iter_mut()
            .filter(|f| f.name() == "resume_revision")
            .for_each(|f| f.set_type(prost_types::field_descriptor_proto::Type::String))
    });
    assert!(
        retyped
            .iter()
            .any(|e| e.contains("resume_revision = 4 changed type")),
        "{retyped:?}"
    );
    assert!(
        edit(&|m| m.field.push(prost_types::FieldDescriptorProto {
            name: Some("added".into()),
            number: Some(20),
            ..Default::default()
        }))
        .is_empty()
    );
}

/// An agent of the previous version decodes what a newer registrar sends with the new
/// fields (`Endpoint.quic`, `Endpoint.quic_sni`) set: they are unknown fields to it, kept
/// aside and never read, and every field it knows reads as sent, in a full view and in a
/// change batch. Two previous versions: the release just before the QUIC fields (its
/// `registry.proto`, kept under `tests/fixtures/registry-before-quic/`), and v1 as first
/// committed (`registry.v1.binpb`, before `mtls` too).
#[test]
fn an_agent_of_the_previous_version_ignores_the_new_fields() {
    use prost_reflect::{DescriptorPool, DynamicMessage, Value};
    use shared_proto::registry as pb;

    let before_quic = protox::compile(
        ["aether/registry/v1/registry.proto"],
        [concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/registry-before-quic"
        )],
    )
    .expect("the previous registry.proto compiles");
    let versions = [
        (
            "before the QUIC fields",
            DescriptorPool::decode(before_quic.encode_to_vec().as_slice()).unwrap(),
            &[8, 9][..],
        ),
        (
            "v1 as committed",
            DescriptorPool::decode(shared_proto::registry::V1_DESCRIPTOR_SET).unwrap(),
            &[7, 8, 9][..],
        ),
    ];

    let endpoint = pb::Endpoint {
        address: "10.0.0.1".into(),
        port: 8080,
        service_port: 80,
        node: "n1".into(),
        pod: "web-1".into(),
        state: pb::EndpointState::Draining as i32,
        mtls: true,
        quic: "n1.example:4443".into(),
        quic_sni: "web-1.prod.example".into(),
    };
    let key = pb::ServiceKey {
        namespace: "prod".into(),
        name: "web".into(),
    };
    let full = pb::WatchEndpointsResponse {
        kind: Some(pb::watch_endpoints_response::Kind::Full(pb::FullView {
            revision: 7,
            services: vec![pb::Service {
                key: Some(key.clone()),
                ports: vec![80],
                vip: "10.96.0.1".into(),
                endpoints: vec![endpoint.clone()],
            }],
            ..Default::default()
        })),
    };
    let batch = pb::WatchEndpointsResponse {
        kind: Some(pb::watch_endpoints_response::Kind::Changes(
            pb::ChangeBatch {
                revision: 8,
                changes: vec![pb::Change {
                    kind: Some(pb::change::Kind::EndpointUpserted(pb::EndpointUpsert {
                        service: Some(key),
                        endpoint: Some(endpoint),
                    })),
                }],
            },
        )),
    };

    fn get(m: &DynamicMessage, name: &str) -> Option<Value> {
        m.get_field_by_name(name).map(|v| v.into_owned())
    }
    fn message(v: Option<Value>) -> DynamicMessage {
        match v {
            Some(Value::Message(m)) => m,
            other => panic!("not a message: {other:?}"),
        }
    }
    fn first(v: Option<Value>) -> DynamicMessage {
        match v {
            Some(Value::List(mut l)) => message(Some(l.remove(0))),
            other => panic!("not a list: {other:?}"),
        }
    }
    /// The old agent's endpoint: every field it knows as sent, the new ones unknown.
    fn check(version: &str, e: &DynamicMessage, unknown: &[u32]) {
        let s = |v: &str| Some(Value::String(v.into()));
        assert_eq!(get(e, "address"), s("10.0.0.1"), "{version}");
        assert_eq!(get(e, "port"), Some(Value::U32(8080)), "{version}");
        assert_eq!(get(e, "service_port"), Some(Value::U32(80)), "{version}");
        assert_eq!(get(e, "node"), s("n1"), "{version}");
        assert_eq!(get(e, "pod"), s("web-1"), "{version}");
        assert_eq!(
            get(e, "state"),
            Some(Value::EnumNumber(pb::EndpointState::Draining as i32)),
            "{version}"
        );
        if !unknown.contains(&7) {
            assert_eq!(get(e, "mtls"), Some(Value::Bool(true)), "{version}");
        }
        assert_eq!(get(e, "quic"), None, "{version} has no quic field");
        assert_eq!(get(e, "quic_sni"), None, "{version} has no quic_sni field");
        let got: Vec<u32> = e.unknown_fields().map(|f| f.number()).collect();
        assert_eq!(got, unknown, "{version}: the fields unknown to it");
    }

    for (version, pool, unknown) in &versions {
        let response = pool
            .get_message_by_name("aether.registry.v1.WatchEndpointsResponse")
            .unwrap();
        let old = DynamicMessage::decode(response.clone(), full.encode_to_vec().as_slice())
            .unwrap_or_else(|e| panic!("{version} decodes a full view with the new fields: {e}"));
        let view = message(get(&old, "full"));
        assert_eq!(get(&view, "revision"), Some(Value::I64(7)), "{version}");
        let service = first(get(&view, "services"));
        assert_eq!(
            get(&service, "vip"),
            Some(Value::String("10.96.0.1".into())),
            "{version}"
        );
        check(version, &first(get(&service, "endpoints")), unknown);

        let old = DynamicMessage::decode(response, batch.encode_to_vec().as_slice())
            .unwrap_or_else(|e| {
                panic!("{version} decodes a change batch with the new fields: {e}")
            });
        let changes = message(get(&old, "changes"));
        assert_eq!(get(&changes, "revision"), Some(Value::I64(8)), "{version}");
        let upsert = message(get(&first(get(&changes, "changes")), "endpoint_upserted"));
        check(version, &message(get(&upsert, "endpoint")), unknown);
    }
}
