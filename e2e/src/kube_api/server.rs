//! The HTTPS front: the listener (closed while the server is down), TLS, HTTP/1.1 with
//! hyper, then per request authentication (bearer token), authorization (RBAC rules),
//! routing and the handlers (reads here; writes are `write`'s). A watch is a chunked
//! response fed by its own task, which forwards the store's events, adds bookmarks and
//! ends the stream at its timeout.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full, Limited, combinators::BoxBody};
use hyper::body::{Bytes, Frame, Incoming};
use hyper::header::{AUTHORIZATION, CONTENT_TYPE, HeaderMap, HeaderValue};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use serde_json::{Value, json};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio_rustls::TlsAcceptor;

use super::access::{Access, groups};
use super::discovery;
use super::resource::Resource;
use super::selector::Selector;
use super::status::Failure;
use super::store::{Scope, Store};
use super::write::{self, PatchType};

/// How often an open watch that asked for bookmarks gets one.
pub const BOOKMARK_EVERY: Duration = Duration::from_secs(1);
/// A watch without `timeoutSeconds` ends after this, as the real server's
/// `--min-request-timeout` default.
const DEFAULT_WATCH_TIMEOUT: Duration = Duration::from_secs(1800);
/// The largest request body read (the real server's limit is 3 MiB too).
const MAX_BODY: usize = 3 << 20;

/// What the server thread and the test's handle share.
pub struct Shared {
    state: Mutex<State>,
    /// Signalled whenever `listening`, `connections` or the open watches change.
    changed: Condvar,
    /// `127.0.0.1:PORT`, as discovery reports it.
    pub address: SocketAddr,
}

pub struct State {
    pub store: Store,
    pub access: Access,
    pub listening: bool,
    pub connections: usize,
}

impl Shared {
    pub fn new(address: SocketAddr, store: Store) -> Shared {
        let state = State {
            store,
            access: Access::new(),
            listening: false,
            connections: 0,
        };
        Shared {
            state: Mutex::new(state),
            changed: Condvar::new(),
            address,
        }
    }

    pub fn lock(&self) -> MutexGuard<'_, State> {
        // A panic elsewhere while the lock was held leaves the state as consistent as any
        // step leaves it; the tests should see that panic, not a second one here.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn update(&self, f: impl FnOnce(&mut State)) {
        f(&mut self.lock());
        self.changed.notify_all();
    }

    /// Blocks the calling (non-server) thread until `done` holds, for at most 10 s.
    pub fn wait_until(&self, what: &str, done: impl Fn(&State) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut state = self.lock();
        while !done(&state) {
            let left = deadline
                .checked_duration_since(Instant::now())
                .unwrap_or_else(|| panic!("test API server: {what} did not happen within 10 s"));
            state = self
                .changed
                .wait_timeout(state, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

/// A listening socket with SO_REUSEADDR, so that the port can be bound again after a
/// `set_down` while the closed connections sit in TIME_WAIT.
pub fn bind(address: SocketAddr) -> io::Result<TcpListener> {
    let socket = TcpSocket::new_v4()?;
    socket.set_reuseaddr(true)?;
    socket.bind(address)?;
    socket.listen(1024)
}

/// Serves until the task is dropped: accepts while up; while down, holds no listener (so
/// connects are refused) and has closed every connection.
pub async fn serve(
    shared: Arc<Shared>,
    listener: TcpListener,
    tls: TlsAcceptor,
    mut down: watch::Receiver<bool>,
) {
    let mut listener = Some(listener);
    loop {
        let l = match listener.take() {
            Some(l) => l,
            None => {
                if down.wait_for(|d| !*d).await.is_err() {
                    return;
                }
                rebind(shared.address).await
            }
        };
        shared.update(|s| s.listening = true);
        let for_connections = down.clone();
        loop {
            tokio::select! {
                accepted = l.accept() => {
                    let Ok((stream, _)) = accepted else { continue };
                    let open = Open::new(&shared);
                    tokio::spawn(connection(shared.clone(), tls.clone(), stream, for_connections.clone(), open));
                }
                d = down.wait_for(|d| *d) => {
                    if d.is_err() {
                        return;
                    }
                    break;
                }
            }
        }
        drop(l);
        shared.update(|s| s.listening = false);
    }
}

/// Binds the server's port again. Another socket may hold it for a moment (an outgoing
/// connection given it as an ephemeral port), so a few seconds of retries.
async fn rebind(address: SocketAddr) -> TcpListener {
    let mut tries = 0;
    loop {
        match bind(address) {
            Ok(l) => return l,
            Err(e) if tries < 100 => {
                tries += 1;
                eprintln!("test API server: binding {address} again: {e}; retrying");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("test API server: cannot bind {address} again: {e}"),
        }
    }
}

/// Counts an open connection while alive.
struct Open(Arc<Shared>);

impl Open {
    fn new(shared: &Arc<Shared>) -> Open {
        shared.update(|s| s.connections += 1);
        Open(shared.clone())
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.update(|s| s.connections -= 1);
    }
}

async fn connection(
    shared: Arc<Shared>,
    tls: TlsAcceptor,
    stream: TcpStream,
    mut down: watch::Receiver<bool>,
    _open: Open,
) {
    // As Go's net/http does: a watch event is written whole and must not wait for the
    // client's delayed ACK (Nagle), which would add ~40 ms to an event past one segment.
    let _ = stream.set_nodelay(true);
    let serve = async {
        let Ok(stream) = tls.accept(stream).await else {
            return;
        };
        let service = service_fn(|req| {
            let shared = shared.clone();
            async move { Ok::<_, Infallible>(handle(&shared, req).await) }
        });
        // Errors here are the client's (a reset, a malformed request): nothing to report.
        let _ = http1::Builder::new()
            .timer(TokioTimer::new())
            .serve_connection(TokioIo::new(stream), service)
            .await;
    };
    tokio::select! {
        _ = serve => {}
        _ = down.wait_for(|d| *d) => {}
    }
}

type Body = BoxBody<Bytes, Infallible>;

/// Where a path leads.
enum Route {
    Document(Value),
    Objects {
        resource: Resource,
        namespace: Option<String>,
        name: Option<String>,
    },
    TokenReviews,
    Unknown,
}

fn route(path: &str, address: SocketAddr) -> Route {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let document = |d: Option<Value>| d.map_or(Route::Unknown, Route::Document);
    match parts.as_slice() {
        ["version"] => Route::Document(discovery::version()),
        ["api"] => Route::Document(discovery::core_versions(&address.to_string())),
        ["api", "v1"] => document(discovery::resources("")),
        ["apis"] => Route::Document(discovery::groups()),
        ["apis", group] => document(discovery::group(group)),
        ["apis", group, "v1"] => document(discovery::resources(group)),
        ["apis", "authentication.k8s.io", "v1", "tokenreviews"] => Route::TokenReviews,
        ["openapi", "v3"] => Route::Document(discovery::openapi_index()),
        ["openapi", "v3", "api", "v1"] => document(discovery::openapi("")),
        ["openapi", "v3", "apis", group, "v1"] => document(discovery::openapi(group)),
        ["api", "v1", rest @ ..] => objects_route("", rest),
        ["apis", group, "v1", rest @ ..] => objects_route(group, rest),
        _ => Route::Unknown,
    }
}

/// `[namespaces/NS/]PLURAL[/NAME]` in a group at v1. A namespaced resource is listed
/// across namespaces at its plural alone and named only within a namespace; a
/// cluster-scoped one is never within a namespace.
fn objects_route(group: &str, rest: &[&str]) -> Route {
    let (namespace, rest) = match rest {
        ["namespaces", ns, rest @ ..] if !rest.is_empty() => (Some(*ns), rest),
        _ => (None, rest),
    };
    let (plural, name) = match rest {
        [plural] => (*plural, None),
        [plural, name] => (*plural, Some(*name)),
        _ => return Route::Unknown,
    };
    let Some(resource) = Resource::from_path(group, plural) else {
        return Route::Unknown;
    };
    match (resource.namespaced(), namespace, name) {
        (true, None, Some(_)) | (false, Some(_), _) => Route::Unknown,
        _ => Route::Objects {
            resource,
            namespace: namespace.map(str::to_owned),
            name: name.map(str::to_owned),
        },
    }
}

async fn handle(shared: &Arc<Shared>, req: Request<Incoming>) -> Response<Body> {
    let (parts, body) = req.into_parts();
    let target = parts
        .uri
        .path_and_query()
        .map_or_else(|| parts.uri.path().to_owned(), |p| p.as_str().to_owned());
    let query = Query::parse(parts.uri.query().unwrap_or(""));
    let route = route(parts.uri.path(), shared.address);
    let node_patch = parts.method == Method::PATCH
        && matches!(
            &route,
            Route::Objects {
                resource: Resource::Nodes,
                name: Some(_),
                ..
            }
        );

    let user = {
        let mut s = shared.lock();
        let user = bearer(&parts.headers).and_then(|t| s.access.authenticate(t));
        if let Some(u) = &user {
            let record = s.access.user(u);
            record.requests.push(format!("{} {target}", parts.method));
            record.node_patches += usize::from(node_patch);
        }
        user
    };
    let Some(user) = user else {
        return failure(Failure::unauthorized());
    };

    match route {
        Route::Unknown => failure(Failure::no_such_path()),
        Route::Document(doc) if parts.method == Method::GET => json_response(StatusCode::OK, &doc),
        Route::Document(_) => failure(Failure::method_not_allowed()),
        Route::TokenReviews => {
            if parts.method != Method::POST {
                return failure(Failure::method_not_allowed());
            }
            if !shared
                .lock()
                .access
                .allowed(&user, "tokenreviews", "create")
            {
                return failure(Failure::forbidden(
                    &user,
                    "create",
                    "tokenreviews",
                    "authentication.k8s.io",
                    None,
                    None,
                ));
            }
            token_review(shared, body).await.unwrap_or_else(failure)
        }
        Route::Objects {
            resource,
            namespace,
            name,
        } => {
            let watch = query.flag("watch");
            let verb = match (&parts.method, &name) {
                (&Method::GET, _) if watch => "watch",
                (&Method::GET, None) => "list",
                (&Method::GET, Some(_)) => "get",
                (&Method::PATCH, Some(_)) => "patch",
                (&Method::PUT, Some(_)) => "update",
                (&Method::DELETE, Some(_)) => "delete",
                (&Method::DELETE, None) => "deletecollection",
                (&Method::POST, None) => "create",
                _ => return failure(Failure::method_not_allowed()),
            };
            if !shared.lock().access.allowed(&user, resource.plural(), verb) {
                return failure(Failure::forbidden(
                    &user,
                    verb,
                    resource.plural(),
                    resource.group(),
                    namespace.as_deref(),
                    name.as_deref(),
                ));
            }
            if !resource.verbs().contains(&verb) {
                return failure(Failure::method_not_allowed());
            }
            let request = ObjectRequest {
                resource,
                namespace: namespace.as_deref(),
                name: name.as_deref(),
                verb,
                query: &query,
            };
            objects(shared, request, &parts.headers, body)
                .await
                .unwrap_or_else(failure)
        }
    }
}

/// A request on objects, authorized and of a verb the resource serves.
struct ObjectRequest<'a> {
    resource: Resource,
    namespace: Option<&'a str>,
    name: Option<&'a str>,
    verb: &'static str,
    query: &'a Query,
}

async fn objects(
    shared: &Arc<Shared>,
    r: ObjectRequest<'_>,
    headers: &HeaderMap,
    body: Incoming,
) -> Result<Response<Body>, Failure> {
    let (resource, ns, query) = (r.resource, r.namespace, r.query);
    if !matches!(r.verb, "get" | "list" | "watch")
        && query.get("dryRun").is_some_and(|d| !d.is_empty())
    {
        return Err(Failure::bad_request(
            "dryRun is not implemented by the test API server",
        ));
    }
    match (r.verb, r.name) {
        ("list", _) => list(shared, &scope(resource, ns, None, query)?, query),
        ("watch", n) => open_watch(shared, scope(resource, ns, n, query)?, query),
        ("get", Some(n)) => get(shared, resource, ns, n),
        // A namespaced object is created within a namespace, not at the plural alone.
        ("create", None) if ns.is_some() || !resource.namespaced() => {
            let object = read_json(body).await?;
            let created = write::create(&mut shared.lock().store, resource, ns, object)?;
            Ok(json_response(StatusCode::CREATED, &created))
        }
        ("update", Some(n)) => {
            let object = read_json(body).await?;
            Ok(json_response(
                StatusCode::OK,
                &write::update(&mut shared.lock().store, resource, ns, n, object)?,
            ))
        }
        ("patch", Some(n)) => {
            let content_type = headers
                .get(CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("");
            let patch_type = PatchType::from_content_type(content_type)?;
            let patch = read_json(body).await?;
            Ok(json_response(
                StatusCode::OK,
                &write::patch(
                    &mut shared.lock().store,
                    resource,
                    ns,
                    n,
                    patch_type,
                    &patch,
                )?,
            ))
        }
        ("delete", Some(n)) => {
            let bytes = read_body(body).await?;
            let options = if bytes.is_empty() {
                Value::Null
            } else {
                parse_json(&bytes)?
            };
            Ok(json_response(
                StatusCode::OK,
                &write::delete(&mut shared.lock().store, resource, ns, n, &options)?,
            ))
        }
        _ => Err(Failure::method_not_allowed()),
    }
}

fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

fn json_response(code: StatusCode, body: &Value) -> Response<Body> {
    let mut bytes = serde_json::to_vec(body).expect("a JSON value serializes");
    bytes.push(b'\n');
    let mut r = Response::new(Full::new(Bytes::from(bytes)).boxed());
    *r.status_mut() = code;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

fn failure(f: Failure) -> Response<Body> {
    let code = StatusCode::from_u16(f.code).expect("a valid status code");
    json_response(code, &f.to_json())
}

/// The objects a list or watch sees: the path's namespace, the field and label
/// selectors, and for a watch on a named object its name.
fn scope(
    resource: Resource,
    namespace: Option<&str>,
    name: Option<&str>,
    query: &Query,
) -> Result<Scope, Failure> {
    let mut fields = query.get("fieldSelector").unwrap_or("").to_owned();
    if let Some(n) = name {
        fields = format!("{fields},metadata.name={n}");
    }
    Ok(Scope {
        resource,
        namespace: namespace.map(str::to_owned),
        fields: Selector::fields(resource, &fields)
            .map_err(|e| Failure::bad_request(format!("unable to parse requirement: {e}")))?,
        labels: Selector::labels(query.get("labelSelector").unwrap_or(""))
            .map_err(Failure::bad_request)?,
    })
}

/// `resourceVersion` from the query: unset or empty is None; anything but a number is a
/// bad request.
fn resource_version(query: &Query) -> Result<Option<u64>, Failure> {
    match query.get("resourceVersion").filter(|v| !v.is_empty()) {
        None => Ok(None),
        Some(v) => v.parse().map(Some).map_err(|_| {
            Failure::bad_request(format!(
                "resourceVersion: Invalid value: {v:?}: must be a number"
            ))
        }),
    }
}

/// A list at a resourceVersion: `resourceVersionMatch=NotOlderThan` is served from now,
/// as the real server does; otherwise (Exact, or the legacy unset match) a version older
/// than the history is 410 Gone. A retained older version is served from now too: the
/// store keeps no snapshots.
fn list(shared: &Shared, scope: &Scope, query: &Query) -> Result<Response<Body>, Failure> {
    let rv = resource_version(query)?
        .filter(|_| query.get("resourceVersionMatch") != Some("NotOlderThan"));
    let (items, rv) = shared
        .lock()
        .store
        .list(scope, rv)
        .map_err(|e| Failure::expired(e.message()))?;
    // A list's items carry no kind or apiVersion: the list's own say it.
    let items: Vec<Value> = items
        .into_iter()
        .map(|mut o| {
            if let Value::Object(m) = &mut o {
                m.remove("kind");
                m.remove("apiVersion");
            }
            o
        })
        .collect();
    let list = json!({"kind": format!("{}List", scope.resource.kind()), "apiVersion": scope.resource.api_version(),
                      "metadata": {"resourceVersion": rv.to_string()}, "items": items});
    Ok(json_response(StatusCode::OK, &list))
}

fn get(
    shared: &Shared,
    resource: Resource,
    namespace: Option<&str>,
    name: &str,
) -> Result<Response<Body>, Failure> {
    let s = shared.lock();
    let object = s
        .store
        .get(resource, namespace, name)
        .ok_or_else(|| Failure::not_found(resource, name))?;
    Ok(json_response(StatusCode::OK, object))
}

/// A watch: 200 with a chunked body of one JSON event per line. A resourceVersion older
/// than the history gets one ERROR event (a Status, code 410, reason Expired) and the end
/// of the stream, which is what the real server sends.
fn open_watch(
    shared: &Arc<Shared>,
    scope: Scope,
    query: &Query,
) -> Result<Response<Body>, Failure> {
    let from = resource_version(query)?;
    let initial = query.flag("sendInitialEvents");
    let bookmarks = query.flag("allowWatchBookmarks");
    let timeout = query
        .get("timeoutSeconds")
        .and_then(|t| t.parse().ok())
        .map_or(DEFAULT_WATCH_TIMEOUT, Duration::from_secs);
    let resource = scope.resource;
    let (events_tx, events) = mpsc::unbounded_channel();
    let (out, body) = mpsc::channel(64);
    let opened = shared.lock().store.watch(scope, from, initial, events_tx);
    match opened {
        Ok((id, replay)) => {
            let registered = Registered {
                shared: shared.clone(),
                id,
            };
            tokio::spawn(stream_watch(
                registered,
                resource,
                replay.into(),
                events,
                out,
                bookmarks,
                timeout,
            ));
        }
        Err(expired) => {
            let error =
                json!({"type": "ERROR", "object": Failure::expired(expired.message()).to_json()});
            out.try_send(line(&error))
                .expect("an empty channel has room");
        }
    }
    let mut r = Response::new(ChannelBody(body).boxed());
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    Ok(r)
}

fn line(event: &Value) -> Bytes {
    let mut bytes = serde_json::to_vec(event).expect("a JSON value serializes");
    bytes.push(b'\n');
    Bytes::from(bytes)
}

/// A watch's registration in the store, removed when its stream ends for any reason.
struct Registered {
    shared: Arc<Shared>,
    id: u64,
}

impl Drop for Registered {
    fn drop(&mut self) {
        let id = self.id;
        self.shared.update(|s| s.store.unwatch(id));
    }
}

async fn stream_watch(
    registered: Registered,
    resource: Resource,
    pending: VecDeque<Value>,
    events: mpsc::UnboundedReceiver<Value>,
    out: mpsc::Sender<Bytes>,
    bookmarks: bool,
    timeout: Duration,
) {
    forward(
        &registered.shared,
        resource,
        pending,
        events,
        &out,
        bookmarks,
        timeout,
    )
    .await;
    // Unregistered before the stream ends, so that a client that saw the end sees no
    // open watch either.
    drop(registered);
    drop(out);
}

async fn forward(
    shared: &Shared,
    resource: Resource,
    mut pending: VecDeque<Value>,
    mut events: mpsc::UnboundedReceiver<Value>,
    out: &mpsc::Sender<Bytes>,
    bookmarks: bool,
    timeout: Duration,
) {
    let deadline = tokio::time::sleep(timeout);
    tokio::pin!(deadline);
    let mut tick =
        tokio::time::interval_at(tokio::time::Instant::now() + BOOKMARK_EVERY, BOOKMARK_EVERY);
    loop {
        while let Some(event) = pending.pop_front() {
            tokio::select! {
                sent = out.send(line(&event)) => if sent.is_err() { return },
                _ = &mut deadline => return,
            }
        }
        tokio::select! {
            event = events.recv() => match event {
                Some(e) => pending.push_back(e),
                // The store closed the watch (the server went down).
                None => return,
            },
            _ = tick.tick(), if bookmarks => {
                // Under the lock, every change up to the bookmark's resourceVersion is
                // already in `events`: send those first, then the bookmark.
                let s = shared.lock();
                let bookmark = s.store.bookmark(resource);
                while let Ok(e) = events.try_recv() {
                    pending.push_back(e);
                }
                drop(s);
                pending.push_back(bookmark);
            }
            _ = &mut deadline => return,
            _ = out.closed() => return,
        }
    }
}

/// A response body fed by a channel; it ends when the sender is dropped.
struct ChannelBody(mpsc::Receiver<Bytes>);

impl hyper::body::Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|b| b.map(|b| Ok(Frame::data(b))))
    }
}

async fn read_body(body: Incoming) -> Result<Bytes, Failure> {
    Ok(Limited::new(body, MAX_BODY)
        .collect()
        .await
        .map_err(|_| Failure::payload_too_large())?
        .to_bytes())
}

fn parse_json(bytes: &[u8]) -> Result<Value, Failure> {
    serde_json::from_slice(bytes)
        .map_err(|e| Failure::bad_request(format!("the request body is not JSON: {e}")))
}

async fn read_json(body: Incoming) -> Result<Value, Failure> {
    parse_json(&read_body(body).await?)
}

/// TokenReview: who a bearer token belongs to, with the node it is bound to (as a
/// node-bound service-account token's `authentication.kubernetes.io/node-name`).
async fn token_review(shared: &Shared, body: Incoming) -> Result<Response<Body>, Failure> {
    let review = read_json(body).await?;
    let token = review["spec"]["token"]
        .as_str()
        .ok_or_else(|| Failure::bad_request("spec.token: Required value"))?;
    let audiences = match &review["spec"]["audiences"] {
        Value::Array(a) if !a.is_empty() => Value::Array(a.clone()),
        _ => json!(["https://kubernetes.default.svc.cluster.local"]),
    };
    let s = shared.lock();
    let status = match s.access.authenticate(token) {
        Some(name) => {
            let mut user = json!({"username": name, "groups": groups(&name)});
            if let Some(node) = s.access.get(&name).and_then(|u| u.node.as_deref()) {
                user["extra"] = json!({"authentication.kubernetes.io/node-name": [node]});
            }
            json!({"authenticated": true, "user": user, "audiences": audiences})
        }
        None => json!({"user": {}, "error": "invalid bearer token"}),
    };
    let answer = json!({"kind": "TokenReview", "apiVersion": "authentication.k8s.io/v1", "metadata": {"creationTimestamp": null},
                        "spec": review["spec"], "status": status});
    Ok(json_response(StatusCode::CREATED, &answer))
}

/// A request's query parameters, percent-decoded (`+` is a space, as Go and
/// form_urlencoded encode one).
struct Query(Vec<(String, String)>);

impl Query {
    fn parse(raw: &str) -> Query {
        Query(
            raw.split('&')
                .filter(|p| !p.is_empty())
                .map(|p| {
                    let (k, v) = p.split_once('=').unwrap_or((p, ""));
                    (decode(k), decode(v))
                })
                .collect(),
        )
    }

    fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    fn flag(&self, key: &str) -> bool {
        matches!(self.get(key), Some("true" | "1"))
    }
}

fn decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let hex = |i: usize| bytes.get(i).and_then(|b| char::from(*b).to_digit(16));
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match (bytes[i], hex(i + 1), hex(i + 2)) {
            (b'+', _, _) => out.push(b' '),
            (b'%', Some(high), Some(low)) => {
                out.push((high * 16 + low) as u8);
                i += 2;
            }
            (b, _, _) => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_decode_as_go_encodes_them() {
        let q = Query::parse(
            "fieldSelector=spec.nodeName%3Dn1&watch=1&labelSelector=a+in+%28b%29&x&bad=%zz%4",
        );
        assert_eq!(q.get("fieldSelector"), Some("spec.nodeName=n1"));
        assert!(q.flag("watch") && !q.flag("x"));
        assert_eq!(q.get("labelSelector"), Some("a in (b)"));
        assert_eq!(q.get("x"), Some(""));
        assert_eq!(q.get("bad"), Some("%zz%4"));
    }

    #[test]
    fn paths_route_to_resources() {
        let at: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let objects = |p| match route(p, at) {
            Route::Objects {
                resource,
                namespace,
                name,
            } => Some((resource, namespace, name)),
            _ => None,
        };
        assert_eq!(objects("/api/v1/pods"), Some((Resource::Pods, None, None)));
        assert_eq!(
            objects("/api/v1/namespaces/ns/pods/a"),
            Some((Resource::Pods, Some("ns".into()), Some("a".into())))
        );
        assert_eq!(
            objects("/api/v1/nodes/n1/"),
            Some((Resource::Nodes, None, Some("n1".into())))
        );
        assert_eq!(objects("/api/v1/nodes/n1/status"), None);
        assert_eq!(
            objects("/api/v1/namespaces/ns/nodes/n1"),
            None,
            "nodes are cluster-scoped"
        );
        assert_eq!(
            objects("/api/v1/services/web"),
            None,
            "a service is named within its namespace"
        );
        assert_eq!(
            objects("/api/v1/services"),
            Some((Resource::Services, None, None))
        );
        assert_eq!(
            objects("/api/v1/namespaces/ns/services/web"),
            Some((Resource::Services, Some("ns".into()), Some("web".into())))
        );
        assert_eq!(
            objects("/apis/discovery.k8s.io/v1/endpointslices"),
            Some((Resource::EndpointSlices, None, None))
        );
        assert_eq!(
            objects("/apis/discovery.k8s.io/v1/namespaces/ns/endpointslices/web-1"),
            Some((
                Resource::EndpointSlices,
                Some("ns".into()),
                Some("web-1".into())
            ))
        );
        assert_eq!(
            objects("/apis/coordination.k8s.io/v1/namespaces/ns/leases/l"),
            Some((Resource::Leases, Some("ns".into()), Some("l".into())))
        );
        assert_eq!(
            objects("/apis/coordination.k8s.io/v1beta1/namespaces/ns/leases/l"),
            None
        );
        assert_eq!(
            objects("/api/v1/namespaces/ns/leases/l"),
            None,
            "leases are not in the core group"
        );
        assert_eq!(objects("/api/v1/namespaces/ns"), None);
        assert!(matches!(
            route("/apis/coordination.k8s.io/v1", at),
            Route::Document(_)
        ));
        assert!(matches!(route("/apis/apps/v1", at), Route::Unknown));
        assert!(matches!(
            route("/apis/authentication.k8s.io/v1/tokenreviews", at),
            Route::TokenReviews
        ));
        assert!(matches!(route("/openapi/v2", at), Route::Unknown));
    }
}
