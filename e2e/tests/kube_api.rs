//! The test Kubernetes API server (`aether_e2e::kube_api`) against real clients: kube-rs
//! (the client the worker uses) and kubectl, so that it behaves as an API server and not
//! as what one client happens to accept.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use aether_e2e::kube_api::{KubeApi, Rule};
use futures::{Stream, StreamExt};
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams, VersionMatch, WatchEvent, WatchParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::watcher::{self, Event, watcher};
use kube::runtime::WatchStreamExt;
use kube::{Client, Config};
use serde_json::{Value, json};

const AGENT: &str = "system:serviceaccount:aether:agent";
const READ_PODS: Rule = Rule { resource: "pods", verbs: &["get", "list", "watch"] };
const READ_NODES: Rule = Rule { resource: "nodes", verbs: &["get", "list", "watch"] };
const PATCH_NODES: Rule = Rule { resource: "nodes", verbs: &["get", "watch", "patch"] };
/// How long any one awaited event may take before the test fails instead of hanging.
const PATIENCE: Duration = Duration::from_secs(20);

async fn client(kubeconfig: &Path) -> Client {
    let kc = Kubeconfig::read_from(kubeconfig).expect("reading the kubeconfig");
    let config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await.expect("a client config from the kubeconfig");
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

fn taint_keys(node: &Value) -> Vec<String> {
    node["spec"]["taints"].as_array().into_iter().flatten().map(|t| t["key"].as_str().unwrap().to_owned()).collect()
}

/// A watcher event in a word or three: "apply a", "apply a deleting", "delete a", "init",
/// "init-apply a", "init-done", or "error 410" (an ERROR event's code) / "error" (any other).
fn summary(event: &Result<Event<Pod>, watcher::Error>) -> String {
    let name = |p: &Pod| p.metadata.name.clone().unwrap_or_default();
    match event {
        Ok(Event::Apply(p)) if p.metadata.deletion_timestamp.is_some() => format!("apply {} deleting", name(p)),
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
async fn events_until(stream: &mut (impl Stream<Item = Result<Event<Pod>, watcher::Error>> + Unpin), last: impl Fn(&str) -> bool) -> Vec<String> {
    let mut out = Vec::new();
    loop {
        let event = tokio::time::timeout(PATIENCE, stream.next()).await.unwrap_or_else(|_| panic!("no watcher event within {PATIENCE:?}; so far {out:?}"));
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
    let mut stream = watcher(pods.clone(), watcher::Config::default().fields("spec.nodeName=n1")).default_backoff().boxed();

    let initial = events_until(&mut stream, |e| e == "init-done").await;
    assert_eq!(initial, ["init", "init-apply a", "init-apply b", "init-done"]);

    api.put_pod(pod("d", "n1"));
    api.put_pod(pod("e", "n2"));
    api.mark_pod_deleting("default", "a");
    api.delete_pod("default", "a");
    api.put_pod(pod("b", "n2"));
    let changes = events_until(&mut stream, |e| e == "delete b").await;
    assert_eq!(changes, ["apply d", "apply a deleting", "delete a", "delete b"]);
    assert_eq!(api.watchers("pods"), 1);
    let watches: Vec<String> = api.requests(AGENT).into_iter().filter(|r| r.contains("watch=true")).collect();
    assert_eq!(watches.len(), 1, "{watches:?}");
    for param in ["fieldSelector=spec.nodeName%3Dn1", "allowWatchBookmarks=true", "timeoutSeconds="] {
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
    assert_eq!(without_errors, ["init", "init-apply f", "init-done"], "{relist:?}");
    assert!(relist.contains(&"error 410".to_owned()), "{relist:?}");
    let lists = api.requests(AGENT).into_iter().filter(|r| r.starts_with("GET /api/v1/pods?") && !r.contains("watch=true")).count();
    assert_eq!(lists, 2);

    // The watcher goes on watching from the relist.
    api.put_pod(pod("g", "n1"));
    assert_eq!(events_until(&mut stream, |e| e.starts_with("apply")).await, ["apply g"]);
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
    let rv = pods.list(&Default::default()).await.unwrap().metadata.resource_version.unwrap();
    assert_eq!(rv, api.resource_version().to_string());

    let params = WatchParams::default().fields("spec.nodeName=n1").timeout(10);
    assert!(params.bookmarks, "kube-rs asks for bookmarks by default");
    let mut watch = pods.watch(&params, &rv).await.unwrap().boxed();
    api.put_pod(pod("b", "n1"));
    let mut seen = Vec::new();
    let bookmark = loop {
        match tokio::time::timeout(PATIENCE, watch.next()).await.expect("an event or a bookmark").expect("an open stream").unwrap() {
            WatchEvent::Bookmark(b) => break b,
            WatchEvent::Added(p) => seen.push(p.metadata.name.unwrap()),
            other => panic!("unexpected {other:?}"),
        }
    };
    assert_eq!(seen, ["b"]);
    assert_eq!(bookmark.metadata.resource_version, api.resource_version().to_string());
    drop(watch);

    api.expire_history();
    let mut stale = pods.watch(&WatchParams::default(), &rv).await.expect("a watch from an expired resourceVersion still opens").boxed();
    match stale.next().await.expect("one event").unwrap() {
        WatchEvent::Error(status) => {
            assert_eq!((status.code, status.reason.as_str()), (410, "Expired"));
            assert_eq!(status.message, format!("too old resource version: {rv} ({})", api.resource_version()));
        }
        other => panic!("expected an ERROR event, got {other:?}"),
    }
    assert!(stale.next().await.is_none(), "the stream ends after the ERROR event");
    let exact = ListParams::default().at(&rv).matching(VersionMatch::Exact);
    match pods.list(&exact).await {
        Err(kube::Error::Api(status)) => assert_eq!((status.code, status.reason.as_str()), (410, "Expired")),
        other => panic!("expected 410, got {other:?}"),
    }
    let not_older = ListParams::default().at(&rv).matching(VersionMatch::NotOlderThan);
    assert_eq!(pods.list(&not_older).await.unwrap().items.len(), 2, "NotOlderThan is served from now");

    // A streaming list (sendInitialEvents): the objects, then a bookmark that ends them.
    let config = watcher::Config::default().fields("spec.nodeName=n1").streaming_lists();
    let mut streaming = watcher(pods, config).boxed();
    assert_eq!(events_until(&mut streaming, |e| e == "init-done").await, ["init", "init-apply a", "init-apply b", "init-done"]);
    assert!(api.requests(AGENT).last().unwrap().contains("sendInitialEvents=true"));
}

fn remove_taint(index: usize, taint: &Value) -> Patch<()> {
    let path = format!("/spec/taints/{index}");
    Patch::Json(serde_json::from_value(json!([{"op": "test", "path": path, "value": taint}, {"op": "remove", "path": path}])).unwrap())
}

fn index_of(node: &Node, key: &str) -> usize {
    node.spec.as_ref().unwrap().taints.as_ref().unwrap().iter().position(|t| t.key == key).unwrap()
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
    let patched = nodes.patch("n1", &pp, &remove_taint(index_of(&read, "other"), &taint("other"))).await.unwrap();
    assert_eq!(taint_keys(&api.node("n1").unwrap()), ["aether/not-ready"]);
    assert_eq!(patched.metadata.resource_version.unwrap(), api.resource_version().to_string());

    // Someone adds a taint in front between the agent's read and its patch.
    let read = nodes.get("n1").await.unwrap();
    api.put_node(node("n1", &["added", "aether/not-ready"]));
    let before = api.node("n1").unwrap();
    match nodes.patch("n1", &pp, &remove_taint(index_of(&read, "aether/not-ready"), &taint("aether/not-ready"))).await {
        Err(kube::Error::Api(status)) => {
            assert_eq!((status.code, status.reason.as_str()), (422, "Invalid"), "{status:?}");
            let causes = status.details.unwrap().causes;
            assert_eq!(causes[0].message, "testing value /spec/taints/0 failed: test failed");
        }
        other => panic!("expected 422, got {other:?}"),
    }
    assert_eq!(api.node("n1").unwrap(), before, "a failed patch changes nothing");

    let read = nodes.get("n1").await.unwrap();
    nodes.patch("n1", &pp, &remove_taint(index_of(&read, "aether/not-ready"), &taint("aether/not-ready"))).await.unwrap();
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
    expect_code(nodes.patch("n1", &pp, &Patch::Strategic(json!({"spec": {"taints": []}}))).await, 415);
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
    assert_eq!(nodes.get("n1").await.unwrap().metadata.name.as_deref(), Some("n1"));

    let forbidden = |r: kube::Error| match r {
        kube::Error::Api(status) => {
            assert_eq!((status.code, status.reason.as_str()), (403, "Forbidden"));
            status.message
        }
        other => panic!("expected 403, got {other:?}"),
    };
    let patch = Patch::Merge(json!({"metadata": {"labels": {"x": "y"}}}));
    assert_eq!(forbidden(nodes.patch("n1", &PatchParams::default(), &patch).await.unwrap_err()),
               r#"nodes "n1" is forbidden: User "reader" cannot patch resource "nodes" in API group "" at the cluster scope"#);
    assert_eq!(api.patches("reader"), 1, "a refused patch is counted too");
    assert!(api.node("n1").unwrap()["metadata"]["labels"].is_null());
    let pods: Api<Pod> = Api::namespaced(reader, "kube-system");
    assert_eq!(forbidden(pods.list(&Default::default()).await.unwrap_err()),
               r#"pods is forbidden: User "reader" cannot list resource "pods" in API group "" in the namespace "kube-system""#);

    let kubeconfig = api.kubeconfig("reader");
    let text = std::fs::read_to_string(&kubeconfig).unwrap().replace(&api.token("reader"), "not-a-known-token");
    let bogus = kubeconfig.with_file_name("kubeconfig-bogus");
    std::fs::write(&bogus, text).unwrap();
    let strangers: Api<Node> = Api::all(client(&bogus).await);
    match strangers.get("n1").await {
        Err(kube::Error::Api(status)) => assert_eq!((status.code, status.reason.as_str()), (401, "Unauthorized")),
        other => panic!("expected 401, got {other:?}"),
    }
    assert_eq!(api.requests("reader").len(), 3, "the stranger's request is nobody's: {:?}", api.requests("reader"));
}

/// TokenReview: the reviewer learns who holds a token and the node it is bound to.
#[tokio::test]
async fn token_review_names_the_user_and_its_node() {
    let api = KubeApi::start();
    api.grant("registrar", &[Rule { resource: "tokenreviews", verbs: &["create"] }]);
    api.bind_token_to_node(AGENT, "n1");
    let reviews: Api<TokenReview> = Api::all(client(&api.kubeconfig("registrar")).await);
    let review = |token: String| TokenReview { spec: TokenReviewSpec { token, ..Default::default() }, ..Default::default() };

    let answer = reviews.create(&PostParams::default(), &review(api.token(AGENT))).await.unwrap().status.unwrap();
    assert_eq!(answer.authenticated, Some(true));
    let user = answer.user.unwrap();
    assert_eq!(user.username.as_deref(), Some(AGENT));
    assert_eq!(user.extra.unwrap()["authentication.kubernetes.io/node-name"], ["n1"]);
    assert!(user.groups.unwrap().contains(&"system:serviceaccounts:aether".to_owned()));

    let answer = reviews.create(&PostParams::default(), &review("guess".into())).await.unwrap().status.unwrap();
    assert_ne!(answer.authenticated, Some(true));

    let agents: Api<TokenReview> = Api::all(client(&api.kubeconfig(AGENT)).await);
    match agents.create(&PostParams::default(), &review("guess".into())).await {
        Err(kube::Error::Api(status)) => assert_eq!(status.code, 403),
        other => panic!("expected 403, got {other:?}"),
    }
}

/// The kubectl that scripts/install-tools.sh installs, if it has been installed.
fn kubectl() -> Option<PathBuf> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.tools/bin/kubectl");
    path.exists().then_some(path)
}

/// Real kubectl against the server: list pods in all namespaces and nodes as JSON, a JSON
/// patch on a node, a raw watch that ends at its timeout, and a refused patch reported as
/// the Status says.
#[test]
fn kubectl_lists_patches_and_watches() {
    let Some(kubectl) = kubectl() else {
        eprintln!("SKIPPED kubectl_lists_patches_and_watches: .tools/bin/kubectl is absent (scripts/install-tools.sh installs it)");
        return;
    };
    let api = KubeApi::start();
    api.grant("admin", &[Rule { resource: "pods", verbs: &["*"] }, Rule { resource: "nodes", verbs: &["*"] }]);
    api.grant("reader", &[READ_NODES]);
    api.put_node(node("n1", &["other", "aether/not-ready"]));
    api.put_pod(pod("a", "n1"));
    let mut system_pod = pod("b", "n2");
    system_pod["metadata"]["namespace"] = json!("kube-system");
    api.put_pod(system_pod);
    let cache = tempfile::tempdir().unwrap();
    let run = |user: &str, args: &[&str]| -> Output {
        let out = Command::new(&kubectl)
            .arg("--kubeconfig")
            .arg(api.kubeconfig(user))
            .arg("--cache-dir")
            .arg(cache.path())
            .args(args)
            .env_remove("KUBECONFIG")
            .output()
            .expect("running kubectl");
        eprintln!("kubectl {args:?}: {}\n{}", out.status, String::from_utf8_lossy(&out.stderr));
        out
    };
    let ok = |user: &str, args: &[&str]| -> String {
        let out = run(user, args);
        assert!(out.status.success(), "kubectl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let names = |list: &str| -> Vec<String> {
        let list: Value = serde_json::from_str(list).unwrap();
        list["items"].as_array().unwrap().iter().map(|i| format!("{}/{}", i["metadata"]["namespace"].as_str().unwrap_or(""), i["metadata"]["name"].as_str().unwrap())).collect()
    };

    assert_eq!(names(&ok("admin", &["get", "pods", "-A", "-o", "json"])), ["default/a", "kube-system/b"]);
    assert_eq!(names(&ok("admin", &["get", "nodes", "-o", "json"])), ["/n1"]);
    let table = ok("admin", &["get", "pods", "-A"]);
    assert!(table.contains("kube-system") && table.contains('b'), "{table}");

    let patch = r#"[{"op": "test", "path": "/spec/taints/1/key", "value": "aether/not-ready"}, {"op": "remove", "path": "/spec/taints/1"}]"#;
    assert_eq!(ok("admin", &["patch", "node", "n1", "--type=json", "-p", patch]).trim(), "node/n1 patched");
    assert_eq!(taint_keys(&api.node("n1").unwrap()), ["other"]);
    let failed = run("admin", &["patch", "node", "n1", "--type=json", "-p", patch]);
    assert!(!failed.status.success());
    let stderr = String::from_utf8_lossy(&failed.stderr);
    assert!(stderr.contains("The request is invalid"), "{stderr}");

    let refused = run("reader", &["patch", "node", "n1", "--type=json", "-p", patch]);
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains(r#"Error from server (Forbidden): nodes "n1" is forbidden: User "reader" cannot patch resource "nodes""#), "{stderr}");

    let started = std::time::Instant::now();
    let raw = ok("admin", &["get", "--raw", "/api/v1/pods?watch=true&timeoutSeconds=1"]);
    let events: Vec<(String, String)> = raw
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .map(|e| (e["type"].as_str().unwrap().to_owned(), e["object"]["metadata"]["name"].as_str().unwrap().to_owned()))
        .collect();
    assert_eq!(events, [("ADDED".to_owned(), "a".to_owned()), ("ADDED".to_owned(), "b".to_owned())]);
    assert!(started.elapsed() < Duration::from_secs(10), "the watch ended at its timeout");
    assert_eq!(api.watchers("pods"), 0);
    eprintln!("kubectl asked for: {:#?}", api.requests("admin"));
}
