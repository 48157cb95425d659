//! The writes a client makes over HTTP (create, update, patch, delete) as the real
//! server's generic registry performs them: the body checked against the path, the
//! fields the server fills in, optimistic concurrency on `resourceVersion`, and the
//! answers. Pure functions over the store; the server reads the bodies and holds the
//! lock.
//!
//! The server does not know the resources' schemas: `fieldValidation=Strict` is not
//! enforced, and validation stops at names, namespaces, kinds and Lease timestamps.

use serde_json::{Value, json};

use super::patch::{PatchError, json_patch, merge_patch};
use super::resource::Resource;
use super::status::{self, Failure};
use super::store::Store;
use super::timestamps::micro_time;

/// The patch formats the server applies.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum PatchType {
    Json,
    Merge,
}

impl PatchType {
    /// From the request's Content-Type; a strategic merge or apply patch is 415.
    pub fn from_content_type(content_type: &str) -> Result<PatchType, Failure> {
        match content_type
            .split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase()
            .as_str()
        {
            "application/json-patch+json" => Ok(PatchType::Json),
            "application/merge-patch+json" => Ok(PatchType::Merge),
            _ => Err(Failure::unsupported_patch(content_type)),
        }
    }
}

/// POST: a new object in `namespace` (None for a cluster-scoped resource). The server
/// sets uid and creationTimestamp, generates the name from `metadata.generateName` if
/// there is none, and fills in defaults.
pub fn create(
    store: &mut Store,
    resource: Resource,
    namespace: Option<&str>,
    object: Value,
) -> Result<Value, Failure> {
    let mut object = decode(resource, object)?;
    if object["metadata"]["name"]
        .as_str()
        .is_none_or(str::is_empty)
    {
        match object["metadata"]["generateName"]
            .as_str()
            .filter(|g| !g.is_empty())
        {
            Some(prefix) => {
                object["metadata"]["name"] = json!(generated_name(prefix, store.resource_version()))
            }
            None => {
                return Err(Failure::invalid(
                    resource,
                    "",
                    "metadata.name",
                    "FieldValueRequired",
                    "Required value: name or generateName is required",
                ));
            }
        }
    }
    let name = object["metadata"]["name"]
        .as_str()
        .expect("set above")
        .to_owned();
    in_namespace(&mut object, namespace)?;
    if object["metadata"]["resourceVersion"]
        .as_str()
        .is_some_and(|rv| !rv.is_empty())
    {
        return Err(Failure::internal(
            "resourceVersion should not be set on objects to be created",
        ));
    }
    if store.get(resource, namespace, &name).is_some() {
        return Err(Failure::already_exists(resource, &name));
    }
    let metadata = object["metadata"]
        .as_object_mut()
        .expect("decode checks it");
    for field in [
        "uid",
        "creationTimestamp",
        "resourceVersion",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
    ] {
        metadata.remove(field);
    }
    fill_defaults(store, resource, &mut object, None);
    Ok(store.put(resource, object))
}

/// PUT: replaces an existing object. A `metadata.resourceVersion` other than the stored
/// one is a 409 Conflict; none at all replaces unconditionally (the resources here allow
/// unconditional updates). An update that changes nothing writes nothing.
pub fn update(
    store: &mut Store,
    resource: Resource,
    namespace: Option<&str>,
    name: &str,
    object: Value,
) -> Result<Value, Failure> {
    let mut object = decode(resource, object)?;
    let named = object["metadata"]["name"].as_str().unwrap_or("");
    if named != name {
        return Err(Failure::bad_request(format!(
            "the name of the object ({named}) does not match the name on the URL ({name})"
        )));
    }
    in_namespace(&mut object, namespace)?;
    let current = store
        .get(resource, namespace, name)
        .cloned()
        .ok_or_else(|| Failure::not_found(resource, name))?;
    let rv = &object["metadata"]["resourceVersion"];
    if rv.as_str().is_some_and(|v| !v.is_empty()) && *rv != current["metadata"]["resourceVersion"] {
        return Err(Failure::conflict(resource, name));
    }
    // The body's uid is a precondition, as on the real server.
    let (uid, current_uid) = (&object["metadata"]["uid"], &current["metadata"]["uid"]);
    if uid.as_str().is_some_and(|u| !u.is_empty()) && uid != current_uid {
        return Err(precondition_failed(
            resource,
            namespace,
            name,
            "UID",
            uid,
            current_uid,
        ));
    }
    for field in [
        "uid",
        "creationTimestamp",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
    ] {
        object["metadata"][field] = current["metadata"][field].clone();
        if object["metadata"][field].is_null() {
            object["metadata"]
                .as_object_mut()
                .expect("decode checks it")
                .remove(field);
        }
    }
    fill_defaults(store, resource, &mut object, Some(&current));
    Ok(store_if_changed(
        store, resource, namespace, name, &current, object,
    ))
}

/// PATCH: a JSON patch or a JSON merge patch of an existing object. A patch that fails
/// leaves the object as it was; one that changes nothing writes nothing (no new
/// resourceVersion, no event), as on the real server. A `metadata.resourceVersion` the
/// patch sets must be the stored one (409 Conflict otherwise).
pub fn patch(
    store: &mut Store,
    resource: Resource,
    namespace: Option<&str>,
    name: &str,
    patch_type: PatchType,
    patch: &Value,
) -> Result<Value, Failure> {
    let current = store
        .get(resource, namespace, name)
        .cloned()
        .ok_or_else(|| Failure::not_found(resource, name))?;
    let patched = match patch_type {
        PatchType::Json => json_patch(&current, patch).map_err(|e| match e {
            PatchError::Malformed(m) => Failure::bad_request(m),
            PatchError::NotApplied(m) => Failure::patch_not_applied(m),
        })?,
        PatchType::Merge => merge_patch(&current, patch),
    };
    if !patched.is_object() || !patched["metadata"].is_object() {
        return Err(Failure::bad_request(
            "the patched object is not an object with metadata",
        ));
    }
    if patched["metadata"]["name"] != name
        || patched["metadata"]["namespace"] != current["metadata"]["namespace"]
    {
        return Err(Failure::bad_request(format!(
            "the name of the object ({}) does not match the name on the URL ({name})",
            patched["metadata"]["name"]
        )));
    }
    let rv = &current["metadata"]["resourceVersion"];
    if !patched["metadata"]["resourceVersion"].is_null()
        && patched["metadata"]["resourceVersion"] != *rv
    {
        return Err(Failure::conflict(resource, name));
    }
    let mut patched =
        canonical(resource, patched).map_err(|e| Failure::undecodable(resource, &e))?;
    fill_defaults(store, resource, &mut patched, Some(&current));
    Ok(store_if_changed(
        store, resource, namespace, name, &current, patched,
    ))
}

/// DELETE: removes the object at once (none of these resources has finalizers here).
/// `options` is the request's DeleteOptions (Null without a body); its preconditions on
/// uid and resourceVersion are checked. Answers the deleted object or a Status, as the
/// resource's storage does.
pub fn delete(
    store: &mut Store,
    resource: Resource,
    namespace: Option<&str>,
    name: &str,
    options: &Value,
) -> Result<Value, Failure> {
    let current = store
        .get(resource, namespace, name)
        .ok_or_else(|| Failure::not_found(resource, name))?;
    for (field, label) in [("uid", "UID"), ("resourceVersion", "ResourceVersion")] {
        let wanted = &options["preconditions"][field];
        if !wanted.is_null() && *wanted != current["metadata"][field] {
            return Err(precondition_failed(
                resource,
                namespace,
                name,
                label,
                wanted,
                &current["metadata"][field],
            ));
        }
    }
    let deleted = store
        .delete(resource, namespace, name)
        .expect("present above");
    Ok(if resource.delete_returns_object() {
        deleted
    } else {
        status::deleted(resource, name, &deleted["metadata"]["uid"])
    })
}

/// Fields stored in a canonical form whatever form a client wrote them in, checked as
/// the real server decodes them: a Lease's `spec.acquireTime` and `spec.renewTime` are
/// MicroTimes (six fractional digits; an offset is stored as UTC). The error is the
/// decoder's.
pub fn canonical(resource: Resource, mut object: Value) -> Result<Value, String> {
    if resource == Resource::Leases {
        for field in ["acquireTime", "renewTime"] {
            match &object["spec"][field] {
                Value::Null => {}
                Value::String(text) => object["spec"][field] = json!(micro_time(text)?),
                other => {
                    return Err(format!(
                        "json: cannot unmarshal {other} into Go struct field LeaseSpec.spec.{field} of type string"
                    ));
                }
            }
        }
    }
    Ok(object)
}

/// The checks of a body that the real server's decoder makes: a JSON object of the
/// resource's apiVersion and kind (either may be omitted), with a metadata object.
fn decode(resource: Resource, object: Value) -> Result<Value, Failure> {
    if !object.is_object() {
        return Err(Failure::undecodable(
            resource,
            &format!("the body is not a JSON object: {object}"),
        ));
    }
    if let Some(given) = object["apiVersion"]
        .as_str()
        .filter(|v| *v != resource.api_version())
    {
        return Err(Failure::bad_request(format!(
            "the API version in the data ({given}) does not match the expected API version ({})",
            resource.api_version()
        )));
    }
    if let Some(given) = object["kind"].as_str().filter(|k| *k != resource.kind()) {
        return Err(Failure::bad_request(format!(
            "the kind in the data ({given}) does not match the expected kind ({})",
            resource.kind()
        )));
    }
    let mut object = canonical(resource, object).map_err(|e| Failure::undecodable(resource, &e))?;
    match &object["metadata"] {
        Value::Null => object["metadata"] = json!({}),
        Value::Object(_) => {}
        other => {
            return Err(Failure::undecodable(
                resource,
                &format!("metadata is not an object: {other}"),
            ));
        }
    }
    Ok(object)
}

/// A namespaced object is in the path's namespace: the body may name the same one or
/// none.
fn in_namespace(object: &mut Value, namespace: Option<&str>) -> Result<(), Failure> {
    let Some(ns) = namespace else { return Ok(()) };
    match object["metadata"]["namespace"].as_str() {
        Some(given) if !given.is_empty() && given != ns => Err(Failure::bad_request(
            "the namespace of the provided object does not match the namespace sent on the request",
        )),
        _ => {
            object["metadata"]["namespace"] = json!(ns);
            Ok(())
        }
    }
}

/// Stores `object` in place of `current` unless it is the same; returns what is stored.
fn store_if_changed(
    store: &mut Store,
    resource: Resource,
    namespace: Option<&str>,
    name: &str,
    current: &Value,
    mut object: Value,
) -> Value {
    object["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"].clone();
    object["kind"] = json!(resource.kind());
    object["apiVersion"] = json!(resource.api_version());
    if object == *current {
        return object;
    }
    store.replace(resource, namespace, name, object)
}

/// The defaults the real server fills in on a write (of those a client of these
/// resources reads): a Service's type, ports' protocol and targetPort, its cluster IP (a
/// new one on create, the old one kept on an update that leaves it empty) and IP family;
/// an EndpointSlice's ports' protocol and name.
fn fill_defaults(store: &Store, resource: Resource, object: &mut Value, current: Option<&Value>) {
    let default = |v: &mut Value, key: &str, value: Value| {
        if v[key].is_null() {
            v[key] = value;
        }
    };
    match resource {
        Resource::Services => {
            if !object["spec"].is_object() {
                object["spec"] = json!({});
            }
            let spec = &mut object["spec"];
            default(spec, "type", json!("ClusterIP"));
            default(spec, "sessionAffinity", json!("None"));
            for port in spec["ports"].as_array_mut().into_iter().flatten() {
                default(port, "protocol", json!("TCP"));
                let number = port["port"].clone();
                default(port, "targetPort", number);
            }
            if spec["type"] != "ExternalName" {
                if spec["clusterIP"].as_str().is_none_or(str::is_empty) {
                    spec["clusterIP"] = match current.map(|c| &c["spec"]["clusterIP"]) {
                        Some(old) if old.as_str().is_some_and(|ip| !ip.is_empty()) => old.clone(),
                        _ => json!(free_cluster_ip(store)),
                    };
                }
                let ip = spec["clusterIP"].clone();
                default(spec, "clusterIPs", json!([ip]));
                default(spec, "ipFamilies", json!(["IPv4"]));
                default(spec, "ipFamilyPolicy", json!("SingleStack"));
                default(spec, "internalTrafficPolicy", json!("Cluster"));
            }
        }
        Resource::EndpointSlices => {
            for port in object["ports"].as_array_mut().into_iter().flatten() {
                default(port, "protocol", json!("TCP"));
                default(port, "name", json!(""));
            }
        }
        Resource::Pods | Resource::Nodes | Resource::Leases => {}
    }
}

/// The lowest address from 10.96.0.10 up that no Service holds (the real allocator picks
/// at random in the service CIDR; a sequence keeps tests reproducible).
fn free_cluster_ip(store: &Store) -> String {
    let taken: Vec<&str> = store
        .objects(Resource::Services)
        .filter_map(|s| s["spec"]["clusterIP"].as_str())
        .collect();
    (10u32..65_536)
        .map(|n| format!("10.96.{}.{}", n >> 8, n & 0xff))
        .find(|ip| !taken.contains(&ip.as_str()))
        .expect("fewer than 65,526 services")
}

/// `prefix` and five characters from the alphabet the real server's name generator
/// uses, derived from `seed` (the store's resourceVersion, new for every write).
fn generated_name(prefix: &str, seed: u64) -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let mut n = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let suffix: String = (0..5)
        .map(|_| {
            let c = ALPHABET[(n % ALPHABET.len() as u64) as usize];
            n /= ALPHABET.len() as u64;
            char::from(c)
        })
        .collect();
    format!("{prefix}{suffix}")
}

/// A storage precondition (a uid or resourceVersion the client required) that the stored
/// object fails: a 409 Conflict whose message carries the storage error's text.
fn precondition_failed(
    resource: Resource,
    namespace: Option<&str>,
    name: &str,
    label: &str,
    wanted: &Value,
    actual: &Value,
) -> Failure {
    let cause = format!(
        "StorageError: invalid object, Code: 4, Key: {}, ResourceVersion: 0, AdditionalErrorMsg: Precondition failed: {label} in precondition: {}, {label} in object meta: {}",
        etcd_key(resource, namespace, name),
        wanted.as_str().unwrap_or(""),
        actual.as_str().unwrap_or("")
    );
    Failure::conflict_because(resource, name, &cause)
}

/// The etcd key a real server's messages name an object by.
fn etcd_key(resource: Resource, namespace: Option<&str>, name: &str) -> String {
    let plural = match resource {
        Resource::Services => "services/specs",
        Resource::Nodes => "minions",
        r => r.plural(),
    };
    match namespace {
        Some(ns) => format!("/registry/{plural}/{ns}/{name}"),
        None => format!("/registry/{plural}/{name}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(name: &str, holder: &str, renew: &str) -> Value {
        json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": name},
               "spec": {"holderIdentity": holder, "leaseDurationSeconds": 15, "renewTime": renew}})
    }

    /// A failure's code, reason and message.
    fn failed<T: std::fmt::Debug>(r: Result<T, Failure>) -> (u16, String, String) {
        let f = r.expect_err("a failure").to_json();
        (
            f["code"].as_u64().unwrap() as u16,
            f["reason"].as_str().unwrap().to_owned(),
            f["message"].as_str().unwrap().to_owned(),
        )
    }

    fn check<T: std::fmt::Debug>(r: Result<T, Failure>, code: u16, reason: &str, message: &str) {
        assert_eq!(failed(r), (code, reason.to_owned(), message.to_owned()));
    }

    const T1: &str = "2026-11-30T23:59:59.123456Z";
    const T2: &str = "2026-12-01T00:00:04.000001Z";

    #[test]
    fn leases_are_created_once_and_replaced_at_their_resource_version() {
        let mut s = Store::new(0);
        let created = create(
            &mut s,
            Resource::Leases,
            Some("aether"),
            lease("registrar", "n1", T1),
        )
        .unwrap();
        assert_eq!(created["metadata"]["namespace"], "aether");
        assert_eq!(
            created["spec"]["renewTime"], T1,
            "a MicroTime is stored as given"
        );
        let rv = created["metadata"]["resourceVersion"]
            .as_str()
            .unwrap()
            .to_owned();
        check(
            create(
                &mut s,
                Resource::Leases,
                Some("aether"),
                lease("registrar", "n2", T1),
            ),
            409,
            "AlreadyExists",
            r#"leases.coordination.k8s.io "registrar" already exists"#,
        );

        let mut stale = lease("registrar", "n2", T2);
        stale["metadata"]["resourceVersion"] = json!("1");
        check(
            update(&mut s, Resource::Leases, Some("aether"), "registrar", stale),
            409,
            "Conflict",
            r#"Operation cannot be fulfilled on leases.coordination.k8s.io "registrar": the object has been modified; please apply your changes to the latest version and try again"#,
        );
        let mut fresh = created.clone();
        fresh["spec"]["renewTime"] = json!(T2);
        let renewed = update(
            &mut s,
            Resource::Leases,
            Some("aether"),
            "registrar",
            fresh.clone(),
        )
        .unwrap();
        assert_eq!(renewed["spec"]["renewTime"], T2);
        assert_eq!(renewed["metadata"]["uid"], created["metadata"]["uid"]);
        let new_rv = renewed["metadata"]["resourceVersion"]
            .as_str()
            .unwrap()
            .to_owned();
        assert_eq!(new_rv, (rv.parse::<u64>().unwrap() + 1).to_string());
        // The same object again: nothing to write, the resourceVersion stays.
        let mut same = renewed.clone();
        same["metadata"]["resourceVersion"] = json!(new_rv);
        assert_eq!(
            update(&mut s, Resource::Leases, Some("aether"), "registrar", same).unwrap(),
            renewed
        );
        assert_eq!(s.resource_version().to_string(), new_rv);
        // Without a resourceVersion an update is unconditional.
        let mut unconditional = lease("registrar", "n3", T2);
        unconditional["metadata"]["namespace"] = json!("aether");
        assert_eq!(
            update(
                &mut s,
                Resource::Leases,
                Some("aether"),
                "registrar",
                unconditional
            )
            .unwrap()["spec"]["holderIdentity"],
            "n3"
        );

        check(
            update(
                &mut s,
                Resource::Leases,
                Some("aether"),
                "other",
                lease("other", "n1", T1),
            ),
            404,
            "NotFound",
            r#"leases.coordination.k8s.io "other" not found"#,
        );
        check(
            update(
                &mut s,
                Resource::Leases,
                Some("aether"),
                "other",
                lease("registrar", "n1", T1),
            ),
            400,
            "BadRequest",
            "the name of the object (registrar) does not match the name on the URL (other)",
        );
        let mut elsewhere = lease("registrar", "n1", T1);
        elsewhere["metadata"]["namespace"] = json!("kube-system");
        check(
            update(
                &mut s,
                Resource::Leases,
                Some("aether"),
                "registrar",
                elsewhere,
            ),
            400,
            "BadRequest",
            "the namespace of the provided object does not match the namespace sent on the request",
        );
    }

    #[test]
    fn bad_bodies_are_refused_as_the_real_server_refuses_them() {
        let mut s = Store::new(0);
        check(
            create(
                &mut s,
                Resource::Leases,
                Some("ns"),
                lease("a", "n1", "2026-11-30T23:59:59Z"),
            ),
            400,
            "BadRequest",
            r#"Lease in version "v1" cannot be handled as a Lease: parsing time "2026-11-30T23:59:59Z" as "2006-01-02T15:04:05.000000Z07:00": cannot parse "Z" as ".000000""#,
        );
        let offset = create(
            &mut s,
            Resource::Leases,
            Some("ns"),
            lease("a", "n1", "2026-12-01T00:59:59.123456+01:00"),
        )
        .unwrap();
        assert_eq!(
            offset["spec"]["renewTime"], T1,
            "stored in UTC, as the real server re-encodes it"
        );
        check(
            create(&mut s, Resource::Leases, Some("ns"), json!({"spec": {}})),
            422,
            "Invalid",
            r#"Lease.coordination.k8s.io "" is invalid: metadata.name: Required value: name or generateName is required"#,
        );
        check(
            create(
                &mut s,
                Resource::Services,
                Some("ns"),
                json!({"kind": "Pod", "metadata": {"name": "a"}}),
            ),
            400,
            "BadRequest",
            "the kind in the data (Pod) does not match the expected kind (Service)",
        );
        check(
            create(
                &mut s,
                Resource::EndpointSlices,
                Some("ns"),
                json!({"apiVersion": "discovery.k8s.io/v1beta1", "metadata": {"name": "a"}}),
            ),
            400,
            "BadRequest",
            "the API version in the data (discovery.k8s.io/v1beta1) does not match the expected API version (discovery.k8s.io/v1)",
        );
        check(
            create(
                &mut s,
                Resource::Services,
                Some("ns"),
                json!({"metadata": {"name": "a", "resourceVersion": "3"}}),
            ),
            500,
            "InternalError",
            "resourceVersion should not be set on objects to be created",
        );
        let generated = create(
            &mut s,
            Resource::EndpointSlices,
            Some("ns"),
            json!({"metadata": {"generateName": "web-"}, "addressType": "IPv4"}),
        )
        .unwrap();
        let name = generated["metadata"]["name"].as_str().unwrap();
        assert!(name.len() == 9 && name.starts_with("web-"), "{name}");
    }

    #[test]
    fn services_get_the_real_server_s_defaults() {
        let mut s = Store::new(0);
        let web = json!({"metadata": {"name": "web"}, "spec": {"selector": {"app": "web"}, "ports": [{"port": 80}, {"port": 53, "protocol": "UDP", "targetPort": 5353}]}});
        let created = create(&mut s, Resource::Services, Some("ns"), web.clone()).unwrap();
        assert_eq!(created["spec"]["clusterIP"], "10.96.0.10");
        assert_eq!(created["spec"]["clusterIPs"], json!(["10.96.0.10"]));
        assert_eq!(created["spec"]["type"], "ClusterIP");
        assert_eq!(
            created["spec"]["ports"],
            json!([{"port": 80, "protocol": "TCP", "targetPort": 80}, {"port": 53, "protocol": "UDP", "targetPort": 5353}])
        );
        let mut db = web.clone();
        db["metadata"]["name"] = json!("db");
        assert_eq!(
            create(&mut s, Resource::Services, Some("ns"), db).unwrap()["spec"]["clusterIP"],
            "10.96.0.11"
        );
        let mut headless = web.clone();
        headless["metadata"]["name"] = json!("headless");
        headless["spec"]["clusterIP"] = json!("None");
        assert_eq!(
            create(&mut s, Resource::Services, Some("ns"), headless).unwrap()["spec"]["clusterIPs"],
            json!(["None"])
        );
        // An update that leaves the cluster IP out keeps it.
        let updated = update(&mut s, Resource::Services, Some("ns"), "web", web).unwrap();
        assert_eq!(updated["spec"]["clusterIP"], "10.96.0.10");
        assert_eq!(updated, created, "nothing changed");

        let slice = json!({"metadata": {"name": "web-1", "labels": {"kubernetes.io/service-name": "web"}}, "addressType": "IPv4",
                           "endpoints": [{"addresses": ["10.0.0.5"]}], "ports": [{"port": 8080}]});
        let slice = create(&mut s, Resource::EndpointSlices, Some("ns"), slice).unwrap();
        assert_eq!(
            slice["ports"],
            json!([{"port": 8080, "protocol": "TCP", "name": ""}])
        );
        assert_eq!(slice["apiVersion"], "discovery.k8s.io/v1");
    }

    #[test]
    fn deletes_answer_as_the_storage_does_and_check_preconditions() {
        let mut s = Store::new(0);
        let web = create(
            &mut s,
            Resource::Services,
            Some("ns"),
            json!({"metadata": {"name": "web"}}),
        )
        .unwrap();
        let slice = create(
            &mut s,
            Resource::EndpointSlices,
            Some("ns"),
            json!({"metadata": {"name": "web-1"}}),
        )
        .unwrap();
        check(
            delete(
                &mut s,
                Resource::EndpointSlices,
                Some("ns"),
                "web-1",
                &json!({"preconditions": {"uid": "nope"}}),
            ),
            409,
            "Conflict",
            "Operation cannot be fulfilled on endpointslices.discovery.k8s.io \"web-1\": StorageError: invalid object, Code: 4, \
               Key: /registry/endpointslices/ns/web-1, ResourceVersion: 0, AdditionalErrorMsg: Precondition failed: UID in precondition: nope, \
               UID in object meta: 00000000-0000-4000-8000-000000000002",
        );
        let precondition =
            json!({"preconditions": {"resourceVersion": slice["metadata"]["resourceVersion"]}});
        let status = delete(
            &mut s,
            Resource::EndpointSlices,
            Some("ns"),
            "web-1",
            &precondition,
        )
        .unwrap();
        assert_eq!(
            status,
            json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                                  "details": {"name": "web-1", "group": "discovery.k8s.io", "kind": "endpointslices", "uid": slice["metadata"]["uid"]}})
        );
        let deleted = delete(&mut s, Resource::Services, Some("ns"), "web", &Value::Null).unwrap();
        assert_eq!(deleted["metadata"]["uid"], web["metadata"]["uid"]);
        check(
            delete(&mut s, Resource::Services, Some("ns"), "web", &Value::Null),
            404,
            "NotFound",
            r#"services "web" not found"#,
        );
    }

    #[test]
    fn a_json_patch_adds_a_taint_guarded_by_the_resource_version() {
        let mut s = Store::new(0);
        let bare = s.put(
            Resource::Nodes,
            json!({"metadata": {"name": "n1"}, "spec": {"podCIDR": "10.0.0.0/24"}}),
        );
        let guarded = |rv: &Value, path: &str, value: Value| json!([{"op": "test", "path": "/metadata/resourceVersion", "value": rv}, {"op": "add", "path": path, "value": value}]);
        let taint = json!({"key": "aether/not-ready", "effect": "NoSchedule"});
        let first = guarded(
            &bare["metadata"]["resourceVersion"],
            "/spec/taints",
            json!([taint]),
        );
        let tainted = patch(&mut s, Resource::Nodes, None, "n1", PatchType::Json, &first).unwrap();
        assert_eq!(tainted["spec"]["taints"], json!([taint]));
        check(
            patch(&mut s, Resource::Nodes, None, "n1", PatchType::Json, &first),
            422,
            "Invalid",
            "the server rejected our request due to an error in our request",
        );
        let other = json!({"key": "other", "effect": "NoExecute"});
        let second = guarded(
            &tainted["metadata"]["resourceVersion"],
            "/spec/taints/-",
            other.clone(),
        );
        let twice = patch(
            &mut s,
            Resource::Nodes,
            None,
            "n1",
            PatchType::Json,
            &second,
        )
        .unwrap();
        assert_eq!(twice["spec"]["taints"], json!([taint, other]));
        assert_eq!(s.get(Resource::Nodes, None, "n1"), Some(&twice));
    }

    #[test]
    fn patch_types_come_from_the_content_type() {
        assert_eq!(
            PatchType::from_content_type("application/json-patch+json; charset=utf-8").unwrap(),
            PatchType::Json
        );
        assert_eq!(
            PatchType::from_content_type("Application/Merge-Patch+JSON").unwrap(),
            PatchType::Merge
        );
        assert_eq!(
            failed(PatchType::from_content_type(
                "application/strategic-merge-patch+json"
            ))
            .0,
            415
        );
    }
}
