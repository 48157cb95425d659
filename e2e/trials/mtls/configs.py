"""Envoy configuration for the mTLS trials, built as plain dicts (written as JSON).

The node Envoy takes its listeners and clusters from files (LDS and CDS over
path_config_source), so that listener_manager.listener_modified and
cluster_manager.cluster_modified mean what they do under the agent's ADS; secrets come
from the in-process SDS server (sds.py) over gRPC on a unix socket.
"""

T = "type.googleapis.com/"

HCM = T + "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
ROUTER = T + "envoy.extensions.filters.http.router.v3.Router"
TCP_PROXY = T + "envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy"
UPSTREAM_TLS = T + "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"
DOWNSTREAM_TLS = T + "envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext"
FILE_LOG = T + "envoy.extensions.access_loggers.file.v3.FileAccessLog"
SET_FS = T + "envoy.extensions.filters.network.set_filter_state.v3.Config"
ON_DEMAND = T + "envoy.extensions.transport_sockets.tls.cert_selectors.on_demand_secret.v3.Config"
FS_MAPPER = T + "envoy.extensions.transport_sockets.tls.cert_mappers.filter_state_override.v3.Config"
FS_INPUT = T + "envoy.extensions.matching.common_inputs.transport_socket.v3.FilterStateInput"
META_INPUT = T + "envoy.extensions.matching.common_inputs.transport_socket.v3.EndpointMetadataInput"
TS_NAME_ACTION = T + "envoy.extensions.matching.common_inputs.transport_socket.v3.TransportSocketNameAction"
HTTP_OPTS = T + "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
RAW_BUFFER = T + "envoy.extensions.transport_sockets.raw_buffer.v3.RawBuffer"
INTERNAL_UPSTREAM = T + "envoy.extensions.transport_sockets.internal_upstream.v3.InternalUpstreamTransport"
INTERNAL_LISTENER_EXT = T + "envoy.extensions.bootstrap.internal_listener.v3.InternalListener"
ORIGINAL_DST = T + "envoy.extensions.filters.listener.original_dst.v3.OriginalDst"
TLS_INSPECTOR = T + "envoy.extensions.filters.listener.tls_inspector.v3.TlsInspector"
LISTENER = T + "envoy.config.listener.v3.Listener"
CLUSTER = T + "envoy.config.cluster.v3.Cluster"

# The key the filter_state_override mapper reads; Envoy's name, not configurable.
MAPPER_KEY = "envoy.tls.certificate_mappers.on_demand_secret"
AGENT_SECRET = "svid|agent"

PEER_HEADERS = [
    ("x-peer", "%DOWNSTREAM_PEER_URI_SAN%"),
    ("x-peer-serial", "%DOWNSTREAM_PEER_SERIAL%"),
    ("x-upstream-conn", "%CONNECTION_ID%"),
]


def addr(ip, port):
    return {"socket_address": {"address": ip, "port_value": port}}


def sds_source(api_type="DELTA_GRPC"):
    return {"resource_api_version": "V3",
            "api_config_source": {"api_type": api_type, "transport_api_version": "V3",
                                  "set_node_on_first_message_only": True,
                                  "grpc_services": [{"envoy_grpc": {"cluster_name": "sds"}}]}}


def sds_cluster(socket_path):
    return {"name": "sds", "type": "STATIC", "connect_timeout": "1s",
            "typed_extension_protocol_options": {
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": HTTP_OPTS, "explicit_http_config": {"http2_protocol_options": {}}}},
            "load_assignment": {"cluster_name": "sds", "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"pipe": {"path": socket_path}}}}]}]}}


def file_log(path, fmt):
    return {"name": "envoy.access_loggers.file",
            "typed_config": {"@type": FILE_LOG, "path": path,
                             "log_format": {"text_format_source": {"inline_string": fmt + "\n"}}}}


def hcm(stat_prefix, virtual_hosts, log_path=None, log_fmt=None):
    cfg = {"@type": HCM, "stat_prefix": stat_prefix,
           "route_config": {"name": stat_prefix, "virtual_hosts": virtual_hosts},
           "http_filters": [{"name": "envoy.filters.http.router",
                             "typed_config": {"@type": ROUTER}}]}
    if log_path:
        cfg["access_log"] = [file_log(log_path, log_fmt)]
    return {"name": "envoy.filters.network.http_connection_manager", "typed_config": cfg}


def direct_vhost(body, backend, peer_headers=True):
    headers = [("x-backend", backend)] + (PEER_HEADERS if peer_headers else
                                          [("x-upstream-conn", "%CONNECTION_ID%")])
    return {"name": "all", "domains": ["*"],
            "routes": [{"match": {"prefix": "/"},
                        "direct_response": {"status": 200, "body": {"inline_string": body}},
                        "response_headers_to_add": [
                            {"header": {"key": k, "value": v}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
                            for k, v in headers]}]}


# --- the remote side: an mTLS server with static certificates, and plain backends -------

def remote_bootstrap(pki, work):
    web_cert, web_key = pki.path("web.pem"), pki.path("web.key")
    log = f"{work}/remote-access.log"
    fmt = ("listener=%DOWNSTREAM_LOCAL_ADDRESS% src=%DOWNSTREAM_REMOTE_ADDRESS% "
           "peer=%DOWNSTREAM_PEER_URI_SAN% serial=%DOWNSTREAM_PEER_SERIAL% conn=%CONNECTION_ID%")

    def plain(name, ip, port, body, backend):
        return {"name": name, "address": addr(ip, port), "filter_chains": [
            {"filters": [hcm(name, [direct_vhost(body, backend, peer_headers=False)], log, fmt)]}]}

    tls_listener = {
        "name": "web-tls", "address": addr("127.0.0.10", 8443),
        "filter_chains": [{
            "transport_socket": {"name": "envoy.transport_sockets.tls", "typed_config": {
                "@type": DOWNSTREAM_TLS, "require_client_certificate": True,
                "common_tls_context": {
                    "tls_certificates": [{"certificate_chain": {"filename": web_cert},
                                          "private_key": {"filename": web_key}}],
                    "validation_context": {"trusted_ca": {"filename": pki.ca_pem()}}}}},
            "filters": [hcm("web_tls", [direct_vhost("web over mTLS", "tls")], log, fmt)]}]}
    # A permissive server, as a permissive pod's inbound is: TLS (a client certificate
    # required) and plaintext on one port, told apart by the tls_inspector.
    permissive_listener = {
        "name": "web-permissive", "address": addr("127.0.0.12", 8443),
        "listener_filters": [{"name": "envoy.filters.listener.tls_inspector",
                              "typed_config": {"@type": TLS_INSPECTOR}}],
        "filter_chains": [
            {**tls_listener["filter_chains"][0],
             "filter_chain_match": {"transport_protocol": "tls"}},
            {"filters": [hcm("web_permissive_plain",
                             [direct_vhost("web over plaintext", "plain")], log, fmt)]}]}
    return {"static_resources": {"listeners": [
        tls_listener,
        permissive_listener,
        plain("web-plain", "127.0.0.11", 8080, "web over plaintext", "plain"),
        plain("pod-app", "127.0.0.20", 8080, "pod app", "app"),
        plain("capture-fallback", "127.0.0.21", 8080, "capture fallback", "fallback"),
    ], "clusters": []}}


# --- the node side ------------------------------------------------------------------------

def node_bootstrap(work, sds_socket, internal_listeners=False):
    cfg = {
        "node": {"id": "node-1", "cluster": "aether"},
        "static_resources": {"clusters": [sds_cluster(sds_socket)]},
        "dynamic_resources": {
            # ADS carries only secrets here (the sources that say `ads: {}`).
            "ads_config": {"api_type": "DELTA_GRPC", "transport_api_version": "V3",
                           "set_node_on_first_message_only": True,
                           "grpc_services": [{"envoy_grpc": {"cluster_name": "sds"}}]},
            "lds_config": {"resource_api_version": "V3",
                           "path_config_source": {"path": f"{work}/lds.json"}},
            "cds_config": {"resource_api_version": "V3",
                           "path_config_source": {"path": f"{work}/cds.json"}}},
    }
    if internal_listeners:
        cfg["bootstrap_extensions"] = [{"name": "envoy.bootstrap.internal_listener",
                                        "typed_config": {"@type": INTERNAL_LISTENER_EXT}}]
    return cfg


def discovery_response(type_url, resources):
    return {"version_info": "1", "type_url": type_url,
            "resources": [{"@type": type_url, **r} for r in resources]}


def set_filter_state(values):
    """The network set_filter_state filter, applied when the connection is accepted."""
    return {"name": "envoy.filters.network.set_filter_state",
            "typed_config": {"@type": SET_FS, "on_new_connection": values}}


def fs_value(key, fmt, factory, shared="ONCE"):
    return {"object_key": key, "factory_key": factory, "shared_with_upstream": shared,
            "format_string": {"text_format_source": {"inline_string": fmt}}}


NODE_LOG_FMT = ("src=%DOWNSTREAM_REMOTE_ADDRESS_WITHOUT_PORT% code=%RESPONSE_CODE% "
                "flags=%RESPONSE_FLAGS% cluster=%UPSTREAM_CLUSTER% "
                "upstream_failure=%UPSTREAM_TRANSPORT_FAILURE_REASON% ms=%DURATION%")


def outbound_listener(name, port, routes, network_filters=(), log=None, chains=None):
    """An outbound HTTP listener on 127.0.0.1:<port>: routes is {host: cluster}."""
    if chains is None:
        chains = [{"filters": [*network_filters, hcm(name, outbound_vhosts(routes), log, NODE_LOG_FMT)]}]
    return {"name": name, "address": addr("127.0.0.1", port), "filter_chains": chains}


def outbound_vhosts(routes):
    return [{"name": host, "domains": [host, f"{host}:*"],
             "routes": [{"match": {"prefix": "/"},
                         "route": {"cluster": cluster, "timeout": "12s"}}]}
            for host, cluster in routes.items()]


def validation_web(pki):
    return {"trusted_ca": {"filename": pki.ca_pem()},
            "match_typed_subject_alt_names": [
                {"san_type": "URI", "matcher": {"exact": "spiffe://aether.test/ns/default/pod/web"}}]}


# Envoy's upstream default is TLS 1.2 at most; the mesh would use 1.3 (where the client
# certificate is chosen on the server's CertificateRequest, after the ServerHello).
UPSTREAM_TLS_PARAMS = {"tls_maximum_protocol_version": "TLSv1_3"}


ADS_SOURCE = {"resource_api_version": "V3", "ads": {}}


def tls_on_demand(pki, default=AGENT_SECRET, source=None):
    """(a): the client certificate is named per connection, fetched over SDS on demand."""
    return {"name": "envoy.transport_sockets.tls", "typed_config": {
        "@type": UPSTREAM_TLS,
        "common_tls_context": {
            "custom_tls_certificate_selector": {
                "name": "envoy.tls.certificate_selectors.on_demand_secret",
                "typed_config": {
                    "@type": ON_DEMAND, "config_source": source or sds_source(),
                    "certificate_mapper": {
                        "name": "envoy.tls.upstream_certificate_mappers.filter_state_override",
                        "typed_config": {"@type": FS_MAPPER, "default_value": default}}}},
            "tls_params": UPSTREAM_TLS_PARAMS,
            "validation_context": validation_web(pki)}}}


def tls_sds(pki, secret):
    """A fixed client certificate, by SDS name."""
    return {"name": "envoy.transport_sockets.tls", "typed_config": {
        "@type": UPSTREAM_TLS,
        "common_tls_context": {
            "tls_certificate_sds_secret_configs": [{"name": secret, "sds_config": sds_source()}],
            "tls_params": UPSTREAM_TLS_PARAMS,
            "validation_context": validation_web(pki)}}}


def cluster(name, endpoints, transport_socket=None, connect_timeout="2s", idle_timeout=None,
            **extra):
    """A STATIC cluster; endpoints is [(ip, port)] or [(ip, port, metadata)]."""
    lb = []
    for ep in endpoints:
        e = {"endpoint": {"address": addr(ep[0], ep[1])}}
        if len(ep) > 2:
            e["metadata"] = {"filter_metadata": {"envoy.transport_socket_match": ep[2]}}
        lb.append(e)
    c = {"name": name, "type": "STATIC", "connect_timeout": connect_timeout,
         "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": lb}]}}
    if transport_socket:
        c["transport_socket"] = transport_socket
    if idle_timeout:
        c["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": HTTP_OPTS, "explicit_http_config": {"http_protocol_options": {}},
                "common_http_protocol_options": {"idle_timeout": idle_timeout}}}
    c.update(extra)
    return c
