//! The test Kubernetes API server (`aether_e2e::kube_api`) against real clients: kube-rs
//! (the client the worker and the mesh registrar use) and kubectl, so that it behaves as
//! an API server and not as what one client happens to accept.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use aether_e2e::kube_api::{KubeApi, Rule};
use futures::{Stream, StreamExt};
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{Node, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{
    Api, ListParams, Patch, PatchParams, PostParams, VersionMatch, WatchEvent, WatchParams,
};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event, watcher};
use kube::{Client, Config};
use serde_json::{Value, json};

const AGENT: &str = "system:serviceaccount:aether:agent";
const READ_PODS: Rule = Rule {
    resource: "pods",
    verbs: &["get", "list", "watch"],
};
const READ_NODES: Rule = Rule {
    resource: "nodes",
    verbs: &["get", "list", "watch"],
};
const PATCH_NODES: Rule = Rule {
    resource: "nodes",
    verbs: &["get", "watch", "patch"],
};
const REGISTRAR: &str = "system:serviceaccount:aether:registrar";
const READ_DISCOVERY: [Rule; 2] = [
    Rule {
        resource: "services",
        verbs: &["get", "list", "watch"],
    },
    Rule {
        resource: "endpointslices",
        verbs: &["get", "list", "watch"],
    },
];
/// MicroTimes as a Lease carries them.
const T1: &str = "2026-11-30T23:59:59.123456Z";
const T2: &str = "2026-12-01T00:00:04.500000Z";
const T3: &str = "2026-12-01T00:00:09.000001Z";
/// How long any one awaited event may take before the test fails instead of hanging.
const PATIENCE: Duration = Duration::from_secs(20);

async fn client(kubeconfig: &Path) -> Client {
    let kc = Kubeconfig::read_from(kubeconfig).expect("reading the kubeconfig");
    let config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .expect("a client config from the kubeconfig");
    Client::try_from(config).expect("a client")
}

fn pod(name: &str, node: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
           "spec": {"nodeName": node, "containers": [{"name": "app", "image": "app:1"}]}})
}

fn taint(key: &str) -> Value {
    json!({"key": key, "effect": "NoSchedule"})
}

fn node(name: &str, taints: &[&str]) -> Value {
    let taints: Vec<Value> = taints.iter().map(|k| taint(k)).collect();
    json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}, "spec": {"taints": taints}})
}

fn service(namespace: &str, name: &str, app: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": namespace, "labels": {"app": app}},
           "spec": {"selector": {"app": app}, "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}]}})
}

fn endpoint_slice(namespace: &str, name: &str, service: &str, ip: &str) -> Value {
    json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
           "metadata": {"name": name, "namespace": namespace, "labels": {"kubernetes.io/service-name": service}},
           "addressType": "IPv4", "endpoints": [{"addresses": [ip], "conditions": {"ready": true}}],
           "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}]})
}

fn micro(text: &str) -> MicroTime {
    MicroTime(text.parse().expect("an RFC 3339 timestamp"))
}

fn lease(name: &str, holder: &str, renewed: &str) -> Lease {
    Lease {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(holder.into()),
            lease_duration_seconds: Some(15),
            acquire_time: Some(micro(T1)),
            renew_time: Some(micro(renewed)),
            ..Default::default()
        }),
    }
}

fn holder(lease: &Value) -> &str {
    lease["spec"]["holderIdentity"].as_str().unwrap_or("")
}

/// The Status of a failed kube-rs call, or a panic naming what came back instead.
fn status<T: std::fmt::Debug>(result: kube::Result<T>) -> kube::core::Status {
    match result {
        Err(kube::Error::Api(status)) => *status,
        other => panic!("expected an error Status from the server, got {other:?}"),
    }
}

fn taint_keys(node: &Value) -> Vec<String> {
    node["spec"]["taints"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|t| t["key"].as_str().unwrap().to_owned())
        .collect()
}

/// A watcher event in a word or three: "apply a", "apply a deleting", "delete a", "init",
/// "init-apply a", "init-done", or "error 410" (an ERROR event's code) / "error" (any other).
fn summary<K: kube::Resource>(event: &Result<Event<K>, watcher::Error>) -> String {
    let name = |p: &K| p.meta().name.clone().unwrap_or_default();
    match event {
        Ok(Event::Apply(p)) if p.meta().deletion_timestamp.is_some() => {
            format!("apply {} deleting", name(p))
        }
        Ok(Event::Apply(p)) => format!("apply {}", name(p)),
        Ok(Event::Delete(p)) => format!("delete {}", name(p)),
        Ok(Event::Init) => "init".into(),
        Ok(Event::InitApply(p)) => format!("init-apply {}", name(p)),
        Ok(Event::InitDone) => "init-done".into(),
        Err(watcher::Error::WatchError(status)) => format!("error {}", status.code),
        Err(_) => "error".into(),
    }
}

/// The watcher's events until (and with) the first one for which `last` holds.
async fn events_until<K: kube::Resource>(
    stream: &mut (impl Stream<Item = Result<Event<K>, watcher::Error>> + Unpin),
    last: impl Fn(&str) -> bool,
) -> Vec<String> {
    let mut out = Vec::new();
    loop {
        let event = tokio::time::timeout(PATIENCE, stream.next())
            .await
            .unwrap_or_else(|_| panic!("no watcher event within {PATIENCE:?}; so far {out:?}"));
        let s = summary(&event.expect("the watcher stream does not end"));
        let done = last(&s);
        out.push(s);
        if done {
            return out;
        }
    }
}

/// kube-rs's watcher, scoped to a node by a field selector, as the agent runs it: the
/// initial pods, then ADDED, the deletion mark (MODIFIED) and DELETED in order, a pod
/// moving off the node as DELETED; across an outage during which the history expired, a
/// 410 on the resumed watch and a relist that ends with the right view.
#[tokio::test]
async fn kube_rs_watcher_follows_a_node_s_pods_and_relists_after_410() {
    let api = KubeApi::start();
    api.grant(AGENT, &[READ_PODS]);
    for (name, on) in [("a", "n1"), ("b", "n1"), ("c", "n2")] {
        api.put_pod(pod(name, on));
    }
    let pods: Api<Pod> = Api::all(client(&api.kubeconfig(AGENT)).await);
    let mut stream = watcher(
        pods.clone(),
        watcher::Config::default().fields("spec.nodeName=n1"),
    )
    .default_backoff()
    .boxed();

    let initial = events_until(&mut stream, |e| e == "init-done").await;
    assert_eq!(
        initial,
        ["init", "init-apply a", "init-apply b", "init-done"]
    );

    api.put_pod(pod("d", "n1"));
    api.put_pod(pod("e", "n2"));
    api.mark_pod_deleting("default", "a");
    api.delete_pod("default", "a");
    api.put_pod(pod("b", "n2"));
    let changes = events_until(&mut stream, |e| e == "delete b").await;
    assert_eq!(
        changes,
        ["apply d", "apply a deleting", "delete a", "delete b"]
    );
    assert_eq!(api.watchers("pods"), 1);
    let watches: Vec<String> = api
        .requests(AGENT)
        .into_iter()
        .filter(|r| r.contains("watch=true"))
        .collect();
    assert_eq!(watches.len(), 1, "{watches:?}");
    for param in [
        "fieldSelector=spec.nodeName%3Dn1",
        "allowWatchBookmarks=true",
        "timeoutSeconds=",
    ] {
        assert!(watches[0].contains(param), "{param} in {}", watches[0]);
    }

    // An outage in which pods change and the history is compacted away: the watcher's
    // resumed watch gets 410 and it lists again by itself.
    api.set_down(true);
    assert_eq!(api.watchers("pods"), 0);
    let address = api.url().trim_start_matches("https://").to_owned();
    let refused = std::net::TcpStream::connect(&address).unwrap_err();
    assert_eq!(refused.kind(), std::io::ErrorKind::ConnectionRefused);
    api.put_pod(pod("f", "n1"));
    api.delete_pod("default", "d");
    api.expire_history();
    api.set_down(false);
    let relist = events_until(&mut stream, |e| e == "init-done").await;
    let without_errors: Vec<&String> = relist.iter().filter(|e| !e.starts_with("error")).collect();
    assert_eq!(
        without_errors,
        ["init", "init-apply f", "init-done"],
        "{relist:?}"
    );
    assert!(relist.contains(&"error 410".to_owned()), "{relist:?}");
    let lists = api
        .requests(AGENT)
        .into_iter()
        .filter(|r| r.starts_with("GET /api/v1/pods?") && !r.contains("watch=true"))
        .count();
    assert_eq!(lists, 2);

    // The watcher goes on watching from the relist.
    api.put_pod(pod("g", "n1"));
    assert_eq!(
        events_until(&mut stream, |e| e.starts_with("apply")).await,
        ["apply g"]
    );
}

/// A watch that asked for bookmarks gets one (about every second) at the current
/// resourceVersion; a watch from an expired resourceVersion gets an ERROR event with a
/// 410 Status; a list from one gets 410.
#[tokio::test]
async fn watches_get_bookmarks_and_expired_resource_versions_get_410() {
    let api = KubeApi::start();
    api.grant(AGENT, &[READ_PODS]);
    api.put_pod(pod("a", "n1"));
    let pods: Api<Pod> = Api::all(client(&api.kubeconfig(AGENT)).await);
    let rv = pods
        .list(&Default::default())
        .await
        .unwrap()
        .metadata
        .resource_version
        .unwrap();
    assert_eq!(rv, api.resource_version().to_string());

    let params = WatchParams::default()
        .fields("spec.nodeName=n1")
        .timeout(10);
    assert!(params.bookmarks, "kube-rs asks for bookmarks by default");
    let mut watch = pods.watch(&params, &rv).await.unwrap().boxed();
    api.put_pod(pod("b", "n1"));
    let mut seen = Vec::new();
    let bookmark = loop {
        match tokio::time::timeout(PATIENCE, watch.next())
            .await
            .expect("an event or a bookmark")
            .expect("an open stream")
            .unwrap()
        {
            WatchEvent::Bookmark(b) => break b,
            WatchEvent::Added(p) => seen.push(p.metadata.name.unwrap()),
            other => panic!("unexpected {other:?}"),
        }
    };
    assert_eq!(seen, ["b"]);
    assert_eq!(
        bookmark.metadata.resource_version,
        api.resource_version().to_string()
    );
    drop(watch);

    api.expire_history();
    let mut stale = pods
        .watch(&WatchParams::default(), &rv)
        .await
        .expect("a watch from an expired resourceVersion still opens")
        .boxed();
    match stale.next().await.expect("one event").unwrap() {
        WatchEvent::Error(status) => {
            assert_eq!((status.code, status.reason.as_str()), (410, "Expired"));
            assert_eq!(
                status.message,
                format!(
                    "too old resource version: {rv} ({})",
                    api.resource_version()
                )
            );
        }
        other => panic!("expected an ERROR event, got {other:?}"),
    }
    assert!(
        stale.next().await.is_none(),
        "the stream ends after the ERROR event"
    );
    let exact = ListParams::default().at(&rv).matching(VersionMatch::Exact);
    match pods.list(&exact).await {
        Err(kube::Error::Api(status)) => {
            assert_eq!((status.code, status.reason.as_str()), (410, "Expired"))
        }
        other => panic!("expected 410, got {other:?}"),
    }
    let not_older = ListParams::default()
        .at(&rv)
        .matching(VersionMatch::NotOlderThan);
    assert_eq!(
        pods.list(&not_older).await.unwrap().items.len(),
        2,
        "NotOlderThan is served from now"
    );

    // A streaming list (sendInitialEvents): the objects, then a bookmark that ends them.
    let config = watcher::Config::default()
        .fields("spec.nodeName=n1")
        .streaming_lists();
    let mut streaming = watcher(pods, config).boxed();
    assert_eq!(
        events_until(&mut streaming, |e| e == "init-done").await,
        ["init", "init-apply a", "init-apply b", "init-done"]
    );
    assert!(
        api.requests(AGENT)
            .last()
            .unwrap()
            .contains("sendInitialEvents=true")
    );
}

fn remove_taint(index: usize, taint: &Value) -> Patch<()> {
    let path = format!("/spec/taints/{index}");
    Patch::Json(
        serde_json::from_value(
            json!([{"op": "test", "path": path, "value": taint}, {"op": "remove", "path": path}]),
        )
        .unwrap(),
    )
}

fn index_of(node: &Node, key: &str) -> usize {
    node.spec
        .as_ref()
        .unwrap()
        .taints
        .as_ref()
        .unwrap()
        .iter()
        .position(|t| t.key == key)
        .unwrap()
}

/// The startup taint's removal as the agent does it: a JSON patch that tests the taint at
/// its index, then removes it. A concurrent change to the taints makes the test fail with
/// 422 and changes nothing; the caller reads again and succeeds.
#[tokio::test]
async fn json_patch_test_op_on_a_taint_fails_with_422_after_a_concurrent_change() {
    let api = KubeApi::start();
    api.grant(AGENT, &[PATCH_NODES]);
    api.put_node(node("n1", &["other", "aether/not-ready"]));
    let nodes: Api<Node> = Api::all(client(&api.kubeconfig(AGENT)).await);
    let pp = PatchParams::default();

    let read = nodes.get("n1").await.unwrap();
    let patched = nodes
        .patch(
            "n1",
            &pp,
            &remove_taint(index_of(&read, "other"), &taint("other")),
        )
        .await
        .unwrap();
    assert_eq!(taint_keys(&api.node("n1").unwrap()), ["aether/not-ready"]);
    assert_eq!(
        patched.metadata.resource_version.unwrap(),
        api.resource_version().to_string()
    );

    // Someone adds a taint in front between the agent's read and its patch.
    let read = nodes.get("n1").await.unwrap();
    api.put_node(node("n1", &["added", "aether/not-ready"]));
    let before = api.node("n1").unwrap();
    match nodes
        .patch(
            "n1",
            &pp,
            &remove_taint(
                index_of(&read, "aether/not-ready"),
                &taint("aether/not-ready"),
            ),
        )
        .await
    {
        Err(kube::Error::Api(status)) => {
            assert_eq!(
                (status.code, status.reason.as_str()),
                (422, "Invalid"),
                "{status:?}"
            );
            let causes = status.details.unwrap().causes;
            assert_eq!(
                causes[0].message,
                "testing value /spec/taints/0 failed: test failed"
            );
        }
        other => panic!("expected 422, got {other:?}"),
    }
    assert_eq!(
        api.node("n1").unwrap(),
        before,
        "a failed patch changes nothing"
    );

    let read = nodes.get("n1").await.unwrap();
    nodes
        .patch(
            "n1",
            &pp,
            &remove_taint(
                index_of(&read, "aether/not-ready"),
                &taint("aether/not-ready"),
            ),
        )
        .await
        .unwrap();
    assert_eq!(taint_keys(&api.node("n1").unwrap()), ["added"]);
    assert_eq!(api.patches(AGENT), 3);

    // A merge patch works too; one with a stale resourceVersion is a 409 Conflict; a
    // strategic merge patch is not implemented (415).
    let merge = Patch::Merge(json!({"metadata": {"labels": {"aether/ready": "true"}}}));
    let labelled = nodes.patch("n1", &pp, &merge).await.unwrap();
    assert_eq!(labelled.metadata.labels.unwrap()["aether/ready"], "true");
    let stale = Patch::Merge(json!({"metadata": {"resourceVersion": "2", "labels": {"x": "y"}}}));
    let expect_code = |r: kube::Result<Node>, code: u16| match r {
        Err(kube::Error::Api(status)) => assert_eq!(status.code, code, "{status:?}"),
        other => panic!("expected {code}, got {other:?}"),
    };
    expect_code(nodes.patch("n1", &pp, &stale).await, 409);
    expect_code(
        nodes
            .patch(
                "n1",
                &pp,
                &Patch::Strategic(json!({"spec": {"taints": []}})),
            )
            .await,
        415,
    );
    assert_eq!(api.patches(AGENT), 6);
}

/// RBAC: a verb not granted is a 403 with a Status body worded as the real server's; an
/// unknown token is a 401.
#[tokio::test]
async fn ungranted_verbs_get_403_and_unknown_tokens_get_401() {
    let api = KubeApi::start();
    api.grant("reader", &[READ_NODES]);
    api.put_node(node("n1", &["t"]));
    let reader = client(&api.kubeconfig("reader")).await;
    let nodes: Api<Node> = Api::all(reader.clone());
    assert_eq!(
        nodes.get("n1").await.unwrap().metadata.name.as_deref(),
        Some("n1")
    );

    let forbidden = |r: kube::Error| match r {
        kube::Error::Api(status) => {
            assert_eq!((status.code, status.reason.as_str()), (403, "Forbidden"));
            status.message
        }
        other => panic!("expected 403, got {other:?}"),
    };
    let patch = Patch::Merge(json!({"metadata": {"labels": {"x": "y"}}}));
    assert_eq!(
        forbidden(
            nodes
                .patch("n1", &PatchParams::default(), &patch)
                .await
                .unwrap_err()
        ),
        r#"nodes "n1" is forbidden: User "reader" cannot patch resource "nodes" in API group "" at the cluster scope"#
    );
    assert_eq!(api.patches("reader"), 1, "a refused patch is counted too");
    assert!(api.node("n1").unwrap()["metadata"]["labels"].is_null());
    let pods: Api<Pod> = Api::namespaced(reader, "kube-system");
    assert_eq!(
        forbidden(pods.list(&Default::default()).await.unwrap_err()),
        r#"pods is forbidden: User "reader" cannot list resource "pods" in API group "" in the namespace "kube-system""#
    );

    let kubeconfig = api.kubeconfig("reader");
    let text = std::fs::read_to_string(&kubeconfig)
        .unwrap()
        .replace(&api.token("reader"), "not-a-known-token");
    let bogus = kubeconfig.with_file_name("kubeconfig-bogus");
    std::fs::write(&bogus, text).unwrap();
    let strangers: Api<Node> = Api::all(client(&bogus).await);
    match strangers.get("n1").await {
        Err(kube::Error::Api(status)) => {
            assert_eq!((status.code, status.reason.as_str()), (401, "Unauthorized"))
        }
        other => panic!("expected 401, got {other:?}"),
    }
    assert_eq!(
        api.requests("reader").len(),
        3,
        "the stranger's request is nobody's: {:?}",
        api.requests("reader")
    );
}

/// TokenReview: the reviewer learns who holds a token and the node it is bound to.
#[tokio::test]
async fn token_review_names_the_user_and_its_node() {
    let api = KubeApi::start();
    api.grant(
        "registrar",
        &[Rule {
            resource: "tokenreviews",
            verbs: &["create"],
        }],
    );
    api.bind_token_to_node(AGENT, "n1");
    let reviews: Api<TokenReview> = Api::all(client(&api.kubeconfig("registrar")).await);
    let review = |token: String| TokenReview {
        spec: TokenReviewSpec {
            token,
            ..Default::default()
        },
        ..Default::default()
    };

    let answer = reviews
        .create(&PostParams::default(), &review(api.token(AGENT)))
        .await
        .unwrap()
        .status
        .unwrap();
    assert_eq!(answer.authenticated, Some(true));
    let user = answer.user.unwrap();
    assert_eq!(user.username.as_deref(), Some(AGENT));
    assert_eq!(
        user.extra.unwrap()["authentication.kubernetes.io/node-name"],
        ["n1"]
    );
    assert!(
        user.groups
            .unwrap()
            .contains(&"system:serviceaccounts:aether".to_owned())
    );

    let answer = reviews
        .create(&PostParams::default(), &review("guess".into()))
        .await
        .unwrap()
        .status
        .unwrap();
    assert_ne!(answer.authenticated, Some(true));

    let agents: Api<TokenReview> = Api::all(client(&api.kubeconfig(AGENT)).await);
    match agents
        .create(&PostParams::default(), &review("guess".into()))
        .await
    {
        Err(kube::Error::Api(status)) => assert_eq!(status.code, 403),
        other => panic!("expected 403, got {other:?}"),
    }
}

fn names<K: kube::Resource>(items: &[K]) -> Vec<String> {
    items
        .iter()
        .map(|o| o.meta().name.clone().unwrap_or_default())
        .collect()
}

/// The registrar's discovery as kube-rs runs it: EndpointSlices of one service selected
/// by the `kubernetes.io/service-name` label (a slice relabelled to another service
/// leaves the view as a deletion), across an outage in which the history expired (a 410,
/// then a relist); Services by label, a watch resumed from a list's resourceVersion, and
/// 410 Gone for that resourceVersion once the history has expired.
#[tokio::test]
async fn kube_rs_watches_services_and_endpoint_slices_by_label_and_relists_after_410() {
    let api = KubeApi::start();
    api.grant(REGISTRAR, &READ_DISCOVERY);
    api.put_service(service("shop", "web", "web"));
    api.put_service(service("shop", "db", "db"));
    api.put_endpoint_slice(endpoint_slice("shop", "web-1", "web", "10.0.0.1"));
    api.put_endpoint_slice(endpoint_slice("shop", "db-1", "db", "10.0.0.2"));
    let client = client(&api.kubeconfig(REGISTRAR)).await;

    let slices: Api<EndpointSlice> = Api::all(client.clone());
    let web = ListParams::default().labels("kubernetes.io/service-name=web");
    let listed = slices.list(&web).await.unwrap();
    assert_eq!(names(&listed.items), ["web-1"]);
    assert_eq!(
        listed.items[0].endpoints.as_ref().expect("endpoints")[0].addresses,
        ["10.0.0.1"]
    );
    let mut stream = watcher(
        slices,
        watcher::Config::default().labels("kubernetes.io/service-name=web"),
    )
    .default_backoff()
    .boxed();
    assert_eq!(
        events_until(&mut stream, |e| e == "init-done").await,
        ["init", "init-apply web-1", "init-done"]
    );
    api.put_endpoint_slice(endpoint_slice("shop", "web-2", "web", "10.0.0.3"));
    api.put_endpoint_slice(endpoint_slice("shop", "db-2", "db", "10.0.0.4"));
    api.put_endpoint_slice(endpoint_slice("shop", "web-1", "db", "10.0.0.1"));
    api.delete_endpoint_slice("shop", "web-2");
    assert_eq!(
        events_until(&mut stream, |e| e == "delete web-2").await,
        ["apply web-2", "delete web-1", "delete web-2"]
    );
    assert_eq!(api.watchers("endpointslices"), 1);
    let watches: Vec<String> = api
        .requests(REGISTRAR)
        .into_iter()
        .filter(|r| r.contains("watch=true"))
        .collect();
    assert_eq!(watches.len(), 1, "{watches:?}");
    assert!(
        watches[0].starts_with("GET /apis/discovery.k8s.io/v1/endpointslices?"),
        "{}",
        watches[0]
    );

    api.set_down(true);
    assert_eq!(api.watchers("endpointslices"), 0);
    api.put_endpoint_slice(endpoint_slice("shop", "web-3", "web", "10.0.0.5"));
    api.expire_history();
    api.set_down(false);
    let relist = events_until(&mut stream, |e| e == "init-done").await;
    let without_errors: Vec<&String> = relist.iter().filter(|e| !e.starts_with("error")).collect();
    assert_eq!(
        without_errors,
        ["init", "init-apply web-3", "init-done"],
        "{relist:?}"
    );
    assert!(relist.contains(&"error 410".to_owned()), "{relist:?}");
    drop(stream);

    let services: Api<Service> = Api::namespaced(client, "shop");
    let list = services
        .list(&ListParams::default().labels("app=web"))
        .await
        .unwrap();
    assert_eq!(names(&list.items), ["web"]);
    let rv = list.metadata.resource_version.unwrap();
    api.put_service(service("shop", "web-canary", "web"));
    api.put_service(service("shop", "cache", "cache"));
    api.delete_service("shop", "web");
    assert!(api.service("shop", "web").is_none());
    let mut resumed = services
        .watch(&WatchParams::default().labels("app=web").timeout(10), &rv)
        .await
        .unwrap()
        .boxed();
    let mut seen = Vec::new();
    while seen.len() < 2 {
        let event = tokio::time::timeout(PATIENCE, resumed.next())
            .await
            .expect("an event")
            .expect("an open stream")
            .unwrap();
        match event {
            WatchEvent::Added(s) => seen.push(format!("added {}", s.metadata.name.unwrap())),
            WatchEvent::Deleted(s) => seen.push(format!("deleted {}", s.metadata.name.unwrap())),
            WatchEvent::Bookmark(_) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(seen, ["added web-canary", "deleted web"]);
    drop(resumed);

    api.expire_history();
    let mut stale = services
        .watch(&WatchParams::default().labels("app=web"), &rv)
        .await
        .expect("a watch from an expired resourceVersion still opens")
        .boxed();
    match stale.next().await.expect("one event").unwrap() {
        WatchEvent::Error(status) => {
            assert_eq!((status.code, status.reason.as_str()), (410, "Expired"))
        }
        other => panic!("expected an ERROR event, got {other:?}"),
    }
    let exact = ListParams::default()
        .labels("app=web")
        .at(&rv)
        .matching(VersionMatch::Exact);
    let gone = status(services.list(&exact).await);
    assert_eq!((gone.code, gone.reason.as_str()), (410, "Expired"));
}

/// The registrar's lease as kube-rs writes it: a create; a second create refused with
/// 409 AlreadyExists; a replace from a read that another holder's write has made stale
/// refused with 409 Conflict, worded as the real server words it; a replace from a fresh
/// read accepted with a new resourceVersion. MicroTimes are kept to the microsecond. A
/// watch on the lease sees the two accepted writes and nothing of the refused ones.
#[tokio::test]
async fn kube_rs_creates_a_lease_once_and_replaces_it_at_its_resource_version() {
    let api = KubeApi::start();
    api.grant(
        REGISTRAR,
        &[Rule {
            resource: "leases",
            verbs: &["get", "list", "watch", "create", "update"],
        }],
    );
    api.grant(
        "reader",
        &[Rule {
            resource: "leases",
            verbs: &["get"],
        }],
    );
    let leases: Api<Lease> = Api::namespaced(client(&api.kubeconfig(REGISTRAR)).await, "aether");
    let pp = PostParams::default();

    let created = leases
        .create(&pp, &lease("registrar", "n1", T1))
        .await
        .unwrap();
    let rv = created.metadata.resource_version.clone().unwrap();
    assert_eq!(rv, api.resource_version().to_string());
    assert_eq!(created.spec.unwrap().renew_time, Some(micro(T1)));
    let stored = api.lease("aether", "registrar").expect("the created lease");
    assert_eq!(
        (
            stored["spec"]["renewTime"].as_str(),
            stored["spec"]["acquireTime"].as_str()
        ),
        (Some(T1), Some(T1)),
        "MicroTimes as written"
    );
    assert_eq!(
        (stored["kind"].as_str(), stored["apiVersion"].as_str()),
        (Some("Lease"), Some("coordination.k8s.io/v1"))
    );
    let params = WatchParams::default()
        .fields("metadata.name=registrar")
        .timeout(10);
    let mut watch = leases.watch(&params, &rv).await.unwrap().boxed();

    let exists = status(leases.create(&pp, &lease("registrar", "n2", T2)).await);
    assert_eq!(
        (exists.code, exists.reason.as_str()),
        (409, "AlreadyExists")
    );
    assert_eq!(
        exists.message,
        r#"leases.coordination.k8s.io "registrar" already exists"#
    );
    assert_eq!(holder(&api.lease("aether", "registrar").unwrap()), "n1");

    // Another holder takes the lease over between the registrar's read and its write.
    let read = leases.get("registrar").await.unwrap();
    let mut foreign = api.lease("aether", "registrar").unwrap();
    foreign["spec"]["holderIdentity"] = json!("n2");
    foreign["spec"]["renewTime"] = json!(T2);
    api.put_lease(foreign);
    let mut renewal = read.clone();
    renewal.spec.as_mut().unwrap().renew_time = Some(micro(T3));
    let conflict = status(leases.replace("registrar", &pp, &renewal).await);
    assert_eq!((conflict.code, conflict.reason.as_str()), (409, "Conflict"));
    assert_eq!(
        conflict.message,
        "Operation cannot be fulfilled on leases.coordination.k8s.io \"registrar\": the object has been modified; \
                                  please apply your changes to the latest version and try again"
    );
    assert_eq!(
        holder(&api.lease("aether", "registrar").unwrap()),
        "n2",
        "a refused replace writes nothing"
    );

    let fresh = leases.get("registrar").await.unwrap();
    let before: u64 = fresh
        .metadata
        .resource_version
        .clone()
        .unwrap()
        .parse()
        .unwrap();
    let mut takeover = fresh;
    let spec = takeover.spec.as_mut().unwrap();
    spec.holder_identity = Some("n1".into());
    spec.renew_time = Some(micro(T3));
    spec.lease_transitions = Some(1);
    let replaced = leases.replace("registrar", &pp, &takeover).await.unwrap();
    let after: u64 = replaced.metadata.resource_version.unwrap().parse().unwrap();
    assert!(after > before, "{after} after {before}");
    assert_eq!(after, api.resource_version());
    let stored = api.lease("aether", "registrar").unwrap();
    assert_eq!(
        (holder(&stored), stored["spec"]["renewTime"].as_str()),
        ("n1", Some(T3))
    );
    assert_eq!(
        stored["metadata"]["uid"],
        created.metadata.uid.unwrap(),
        "the same object, replaced"
    );

    let mut writes = Vec::new();
    while writes.len() < 2 {
        match tokio::time::timeout(PATIENCE, watch.next())
            .await
            .expect("an event")
            .expect("an open stream")
            .unwrap()
        {
            WatchEvent::Modified(l) => writes.push(format!(
                "{} {}",
                l.spec.unwrap().holder_identity.unwrap(),
                l.metadata.resource_version.unwrap()
            )),
            WatchEvent::Bookmark(_) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(writes, [format!("n2 {before}"), format!("n1 {after}")]);

    let absent = status(
        leases
            .replace("absent", &pp, &lease("absent", "n1", T1))
            .await,
    );
    assert_eq!(
        (absent.code, absent.message.as_str()),
        (404, r#"leases.coordination.k8s.io "absent" not found"#)
    );
    let readers: Api<Lease> = Api::namespaced(client(&api.kubeconfig("reader")).await, "aether");
    assert_eq!(
        readers
            .get("registrar")
            .await
            .unwrap()
            .metadata
            .resource_version
            .unwrap(),
        after.to_string()
    );
    let forbidden = status(readers.replace("registrar", &pp, &takeover).await);
    assert_eq!(
        forbidden.message,
        r#"leases.coordination.k8s.io "registrar" is forbidden: User "reader" cannot update resource "leases" in API group "coordination.k8s.io" in the namespace "aether""#
    );
}

/// A JSON patch that adds a taint, guarded by a `test` of `metadata.resourceVersion`: to a
/// node without `spec.taints` (`add /spec/taints` with an array) and to one with taints
/// (`add /spec/taints/-`). A node changed since it was read fails the test with 422 and
/// is left as it was; a fresh read succeeds.
#[tokio::test]
async fn json_patch_adds_a_taint_guarded_by_the_resource_version() {
    let api = KubeApi::start();
    api.grant(AGENT, &[PATCH_NODES]);
    api.put_node(json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "bare"}, "spec": {"podCIDR": "10.0.1.0/24"}}));
    api.put_node(node("tainted", &["other"]));
    let nodes: Api<Node> = Api::all(client(&api.kubeconfig(AGENT)).await);
    let pp = PatchParams::default();
    let guarded = |read: &Node, path: &str, value: Value| -> Patch<()> {
        let rv = read
            .metadata
            .resource_version
            .clone()
            .expect("a read node has a resourceVersion");
        let ops = json!([{"op": "test", "path": "/metadata/resourceVersion", "value": rv}, {"op": "add", "path": path, "value": value}]);
        Patch::Json(serde_json::from_value(ops).expect("a JSON patch"))
    };

    let bare = nodes.get("bare").await.unwrap();
    assert!(bare.spec.as_ref().unwrap().taints.is_none());
    let patched = nodes
        .patch(
            "bare",
            &pp,
            &guarded(&bare, "/spec/taints", json!([taint("aether/mesh")])),
        )
        .await
        .unwrap();
    assert_eq!(taint_keys(&api.node("bare").unwrap()), ["aether/mesh"]);
    assert_eq!(
        patched.metadata.resource_version.unwrap(),
        api.resource_version().to_string()
    );

    // Someone labels the node between the read and the patch.
    let read = nodes.get("tainted").await.unwrap();
    let mut labelled = api.node("tainted").unwrap();
    labelled["metadata"]["labels"] = json!({"zone": "a"});
    api.put_node(labelled);
    let before = api.node("tainted").unwrap();
    let stale = status(
        nodes
            .patch(
                "tainted",
                &pp,
                &guarded(&read, "/spec/taints/-", taint("aether/mesh")),
            )
            .await,
    );
    assert_eq!(
        (stale.code, stale.reason.as_str()),
        (422, "Invalid"),
        "{stale:?}"
    );
    assert_eq!(
        stale.details.unwrap().causes[0].message,
        "testing value /metadata/resourceVersion failed: test failed"
    );
    assert_eq!(
        api.node("tainted").unwrap(),
        before,
        "a failed patch changes nothing"
    );

    let read = nodes.get("tainted").await.unwrap();
    nodes
        .patch(
            "tainted",
            &pp,
            &guarded(&read, "/spec/taints/-", taint("aether/mesh")),
        )
        .await
        .unwrap();
    assert_eq!(
        taint_keys(&api.node("tainted").unwrap()),
        ["other", "aether/mesh"]
    );
    assert_eq!(
        api.node("tainted").unwrap()["metadata"]["labels"]["zone"],
        "a"
    );
    assert_eq!(api.patches(AGENT), 3);
}

/// The kubectl that scripts/install-tools.sh installs, run against one server with a
/// discovery cache of its own.
struct Kubectl<'a> {
    path: PathBuf,
    api: &'a KubeApi,
    cache: tempfile::TempDir,
}

impl Kubectl<'_> {
    /// None, after saying loudly that `test` is skipped, if kubectl has not been installed
    /// (CI installs it before the tests run).
    fn find<'a>(api: &'a KubeApi, test: &str) -> Option<Kubectl<'a>> {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.tools/bin/kubectl");
        if !path.exists() {
            eprintln!(
                "SKIPPED {test}: .tools/bin/kubectl is absent (scripts/install-tools.sh installs it)"
            );
            return None;
        }
        Some(Kubectl {
            path,
            api,
            cache: tempfile::tempdir().expect("a temp dir for kubectl's cache"),
        })
    }

    fn run(&self, user: &str, args: &[&str]) -> Output {
        let out = Command::new(&self.path)
            .arg("--kubeconfig")
            .arg(self.api.kubeconfig(user))
            .arg("--cache-dir")
            .arg(self.cache.path())
            .args(args)
            .env_remove("KUBECONFIG")
            .output()
            .expect("running kubectl");
        eprintln!(
            "kubectl {args:?}: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }

    /// The standard output of a run that must succeed.
    fn ok(&self, user: &str, args: &[&str]) -> String {
        let out = self.run(user, args);
        assert!(
            out.status.success(),
            "kubectl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).expect("kubectl prints UTF-8")
    }

    /// The standard error of a run that must fail.
    fn fails(&self, user: &str, args: &[&str]) -> String {
        let out = self.run(user, args);
        assert!(
            !out.status.success(),
            "kubectl {args:?} succeeded: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        String::from_utf8(out.stderr).expect("kubectl prints UTF-8")
    }
}

/// "namespace/name" of each item of a list kubectl printed as JSON.
fn listed_names(list: &str) -> Vec<String> {
    let list: Value = serde_json::from_str(list).expect("kubectl printed JSON");
    list["items"]
        .as_array()
        .expect("a list")
        .iter()
        .map(|i| {
            format!(
                "{}/{}",
                i["metadata"]["namespace"].as_str().unwrap_or(""),
                i["metadata"]["name"].as_str().unwrap()
            )
        })
        .collect()
}

/// Real kubectl against the server: list pods in all namespaces and nodes as JSON, a JSON
/// patch on a node, a raw watch that ends at its timeout, and a refused patch reported as
/// the Status says.
#[test]
fn kubectl_lists_patches_and_watches() {
    let api = KubeApi::start();
    let Some(kubectl) = Kubectl::find(&api, "kubectl_lists_patches_and_watches") else {
        return;
    };
    api.grant(
        "admin",
        &[
            Rule {
                resource: "pods",
                verbs: &["*"],
            },
            Rule {
                resource: "nodes",
                verbs: &["*"],
            },
        ],
    );
    api.grant("reader", &[READ_NODES]);
    api.put_node(node("n1", &["other", "aether/not-ready"]));
    api.put_pod(pod("a", "n1"));
    let mut system_pod = pod("b", "n2");
    system_pod["metadata"]["namespace"] = json!("kube-system");
    api.put_pod(system_pod);
    let ok = |user: &str, args: &[&str]| kubectl.ok(user, args);

    assert_eq!(
        listed_names(&ok("admin", &["get", "pods", "-A", "-o", "json"])),
        ["default/a", "kube-system/b"]
    );
    assert_eq!(
        listed_names(&ok("admin", &["get", "nodes", "-o", "json"])),
        ["/n1"]
    );
    let table = ok("admin", &["get", "pods", "-A"]);
    assert!(
        table.contains("kube-system") && table.contains('b'),
        "{table}"
    );

    let patch = r#"[{"op": "test", "path": "/spec/taints/1/key", "value": "aether/not-ready"}, {"op": "remove", "path": "/spec/taints/1"}]"#;
    assert_eq!(
        ok(
            "admin",
            &["patch", "node", "n1", "--type=json", "-p", patch]
        )
        .trim(),
        "node/n1 patched"
    );
    assert_eq!(taint_keys(&api.node("n1").unwrap()), ["other"]);
    let stderr = kubectl.fails(
        "admin",
        &["patch", "node", "n1", "--type=json", "-p", patch],
    );
    assert!(stderr.contains("The request is invalid"), "{stderr}");

    let stderr = kubectl.fails(
        "reader",
        &["patch", "node", "n1", "--type=json", "-p", patch],
    );
    assert!(stderr.contains(r#"Error from server (Forbidden): nodes "n1" is forbidden: User "reader" cannot patch resource "nodes""#), "{stderr}");

    let started = std::time::Instant::now();
    let raw = ok(
        "admin",
        &["get", "--raw", "/api/v1/pods?watch=true&timeoutSeconds=1"],
    );
    let events: Vec<(String, String)> = raw
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .map(|e| {
            (
                e["type"].as_str().unwrap().to_owned(),
                e["object"]["metadata"]["name"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        events,
        [
            ("ADDED".to_owned(), "a".to_owned()),
            ("ADDED".to_owned(), "b".to_owned())
        ]
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "the watch ended at its timeout"
    );
    assert_eq!(api.watchers("pods"), 0);
    eprintln!("kubectl asked for: {:#?}", api.requests("admin"));
}

/// Real kubectl on the mesh registrar's resources: `create -f` of a Service (the server
/// gives it a cluster IP) and an EndpointSlice, a second create refused as AlreadyExists,
/// `get services,endpointslices -A -o json`, `get lease` with its MicroTimes as stored, a
/// JSON patch adding a taint to a node without taints, guarded by its resourceVersion and
/// refused once that is stale, and `delete -f`.
#[test]
fn kubectl_creates_gets_patches_and_deletes_the_registrar_s_resources() {
    let api = KubeApi::start();
    let Some(kubectl) = Kubectl::find(
        &api,
        "kubectl_creates_gets_patches_and_deletes_the_registrar_s_resources",
    ) else {
        return;
    };
    let all: Vec<Rule> = ["services", "endpointslices", "leases", "nodes"]
        .into_iter()
        .map(|resource| Rule {
            resource,
            verbs: &["*"],
        })
        .collect();
    api.grant("admin", &all);
    api.put_service(service("kube-system", "dns", "dns"));
    api.put_lease(json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": "registrar", "namespace": "aether"},
                         "spec": {"holderIdentity": "n1", "leaseDurationSeconds": 15, "acquireTime": T1, "renewTime": T2}}));
    api.put_node(json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}, "spec": {"podCIDR": "10.0.1.0/24"}}));

    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str, object: Value| {
        let path = dir.path().join(name);
        std::fs::write(&path, serde_json::to_vec_pretty(&object).unwrap()).unwrap();
        path.to_str().expect("a UTF-8 temp path").to_owned()
    };
    let mut web = service("default", "web", "web");
    web["metadata"].as_object_mut().unwrap().remove("namespace");
    let (web, slice) = (
        file("web.json", web),
        file(
            "web-slice.json",
            endpoint_slice("default", "web-abc12", "web", "10.0.0.7"),
        ),
    );
    let created = kubectl.ok("admin", &["create", "-f", &web, "-f", &slice]);
    assert_eq!(
        created.lines().collect::<Vec<_>>(),
        [
            "service/web created",
            "endpointslice.discovery.k8s.io/web-abc12 created"
        ]
    );
    assert_eq!(
        api.service("default", "web").expect("the created service")["spec"]["clusterIP"],
        "10.96.0.10"
    );
    assert_eq!(
        api.endpoint_slice("default", "web-abc12")
            .expect("the created slice")["endpoints"][0]["addresses"],
        json!(["10.0.0.7"])
    );
    let stderr = kubectl.fails("admin", &["create", "-f", &web]);
    assert!(
        stderr.contains(r#"Error from server (AlreadyExists): error when creating"#)
            && stderr.contains(r#"services "web" already exists"#),
        "{stderr}"
    );

    let listed: Value = serde_json::from_str(&kubectl.ok(
        "admin",
        &["get", "services,endpointslices", "-A", "-o", "json"],
    ))
    .unwrap();
    let items: Vec<String> = listed["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| {
            format!(
                "{} {} {}/{}",
                i["apiVersion"].as_str().unwrap(),
                i["kind"].as_str().unwrap(),
                i["metadata"]["namespace"].as_str().unwrap(),
                i["metadata"]["name"].as_str().unwrap()
            )
        })
        .collect();
    assert_eq!(
        items,
        [
            "v1 Service default/web",
            "v1 Service kube-system/dns",
            "discovery.k8s.io/v1 EndpointSlice default/web-abc12"
        ]
    );
    let table = kubectl.ok("admin", &["get", "endpointslices", "-n", "default"]);
    assert!(table.contains("web-abc12"), "{table}");

    let lease: Value = serde_json::from_str(&kubectl.ok(
        "admin",
        &["get", "lease", "-n", "aether", "registrar", "-o", "json"],
    ))
    .unwrap();
    assert_eq!(
        (lease["kind"].as_str(), lease["apiVersion"].as_str()),
        (Some("Lease"), Some("coordination.k8s.io/v1"))
    );
    assert_eq!(
        (
            lease["spec"]["acquireTime"].as_str(),
            lease["spec"]["renewTime"].as_str()
        ),
        (Some(T1), Some(T2))
    );

    let rv = api.node("n1").unwrap()["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .to_owned();
    let patch = json!([{"op": "test", "path": "/metadata/resourceVersion", "value": rv},
                       {"op": "add", "path": "/spec/taints", "value": [taint("aether/mesh")]}])
    .to_string();
    assert_eq!(
        kubectl
            .ok(
                "admin",
                &["patch", "node", "n1", "--type", "json", "-p", &patch]
            )
            .trim(),
        "node/n1 patched"
    );
    assert_eq!(taint_keys(&api.node("n1").unwrap()), ["aether/mesh"]);
    let stderr = kubectl.fails(
        "admin",
        &["patch", "node", "n1", "--type", "json", "-p", &patch],
    );
    assert!(
        stderr.contains("The request is invalid"),
        "a stale resourceVersion: {stderr}"
    );
    assert_eq!(taint_keys(&api.node("n1").unwrap()), ["aether/mesh"]);

    let deleted = kubectl.ok("admin", &["delete", "-f", &web, "-f", &slice]);
    assert!(
        deleted.contains(r#"service "web" deleted"#)
            && deleted.contains(r#"endpointslice.discovery.k8s.io "web-abc12" deleted"#),
        "{deleted}"
    );
    assert!(
        api.service("default", "web").is_none()
            && api.endpoint_slice("default", "web-abc12").is_none()
    );
    assert!(api.service("kube-system", "dns").is_some());
    eprintln!("kubectl asked for: {:#?}", api.requests("admin"));
}
