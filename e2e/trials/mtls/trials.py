"""The mTLS trials on a real Envoy. Run through run.sh (a private network namespace).

Question 1 (outbound, one shared listener, per-source-pod client certificate):
  base      one static client certificate (the problem)
  a.*       on-demand secret selector + filter-state mapper, secret named by source IP
  a-chain   (a) with the secret named per pod by a per-source filter chain
  b.*       Cluster.transport_socket_matcher on transport_socket_filter_state
  c         per-source filter chains and per-source clusters
  d         an internal listener in front of (a)
  meta      endpoint-metadata transport_socket_matches combined with (a)
  nosvid    permissive, a pod without its SVID: a chain without the filter state, and a
            transport_socket_matcher that picks mTLS only with it (plaintext, never a
            borrowed certificate)
  add, ip-reuse, scale   what a pod's arrival costs each shape, and what it leaves behind
Question 2 (inbound, capture listener handing off to per-pod listeners):
  q2 *      tls_inspector placement, strict and permissive, rotation

Each trial prints PASS or FAIL with what was observed; PASS means the behaviour recorded
in RESULTS.md still holds (including the expected negatives, which say so).
"""

import json
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import configs as C
import rig
from rig import RESULTS, report, trial
from rig import AGENT, FOREIGN, POD_A, POD_B, POD_C
from sds import SdsServer

A, B, NEW = "127.0.0.2", "127.0.0.3", "127.0.0.44"
WEB = ("127.0.0.10", 8443)
PLAIN = ("127.0.0.11", 8080)
PERMISSIVE = ("127.0.0.12", 8443)
SVC = "web.default.svc"
EXPECT = {A: POD_A, B: POD_B}
# The socket's peer, never an address a filter restored (PROXY protocol, XFF): the
# connection's own source is the pod.
SRC_FMT = "svid|%DOWNSTREAM_DIRECT_REMOTE_ADDRESS_WITHOUT_PORT%"

def summarize(results, expected):
    """(mismatches, conns by source, shared conns) for an interleave run."""
    bad = [r for r in results if r.get("status") != 200 or r.get("peer") != expected[r["src"]]]
    conns = {}
    for r in results:
        if r.get("conn"):
            conns.setdefault(r["src"], set()).add(r["conn"])
    srcs = list(expected)
    shared = set.intersection(*(conns.get(s, set()) for s in srcs)) if len(srcs) > 1 else set()
    return bad, conns, shared


def describe(results, expected):
    bad, conns, shared = summarize(results, expected)
    n = len(results)
    parts = [f"{n - len(bad)}/{n} requests carried their own pod's SPIFFE ID"]
    for s in expected:
        parts.append(f"{s}: {len(conns.get(s, ()))} upstream conn(s)")
    if shared:
        parts.append(f"upstream conns shared across pods: {sorted(shared)}")
    if bad:
        b = bad[0]
        parts.append(f"e.g. src {b['src']} got status={b.get('status')} "
                     f"peer={b.get('peer') or b.get('error')}")
    return bad, shared, "; ".join(parts)


class World:
    def __init__(self, envoy_bin, work):
        self.envoy_bin = envoy_bin
        self.work = work
        self.procs = rig.Procs()
        self.pki = rig.Pki(os.path.join(work, "pki"))
        self.sds = SdsServer(os.path.join(work, "sds.sock"),
                             log=lambda m: print(f"      [{m}]", flush=True))
        self.node = self.remote = None
        self.lds, self.cds = {}, {}

    def issue(self):
        p = self.pki
        self.cert = {
            "a": p.leaf("a", POD_A, 0xA1), "a2": p.leaf("a2", POD_A, 0xA2),
            "b": p.leaf("b", POD_B, 0xB1), "b2": p.leaf("b2", POD_B, 0xB2),
            "c": p.leaf("c", POD_C, 0xC1), "agent": p.leaf("agent", AGENT, 0xAA),
            "web": p.leaf("web", rig.POD_WEB, 0xEB),
            "foreign": p.leaf("foreign", FOREIGN, 0xF1, ca=p.other_ca),
            "evil": p.leaf("evil", "spiffe://evil.test/ns/default/pod/x", 0xE1),
        }
        self.spiffe_of = {"a": POD_A, "b": POD_B, "c": POD_C, "agent": AGENT}

    def pem(self, which):
        cert, key = self.cert[which]
        return open(cert, "rb").read(), open(key, "rb").read()

    def serve_secret(self, name, which):
        self.sds.set_cert(name, *self.pem(which))

    def push(self, lds=False, cds=False):
        rig.push_config(self.node, self.work, self.lds if lds else None,
                        self.cds if cds else None)

    def close(self):
        self.procs.stop_all()
        self.sds.stop()


# --- the node's configuration for question 1 ---------------------------------------------

def fs(fmt, factory="envoy.hashable_string", key=C.MAPPER_KEY, shared="ONCE"):
    return C.set_filter_state([C.fs_value(key, fmt, factory, shared)])


def b_cluster(w, tag, pods):
    """(b): one transport_socket_matches entry per pod, chosen by the source IP."""
    matches = [{"name": f"pod-{p}", "transport_socket": C.tls_sds(w.pki, f"svid|{ip}")}
               for ip, p in pods.items()]
    matcher = {"matcher_tree": {
        "input": {"name": "envoy.matching.inputs.transport_socket_filter_state",
                  "typed_config": {"@type": C.FS_INPUT, "key": "aether.source_ip"}},
        "exact_match_map": {"map": {
            ip: {"action": {"name": "envoy.matching.action.transport_socket.name",
                            "typed_config": {"@type": C.TS_NAME_ACTION, "name": f"pod-{p}"}}}
            for ip, p in pods.items()}}}}
    return C.cluster(f"{tag}|outbound|8443||web.default", [WEB], C.tls_sds(w.pki, C.AGENT_SECRET),
                     transport_socket_matches=matches, transport_socket_matcher=matcher)


def c_cluster(w, ip, p):
    return C.cluster(f"c|outbound|8443||web.default|{p}", [WEB], C.tls_sds(w.pki, f"svid|{ip}"))


def c_listener(w, pods):
    """(c): one filter chain per source pod, each routing to that pod's clusters."""
    chains = [{"name": f"pod-{p}",
               "filter_chain_match": {"source_prefix_ranges": [{"address_prefix": ip, "prefix_len": 32}]},
               "filters": [C.hcm(f"c_{p}", C.outbound_vhosts({SVC: f"c|outbound|8443||web.default|{p}"}),
                                 f"{w.work}/node-access.log", C.NODE_LOG_FMT)]}
              for ip, p in pods.items()]
    return C.outbound_listener("c", 15007, {}, chains=chains)


def a_chain_listener(w, pods):
    """(a) with per-source filter chains that name the secret per pod (a uid), not per IP."""
    chains = [{"name": f"pod-{uid}",
               "filter_chain_match": {"source_prefix_ranges": [{"address_prefix": ip, "prefix_len": 32}]},
               "filters": [fs(f"svid|{uid}"),
                           C.hcm("a_chain", C.outbound_vhosts({SVC: "a-chain|outbound|8443||web.default"}),
                                 f"{w.work}/node-access.log", C.NODE_LOG_FMT)]}
              for ip, uid in pods.items()]
    return C.outbound_listener("a-chain", 15014, {}, chains=chains)


def nosvid_matcher():
    """mTLS only when the endpoint is marked AND the connection carries the mapper's key."""
    def single(input_name, type_url, fields, match):
        return {"single_predicate": {
            "input": {"name": input_name, "typed_config": {"@type": type_url, **fields}},
            "value_match": match}}
    return {"matcher_list": {"matchers": [{
        "predicate": {"and_matcher": {"predicate": [
            single("envoy.matching.inputs.endpoint_metadata", C.META_INPUT,
                   {"filter": "envoy.transport_socket_match", "path": [{"key": "tls"}]},
                   {"exact": "mtls"}),
            single("envoy.matching.inputs.transport_socket_filter_state", C.FS_INPUT,
                   {"key": C.MAPPER_KEY}, {"prefix": "svid|"}),
        ]}},
        "on_match": {"action": {"name": "envoy.matching.action.transport_socket.name",
                                "typed_config": {"@type": C.TS_NAME_ACTION, "name": "mtls"}}}}]}}


def nosvid_listener(w, cluster, without_svid):
    """The default chain sets the mapper's key per source; the sources without an SVID
    match a chain of their own that sets nothing."""
    log = f"{w.work}/node-access.log"
    hcm = C.hcm("nosvid", C.outbound_vhosts({SVC: cluster}), log, C.NODE_LOG_FMT)
    chains = [{"name": "default", "filters": [fs(SRC_FMT), hcm]}]
    if without_svid:
        chains.append({"name": "without-svid", "filter_chain_match": {
            "direct_source_prefix_ranges": [{"address_prefix": ip, "prefix_len": 32}
                                            for ip in without_svid]},
            "filters": [hcm]})
    return C.outbound_listener("nosvid", 15021, {}, chains=chains)


SCALE_CLUSTERS = 4


def q1_resources(w):
    pki = w.pki
    web = [WEB]
    L, K = w.lds, w.cds
    log = f"{w.work}/node-access.log"

    def listener(name, port, cluster, filters=()):
        L[name] = C.outbound_listener(name, port, {SVC: cluster}, list(filters), log=log)

    def cluster(c):
        K[c["name"]] = c

    # base: one client certificate for the whole node.
    cluster(C.cluster("base|outbound|8443||web.default", web, C.tls_sds(pki, C.AGENT_SECRET)))
    listener("base", 15001, "base|outbound|8443||web.default")

    # (a) on-demand selector, filter-state mapper; the two object factories.
    for port, tag, factory in ((15002, "a-hash", "envoy.hashable_string"),
                               (15003, "a-string", "envoy.string")):
        name = f"{tag}|outbound|8443||web.default"
        cluster(C.cluster(name, web, C.tls_on_demand(pki)))
        listener(tag, port, name, [fs(SRC_FMT, factory)])
    # (a) with envoy.string and one upstream pool per downstream connection.
    name = "a-string-perconn|outbound|8443||web.default"
    cluster(C.cluster(name, web, C.tls_on_demand(pki), connection_pool_per_downstream_connection=True))
    listener("a-string-perconn", 15011, name, [fs(SRC_FMT, "envoy.string")])
    # (a) rotation: the same selector, idle upstream connections closed after 300 ms.
    name = "a-rot|outbound|8443||web.default"
    cluster(C.cluster(name, web, C.tls_on_demand(pki), idle_timeout="0.3s"))
    listener("a-rot", 15010, name, [fs(SRC_FMT)])
    # (a) named per pod by a per-source filter chain.
    cluster(C.cluster("a-chain|outbound|8443||web.default", web, C.tls_on_demand(pki)))
    L["a-chain"] = a_chain_listener(w, {A: "uid-a", B: "uid-b"})

    # (b) transport_socket_matcher on a filter-state input, one match entry per pod.
    for port, tag, factory in ((15004, "b-hash", "envoy.hashable_string"),
                               (15005, "b-string", "envoy.string")):
        cluster(b_cluster(w, tag, {A: "a", B: "b"}))
        listener(tag, port, f"{tag}|outbound|8443||web.default",
                 [fs("%DOWNSTREAM_DIRECT_REMOTE_ADDRESS_WITHOUT_PORT%", factory, key="aether.source_ip")])

    # (c) per-source filter chains, each with its own route table and clusters.
    for ip, p in ((A, "a"), (B, "b")):
        cluster(c_cluster(w, ip, p))
    L["c"] = c_listener(w, {A: "a", B: "b"})

    # meta: one cluster, a TLS endpoint marked in metadata and a plaintext one; the
    # marked endpoint gets the on-demand selector, the other the default raw socket.
    name = "meta|outbound|8443||web.default"
    cluster(C.cluster(
        name, [(*WEB, {"tls": "mtls"}), PLAIN],
        {"name": "envoy.transport_sockets.raw_buffer", "typed_config": {"@type": C.RAW_BUFFER}},
        transport_socket_matches=[{"name": "mtls", "match": {"tls": "mtls"},
                                   "transport_socket": C.tls_on_demand(pki)}]))
    listener("meta", 15008, name, [fs(SRC_FMT)])

    # nosvid: B has no SVID. Its source matches a chain without set_filter_state, and the
    # cluster picks mTLS only for a marked endpoint AND a connection carrying the filter
    # state (the mapper's key): B goes plaintext, A presents its own certificate, and no
    # connection can present any other (the mapper's default names a secret never served).
    name = "nosvid|outbound|8443||web.default"
    cluster(C.cluster(
        name, [(*PERMISSIVE, {"tls": "mtls"})],
        {"name": "envoy.transport_sockets.raw_buffer", "typed_config": {"@type": C.RAW_BUFFER}},
        transport_socket_matches=[{"name": "mtls", "match": {"tls": "mtls"},
                                   "transport_socket": C.tls_on_demand(pki, default="svid|none")}],
        transport_socket_matcher=nosvid_matcher()))
    L["nosvid"] = nosvid_listener(w, name, without_svid=[B])

    # (d) outbound HTTP -> internal listener (tcp_proxy) -> a cluster with the selector.
    cluster({
        "name": "d|egress", "connect_timeout": "2s",
        "transport_socket": {"name": "envoy.transport_sockets.internal_upstream",
                             "typed_config": {"@type": C.INTERNAL_UPSTREAM,
                                              "transport_socket": {
                                                  "name": "envoy.transport_sockets.raw_buffer",
                                                  "typed_config": {"@type": C.RAW_BUFFER}}}},
        "load_assignment": {"cluster_name": "d|egress", "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"envoy_internal_address": {
                "server_listener_name": "d-egress"}}}}]}]}})
    name = "d|outbound|8443||web.default"
    cluster(C.cluster(name, web, C.tls_on_demand(pki)))
    listener("d", 15009, "d|egress", [fs(SRC_FMT, shared="TRANSITIVE")])
    L["d-egress"] = {"name": "d-egress", "internal_listener": {},
                     "filter_chains": [{"filters": [{
                         "name": "envoy.filters.network.tcp_proxy",
                         "typed_config": {"@type": C.TCP_PROXY, "stat_prefix": "d_egress",
                                          "cluster": name}}]}]}

    # (a) with a misspelt filter-state key: the mapper finds nothing and says nothing.
    # On its own cluster, and on a-hash's (whose pools (a) has filled for A and B).
    name = "a-typo|outbound|8443||web.default"
    cluster(C.cluster(name, web, C.tls_on_demand(pki)))
    listener("a-typo", 15018, name, [fs(SRC_FMT, key="envoy.tls.certificate_mapper.on_demand_secret")])
    listener("a-typo-shared", 15019, "a-hash|outbound|8443||web.default",
             [fs(SRC_FMT, key="envoy.tls.certificate_mapper.on_demand_secret")])

    # (a) with the secrets over the ADS stream (config_source: ads), the agent's shape.
    name = "a-ads|outbound|8443||web.default"
    cluster(C.cluster(name, web, C.tls_on_demand(pki, source=C.ADS_SOURCE)))
    listener("a-ads", 15017, name, [fs(SRC_FMT)])

    # scale: several services behind one listener, for what each (pod, service) costs;
    # "scale-static" is the same with one fixed certificate, so the difference is what the
    # per-pod certificate contexts cost.
    for tag, port, tls in (("scale", 15013, lambda: C.tls_on_demand(pki, source=C.ADS_SOURCE)),
                           ("scale-static", 15015, lambda: C.tls_sds(pki, C.AGENT_SECRET))):
        routes = {}
        for k in range(1, SCALE_CLUSTERS + 1):
            name = f"{tag}-{k}|outbound|8443||web.default"
            cluster(C.cluster(name, web, tls(), idle_timeout="1s"))
            routes[f"s{k}.default.svc"] = name
        L[tag] = C.outbound_listener(tag, port, routes, [fs(SRC_FMT)], log=log)


# --- question 1 trials ---------------------------------------------------------------------

@trial
def q1_base(w):
    res = rig.interleave("127.0.0.1", 15001, SVC, [A, B], rounds=2, concurrent=2)
    peers = sorted({r.get("peer") for r in res})
    ok = all(r.get("status") == 200 for r in res) and peers == [AGENT]
    report("q1.base (one node certificate)", ok,
           f"every request reached web over mTLS as {peers}: the upstream cannot tell pods apart")


@trial
def q1_a(w, port, label, expect_leak=False, extra=""):
    res = rig.interleave("127.0.0.1", port, SVC, [A, B])
    bad, shared, text = describe(res, EXPECT)
    if extra == "conns":
        text += f"; {len({r['conn'] for r in res if r.get('conn')})} upstream conns for {len(res)} downstream conns"
    ok = (bool(bad) and bool(shared)) if expect_leak else (not bad and not shared)
    report(label, ok, text)


@trial
def q1_tls13(w):
    st = w.node.stats("cluster.a-hash|outbound|8443||web.default.ssl.versions")
    report("q1.a upstream handshakes are TLS 1.3 (client cert chosen after the ServerHello)",
           bool(st) and all("TLSv1.3" in k for k in st), f"{st}")


@trial
def q1_a_typo(w):
    own = rig.interleave("127.0.0.1", 15018, SVC, [A, B], rounds=1, concurrent=1)
    peers = sorted({r.get("peer") for r in own})
    # The same misspelt object on a listener that routes to a-hash, whose pools already
    # hold connections for A and B made by the correctly spelt listener (15002).
    warm = [rig.http_get(s, "127.0.0.1", 15002, SVC) for s in (A, B)]
    shared = [rig.http_get(s, "127.0.0.1", 15019, SVC) for s in (A, B)]
    rode = all(r.get("peer") == EXPECT[r["src"]] and r.get("conn") == wr.get("conn")
               for r, wr in zip(shared, warm))
    ok = peers == [AGENT] and all(r.get("status") == 200 for r in own) and rode
    report("q1.a misspelt filter-state key (expected: silently the default identity)", ok,
           f"key envoy.tls.certificate_mapper.on_demand_secret (mapper, not mappers) on its own "
           f"cluster: every request went out as {peers}, no error anywhere; the same object on "
           f"a cluster whose pools the right key had filled: each pod's request rode that pod's "
           f"pooled conn ({rode}) - the pool key hashes the object's value, not its name")


@trial
def q1_a_missing(w):
    """A source with no secret: silent server, removing server, secret arriving late."""
    node = w.node
    out = []
    stat = "cluster.a-hash|outbound|8443||web.default.upstream_cx_connect_timeout"
    t0 = node.stat(stat)
    w.sds.unknown_policy = "silent"
    silent = rig.http_get("127.0.0.4", "127.0.0.1", 15002, SVC)
    out.append(f"silent SDS: status={silent.get('status')} after {silent['secs']:.2f}s "
               f"(connect_timeout 2s; upstream_cx_connect_timeout +{node.stat(stat) - t0}; "
               f"{node_log_for('127.0.0.4', w)})")
    w.sds.unknown_policy = "remove"
    removed = rig.http_get("127.0.0.14", "127.0.0.1", 15002, SVC)
    out.append(f"SDS answers removed_resources: status={removed.get('status')} after "
               f"{removed['secs']:.3f}s ({node_log_for('127.0.0.14', w)})")
    w.sds.unknown_policy = "silent"
    late = {}
    t = threading.Thread(target=lambda: late.update(
        rig.http_get("127.0.0.24", "127.0.0.1", 15002, SVC)))
    t.start()
    subscribed = w.sds.wait_subscribed("svid|127.0.0.24")
    w.serve_secret("svid|127.0.0.24", "c")
    t.join()
    out.append(f"secret served while the handshake waited (subscription seen: {subscribed}): "
               f"status={late.get('status')} peer={late.get('peer')} after {late.get('secs', 0):.3f}s")
    ok = (silent.get("status") == 503 and 1.9 < silent["secs"] < 3
          and removed.get("status") == 503 and removed["secs"] < 1.0
          and late.get("status") == 200 and late.get("peer") == POD_C)
    report("q1.a missing secret", ok, "; ".join(out))


def node_log_lines(src, w):
    try:
        return [l for l in open(f"{w.work}/node-access.log") if f"src={src} " in l]
    except FileNotFoundError:
        return []


def node_log_for(src, w, want="code=503"):
    """The flags and upstream failure of the node's last access log line for `src` with `want`."""
    try:
        line = rig.poll(lambda: [l for l in node_log_lines(src, w) if want in l], timeout=5,
                        what=f"node access log for {src}")[-1]
        return " ".join(p for p in line.split() if p.split("=")[0] in ("flags", "upstream_failure"))
    except TimeoutError:
        return "no access log line"


CONFIG_STATS = ("cluster_manager.cluster_added", "cluster_manager.cluster_modified",
                "cluster_manager.cluster_removed", "listener_manager.listener_added",
                "listener_manager.listener_modified", "listener_manager.listener_in_place_updated",
                "listener_manager.total_filter_chains_draining")


def config_stats(node):
    return {k: node.stat(k) for k in CONFIG_STATS}


def delta(before, after):
    return {k.split(".")[-1]: after[k] - before[k] for k in before if after[k] != before[k]}


@trial
def q1_a_removed(w):
    """Pod deleted: the agent removes its secret. Pooled conns vs new handshakes."""
    node = w.node
    cx = "cluster.a-rot|outbound|8443||web.default.upstream_cx_active"
    name = f"svid|{NEW}"
    w.serve_secret(name, "c")
    first = rig.http_get(NEW, "127.0.0.1", 15010, SVC)
    w.sds.unknown_policy = "remove"
    w.sds.remove(name)
    pooled = rig.http_get(NEW, "127.0.0.1", 15010, SVC)
    rig.poll(lambda: node.stat(cx) == 0, what="a-rot idle connection closed")
    fresh = rig.http_get(NEW, "127.0.0.1", 15010, SVC)
    w.sds.unknown_policy = "silent"
    ok = (first.get("peer") == POD_C and pooled.get("peer") == POD_C
          and pooled.get("conn") == first.get("conn") and fresh.get("status") == 503
          and fresh["secs"] < 1)
    report("q1.a secret removed (pod deleted)", ok,
           f"right after the removal the pooled conn still served as {pooled.get('peer')}; once it "
           f"closed, a new handshake failed in {fresh['secs']:.3f}s with {fresh.get('status')} "
           f"({node_log_for(NEW, w)})")
    w.serve_secret(name, "c")


@trial
def q1_a_rotation(w):
    node = w.node
    before = config_stats(node)
    r1 = rig.http_get(A, "127.0.0.1", 15010, SVC)
    w.serve_secret(f"svid|{A}", "a2")
    # The next request may still ride the pooled connection from before the rotation.
    r2 = rig.http_get(A, "127.0.0.1", 15010, SVC)
    same_conn = r2.get("conn") == r1.get("conn")
    rig.poll(lambda: node.stat("cluster.a-rot|outbound|8443||web.default.upstream_cx_active") == 0,
             what="a-rot idle connection closed")
    r3 = rig.http_get(A, "127.0.0.1", 15010, SVC)
    after = config_stats(node)
    ok = (r1.get("serial") == "a1" and r3.get("serial") == "a2"
          and r3.get("peer") == POD_A and before == after)
    report("q1.a rotation (same SDS name, new certificate)", ok,
           f"before: serial {r1.get('serial')}; right after the push: serial {r2.get('serial')} "
           f"({'the same pooled conn' if same_conn else 'a new conn'}); after the idle close: "
           f"serial {r3.get('serial')}; config changes: {delta(before, after) or 'none'}")
    w.serve_secret(f"svid|{A}", "a")


@trial
def q1_add_pod(w):
    """Pod C (127.0.0.44) arrives: what each shape has to change, and what it disturbs."""
    node = w.node
    w.serve_secret(f"svid|{NEW}", "c")
    w.serve_secret("svid|uid-c", "c")
    out, ok = [], True

    def measure(label, port, cluster, change):
        nonlocal ok
        cx = f"cluster.{cluster}.upstream_cx_destroy"
        warm = rig.http_get(A, "127.0.0.1", port, SVC)
        s0, d0 = config_stats(node), node.stat(cx)
        t0 = time.monotonic()
        change()
        t_cfg = time.monotonic() - t0
        rc = rig.http_get(NEW, "127.0.0.1", port, SVC)
        ra = rig.http_get(A, "127.0.0.1", port, SVC)
        s1 = config_stats(node)
        closed = node.stat(cx) - d0
        good = rc.get("peer") == POD_C and ra.get("peer") == POD_A and warm.get("status") == 200
        ok = ok and good
        out.append(f"{label}: C served as {rc.get('peer', rc.get('error'))}; config changes "
                   f"{delta(s0, s1) or 'none'} (applied in {t_cfg:.2f}s); pooled upstream conns "
                   f"of the existing pods closed by the change: {closed}")
        return s0, s1, closed

    def size(resource):
        return len(json.dumps(resource, separators=(",", ":")))

    # (a): only an SDS secret.
    sa0, sa1, _ = measure("(a)", 15002, "a-hash|outbound|8443||web.default", lambda: None)
    ok = ok and sa0 == sa1
    # (a-chain): a filter chain on the outbound listener (LDS), the secret over SDS.
    grow = {}

    def add_chain():
        old = size(w.lds["a-chain"])
        w.lds["a-chain"] = a_chain_listener(w, {A: "uid-a", B: "uid-b", NEW: "uid-c"})
        grow["a-chain"] = f"the outbound listener +{size(w.lds['a-chain']) - old} B"
        w.push(lds=True)
    s0, s1, _ = measure("(a-chain)", 15014, "a-chain|outbound|8443||web.default", add_chain)
    ok = ok and s1["listener_manager.listener_in_place_updated"] - s0["listener_manager.listener_in_place_updated"] == 1
    # (b): every cluster gets a transport_socket_matches entry and a matcher branch (CDS).
    def add_b():
        name = "b-hash|outbound|8443||web.default"
        old = size(w.cds[name])
        w.cds[name] = b_cluster(w, "b-hash", {A: "a", B: "b", NEW: "c"})
        grow["b"] = f"every service's cluster +{size(w.cds[name]) - old} B"
        w.push(cds=True)
    s0, s1, closed_b = measure("(b)", 15004, "b-hash|outbound|8443||web.default", add_b)
    ok = ok and s1["cluster_manager.cluster_modified"] - s0["cluster_manager.cluster_modified"] == 1
    # (c): a filter chain (LDS) and a cluster per service (CDS).
    def add_c():
        old = size(w.lds["c"])
        w.cds[f"c|outbound|8443||web.default|c"] = c_cluster(w, NEW, "c")
        w.lds["c"] = c_listener(w, {A: "a", B: "b", NEW: "c"})
        grow["c"] = (f"the outbound listener +{size(w.lds['c']) - old} B (+ its own route table "
                     f"for every service), a new cluster per service of "
                     f"{size(w.cds['c|outbound|8443||web.default|c'])} B")
        w.push(cds=True, lds=True)
    s0, s1, _ = measure("(c)", 15007, "c|outbound|8443||web.default|a", add_c)
    report("q1.add a pod: what changes", ok,
           " | ".join(out) + f" | config bytes per pod (JSON, this trial's shapes): {grow}")


@trial
def q1_ip_reuse(w):
    """Pod A is gone and a new pod (C) gets its IP: what identity do its requests carry?"""
    node = w.node
    # (a), named by IP: the agent replaces the secret under the same name.
    before = rig.http_get(A, "127.0.0.1", 15002, SVC)
    w.serve_secret(f"svid|{A}", "c")
    after = rig.http_get(A, "127.0.0.1", 15002, SVC)
    # (a-chain), named per pod: the chain for that IP now names the new pod.
    chained_before = rig.http_get(A, "127.0.0.1", 15014, SVC)
    w.lds["a-chain"] = a_chain_listener(w, {A: "uid-c", B: "uid-b", NEW: "uid-c"})
    w.push(lds=True)
    chained_after = rig.http_get(A, "127.0.0.1", 15014, SVC)
    ok = (before.get("peer") == POD_A and after.get("peer") == POD_A
          and chained_before.get("peer") == POD_A and chained_after.get("peer") == POD_C)
    report("q1.ip-reuse (expected: (a) by IP keeps the old pod's identity on pooled conns)", ok,
           f"(a) named by IP: after the secret for {A} became pod C's, the next request still went "
           f"as {after.get('peer')} on upstream conn {after.get('conn')} (before: {before.get('conn')}); "
           f"(a-chain) named by pod uid: {chained_before.get('peer')} -> {chained_after.get('peer')} "
           f"(a new pool key, a new handshake)")
    w.serve_secret(f"svid|{A}", "a")
    w.lds["a-chain"] = a_chain_listener(w, {A: "uid-a", B: "uid-b", NEW: "uid-c"})
    w.push(lds=True)


@trial
def q1_scale(w, pods=40):
    """pods x SCALE_CLUSTERS (pod, service) pairs through the selector: memory and SDS."""
    node = w.node
    srcs = [f"127.0.1.{i}" for i in range(1, pods + 1)]
    for s in srcs:
        w.serve_secret(f"svid|{s}", "c")
    hosts = [f"s{k}.default.svc" for k in range(1, SCALE_CLUSTERS + 1)]
    pairs = pods * SCALE_CLUSTERS

    def mem():
        return int(json.loads(node.get("/memory"))["allocated"])

    def run(tag, port):
        def active():
            return sum(node.stat(f"cluster.{tag}-{k}|outbound|8443||web.default.upstream_cx_active")
                       for k in range(1, SCALE_CLUSTERS + 1))
        for h in hosts:  # warm each cluster once, from a source with no secret of its own
            rig.http_get("127.0.0.1", "127.0.0.1", port, h)
        rig.poll(lambda: active() == 0, what=f"{tag} clusters idle")
        streams0, m0 = node.stat("cluster.sds.upstream_rq_active"), mem()
        with ThreadPoolExecutor(16) as ex:
            res = list(ex.map(lambda sh: rig.http_get(sh[0], "127.0.0.1", port, sh[1]),
                              [(s, h) for s in srcs for h in hosts]))
        m1, conns = mem(), active()
        rig.poll(lambda: active() == 0, what=f"{tag} clusters idle again")
        m2 = mem()
        contexts = sum(node.stat(f"cluster.{tag}-{k}|outbound|8443||web.default.on_demand_secret.cert_active")
                       for k in range(1, SCALE_CLUSTERS + 1))
        return {"res": res, "conns": conns, "busy": (m1 - m0) / pairs / 1024,
                "idle": (m2 - m0) / pairs / 1024, "contexts": contexts,
                "streams": node.stat("cluster.sds.upstream_rq_active") - streams0}

    static = run("scale-static", 15015)
    dyn = run("scale", 15013)
    good = sum(1 for r in dyn["res"] if r.get("peer") == POD_C)
    subs = sorted({n for _, _, names in w.sds.requests for n in names if n.startswith("svid|127.0.1.")})
    report(f"q1.scale {pods} pods x {SCALE_CLUSTERS} services through (a) over ADS", good == pairs,
           f"{good}/{pairs} served with the pod's identity; {dyn['conns']} upstream TLS conns while "
           f"busy (static cert, same pool keys: {static['conns']}); memory per (pod, service): "
           f"{dyn['busy']:.1f} KiB with its conn, {dyn['idle']:.1f} KiB left once the conns closed "
           f"(static cert: {static['busy']:.1f} and {static['idle']:.1f}); {dyn['contexts']} "
           f"certificate contexts ({dyn['contexts'] // SCALE_CLUSTERS} per cluster, never evicted "
           f"in 1.40); {len(subs)} SDS subscriptions, {dyn['streams']} new gRPC streams "
           f"(they ride the ADS stream)")


@trial
def q1_sds_streams(w):
    """On a non-ADS gRPC config source every secret name is its own gRPC stream."""
    node = w.node
    before = node.stat("cluster.sds.upstream_rq_active")
    names = [f"127.0.2.{i}" for i in range(1, 11)]
    for s in names:
        w.serve_secret(f"svid|{s}", "c")
    res = [rig.http_get(s, "127.0.0.1", 15002, SVC) for s in names]
    after = node.stat("cluster.sds.upstream_rq_active")
    ok = all(r.get("peer") == POD_C for r in res) and after - before == len(names)
    report("q1.a SDS over its own gRPC source: one stream per secret name", ok,
           f"{len(names)} new names -> {after - before} new gRPC streams to the SDS cluster")


@trial
def q1_file_sds(w):
    """The on-demand selector over a file config source: one file serves every name."""
    path = f"{w.work}/file-sds/secret.json"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    cert, key = w.cert["a"]
    with open(path, "w") as f:
        json.dump(C.discovery_response(C.T + "envoy.extensions.transport_sockets.tls.v3.Secret", [
            {"name": f"svid|{A}", "tls_certificate": {"certificate_chain": {"filename": cert},
                                                     "private_key": {"filename": key}}}]), f)
    ctx = C.tls_on_demand(w.pki)
    sel = ctx["typed_config"]["common_tls_context"]["custom_tls_certificate_selector"]["typed_config"]
    sel["config_source"] = {"resource_api_version": "V3", "path_config_source": {"path": path}}
    name = "file|outbound|8443||web.default"
    w.cds[name] = C.cluster(name, [WEB], ctx)
    w.lds["file"] = C.outbound_listener("file", 15012, {SVC: name}, [fs(SRC_FMT)],
                                        log=f"{w.work}/node-access.log")
    w.push(cds=True, lds=True)
    ra = rig.http_get(A, "127.0.0.1", 15012, SVC)
    rb = rig.http_get(B, "127.0.0.1", 15012, SVC)
    errs = sorted({l.split("] ", 1)[-1][:160] for l in w.node.log_grep("Unexpected SDS secret")})
    ok = ra.get("peer") == POD_A and rb.get("status") == 503
    report("q1.a over a file SDS source (path_config_source)", ok,
           f"A (the name in the file): status={ra.get('status')} peer={ra.get('peer')}; "
           f"B (another name, same file): status={rb.get('status')} after {rb['secs']:.1f}s; "
           f"envoy log: {errs[:1] or 'nothing'}")


def start_node(w):
    for ip, which in ((A, "a"), (B, "b")):
        w.serve_secret(f"svid|{ip}", which)
    for uid, which in (("uid-a", "a"), ("uid-b", "b")):
        w.serve_secret(f"svid|{uid}", which)
    w.serve_secret(C.AGENT_SECRET, "agent")
    w.sds.set_ca(TRUST, open(w.pki.ca_pem(), "rb").read())
    for ip in INBOUND:
        w.serve_secret(f"svid|{ip}", "b")
    q1_resources(w)
    listeners, clusters = q2_resources(w)  # the node has one Envoy: question 2's join it
    w.lds.update((l["name"], l) for l in listeners)
    w.cds.update((c["name"], c) for c in clusters)
    w.push(lds=True, cds=True)
    # One worker: upstream connection pools are per worker, so with one the trials about
    # pooled connections (leaks, rotation, IP reuse) are deterministic; with N workers the
    # same happens per worker.
    w.node = rig.Envoy(w.procs, w.envoy_bin, w.work, "node",
                       C.node_bootstrap(w.work, os.path.join(w.work, "sds.sock"),
                                        internal_listeners=True), 19000, concurrency=1)
    print(f"      node Envoy {json.loads(w.node.get('/server_info'))['version']}: "
          f"{len(w.lds)} listeners, {len(w.cds) + 1} clusters", flush=True)


def q1(w):
    q1_base(w)
    q1_a(w, 15002, "q1.a on-demand selector, envoy.hashable_string")
    q1_tls13(w)
    q1_a(w, 15003, "q1.a on-demand selector, envoy.string (expected: pools shared, identity leaks)",
         expect_leak=True)
    q1_a(w, 15011, "q1.a envoy.string + connection_pool_per_downstream_connection", extra="conns")
    q1_a(w, 15014, "q1.a-chain per-source chains name the secret per pod")
    q1_a_typo(w)
    q1_a_missing(w)
    q1_a_rotation(w)
    q1_a_removed(w)
    q1_a(w, 15004, "q1.b transport_socket_matcher, envoy.hashable_string")
    q1_a(w, 15005, "q1.b transport_socket_matcher, envoy.string (expected: pools shared, identity leaks)",
         expect_leak=True)
    q1_a(w, 15007, "q1.c per-source filter chains + per-source clusters")
    q1_a(w, 15009, "q1.d internal listener in front of (a)")
    q1_meta(w)
    q1_nosvid(w)
    q1_add_pod(w)
    q1_ip_reuse(w)
    q1_a(w, 15017, "q1.a over ADS (config_source: ads), envoy.hashable_string")
    q1_sds_streams(w)
    q1_scale(w)


@trial
def q1_meta(w):
    res = []
    for src in (A, B):  # a batch per pod, so round robin sends each pod to both endpoints
        for _ in range(4):
            res.append(rig.http_get(src, "127.0.0.1", 15008, SVC))
    tls = [r for r in res if r.get("backend") == "tls"]
    plain = [r for r in res if r.get("backend") == "plain"]
    tls_ok = all(r.get("peer") == EXPECT[r["src"]] for r in tls)
    conns, plain_conns = {}, {}
    for r in tls:
        conns.setdefault(r["src"], set()).add(r["conn"])
    for r in plain:
        plain_conns.setdefault(r["src"], set()).add(r["conn"])
    shared = conns.get(A, set()) & conns.get(B, set())
    plain_shared = plain_conns.get(A, set()) & plain_conns.get(B, set())
    ok = (len(tls) + len(plain) == len(res) and tls_ok and not shared
          and set(conns) == {A, B} and set(plain_conns) == {A, B})
    report("q1.meta endpoint-metadata match + on-demand selector", ok,
           f"{len(tls)} requests to the marked endpoint over mTLS, each with its own pod's ID: "
           f"{tls_ok}; {len(plain)} to the unmarked endpoint in plaintext; TLS conns per pod "
           f"{ {k: len(v) for k, v in conns.items()} }, plaintext conns per pod "
           f"{ {k: len(v) for k, v in plain_conns.items()} }, shared plaintext conns "
           f"{sorted(plain_shared) or 'none'} (the hashable object keys plaintext pools per pod too)")


@trial
def q1_nosvid(w):
    def batch():
        return [rig.http_get(src, "127.0.0.1", 15021, SVC) for src in (A, B) for _ in range(4)]
    before = w.node.stat("listener_manager.listener_in_place_updated")
    res = batch()
    a = [r for r in res if r["src"] == A]
    b = [r for r in res if r["src"] == B]
    a_ok = all(r.get("status") == 200 and r.get("backend") == "tls" and r.get("peer") == POD_A
               for r in a)
    b_plain = all(r.get("status") == 200 and r.get("backend") == "plain" for r in b)
    # B's SVID arrives: its chain goes (an in-place listener update), and its next
    # connection presents its own certificate.
    L = w.lds
    L["nosvid"] = nosvid_listener(w, "nosvid|outbound|8443||web.default", without_svid=[])
    w.push(lds=True)  # waits for Envoy's lds.update_success
    in_place = w.node.stat("listener_manager.listener_in_place_updated") - before
    after = [rig.http_get(B, "127.0.0.1", 15021, SVC) for _ in range(4)]
    b_own = all(r.get("status") == 200 and r.get("backend") == "tls" and r.get("peer") == POD_B
                for r in after)
    peers = sorted({r.get("peer") or "none" for r in res + after})
    report("q1.nosvid a pod without its SVID goes plaintext, never with another's certificate",
           a_ok and b_plain and b_own and in_place == 1 and AGENT not in peers,
           f"A over mTLS as its own ID: {a_ok}; B (no SVID) reached the permissive server in "
           f"plaintext: {b_plain}; B's chain removed by {in_place} in-place listener update; B "
           f"then over mTLS as its "
           f"own ID: {b_own}; peers seen {peers}")


# --- question 2 ------------------------------------------------------------------------------

# The inbound pods: address -> (listener name, tls_inspector on the pod listener, mode).
# Their connections to port 80 are REDIRECTed to a capture listener (run.sh): 127.0.0.8's
# to 15016, whose capture listener runs the tls_inspector itself; the others' to 15006.
INBOUND = {
    "127.0.0.5": ("inbound|uid-strict", True, "strict"),
    "127.0.0.6": ("inbound|uid-permissive", True, "permissive"),
    "127.0.0.7": ("inbound|uid-noinspector", False, "permissive"),
    "127.0.0.8": ("inbound|uid-capture-inspector", False, "permissive"),
    "127.0.0.9": ("inbound|uid-strict-single", False, "strict-single"),
}
Q2_LOG_FMT = ("chain=%FILTER_CHAIN_NAME% local=%DOWNSTREAM_LOCAL_ADDRESS% "
              "src=%DOWNSTREAM_REMOTE_ADDRESS% peer=%DOWNSTREAM_PEER_URI_SAN% "
              "tls=%DOWNSTREAM_TLS_VERSION% flags=%RESPONSE_FLAGS% "
              "failure=%DOWNSTREAM_TRANSPORT_FAILURE_REASON%")
TRUST = "trust|aether.test"


def pod_tls_context(secret):
    return {"name": "envoy.transport_sockets.tls", "typed_config": {
        "@type": C.DOWNSTREAM_TLS, "require_client_certificate": True,
        "common_tls_context": {
            "tls_certificate_sds_secret_configs": [{"name": secret, "sds_config": C.sds_source()}],
            "combined_validation_context": {
                "default_validation_context": {"match_typed_subject_alt_names": [
                    {"san_type": "URI", "matcher": {"prefix": "spiffe://aether.test/"}}]},
                "validation_context_sds_secret_config": {"name": TRUST,
                                                         "sds_config": C.sds_source()}}}}}


def q2_resources(w):
    log = f"{w.work}/inbound-access.log"

    def tcp_proxy(cluster):
        return {"name": "envoy.filters.network.tcp_proxy",
                "typed_config": {"@type": C.TCP_PROXY, "stat_prefix": cluster, "cluster": cluster,
                                 "access_log": [C.file_log(log, Q2_LOG_FMT)]}}

    listeners = []
    clusters = [C.cluster("inbound|fallback", [("127.0.0.21", 8080)])]
    for port, inspector in ((15006, False), (15016, True)):
        filters = [{"name": "envoy.filters.listener.original_dst",
                    "typed_config": {"@type": C.ORIGINAL_DST}}]
        if inspector:
            filters.append({"name": "envoy.filters.listener.tls_inspector",
                            "typed_config": {"@type": C.TLS_INSPECTOR}})
        listeners.append({
            "name": f"inbound-{port}", "address": C.addr("0.0.0.0", port),
            "use_original_dst": True, "listener_filters": filters,
            "access_log": [C.file_log(log, Q2_LOG_FMT)],
            "filter_chains": [{"name": "capture-fallback",
                               "filters": [tcp_proxy("inbound|fallback")]}]})
    for ip, (name, inspector, mode) in INBOUND.items():
        uid = name.split("|")[1]
        backend = f"inbound|80||{uid}"
        clusters.append(C.cluster(backend, [("127.0.0.20", 8080)]))
        tls_chain = {"name": "tls", "transport_socket": pod_tls_context(f"svid|{ip}"),
                     "filters": [tcp_proxy(backend)]}
        if mode == "strict-single":
            chains = [tls_chain]
        else:
            tls_chain["filter_chain_match"] = {"transport_protocol": "tls"}
            chains = [tls_chain]
            if mode == "permissive":
                chains.append({"name": "plaintext", "filters": [tcp_proxy(backend)]})
        listener = {"name": name, "address": C.addr(ip, 80), "bind_to_port": False,
                    "access_log": [C.file_log(log, Q2_LOG_FMT)], "filter_chains": chains}
        if inspector:
            listener["listener_filters"] = [{"name": "envoy.filters.listener.tls_inspector",
                                             "typed_config": {"@type": C.TLS_INSPECTOR}}]
            if mode == "permissive":
                # A client that waits for the server to speak first (MySQL, SMTP) gives the
                # inspector nothing to read: go on as plaintext after 1 s instead of closing
                # after the default 15 s.
                listener["listener_filters_timeout"] = "1s"
                listener["continue_on_listener_filters_timeout"] = True
        listeners.append(listener)
    return listeners, clusters


def inbound_log(w, client):
    """The inbound access log line for this client connection (polled: flushed every 20 ms)."""
    path = f"{w.work}/inbound-access.log"
    key = f"src={client.src}:{client.local_port} "
    try:
        line = rig.poll(lambda: [l for l in open(path) if key in l], timeout=5,
                        what=f"inbound log for {key}")[-1]
    except TimeoutError:
        return {}
    return dict(p.split("=", 1) for p in line.split() if "=" in p)


def call(w, src, dst, tls=False, cert=None, ca=True):
    cert_path, key_path = w.cert[cert] if cert else (None, None)
    c = rig.TlsClient(src, dst, 80, tls=tls, cert=cert_path, key=key_path,
                      ca=w.pki.ca_pem() if ca else None)
    r = c.try_request()
    c.close()
    r["log"] = inbound_log(w, c)
    r["server"] = c.server_uri
    return r


def short(r):
    log = r.get("log", {})
    got = f"served '{r.get('body')}'" if r.get("ok") else f"refused ({r.get('error', r.get('status'))})"
    chain = log.get("chain", "no log line")
    peer = log.get("peer", "")
    fail = log.get("failure", "-")
    return (f"{got}; envoy: chain={chain} peer={peer}"
            + (f" failure={fail}" if fail not in ("-", "") else "")
            + (f" flags={log.get('flags')}" if log.get("flags") not in (None, "-") else ""))


@trial
def q2_inspector(w):
    node = w.node

    def inspected(dst):
        before = node.stat("tls_inspector.tls_found")
        r = call(w, A, dst, tls=True, cert="a")
        r["inspected"] = node.stat("tls_inspector.tls_found") - before
        return r
    # tls_inspector only on the pod listener (capture: original_dst only).
    on_pod = inspected("127.0.0.5")
    # tls_inspector on neither.
    neither = inspected("127.0.0.7")
    # tls_inspector only on the capture listener (15016).
    on_capture = inspected("127.0.0.8")
    found = {k: (on_pod, on_capture, neither)[i]["inspected"]
             for i, k in enumerate(("pod", "capture", "neither"))}
    ok = (on_pod.get("ok") and on_pod["log"].get("chain") == "tls"
          and on_capture.get("ok") and on_capture["log"].get("chain") == "tls"
          and not neither.get("ok") and neither["log"].get("chain") == "plaintext")
    report("q2 tls_inspector after the use_original_dst hand-off", ok,
           f"on the pod listener: {short(on_pod)} | on the capture listener only: {short(on_capture)} "
           f"| on neither: {short(neither)} | tls_inspector.tls_found increments {found}")


@trial
def q2_modes(w):
    cases = [
        # (name, dst, tls, cert, expect_ok, expect_chain)
        ("strict, trust-domain cert", "127.0.0.5", True, "a", True, "tls"),
        ("strict, TLS without a client cert", "127.0.0.5", True, None, False, "tls"),
        ("strict, plaintext", "127.0.0.5", False, None, False, None),
        ("strict, foreign trust domain", "127.0.0.5", True, "foreign", False, "tls"),
        ("strict, our CA but a SAN outside spiffe://aether.test/", "127.0.0.5", True, "evil", False, "tls"),
        ("permissive, trust-domain cert", "127.0.0.6", True, "b", True, "tls"),
        ("permissive, plaintext", "127.0.0.6", False, None, True, "plaintext"),
        ("permissive, TLS without a client cert", "127.0.0.6", True, None, False, "tls"),
        ("permissive, foreign trust domain", "127.0.0.6", True, "foreign", False, "tls"),
        ("strict single chain (no inspector), trust-domain cert", "127.0.0.9", True, "a", True, "tls"),
        ("strict single chain (no inspector), plaintext", "127.0.0.9", False, None, False, "tls"),
    ]
    for name, dst, tls, cert, expect_ok, expect_chain in cases:
        r = call(w, A, dst, tls=tls, cert=cert)
        log = r["log"]
        ok = bool(r.get("ok")) == expect_ok
        if expect_chain:
            ok = ok and log.get("chain") == expect_chain
        if expect_ok and tls:
            ok = ok and log.get("peer") == w.spiffe_of[cert] and r["server"] == [POD_B]
        if not expect_chain and not expect_ok:
            ok = ok and log.get("flags") == "NR"
        report(f"q2 {name}", ok, short(r))


@trial
def q2_silent_client(w):
    """A server-first client sends nothing: how long until its pod is reached?"""
    node = w.node
    out, delays = [], {}
    for dst, uid in (("127.0.0.6", "uid-permissive"), ("127.0.0.7", "uid-noinspector")):
        stat = f"cluster.inbound|80||{uid}.upstream_cx_total"
        before = node.stat(stat)
        c = rig.TlsClient(A, dst, 80)
        t0 = time.monotonic()
        rig.poll(lambda: node.stat(stat) > before, what=f"upstream connect for {dst}")
        delays[dst] = time.monotonic() - t0
        r = c.try_request()
        c.close()
        out.append(f"{uid}: the pod was connected {delays[dst]:.2f}s after a silent accept, then "
                   f"{'served' if r.get('ok') else 'refused'} on chain {inbound_log(w, c).get('chain')}")
    timeouts = node.stat("listener.127.0.0.6_80.downstream_pre_cx_timeout")
    ok = 0.9 < delays["127.0.0.6"] < 2 and delays["127.0.0.7"] < 0.5
    report("q2 permissive with a client that waits for the server", ok,
           "; ".join(out) + f"; listener.127.0.0.6_80.downstream_pre_cx_timeout={timeouts}")


@trial
def q2_rotation(w):
    node = w.node
    before = config_stats(node)
    lds0 = node.stat("listener_manager.lds.update_success")
    held = rig.TlsClient(A, "127.0.0.5", 80, tls=True, cert=w.cert["a"][0], key=w.cert["a"][1],
                         ca=w.pki.ca_pem())
    first = held.try_request()
    serial_before = held.server_serial
    w.serve_secret("svid|127.0.0.5", "b2")

    def certs_serials():
        return sorted({c["serial_number"] for cert in node.certs()["certificates"]
                       for c in cert["cert_chain"] if POD_B in str(c.get("subject_alt_names"))})
    serials = rig.poll(lambda: "b2" in certs_serials() and certs_serials(), what="/certs shows b2")
    again = held.try_request()
    held.close()
    fresh = rig.TlsClient(A, "127.0.0.5", 80, tls=True, cert=w.cert["a"][0], key=w.cert["a"][1],
                          ca=w.pki.ca_pem())
    new = fresh.try_request()
    fresh.close()
    after = config_stats(node)
    lds = node.stat("listener_manager.lds.update_success") - lds0
    draining = node.stat("listener_manager.total_listeners_draining")
    sds = node.stat("sds.svid|127.0.0.5.update_success")
    by_sds = node.stat("listener.127.0.0.5_80.server_ssl_socket_factory.ssl_context_update_by_sds")
    ok = (first.get("ok") and again.get("ok") and new.get("ok") and before == after
          and lds == 0 and draining == 0 and serial_before == "B1" and fresh.server_serial == "B2")
    report("q2 secret rotation on a pod listener", ok,
           f"server serial {serial_before} -> {fresh.server_serial} on a new connection; the "
           f"connection opened before the push still served after it: {again.get('ok')}; "
           f"/certs serials for pod/b: {serials}; sds.svid|127.0.0.5.update_success={sds}, "
           f"listener.127.0.0.5_80.server_ssl_socket_factory.ssl_context_update_by_sds={by_sds}; "
           f"listener/cluster changes: {delta(before, after) or 'none'}, LDS updates {lds}, "
           f"listeners draining {draining}")


def q2(w):
    q2_inspector(w)
    q2_modes(w)
    q2_silent_client(w)
    q2_rotation(w)



def main():
    envoy_bin = os.environ["ENVOY_BIN"]
    keep = os.environ.get("TRIAL_KEEP")
    work = tempfile.mkdtemp(prefix="aether-mtls-")
    w = World(envoy_bin, work)
    only = set(sys.argv[1:])
    try:
        w.issue()
        w.sds.start()
        w.remote = rig.Envoy(w.procs, envoy_bin, work, "remote", C.remote_bootstrap(w.pki, work), 19001)
        start_node(w)
        if not only or "q1" in only:
            q1(w)
        if not only or "q2" in only:
            q2(w)
        if not only or "q1" in only:
            q1_file_sds(w)  # last: it adds a listener and a cluster on a file SDS source
    finally:
        w.close()
        if keep:
            print(f"work dir kept: {work}")
        else:
            import shutil
            shutil.rmtree(work, ignore_errors=True)
    failed = [n for n, ok in RESULTS if not ok]
    print(f"\n{len(RESULTS) - len(failed)}/{len(RESULTS)} trials as recorded" +
          (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
