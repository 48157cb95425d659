"""The QUIC trials on a real Envoy, with a real HTTP/3 client (aioquic). Run through
run.sh (a private network namespace). They settle what issue 39's QUIC twins can rest on:

  down.*     a QUIC listener with QuicDownstreamTransport and an HTTP/3 connection manager
             answers HTTP/3; client certificates under the runtime feature
             envoy.reloadable_features.quic_mtls_server_enabled (its default, then on and
             off explicitly): who is refused, what identity the twin sees
  sni.*      one QUIC port for every twin, the pod's chain chosen by SNI
  rotate     a rotated SVID (SDS) reaches new QUIC handshakes; open connections and the
             listener are untouched
  add.*      what adding a twin does to the open connections of the others: one shared
             listener with a chain per twin, against one listener (and port) per twin
  up.*       HTTP/3 outbound: the on-demand client-certificate selector on QUIC, and a
             static-certificate cluster per (calling pod, service)
  cost.*     server.memory_allocated per twin listener and per upstream HTTP/3 cluster

Each trial prints PASS or FAIL with what was observed; PASS means the behaviour recorded in
RESULTS.md still holds (including the expected negatives, which say so).
"""

import http.client
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "mtls"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "quic"))

import configs as C  # noqa: E402 - the mTLS trials' configuration helpers
import h3_client as h3  # noqa: E402 - the tests' HTTP/3 client (aioquic)
import rig  # noqa: E402
from rig import RESULTS, report, trial  # noqa: E402
from rig import FOREIGN, POD_A, POD_B, POD_C  # noqa: E402
from sds import SdsServer  # noqa: E402

QUIC_DOWN = C.T + "envoy.extensions.transport_sockets.quic.v3.QuicDownstreamTransport"
QUIC_UP = C.T + "envoy.extensions.transport_sockets.quic.v3.QuicUpstreamTransport"
MTLS_FEATURE = "envoy.reloadable_features.quic_mtls_server_enabled"
NODE_IP = "127.0.0.30"
SHARED_PORT = 15443
SNI = {"a": "a.twin.aether", "b": "b.twin.aether", "c": "c.twin.aether"}
POD = {"a": POD_A, "b": POD_B, "c": POD_C}
SERIAL = {"a": "A1", "a2": "A2", "b": "B1", "c": "C1"}
TRUST_PREFIX = "spiffe://aether.test/"

def short(r):
    """One request's outcome in a few words."""
    if not r["ok"]:
        return f"refused ({r.get('error') or [x['headers'].get(':status') for x in r['responses']]})"
    last = r["responses"][-1]["headers"]
    return (f"200 from {last.get('x-backend')}, server {r['server_uri']} serial "
            f"{r['server_serial']}, twin saw {last.get('x-peer') or 'no client certificate'}")


# --- configuration -------------------------------------------------------------------------

def h3_hcm(name, body):
    f = C.hcm(name, [C.direct_vhost(body, name)])
    f["typed_config"]["codec_type"] = "HTTP3"
    f["typed_config"]["http3_protocol_options"] = {}
    return f


def twin_chain(secret, body, sni=None, require_client=True):
    """One twin's filter chain: QUIC with the pod's SVID (by SDS name), a client SVID of
    the trust domain required, HTTP/3 answered directly (the pod's app in a real twin)."""
    tls = {"require_client_certificate": require_client,
           "common_tls_context": {
               "alpn_protocols": ["h3"],
               "tls_certificate_sds_secret_configs": [{"name": secret,
                                                       "sds_config": C.ADS_SOURCE}],
               # The bundle over SDS, and only URI SANs of the trust domain: a leaf of
               # our CA naming another trust domain is refused too.
               "combined_validation_context": {
                   "default_validation_context": {"match_typed_subject_alt_names": [
                       {"san_type": "URI", "matcher": {"prefix": TRUST_PREFIX}}]},
                   "validation_context_sds_secret_config": {"name": "trust",
                                                            "sds_config": C.ADS_SOURCE}}}}
    chain = {"transport_socket": {"name": "envoy.transport_sockets.quic", "typed_config": {
        "@type": QUIC_DOWN, "downstream_tls_context": tls}},
        "filters": [h3_hcm(body, body)]}
    if sni:
        chain["filter_chain_match"] = {"server_names": [sni]}
    return chain


def quic_listener(name, port, chains):
    return {"name": name,
            "address": {"socket_address": {"protocol": "UDP", "address": NODE_IP,
                                           "port_value": port}},
            "udp_listener_config": {"quic_options": {},
                                    "downstream_socket_config": {"prefer_gro": True}},
            "filter_chains": chains}


def node_bootstrap(work, mtls_feature):
    cfg = C.node_bootstrap(work, os.path.join(work, "sds.sock"))
    if mtls_feature is not None:
        cfg["layered_runtime"] = {"layers": [{"name": "static", "static_layer": {
            MTLS_FEATURE: mtls_feature}}]}
    return cfg


def upstream_h3_cluster(name, secret, sni, port, selector=False):
    """A cluster to a twin over HTTP/3 presenting `secret` (a static certificate by SDS
    name), or, with `selector`, the on-demand selector the TCP outbound uses."""
    ctx = {"alpn_protocols": ["h3"], "tls_params": C.UPSTREAM_TLS_PARAMS,
           "validation_context": {"trusted_ca": {"filename": WORLD.pki.ca_pem()},
                                  "match_typed_subject_alt_names": [
                                      {"san_type": "URI", "matcher": {"prefix": TRUST_PREFIX}}]}}
    if selector:
        ctx["custom_tls_certificate_selector"] = C.tls_on_demand(WORLD.pki)["typed_config"][
            "common_tls_context"]["custom_tls_certificate_selector"]
    else:
        ctx["tls_certificate_sds_secret_configs"] = [{"name": secret, "sds_config": C.ADS_SOURCE}]
    c = C.cluster(name, [(NODE_IP, port)], transport_socket={
        "name": "envoy.transport_sockets.quic", "typed_config": {
            "@type": QUIC_UP, "upstream_tls_context": {"sni": sni, "common_tls_context": ctx}}})
    c["typed_extension_protocol_options"] = {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": C.HTTP_OPTS, "explicit_http_config": {"http3_protocol_options": {}}}}
    return c


# --- the world -----------------------------------------------------------------------------

class World:
    def __init__(self, envoy_bin, work):
        self.envoy_bin, self.work = envoy_bin, work
        self.procs = rig.Procs()
        self.pki = rig.Pki(os.path.join(work, "pki"))
        self.sds = SdsServer(os.path.join(work, "sds.sock"))
        self.node = None
        self.lds, self.cds = {}, {}
        p = self.pki
        self.cert = {"a": p.leaf("a", POD_A, 0xA1), "a2": p.leaf("a2", POD_A, 0xA2),
                     "b": p.leaf("b", POD_B, 0xB1), "c": p.leaf("c", POD_C, 0xC1),
                     # b's SVID with its twin's server name as a DNS SAN too.
                     "b-dns": p.leaf("b-dns", POD_B, 0xB3, dns=SNI["b"]),
                     "foreign": p.leaf("foreign", FOREIGN, 0xF1, ca=p.other_ca),
                     "evil": p.leaf("evil", "spiffe://evil.test/ns/default/pod/x", 0xE1)}
        for which in ("a", "b", "c", "b-dns"):
            self.serve(f"svid|{which}", which)
        self.sds.set_ca("trust", open(p.ca_pem(), "rb").read())
        self.sds.start()

    def serve(self, name, which):
        cert, key = self.cert[which]
        self.sds.set_cert(name, open(cert, "rb").read(), open(key, "rb").read())

    def push(self, lds=False, cds=False):
        rig.push_config(self.node, self.work, self.lds if lds else None,
                        self.cds if cds else None)

    def start_node(self, mtls_feature, wait=True):
        if self.node:
            self.procs.stop(self.node.proc)
            self.node = None
        self.push(lds=True, cds=True)
        self.node = rig.Envoy(self.procs, self.envoy_bin, self.work, "node",
                              node_bootstrap(self.work, mtls_feature), 19000, concurrency=1)
        if wait:
            rig.poll(lambda: self.node.stat("listener_manager.total_listeners_active")
                     == len(self.lds), what="every listener active")

    def get(self, port, who=None, sni=None, **kw):
        cert, key = self.cert[who] if who else (None, None)
        return h3.request(NODE_IP, port, sni=sni, cert=cert, key=key, **kw)

    def listener_updated(self, name):
        dump = json.loads(self.node.get("/config_dump?resource=dynamic_listeners"))
        for entry in dump.get("configs", []):
            if entry.get("name") == name:
                active = entry.get("active_state", {})
                return active.get("version_info"), active.get("last_updated")
        return None

    def close(self):
        self.procs.stop_all()
        self.sds.stop()


WORLD = None


# --- downstream: HTTP/3 and client certificates ---------------------------------------------

@trial
def down_h3_and_mtls(w):
    """A real HTTP/3 client through a QUIC twin, and who is refused, per runtime setting."""
    w.lds = {"twins": quic_listener("twins", SHARED_PORT, [
        twin_chain("svid|a", "a", SNI["a"]), twin_chain("svid|b", "b", SNI["b"])])}
    for label, feature in (("default", None), ("on", True)):
        w.start_node(feature)
        none = w.get(SHARED_PORT, sni=SNI["a"])
        own = w.get(SHARED_PORT, "c", sni=SNI["a"])
        foreign = w.get(SHARED_PORT, "foreign", sni=SNI["a"])
        evil = w.get(SHARED_PORT, "evil", sni=SNI["a"])
        seen = own["responses"][-1]["headers"].get("x-peer") if own["ok"] else None
        report(f"down.h3.{label}", own["ok"] and seen == POD_C
               and own["server_uri"] == [POD_A],
               f"HTTP/3 200 through twin a, server presented {own['server_uri']}, the twin "
               f"saw the client's own {seen}")
        report(f"down.mtls.{label}.refused (expected)",
               not none["ok"] and not foreign["ok"] and not evil["ok"],
               f"no certificate: {short(none)}; foreign trust domain: {short(foreign)}; "
               f"our CA naming evil.test: {short(evil)}")
    # Off: a QUIC listener that requires client certificates is refused, not served
    # without the check.
    w.start_node(False, wait=False)
    msg = "TLS Client Authentication is not supported over QUIC"
    rejected = rig.poll(lambda: w.node.log_grep(msg), what="the listener's rejection")
    report("down.mtls.off.rejected (expected)",
           w.node.stat("listener_manager.total_listeners_active") == 0,
           f"with the feature off Envoy rejects the listener: {rejected[0].split('] ')[-1]}")


@trial
def sni_chains(w):
    """One port for every twin, the chain chosen by SNI."""
    w.lds = {"twins": quic_listener("twins", SHARED_PORT, [
        twin_chain("svid|a", "a", SNI["a"]), twin_chain("svid|b", "b", SNI["b"])])}
    w.start_node(True)
    a = w.get(SHARED_PORT, "c", sni=SNI["a"])
    b = w.get(SHARED_PORT, "c", sni=SNI["b"])
    unknown = w.get(SHARED_PORT, "c", sni="x.twin.aether")
    nosni = w.get(SHARED_PORT, "c", sni=None)
    body = lambda r: r["responses"][-1]["headers"].get("x-backend") if r["ok"] else None  # noqa: E731
    report("sni.select", a["ok"] and b["ok"] and body(a) == "a" and body(b) == "b"
           and a["server_uri"] == [POD_A] and b["server_uri"] == [POD_B],
           f"SNI a: {short(a)}; SNI b: {short(b)}")
    report("sni.unknown.refused (expected)", not unknown["ok"] and not nosni["ok"],
           f"unknown SNI: {short(unknown)}; no SNI: {short(nosni)}")


@trial
def rotate(w):
    """A rotated SVID reaches new handshakes; the open connection and the listener stay."""
    w.lds = {"twins": quic_listener("twins", SHARED_PORT, [
        twin_chain("svid|a", "a", SNI["a"]), twin_chain("svid|b", "b", SNI["b"])])}
    w.start_node(True)
    before = w.listener_updated("twins")
    modified = w.node.stat("listener_manager.listener_modified")
    rotated = {}

    def rotate_then_wait(i):
        w.serve("svid|a", "a2")
        rotated["new"] = rig.poll(
            lambda: (lambda r: r if r["server_serial"] == SERIAL["a2"] else None)(
                w.get(SHARED_PORT, "c", sni=SNI["a"])), what="a new handshake with A2")

    old = w.get(SHARED_PORT, "c", sni=SNI["a"], n=2, between=rotate_then_wait)
    after = w.listener_updated("twins")
    report("rotate", old["ok"] and len(old["responses"]) == 2
           and old["server_serial"] == SERIAL["a"] and rotated["new"]["ok"]
           and before == after
           and w.node.stat("listener_manager.listener_modified") == modified,
           f"the connection opened before the rotation (serial {old['server_serial']}) "
           f"answered after it: {old['ok']}; a new handshake presented "
           f"{rotated['new']['server_serial']}; listener version/last_updated "
           f"{before} -> {after}")
    w.serve("svid|a", "a")


@trial
def add_twin(w):
    """Adding a twin, with a connection to another twin open: one shared listener (a chain
    more) against one listener per twin (a listener more)."""
    w.lds = {"twins": quic_listener("twins", SHARED_PORT, [
        twin_chain("svid|a", "a", SNI["a"]), twin_chain("svid|b", "b", SNI["b"])]),
        "twin|a": quic_listener("twin|a", 15501, [twin_chain("svid|a", "a")]),
        "twin|b": quic_listener("twin|b", 15502, [twin_chain("svid|b", "b")])}
    w.start_node(True)
    names = ("listener_modified", "listener_in_place_updated", "listener_removed")

    def counters():
        return {n: w.node.stat(f"listener_manager.{n}") for n in names}

    def add(shape):
        def change(_i):
            if shape == "shared":
                w.lds["twins"]["filter_chains"].append(twin_chain("svid|c", "c", SNI["c"]))
            else:
                w.lds["twin|c"] = quic_listener("twin|c", 15503, [twin_chain("svid|c", "c")])
            w.push(lds=True)
        return change

    c0, a_before = counters(), w.listener_updated("twin|a")
    shared = w.get(SHARED_PORT, "c", sni=SNI["a"], n=2, between=add("shared"))
    c1 = counters()
    draining = w.node.stat("listener_manager.total_listeners_draining")
    fresh_c = w.get(SHARED_PORT, "a", sni=SNI["c"])
    own = w.get(15501, "c", n=2, between=add("own"))
    c2, a_after = counters(), w.listener_updated("twin|a")
    twin_c = w.get(15503, "a")
    delta = lambda x, y: {k: y[k] - x[k] for k in names if y[k] != x[k]}  # noqa: E731
    report("add.shared",
           shared["ok"] and fresh_c["ok"] and delta(c0, c1).get("listener_in_place_updated") == 1,
           f"a chain added to the shared QUIC listener: {delta(c0, c1)}, listeners draining "
           f"after it {draining}; the connection to twin a opened before: "
           f"{'answered after' if shared['ok'] else 'failed: ' + short(shared)}; "
           f"the new twin: {short(fresh_c)}")
    report("add.own-listener",
           own["ok"] and twin_c["ok"] and a_before == a_after
           and not delta(c1, c2).get("listener_modified"),
           f"a listener added for twin c: {delta(c1, c2)}; twin a's listener "
           f"{a_before} -> {a_after}, its open connection answered after: {own['ok']}; "
           f"twin c: {short(twin_c)}")


# --- upstream: HTTP/3 outbound and the calling pod's identity --------------------------------

@trial
def up_selector(w):
    """The on-demand client-certificate selector (the TCP outbound's per-pod identity) on
    an upstream QUIC cluster."""
    cfg = node_bootstrap(w.work, True)
    cfg["static_resources"]["clusters"].append(
        upstream_h3_cluster("h3|selector", None, SNI["b"], SHARED_PORT, selector=True))
    cfg["admin"] = {"address": C.addr("127.0.0.1", 19099)}
    path = os.path.join(w.work, "selector.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    out = subprocess.run([w.envoy_bin, "--mode", "validate", "-c", path, "-l", "error"],
                         capture_output=True, text=True, timeout=60)
    text = (out.stdout + out.stderr).strip().splitlines()
    msg = next((line for line in text if "selector" in line.lower()), text[-1] if text else "")
    report("up.selector.refused (expected)",
           out.returncode != 0 and "not supported on QUIC" in msg,
           f"envoy --mode validate exit {out.returncode}: {msg.strip()[:200]}")


@trial
def up_static_per_pod(w):
    """One cluster per (calling pod, service) with the pod's certificate, over HTTP/3: does
    the twin see the calling pod's own identity? Against an SVID with a URI SAN only, then
    one that also names the twin's server name as a DNS SAN."""
    for label, twin_secret in (("uri-only (expected: refused)", "svid|b"),
                               ("dns-san", "svid|b-dns")):
        w.lds = {"twins": quic_listener("twins", SHARED_PORT, [
            twin_chain("svid|a", "a", SNI["a"]), twin_chain(twin_secret, "b", SNI["b"])]),
            "out": C.outbound_listener("out", 15080,
                                       {"b.svc": "h3|a|b", "b-as-c.svc": "h3|c|b"},
                                       log=os.path.join(w.work, "out.log"))}
        w.cds = {"h3|a|b": upstream_h3_cluster("h3|a|b", "svid|a", SNI["b"], SHARED_PORT),
                 "h3|c|b": upstream_h3_cluster("h3|c|b", "svid|c", SNI["b"], SHARED_PORT)}
        w.start_node(True)
        seen = {}
        for host, pod in (("b.svc", "a"), ("b-as-c.svc", "c")):
            conn = http.client.HTTPConnection("127.0.0.1", 15080, timeout=10)
            conn.request("GET", "/", headers={"Host": host})
            r = conn.getresponse()
            r.read()
            seen[pod] = (r.status, r.getheader("x-peer"), r.getheader("x-backend"))
            conn.close()
        failures = [line.split("upstream_failure=")[1].split(" ")[0][:120]
                    for line in open(os.path.join(w.work, "out.log")) if "code=503" in line]
        ok = seen["a"] == (200, POD_A, "b") and seen["c"] == (200, POD_C, "b")
        expect_ok = twin_secret == "svid|b-dns"
        report(f"up.static-per-pod.{label}", ok == expect_ok,
               f"through clusters h3|a|b and h3|c|b the twin of b saw {seen}"
               + (f"; the upstream handshake failed: {failures[-1]}" if failures else ""))
        os.remove(os.path.join(w.work, "out.log"))
    w.cds = {}


# --- costs ---------------------------------------------------------------------------------

@trial
def cost(w, n=100):
    """Allocated memory per twin, as a listener (and port) of its own and as a chain of one
    shared listener, and per upstream HTTP/3 cluster: each shape from 0 to n on a fresh
    Envoy, since a replaced listener's memory is held until its drain ends."""

    def settle():
        # Read until two reads a second apart agree within 64 KiB.
        prev = None
        for _ in range(20):
            cur = int(json.loads(w.node.get("/memory"))["allocated"])
            if prev is not None and abs(cur - prev) < 64 * 1024:
                return cur
            prev = cur
            time.sleep(1)
        return cur

    def grow(lds=None, cds=None):
        w.lds, w.cds = {}, {}
        w.start_node(True)
        base = settle()
        w.lds, w.cds = lds or {}, cds or {}
        w.push(lds=lds is not None, cds=cds is not None)
        return (settle() - base) / n

    per_twin = grow(lds={f"twin|{i}": quic_listener(
        f"twin|{i}", 16000 + i, [twin_chain(f"svid|{'abc'[i % 3]}", f"t{i}")])
        for i in range(n)})
    probe = w.get(16000 + n - 1, "c")
    per_chain = grow(lds={"twins": quic_listener("twins", SHARED_PORT, [
        twin_chain(f"svid|{'abc'[i % 3]}", f"t{i}", f"t{i}.twin.aether") for i in range(n)])})
    sni_probe = w.get(SHARED_PORT, "c", sni=f"t{n - 1}.twin.aether")
    per_cluster = grow(cds={f"h3|{i}": upstream_h3_cluster(
        f"h3|{i}", f"svid|{'abc'[i % 3]}", SNI["a"], SHARED_PORT) for i in range(n)})
    w.cds = {}
    report("cost.measured", probe["ok"] and sni_probe["ok"] and per_twin > 0
           and per_chain > 0 and per_cluster > 0,
           f"{n} twins as listeners of their own: {per_twin / 1024:.1f} KiB each (the last "
           f"answers: {probe['ok']}); as {n} chains of one shared listener: "
           f"{per_chain / 1024:.1f} KiB each (the last answers: {sni_probe['ok']}); {n} "
           f"upstream HTTP/3 clusters: {per_cluster / 1024:.1f} KiB each "
           f"(/memory allocated, 1 worker)")


# --- driver --------------------------------------------------------------------------------

def main():
    global WORLD
    envoy_bin = os.environ["ENVOY_BIN"]
    keep = os.environ.get("TRIAL_KEEP") == "1"
    work = tempfile.mkdtemp(prefix="aether-quic-trials-")
    WORLD = w = World(envoy_bin, work)
    wanted = set(sys.argv[1:])
    try:
        for fn in (down_h3_and_mtls, sni_chains, rotate, add_twin, up_selector,
                   up_static_per_pod, cost):
            if not wanted or any(fn.__name__.startswith(x) for x in wanted):
                print(f"-- {fn.__name__}", flush=True)
                fn(w)
    finally:
        w.close()
        if not keep:
            subprocess.run(["rm", "-rf", work], check=False)
        else:
            print(f"work dir kept: {work}")
    failed = [n for n, ok in RESULTS if not ok]
    print(f"{len(RESULTS) - len(failed)}/{len(RESULTS)} PASS" + (f"; FAIL: {failed}" if failed else ""))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
