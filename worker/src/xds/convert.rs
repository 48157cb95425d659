//! Model resources to Envoy protobuf: the one place that knows both.

use std::net::{IpAddr, SocketAddr};

use envoy_types::pb::envoy::config::cluster::v3 as cluster;
use envoy_types::pb::envoy::config::core::v3 as core;
use envoy_types::pb::envoy::config::endpoint::v3 as endpoint;
use envoy_types::pb::envoy::config::listener::v3 as listener;
use envoy_types::pb::envoy::config::route::v3 as route;
use envoy_types::pb::envoy::extensions::filters::http::on_demand::v3::{OnDemand, OnDemandCds};
use envoy_types::pb::envoy::extensions::filters::http::router::v3::Router;
use envoy_types::pb::envoy::extensions::filters::listener::original_dst::v3::OriginalDst;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3 as hcm;
use envoy_types::pb::envoy::extensions::filters::common::set_filter_state::v3 as filter_state;
use envoy_types::pb::envoy::extensions::filters::listener::tls_inspector::v3::TlsInspector;
use envoy_types::pb::envoy::extensions::filters::network::set_filter_state::v3 as set_filter_state;
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3 as tcp;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::cert_mappers::filter_state_override::v3 as cert_mapper;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::cert_selectors::on_demand_secret::v3 as on_demand_secret;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3 as tls;
use envoy_types::pb::envoy::extensions::upstreams::http::v3 as upstream_http;
use envoy_types::pb::envoy::extensions::matching::common_inputs::transport_socket::v3 as socket_input;
use envoy_types::pb::envoy::r#type::matcher::v3 as matcher;
use envoy_types::pb::xds::core::v3 as xds_core;
use envoy_types::pb::xds::r#type::matcher::v3 as xds_matcher;
use envoy_types::pb::xds::r#type::matcher::v3::string_matcher::MatchPattern;
use envoy_types::pb::google::protobuf::{Any, BoolValue, Duration, Struct, UInt32Value, Value, value};
use envoy_types::util::pack_any;

use aether_model as snapshot;

fn socket_address(a: SocketAddr) -> core::Address {
    core::Address {
        address: Some(core::address::Address::SocketAddress(core::SocketAddress {
            address: a.ip().to_string(),
            port_specifier: Some(core::socket_address::PortSpecifier::PortValue(u32::from(
                a.port(),
            ))),
            ..Default::default()
        })),
    }
}

fn ads() -> core::ConfigSource {
    core::ConfigSource {
        resource_api_version: core::ApiVersion::V3 as i32,
        config_source_specifier: Some(core::config_source::ConfigSourceSpecifier::Ads(
            core::AggregatedConfigSource {},
        )),
        ..Default::default()
    }
}

fn host_prefix(ip: IpAddr) -> core::CidrRange {
    let len = if ip.is_ipv4() { 32 } else { 128 };
    core::CidrRange {
        address_prefix: ip.to_string(),
        prefix_len: Some(UInt32Value { value: len }),
    }
}

pub fn listener(l: &snapshot::Listener) -> Any {
    if let snapshot::ListenerKind::QuicTwins { twins } = &l.kind {
        return quic_twins_listener(l, twins);
    }
    let (direction, filter_chains, listener_filters) = match &l.kind {
        snapshot::ListenerKind::HttpOutbound {
            route_config,
            on_demand,
            source_certificates,
            pod_certificates,
            plaintext_sources,
        } => {
            let router = hcm::HttpFilter {
                name: "envoy.filters.http.router".into(),
                config_type: Some(hcm::http_filter::ConfigType::TypedConfig(pack_any(
                    Router::default(),
                ))),
                ..Default::default()
            };
            // A route to a cluster the proxy does not hold asks for it on the ADS stream
            // (delta only), and the request waits until the cluster and its endpoints
            // have arrived.
            let on_demand = on_demand.then(|| hcm::HttpFilter {
                name: "envoy.filters.http.on_demand".into(),
                config_type: Some(hcm::http_filter::ConfigType::TypedConfig(pack_any(
                    OnDemand {
                        odcds: Some(OnDemandCds {
                            source: Some(ads()),
                            timeout: Some(Duration {
                                seconds: 10,
                                nanos: 0,
                            }),
                            ..Default::default()
                        }),
                    },
                ))),
                ..Default::default()
            });
            let manager = hcm::HttpConnectionManager {
                stat_prefix: l.name.clone(),
                codec_type: hcm::http_connection_manager::CodecType::Auto as i32,
                route_specifier: Some(hcm::http_connection_manager::RouteSpecifier::Rds(
                    hcm::Rds {
                        config_source: Some(ads()),
                        route_config_name: route_config.clone(),
                    },
                )),
                http_filters: on_demand.into_iter().chain([router]).collect(),
                ..Default::default()
            };
            let hcm = listener::Filter {
                name: "envoy.filters.network.http_connection_manager".into(),
                config_type: Some(listener::filter::ConfigType::TypedConfig(pack_any(manager))),
            };
            // A source no other chain matches: with identity on, it names a certificate
            // never served (a strict pod without its SVID fails its mTLS handshakes).
            let chain = listener::FilterChain {
                filters: source_certificates
                    .then(|| certificate_filter(&unknown_source_certificate()))
                    .into_iter()
                    .chain([hcm.clone()])
                    .collect(),
                ..Default::default()
            };
            // Each pod holding its SVID: its connections, matched by their direct source
            // address, name its certificate, by uid. A new pod at a reused IP names
            // another, and so gets another upstream pool key (trial "a-chain").
            let certified = pod_certificates
                .iter()
                .map(|(uid, ips)| listener::FilterChain {
                    name: format!("{POD_CHAIN_PREFIX}{uid}"),
                    filter_chain_match: Some(listener::FilterChainMatch {
                        direct_source_prefix_ranges: ips
                            .iter()
                            .map(|ip| host_prefix(*ip))
                            .collect(),
                        ..Default::default()
                    }),
                    filters: vec![
                        certificate_filter(&snapshot::pod_secret_name(uid)),
                        hcm.clone(),
                    ],
                    ..Default::default()
                })
                .collect::<Vec<_>>();
            // Pods without their own SVID (permissive): their connections match this
            // chain by their direct source address, which sets no certificate name, so
            // the clusters' matcher picks plaintext for them (`transport_socket_matcher`).
            let without_svid = (!plaintext_sources.is_empty()).then(|| listener::FilterChain {
                name: WITHOUT_SVID_CHAIN.into(),
                filter_chain_match: Some(listener::FilterChainMatch {
                    direct_source_prefix_ranges: plaintext_sources
                        .iter()
                        .map(|ip| host_prefix(*ip))
                        .collect(),
                    ..Default::default()
                }),
                filters: vec![hcm],
                ..Default::default()
            });
            let chains = [chain]
                .into_iter()
                .chain(certified)
                .chain(without_svid)
                .collect();
            (core::TrafficDirection::Outbound, chains, vec![])
        }
        snapshot::ListenerKind::InboundCapture => {
            // Redirected connections carry the pod's address as their original
            // destination; the filter restores it, and `use_original_dst` hands the
            // connection to the pod's listener on that address. A connection no pod
            // listener takes (an unknown pod, or a port the pod's listener is not on) falls
            // to this chain, whose cluster is never served: it is closed.
            let original_dst = listener::ListenerFilter {
                name: "envoy.filters.listener.original_dst".into(),
                config_type: Some(listener::listener_filter::ConfigType::TypedConfig(
                    pack_any(OriginalDst::default()),
                )),
                ..Default::default()
            };
            let blackhole = listener::FilterChain {
                name: "blackhole".into(),
                filters: vec![tcp_proxy(snapshot::INBOUND_BLACKHOLE)],
                ..Default::default()
            };
            (
                core::TrafficDirection::Inbound,
                vec![blackhole],
                vec![original_dst],
            )
        }
        snapshot::ListenerKind::InboundPod { chain: c } => {
            // The prefixes repeat the listener's addresses: every connection the capture
            // listener hands over matches, and the pod's IPs read the same in config_dump
            // as on the filter chain they used to be.
            let chain = |name: String,
                         transport_protocol: &str,
                         transport_socket: Option<core::TransportSocket>| {
                listener::FilterChain {
                    name,
                    filter_chain_match: Some(listener::FilterChainMatch {
                        prefix_ranges: c.ips.iter().map(|ip| host_prefix(*ip)).collect(),
                        transport_protocol: transport_protocol.into(),
                        ..Default::default()
                    }),
                    filters: vec![inbound_tcp_proxy(
                        &c.cluster,
                        c.access_log.as_deref(),
                        transport_socket.is_some(),
                    )],
                    transport_socket,
                    ..Default::default()
                }
            };
            match &c.tls {
                None => (
                    core::TrafficDirection::Inbound,
                    vec![chain(c.pod_uid.clone(), "", None)],
                    vec![],
                ),
                // Strict: one chain, mTLS with the pod's SVID and peers checked against
                // the trust bundle; no TLS inspector, since there is nothing to tell
                // apart (a plaintext client fails the handshake).
                Some(t) if !t.plaintext => (
                    core::TrafficDirection::Inbound,
                    vec![chain(
                        format!("{}|mtls", c.pod_uid),
                        "",
                        Some(downstream_mtls(&t.certificate)),
                    )],
                    vec![],
                ),
                // Permissive: the TLS inspector on the pod's own listener (its listener
                // filters run after the capture listener's hand-off, so pods without
                // mTLS do not pay for it) sends TLS to the mTLS chain and everything else
                // to the plaintext chain, which matches any transport protocol.
                Some(t) => {
                    let chains = vec![
                        chain(
                            format!("{}|mtls", c.pod_uid),
                            "tls",
                            Some(downstream_mtls(&t.certificate)),
                        ),
                        chain(format!("{}|plaintext", c.pod_uid), "", None),
                    ];
                    (
                        core::TrafficDirection::Inbound,
                        chains,
                        vec![tls_inspector()],
                    )
                }
            }
        }
        snapshot::ListenerKind::QuicTwins { .. } => unreachable!("converted above"),
    };
    let (use_original_dst, bind_to_port, additional_addresses) = match &l.kind {
        snapshot::ListenerKind::HttpOutbound { .. } | snapshot::ListenerKind::QuicTwins { .. } => {
            (None, None, vec![])
        }
        snapshot::ListenerKind::InboundCapture => (Some(BoolValue { value: true }), None, vec![]),
        // Reached only by hand-off from the capture listener, never bound. The first IP
        // is the listener's address; the others (dual stack) are additional addresses.
        snapshot::ListenerKind::InboundPod { chain } => (
            None,
            Some(BoolValue { value: false }),
            chain
                .ips
                .iter()
                .filter(|ip| **ip != l.address.ip())
                .map(|ip| listener::AdditionalAddress {
                    address: Some(socket_address(SocketAddr::new(*ip, l.address.port()))),
                    ..Default::default()
                })
                .collect(),
        ),
    };
    // A server-first client (the server speaks first) sends the TLS inspector nothing:
    // after a second it goes to the plaintext chain instead of being closed at Envoy's
    // default of 15 s.
    let inspects =
        !listener_filters.is_empty() && matches!(l.kind, snapshot::ListenerKind::InboundPod { .. });
    pack_any(listener::Listener {
        name: l.name.clone(),
        address: Some(socket_address(l.address)),
        additional_addresses,
        filter_chains,
        listener_filters,
        listener_filters_timeout: inspects.then_some(Duration {
            seconds: 1,
            nanos: 0,
        }),
        continue_on_listener_filters_timeout: inspects,
        use_original_dst,
        bind_to_port,
        traffic_direction: direction as i32,
        ..Default::default()
    })
}

/// The node's QUIC listener: one UDP socket, a filter chain per twin chosen by its server
/// name (no default chain: a handshake naming no twin, or none, is refused). Each chain
/// terminates QUIC with the pod's SVID (its inbound secret, by SDS: a rotation is a secret
/// update), requires a client certificate that chains to the trust bundle and carries a
/// URI SAN of the trust domain (the bundle secret holds both, as on the TCP inbound), and
/// forwards each HTTP/3 request over HTTP/1.1 to the pod's inbound cluster, the TCP
/// inbound's target, with the caller's SPIFFE ID in `x-forwarded-client-cert`. Client
/// authentication over QUIC needs the runtime feature
/// `envoy.reloadable_features.quic_mtls_server_enabled`, on by default in 1.40 and set
/// explicitly by the bootstrap: without it Envoy rejects the listener rather than serve it
/// unchecked (e2e/trials/quic/RESULTS.md).
fn quic_twins_listener(l: &snapshot::Listener, twins: &[snapshot::Twin]) -> Any {
    use envoy_types::pb::envoy::extensions::transport_sockets::quic::v3::QuicDownstreamTransport;
    let chains = twins
        .iter()
        .map(|t| {
            let tls = tls::DownstreamTlsContext {
                common_tls_context: Some(tls::CommonTlsContext {
                    alpn_protocols: vec!["h3".into()],
                    tls_certificate_sds_secret_configs: vec![sds(&t.certificate)],
                    validation_context_type: Some(bundle_validation()),
                    ..Default::default()
                }),
                require_client_certificate: Some(BoolValue { value: true }),
                ..Default::default()
            };
            let route = route::RouteConfiguration {
                name: format!("twin|{}", t.pod_uid),
                virtual_hosts: vec![route::VirtualHost {
                    name: t.pod_uid.clone(),
                    domains: vec!["*".into()],
                    routes: vec![route::Route {
                        r#match: Some(route::RouteMatch {
                            path_specifier: Some(route::route_match::PathSpecifier::Prefix(
                                "/".into(),
                            )),
                            ..Default::default()
                        }),
                        action: Some(route::route::Action::Route(route::RouteAction {
                            cluster_specifier: Some(
                                route::route_action::ClusterSpecifier::Cluster(t.cluster.clone()),
                            ),
                            ..Default::default()
                        })),
                        ..Default::default()
                    }],
                    ..Default::default()
                }],
                ..Default::default()
            };
            let manager = hcm::HttpConnectionManager {
                stat_prefix: "twin".into(),
                codec_type: hcm::http_connection_manager::CodecType::Http3 as i32,
                http3_protocol_options: Some(core::Http3ProtocolOptions::default()),
                route_specifier: Some(hcm::http_connection_manager::RouteSpecifier::RouteConfig(
                    route,
                )),
                forward_client_cert_details:
                    hcm::http_connection_manager::ForwardClientCertDetails::SanitizeSet as i32,
                set_current_client_cert_details: Some(
                    hcm::http_connection_manager::SetCurrentClientCertDetails {
                        uri: true,
                        ..Default::default()
                    },
                ),
                http_filters: vec![hcm::HttpFilter {
                    name: "envoy.filters.http.router".into(),
                    config_type: Some(hcm::http_filter::ConfigType::TypedConfig(pack_any(
                        Router::default(),
                    ))),
                    ..Default::default()
                }],
                ..Default::default()
            };
            listener::FilterChain {
                name: t.pod_uid.clone(),
                filter_chain_match: Some(listener::FilterChainMatch {
                    server_names: vec![t.sni.clone()],
                    ..Default::default()
                }),
                filters: vec![listener::Filter {
                    name: "envoy.filters.network.http_connection_manager".into(),
                    config_type: Some(listener::filter::ConfigType::TypedConfig(pack_any(manager))),
                }],
                transport_socket: Some(core::TransportSocket {
                    name: "envoy.transport_sockets.quic".into(),
                    config_type: Some(core::transport_socket::ConfigType::TypedConfig(pack_any(
                        QuicDownstreamTransport {
                            downstream_tls_context: Some(tls),
                            ..Default::default()
                        },
                    ))),
                }),
                ..Default::default()
            }
        })
        .collect();
    let mut address = socket_address(l.address);
    if let Some(core::address::Address::SocketAddress(a)) = &mut address.address {
        a.protocol = core::socket_address::Protocol::Udp as i32;
    }
    pack_any(listener::Listener {
        name: l.name.clone(),
        address: Some(address),
        filter_chains: chains,
        udp_listener_config: Some(listener::UdpListenerConfig {
            quic_options: Some(listener::QuicProtocolOptions::default()),
            downstream_socket_config: Some(core::UdpSocketConfig {
                prefer_gro: Some(BoolValue { value: true }),
                ..Default::default()
            }),
            ..Default::default()
        }),
        traffic_direction: core::TrafficDirection::Inbound as i32,
        ..Default::default()
    })
}

fn tls_inspector() -> listener::ListenerFilter {
    listener::ListenerFilter {
        name: "envoy.filters.listener.tls_inspector".into(),
        config_type: Some(listener::listener_filter::ConfigType::TypedConfig(
            pack_any(TlsInspector::default()),
        )),
        ..Default::default()
    }
}

fn sds(name: &str) -> tls::SdsSecretConfig {
    tls::SdsSecretConfig {
        name: name.into(),
        sds_config: Some(ads()),
    }
}

/// The trust bundle, from SDS; the peer's URI SAN must be in the trust domain (the
/// bundle secret carries the SPIFFE ID prefix).
fn bundle_validation() -> tls::common_tls_context::ValidationContextType {
    tls::common_tls_context::ValidationContextType::ValidationContextSdsSecretConfig(sds(
        snapshot::BUNDLE_SECRET,
    ))
}

fn tls_socket(config: Any) -> core::TransportSocket {
    core::TransportSocket {
        name: "envoy.transport_sockets.tls".into(),
        config_type: Some(core::transport_socket::ConfigType::TypedConfig(config)),
    }
}

/// The selector that fetches a certificate over SDS when a handshake needs it, on both
/// sides.
const ON_DEMAND_SELECTOR: &str = "envoy.tls.certificate_selectors.on_demand_secret";

/// A pod's inbound TLS: its certificate, a client certificate required and checked.
///
/// The certificate is the pod's inbound secret ([`snapshot::inbound_secret_name`]), a
/// name no on-demand selector uses: Envoy 1.40 keeps one SDS provider per name, config
/// source and whether its user warms on it, and a second provider's watch on a name the
/// ADS mux already holds sends no request, so a name shared by a listener's certificate
/// and the outbound side's on-demand selector left the selector's handshakes waiting
/// until the cluster's connect timeout (found by e2e/tests/mtls_datapath.rs; Envoy issue
/// 47309). Its own name keeps the listener warming on it, session resumption, and the
/// certificate in admin `/certs`.
fn downstream_mtls(certificate: &str) -> core::TransportSocket {
    // A plain SDS certificate (the pod's inbound secret, a name of its own): the listener
    // warms until it arrives, and Envoy's admin `/certs` lists it.
    tls_socket(pack_any(tls::DownstreamTlsContext {
        common_tls_context: Some(tls::CommonTlsContext {
            tls_certificate_sds_secret_configs: vec![sds(certificate)],
            validation_context_type: Some(bundle_validation()),
            ..Default::default()
        }),
        require_client_certificate: Some(BoolValue { value: true }),
        ..Default::default()
    }))
}

/// The filter state key the upstream certificate mapper reads the secret name from
/// (hardcoded in Envoy: a misspelt key is silently absent, and the mapper then uses its
/// default).
const CERTIFICATE_KEY: &str = "envoy.tls.certificate_mappers.on_demand_secret";
/// The factory of the filter state object. The key is no well-known object, so Envoy
/// needs one (without it the listener is rejected: "does not have an object factory").
/// It must be hashable: the upstream connection pools are keyed by the hashable objects
/// shared with the upstream only, so with the plain `envoy.string` a connection made with
/// one pod's certificate is reused for another pod's requests (measured in
/// e2e/trials/mtls/RESULTS.md).
const CERTIFICATE_FACTORY: &str = "envoy.hashable_string";
/// The upstream certificate mapper that reads [`CERTIFICATE_KEY`].
const CERTIFICATE_MAPPER: &str = "envoy.tls.upstream_certificate_mappers.filter_state_override";

/// The certificate a connection from no known pod names:
/// [`snapshot::NO_SVID_SECRET_PREFIX`] and its direct remote address, never served.
fn unknown_source_certificate() -> String {
    format!(
        "{}%DOWNSTREAM_DIRECT_REMOTE_ADDRESS_WITHOUT_PORT%",
        snapshot::NO_SVID_SECRET_PREFIX
    )
}

/// Names each outbound connection's client certificate: `name`, a format string. The
/// chain it is on was chosen by the direct remote address, the peer of the TCP
/// connection, which nothing the client sends can change.
fn certificate_filter(name: &str) -> listener::Filter {
    let value = filter_state::FilterStateValue {
        key: Some(filter_state::filter_state_value::Key::ObjectKey(
            CERTIFICATE_KEY.into(),
        )),
        factory_key: CERTIFICATE_FACTORY.into(),
        value: Some(filter_state::filter_state_value::Value::FormatString(
            core::SubstitutionFormatString {
                format: Some(core::substitution_format_string::Format::TextFormatSource(
                    core::DataSource {
                        specifier: Some(core::data_source::Specifier::InlineString(
                            name.to_string(),
                        )),
                        ..Default::default()
                    },
                )),
                ..Default::default()
            },
        )),
        shared_with_upstream: filter_state::filter_state_value::SharedWithUpstream::Once as i32,
        ..Default::default()
    };
    listener::Filter {
        name: "envoy.filters.network.set_filter_state".into(),
        config_type: Some(listener::filter::ConfigType::TypedConfig(pack_any(
            set_filter_state::Config {
                on_new_connection: vec![value],
                ..Default::default()
            },
        ))),
    }
}

/// The metadata that marks an endpoint mTLS-capable, and the transport socket match
/// that selects mTLS for it.
const TLS_MODE_KEY: &str = "aether.io/tls";
const TLS_MODE_MTLS: &str = "mtls";

fn mtls_match() -> Struct {
    Struct {
        fields: [(
            TLS_MODE_KEY.to_string(),
            Value {
                kind: Some(value::Kind::StringValue(TLS_MODE_MTLS.into())),
            },
        )]
        .into(),
    }
}

/// The mapper's default: a name no snapshot serves, so a connection that names no
/// calling pod and still reaches mTLS fails its handshake (Envoy requires a non-empty
/// default: "DefaultValue: value length must be at least 1 characters"). No connection
/// ever presents a certificate but its own pod's.
const NO_CERTIFICATE: &str = "spiffe|none";

/// The outbound listener's chain for the sources of pods without their own SVID.
pub const WITHOUT_SVID_CHAIN: &str = "without-svid";
/// The outbound listener's chain of a pod holding its SVID: this prefix and its uid.
pub const POD_CHAIN_PREFIX: &str = "pod|";

/// How long an idle pooled upstream connection of an mTLS cluster lives.
pub const POOL_IDLE_TIMEOUT_S: i64 = 60;
/// How long any upstream connection of an mTLS cluster lives, busy or not. A pooled
/// connection keeps the certificate it was opened with: this bounds how long a rotated
/// SVID, or a deleted pod's identity on a connection a new pod at its IP reuses, can
/// still be presented (SECURITY.md, limitation 19).
pub const POOL_MAX_CONNECTION_DURATION_S: i64 = 300;

/// The HTTP/1.1 upstream (Envoy's default) with the pool bounds above.
fn bounded_pool() -> upstream_http::HttpProtocolOptions {
    use upstream_http::http_protocol_options::{
        ExplicitHttpConfig, UpstreamProtocolOptions, explicit_http_config::ProtocolConfig,
    };
    upstream_http::HttpProtocolOptions {
        common_http_protocol_options: Some(core::HttpProtocolOptions {
            idle_timeout: Some(Duration {
                seconds: POOL_IDLE_TIMEOUT_S,
                nanos: 0,
            }),
            max_connection_duration: Some(Duration {
                seconds: POOL_MAX_CONNECTION_DURATION_S,
                nanos: 0,
            }),
            ..Default::default()
        }),
        upstream_protocol_options: Some(UpstreamProtocolOptions::ExplicitHttpConfig(
            ExplicitHttpConfig {
                protocol_config: Some(ProtocolConfig::HttpProtocolOptions(
                    core::Http1ProtocolOptions::default(),
                )),
            },
        )),
        ..Default::default()
    }
}

/// Upstream mTLS presenting the calling pod's certificate, fetched over SDS at the
/// first handshake that names it.
fn upstream_mtls() -> core::TransportSocket {
    let mapper = cert_mapper::Config {
        default_value: NO_CERTIFICATE.to_string(),
    };
    let selector = on_demand_secret::Config {
        config_source: Some(ads()),
        certificate_mapper: Some(core::TypedExtensionConfig {
            name: CERTIFICATE_MAPPER.into(),
            typed_config: Some(pack_any(mapper)),
        }),
        ..Default::default()
    };
    tls_socket(pack_any(tls::UpstreamTlsContext {
        common_tls_context: Some(tls::CommonTlsContext {
            custom_tls_certificate_selector: Some(core::TypedExtensionConfig {
                name: ON_DEMAND_SELECTOR.into(),
                typed_config: Some(pack_any(selector)),
            }),
            validation_context_type: Some(bundle_validation()),
            // TLS 1.3, as the Envoy 1.40 trials ran it (e2e/trials/mtls): the client
            // certificate is chosen on the server's CertificateRequest.
            tls_params: Some(tls::TlsParameters {
                tls_maximum_protocol_version: tls::tls_parameters::TlsProtocol::TlSv13 as i32,
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }))
}

/// Permissive clusters: mTLS for an endpoint marked mTLS-capable AND a connection that
/// names its calling pod's certificate; anything else takes the cluster's default,
/// plaintext. A connection from a pod without its SVID names none (the outbound
/// listener's [`WITHOUT_SVID_CHAIN`]), so it goes plaintext rather than borrow a
/// certificate. It takes precedence over the metadata match of `transport_socket_matches`,
/// whose entry it names. Chosen by trial `q1.nosvid` (e2e/trials/mtls/RESULTS.md).
fn mtls_only_with_a_certificate() -> xds_matcher::Matcher {
    use xds_matcher::matcher::matcher_list::{FieldMatcher, Predicate, predicate};
    let single = |name: &str, input: Any, pattern: MatchPattern| Predicate {
        match_type: Some(predicate::MatchType::SinglePredicate(
            predicate::SinglePredicate {
                input: Some(xds_core::TypedExtensionConfig {
                    name: name.into(),
                    typed_config: Some(input),
                }),
                matcher: Some(predicate::single_predicate::Matcher::ValueMatch(
                    xds_matcher::StringMatcher {
                        match_pattern: Some(pattern),
                        ..Default::default()
                    },
                )),
            },
        )),
    };
    let marked = single(
        "envoy.matching.inputs.endpoint_metadata",
        pack_any(socket_input::EndpointMetadataInput {
            filter: "envoy.transport_socket_match".into(),
            path: vec![socket_input::endpoint_metadata_input::PathSegment {
                segment: Some(
                    socket_input::endpoint_metadata_input::path_segment::Segment::Key(
                        TLS_MODE_KEY.into(),
                    ),
                ),
            }],
        }),
        MatchPattern::Exact(TLS_MODE_MTLS.into()),
    );
    let named = single(
        "envoy.matching.inputs.transport_socket_filter_state",
        pack_any(socket_input::FilterStateInput {
            key: CERTIFICATE_KEY.into(),
        }),
        MatchPattern::Prefix(snapshot::POD_SECRET_PREFIX.into()),
    );
    let mtls = xds_matcher::matcher::OnMatch {
        on_match: Some(xds_matcher::matcher::on_match::OnMatch::Action(
            xds_core::TypedExtensionConfig {
                name: "envoy.matching.action.transport_socket.name".into(),
                typed_config: Some(pack_any(socket_input::TransportSocketNameAction {
                    name: TLS_MODE_MTLS.into(),
                })),
            },
        )),
        ..Default::default()
    };
    xds_matcher::Matcher {
        matcher_type: Some(xds_matcher::matcher::MatcherType::MatcherList(
            xds_matcher::matcher::MatcherList {
                matchers: vec![FieldMatcher {
                    predicate: Some(Predicate {
                        match_type: Some(predicate::MatchType::AndMatcher(
                            predicate::PredicateList {
                                predicate: vec![marked, named],
                            },
                        )),
                    }),
                    on_match: Some(mtls),
                }],
            },
        )),
        ..Default::default()
    }
}

pub fn secret(n: &snapshot::NamedSecret) -> Any {
    let inline = |s: &str| core::DataSource {
        specifier: Some(core::data_source::Specifier::InlineString(s.to_string())),
        ..Default::default()
    };
    let kind = match &n.secret {
        snapshot::Secret::Certificate { chain_pem, key_pem } => {
            tls::secret::Type::TlsCertificate(tls::TlsCertificate {
                certificate_chain: Some(inline(chain_pem)),
                private_key: Some(inline(key_pem)),
                ..Default::default()
            })
        }
        snapshot::Secret::Validation {
            ca_pem,
            spiffe_prefix,
        } => tls::secret::Type::ValidationContext(tls::CertificateValidationContext {
            trusted_ca: Some(inline(ca_pem)),
            match_typed_subject_alt_names: vec![tls::SubjectAltNameMatcher {
                san_type: tls::subject_alt_name_matcher::SanType::Uri as i32,
                matcher: Some(matcher::StringMatcher {
                    match_pattern: Some(matcher::string_matcher::MatchPattern::Prefix(
                        spiffe_prefix.clone(),
                    )),
                    ..Default::default()
                }),
                ..Default::default()
            }],
            ..Default::default()
        }),
    };
    pack_any(tls::Secret {
        name: n.name.clone(),
        r#type: Some(kind),
    })
}

fn tcp_proxy(cluster: &str) -> listener::Filter {
    inbound_tcp_proxy(cluster, None, false)
}

/// The fields of a pod's inbound access log line (`--inbound-access-log`), JSON keys to
/// Envoy's format operators. `type` tells the line written once the connection to the
/// pod is made (`TcpUpstreamConnected`) from the one written when it ends
/// (`TcpConnectionEnd`); `peer_uri_san` is the SPIFFE ID the peer presented, empty in
/// plaintext (`tls_version` is then empty too). Each line also names the pod's cluster
/// (`pod_cluster`, `inbound|<pod uid>`).
pub const INBOUND_ACCESS_LOG_FIELDS: [(&str, &str); 8] = [
    ("start_time", "%START_TIME(%s.%3f)%"),
    ("type", "%ACCESS_LOG_TYPE%"),
    ("downstream_remote_address", "%DOWNSTREAM_REMOTE_ADDRESS%"),
    ("peer_uri_san", "%DOWNSTREAM_PEER_URI_SAN%"),
    ("tls_version", "%DOWNSTREAM_TLS_VERSION%"),
    ("upstream_local_address", "%UPSTREAM_LOCAL_ADDRESS%"),
    ("upstream_host", "%UPSTREAM_HOST%"),
    ("bytes_received", "%BYTES_RECEIVED%"),
];

/// How much a client of a pod's mTLS chain may send before the connection to the pod is
/// made, buffered.
const MTLS_EARLY_DATA_BYTES: u32 = 16 * 1024;

/// A tcp_proxy to `cluster`; with `access_log`, each connection logged there as one JSON
/// line once the upstream connection is made and one at its end. `after_handshake` (a
/// pod's mTLS chain): the connection to the pod is made only once the peer's TLS
/// handshake has completed, so no unverified peer ever reaches the pod, and the
/// on-connect log line knows the peer's SPIFFE ID (made at once, the connection to the
/// pod and that line come before the handshake ends).
fn inbound_tcp_proxy(
    cluster: &str,
    access_log: Option<&str>,
    after_handshake: bool,
) -> listener::Filter {
    use envoy_types::pb::envoy::config::accesslog::v3 as accesslog;
    use envoy_types::pb::envoy::extensions::access_loggers::file::v3 as file_log;

    let access_log = access_log
        .map(|path| {
            let format = core::SubstitutionFormatString {
                format: Some(core::substitution_format_string::Format::JsonFormat(
                    Struct {
                        fields: INBOUND_ACCESS_LOG_FIELDS
                            .iter()
                            .map(|(k, v)| {
                                (
                                    k.to_string(),
                                    Value {
                                        kind: Some(value::Kind::StringValue(v.to_string())),
                                    },
                                )
                            })
                            .chain([(
                                "pod_cluster".to_string(),
                                Value {
                                    kind: Some(value::Kind::StringValue(cluster.to_string())),
                                },
                            )])
                            .collect(),
                    },
                )),
                ..Default::default()
            };
            accesslog::AccessLog {
                name: "envoy.access_loggers.file".into(),
                config_type: Some(accesslog::access_log::ConfigType::TypedConfig(pack_any(
                    file_log::FileAccessLog {
                        path: path.to_string(),
                        access_log_format: Some(
                            file_log::file_access_log::AccessLogFormat::LogFormat(format),
                        ),
                    },
                ))),
                ..Default::default()
            }
        })
        .into_iter()
        .collect::<Vec<_>>();
    let access_log_options =
        (!access_log.is_empty()).then(|| tcp::tcp_proxy::TcpAccessLogOptions {
            flush_access_log_on_connected: true,
            ..Default::default()
        });
    listener::Filter {
        name: "envoy.filters.network.tcp_proxy".into(),
        config_type: Some(listener::filter::ConfigType::TypedConfig(pack_any(
            tcp::TcpProxy {
                stat_prefix: cluster.to_string(),
                cluster_specifier: Some(tcp::tcp_proxy::ClusterSpecifier::Cluster(
                    cluster.to_string(),
                )),
                access_log,
                access_log_options,
                upstream_connect_mode: if after_handshake {
                    tcp::UpstreamConnectMode::OnDownstreamTlsHandshake as i32
                } else {
                    tcp::UpstreamConnectMode::Immediate as i32
                },
                max_early_data_bytes: after_handshake.then_some(UInt32Value {
                    value: MTLS_EARLY_DATA_BYTES,
                }),
                ..Default::default()
            },
        ))),
    }
}

pub fn route_config(r: &snapshot::RouteConfig) -> Any {
    let virtual_hosts = r
        .virtual_hosts
        .iter()
        .map(|v| route::VirtualHost {
            name: v.name.clone(),
            domains: v.domains.clone(),
            routes: v
                .routes
                .iter()
                .map(|rt| route::Route {
                    r#match: Some(route::RouteMatch {
                        path_specifier: Some(route::route_match::PathSpecifier::Prefix("/".into())),
                        headers: rt
                            .authority_port
                            .map(|p| route::HeaderMatcher {
                                name: ":authority".into(),
                                header_match_specifier: Some(
                                    route::header_matcher::HeaderMatchSpecifier::StringMatch(
                                        matcher::StringMatcher {
                                            match_pattern: Some(
                                                matcher::string_matcher::MatchPattern::Suffix(
                                                    format!(":{p}"),
                                                ),
                                            ),
                                            ..Default::default()
                                        },
                                    ),
                                ),
                                ..Default::default()
                            })
                            .into_iter()
                            .collect(),
                        ..Default::default()
                    }),
                    action: Some(route::route::Action::Route(route::RouteAction {
                        cluster_specifier: Some(route::route_action::ClusterSpecifier::Cluster(
                            rt.cluster.clone(),
                        )),
                        ..Default::default()
                    })),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        })
        .collect();
    pack_any(route::RouteConfiguration {
        name: r.name.clone(),
        virtual_hosts,
        ..Default::default()
    })
}

pub fn cluster(c: &snapshot::Cluster) -> Any {
    let mut out = cluster::Cluster {
        name: c.name.clone(),
        connect_timeout: Some(Duration {
            seconds: 1,
            nanos: 0,
        }),
        ..Default::default()
    };
    match &c.kind {
        snapshot::ClusterKind::Eds => {
            out.cluster_discovery_type = Some(cluster::cluster::ClusterDiscoveryType::Type(
                cluster::cluster::DiscoveryType::Eds as i32,
            ));
            out.eds_cluster_config = Some(cluster::cluster::EdsClusterConfig {
                eds_config: Some(ads()),
                service_name: c.name.clone(),
            });
            // Endpoints marked mTLS-capable get mTLS; the rest of the cluster stays
            // plaintext (the default transport socket).
            if let Some(t) = &c.upstream_tls {
                out.transport_socket_matches = vec![cluster::cluster::TransportSocketMatch {
                    name: TLS_MODE_MTLS.into(),
                    r#match: Some(mtls_match()),
                    transport_socket: Some(upstream_mtls()),
                }];
                if t.plaintext_without_certificate {
                    out.transport_socket_matcher = Some(mtls_only_with_a_certificate());
                }
                out.typed_extension_protocol_options = [(
                    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions".to_string(),
                    pack_any(bounded_pool()),
                )]
                .into();
            }
        }
        snapshot::ClusterKind::Static {
            endpoints,
            draining,
        } => {
            out.cluster_discovery_type = Some(cluster::cluster::ClusterDiscoveryType::Type(
                cluster::cluster::DiscoveryType::Static as i32,
            ));
            // A terminating pod's endpoints are DRAINING in the cluster's own load
            // assignment, exactly as EDS would send them.
            out.load_assignment = Some(load_assignment_of(
                &c.name,
                endpoints.iter().map(|a| snapshot::LbEndpoint {
                    address: *a,
                    draining: *draining,
                    mtls: false,
                }),
            ));
        }
    }
    pack_any(out)
}

pub fn load_assignment(a: &snapshot::LoadAssignment) -> Any {
    pack_any(load_assignment_of(&a.cluster, a.endpoints.iter().cloned()))
}

fn load_assignment_of(
    name: &str,
    eps: impl Iterator<Item = snapshot::LbEndpoint>,
) -> endpoint::ClusterLoadAssignment {
    let lb_endpoints = eps
        .map(|e| endpoint::LbEndpoint {
            host_identifier: Some(endpoint::lb_endpoint::HostIdentifier::Endpoint(
                endpoint::Endpoint {
                    address: Some(socket_address(e.address)),
                    ..Default::default()
                },
            )),
            health_status: if e.draining {
                core::HealthStatus::Draining
            } else {
                core::HealthStatus::Healthy
            } as i32,
            metadata: e.mtls.then(|| core::Metadata {
                filter_metadata: [("envoy.transport_socket_match".to_string(), mtls_match())]
                    .into(),
                ..Default::default()
            }),
            ..Default::default()
        })
        .collect::<Vec<_>>();
    endpoint::ClusterLoadAssignment {
        cluster_name: name.to_string(),
        endpoints: if lb_endpoints.is_empty() {
            vec![]
        } else {
            vec![endpoint::LocalityLbEndpoints {
                lb_endpoints,
                ..Default::default()
            }]
        },
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use aether_model::{Identity, Inputs, MtlsMode, Pod, build};
    use prost::Message;

    use super::*;

    fn decode<T: Message + Default>(any: &Any) -> T {
        T::decode(any.value.as_slice()).expect("decodes")
    }

    fn snapshot_with_pod(mode: MtlsMode) -> aether_model::Snapshot {
        let svid = aether_model::Svid {
            spiffe_id: "spiffe://t/ns/d/pod/p".into(),
            chain_pem: "CHAIN".into(),
            key_pem: "KEY".into(),
            serial: "01".into(),
            not_before: 0,
            not_after: 1,
        };
        let pod = Pod {
            uid: "u".into(),
            namespace: "d".into(),
            name: "p".into(),
            container_id: "c".into(),
            netns: "/n".into(),
            ifname: "eth0".into(),
            ips: vec!["10.0.0.2".parse().unwrap()],
            terminating: false,
            no_quic_twin: false,
        };
        build(&Inputs {
            pods: BTreeMap::from([("u".to_string(), pod)]),
            identity: Identity {
                trust_domain: Some("t".into()),
                mode,
                bundle: Some("CA".into()),
                agent: Some(svid.clone()),
                pods: BTreeMap::from([("u".to_string(), svid)]),
            },
            ..Inputs::default()
        })
    }

    /// Permissive: a pod without its SVID gets the outbound chain without the certificate
    /// name (matched by its direct source address), and an mTLS cluster picks mTLS only
    /// for a marked endpoint and a named certificate; the mapper's default names nothing
    /// served. Strict keeps the plain metadata match: no plaintext path exists there.
    #[test]
    fn a_pod_without_its_svid_gets_a_chain_without_a_certificate_and_plaintext_upstream() {
        let outbound = |plaintext_sources: Vec<IpAddr>| {
            let l = snapshot::Listener {
                name: snapshot::OUTBOUND.into(),
                address: "127.0.0.1:15001".parse().unwrap(),
                kind: snapshot::ListenerKind::HttpOutbound {
                    route_config: snapshot::OUTBOUND.into(),
                    on_demand: false,
                    source_certificates: true,
                    pod_certificates: vec![],
                    plaintext_sources,
                },
            };
            decode::<listener::Listener>(&listener(&l))
        };
        assert_eq!(outbound(vec![]).filter_chains.len(), 1);
        let l = outbound(vec![
            "10.0.0.2".parse().unwrap(),
            "fd00::2".parse().unwrap(),
        ]);
        assert_eq!(l.filter_chains.len(), 2);
        let chain = &l.filter_chains[1];
        assert_eq!(chain.name, WITHOUT_SVID_CHAIN);
        let m = chain.filter_chain_match.as_ref().unwrap();
        assert_eq!(
            m.direct_source_prefix_ranges,
            [
                host_prefix("10.0.0.2".parse().unwrap()),
                host_prefix("fd00::2".parse().unwrap())
            ]
        );
        assert!(m.source_prefix_ranges.is_empty(), "the direct address only");
        let names = |c: &listener::FilterChain| {
            c.filters.iter().map(|f| f.name.clone()).collect::<Vec<_>>()
        };
        assert_eq!(
            names(chain),
            ["envoy.filters.network.http_connection_manager"],
            "no certificate name on this chain"
        );
        assert_eq!(
            names(&l.filter_chains[0])[0],
            "envoy.filters.network.set_filter_state"
        );
        for (mode, matcher) in [(true, true), (false, false)] {
            let c = snapshot::Cluster {
                name: "outbound|80||web.d".into(),
                kind: snapshot::ClusterKind::Eds,
                upstream_tls: Some(snapshot::UpstreamTls {
                    plaintext_without_certificate: mode,
                }),
            };
            let c: cluster::Cluster = decode(&super::cluster(&c));
            assert_eq!(c.transport_socket_matches.len(), 1);
            assert_eq!(c.transport_socket_matcher.is_some(), matcher);
            let opts: upstream_http::HttpProtocolOptions = decode(
                &c.typed_extension_protocol_options["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"],
            );
            let common = opts.common_http_protocol_options.unwrap();
            assert_eq!(
                (
                    common.idle_timeout.unwrap().seconds,
                    common.max_connection_duration.unwrap().seconds
                ),
                (POOL_IDLE_TIMEOUT_S, POOL_MAX_CONNECTION_DURATION_S),
                "an mTLS pool's connections are bounded"
            );
            let Some(core::transport_socket::ConfigType::TypedConfig(any)) = &c
                .transport_socket_matches[0]
                .transport_socket
                .as_ref()
                .unwrap()
                .config_type
            else {
                panic!("typed config")
            };
            let tls: tls::UpstreamTlsContext = decode(any);
            let selector = tls
                .common_tls_context
                .unwrap()
                .custom_tls_certificate_selector
                .unwrap();
            let selector: on_demand_secret::Config = decode(&selector.typed_config.unwrap());
            let mapper: cert_mapper::Config =
                decode(&selector.certificate_mapper.unwrap().typed_config.unwrap());
            assert_eq!(
                mapper.default_value, NO_CERTIFICATE,
                "never a borrowed identity"
            );
        }
        let m = mtls_only_with_a_certificate();
        let text = format!("{m:?}");
        for needle in [
            "envoy.matching.inputs.endpoint_metadata",
            "envoy.matching.inputs.transport_socket_filter_state",
            "AndMatcher",
            "envoy.matching.action.transport_socket.name",
        ] {
            assert!(text.contains(needle), "{needle} missing from {text}");
        }
    }

    /// The outbound listener names each connection's certificate under Envoy's fixed key,
    /// with a hashable object (else pooled upstream connections are shared across pods):
    /// a pod holding its SVID by its uid, on a chain matched by the pod's IPs as the
    /// direct source; any other source a name never served, with its direct address.
    /// Envoy takes a misspelt key or a non-hashable factory without complaint and then
    /// presents the wrong certificate, so both are pinned here.
    #[test]
    fn the_source_certificate_is_keyed_hashable_and_named_by_the_pods_uid() {
        let s = snapshot_with_pod(MtlsMode::Strict);
        let l: listener::Listener = decode(&listener(s.listeners.get(snapshot::OUTBOUND).unwrap()));
        let named = |chain: &listener::FilterChain| {
            let f = &chain.filters[0];
            assert_eq!(f.name, "envoy.filters.network.set_filter_state");
            let Some(listener::filter::ConfigType::TypedConfig(any)) = &f.config_type else {
                panic!("typed config")
            };
            let c: set_filter_state::Config = decode(any);
            let v = &c.on_new_connection[0];
            assert_eq!(
                v.key,
                Some(filter_state::filter_state_value::Key::ObjectKey(
                    "envoy.tls.certificate_mappers.on_demand_secret".into()
                ))
            );
            assert_eq!(v.factory_key, "envoy.hashable_string");
            let Some(filter_state::filter_state_value::Value::FormatString(fs)) = &v.value else {
                panic!("a format string")
            };
            let Some(core::substitution_format_string::Format::TextFormatSource(src)) = &fs.format
            else {
                panic!("text")
            };
            match &src.specifier {
                Some(core::data_source::Specifier::InlineString(name)) => name.clone(),
                other => panic!("{other:?}"),
            }
        };
        assert_eq!(l.filter_chains.len(), 2);
        assert!(l.filter_chains[0].filter_chain_match.is_none());
        assert_eq!(
            named(&l.filter_chains[0]),
            "spiffe|pod|no-svid|%DOWNSTREAM_DIRECT_REMOTE_ADDRESS_WITHOUT_PORT%"
        );
        let pod = &l.filter_chains[1];
        assert_eq!(pod.name, "pod|u");
        assert_eq!(
            pod.filter_chain_match
                .as_ref()
                .unwrap()
                .direct_source_prefix_ranges,
            [host_prefix("10.0.0.2".parse().unwrap())]
        );
        assert_eq!(named(pod), "spiffe|pod|u");
    }

    /// Strict: one mTLS chain, no inspector. Permissive: the inspector with a 1 s timeout
    /// that continues, an mTLS chain for TLS and a plaintext chain for the rest.
    #[test]
    fn pod_listeners_inspect_only_in_permissive_mode() {
        let strict: listener::Listener = decode(&listener(
            snapshot_with_pod(MtlsMode::Strict)
                .listeners
                .get("inbound|u")
                .unwrap(),
        ));
        assert!(strict.listener_filters.is_empty());
        assert_eq!(strict.filter_chains.len(), 1);
        assert!(strict.filter_chains[0].transport_socket.is_some());
        assert_eq!(
            strict.filter_chains[0]
                .filter_chain_match
                .as_ref()
                .unwrap()
                .transport_protocol,
            ""
        );

        let permissive: listener::Listener = decode(&listener(
            snapshot_with_pod(MtlsMode::Permissive)
                .listeners
                .get("inbound|u")
                .unwrap(),
        ));
        assert_eq!(
            permissive.listener_filters[0].name,
            "envoy.filters.listener.tls_inspector"
        );
        assert_eq!(
            permissive.listener_filters_timeout,
            Some(Duration {
                seconds: 1,
                nanos: 0
            })
        );
        assert!(permissive.continue_on_listener_filters_timeout);
        let protocols: Vec<(&str, bool)> = permissive
            .filter_chains
            .iter()
            .map(|c| {
                (
                    c.filter_chain_match
                        .as_ref()
                        .unwrap()
                        .transport_protocol
                        .as_str(),
                    c.transport_socket.is_some(),
                )
            })
            .collect();
        assert_eq!(protocols, vec![("tls", true), ("", false)]);
    }

    /// `--inbound-access-log`: every chain of a pod's listener logs to the file, flushed
    /// once the connection to the pod is made, with the peer's SPIFFE ID; without it, no
    /// access log, and the listener is what it was (its content hash too).
    #[test]
    fn a_pods_inbound_access_log_is_opt_in_and_names_the_peer() {
        let pod_listener = |log: Option<&str>| {
            let s = snapshot_with_pod(MtlsMode::Permissive);
            let mut l: snapshot::Listener = s.listeners.get("inbound|u").unwrap().clone();
            if let snapshot::ListenerKind::InboundPod { chain } = &mut l.kind {
                chain.access_log = log.map(str::to_string);
            }
            l
        };
        let without: listener::Listener = decode(&listener(&pod_listener(None)));
        let with: listener::Listener = decode(&listener(&pod_listener(Some("/dev/stdout"))));
        let proxies = |l: &listener::Listener| -> Vec<tcp::TcpProxy> {
            l.filter_chains
                .iter()
                .map(|c| match &c.filters[0].config_type {
                    Some(listener::filter::ConfigType::TypedConfig(any)) => decode(any),
                    other => panic!("{other:?}"),
                })
                .collect()
        };
        assert!(
            proxies(&without)
                .iter()
                .all(|p| p.access_log.is_empty() && p.access_log_options.is_none())
        );
        let with = proxies(&with);
        assert_eq!(with.len(), 2, "the mTLS and the plaintext chain");
        assert_eq!(
            with.iter()
                .map(|p| p.upstream_connect_mode)
                .collect::<Vec<_>>(),
            vec![
                tcp::UpstreamConnectMode::OnDownstreamTlsHandshake as i32,
                tcp::UpstreamConnectMode::Immediate as i32
            ],
            "the mTLS chain reaches the pod only after the handshake"
        );
        for p in with {
            assert_eq!(p.access_log.len(), 1);
            assert!(p.access_log_options.unwrap().flush_access_log_on_connected);
            let Some(
                envoy_types::pb::envoy::config::accesslog::v3::access_log::ConfigType::TypedConfig(
                    any,
                ),
            ) = &p.access_log[0].config_type
            else {
                panic!("no typed config")
            };
            let file: envoy_types::pb::envoy::extensions::access_loggers::file::v3::FileAccessLog =
                decode(any);
            assert_eq!(file.path, "/dev/stdout");
            let text = format!("{:?}", file.access_log_format);
            for operator in [
                "%DOWNSTREAM_PEER_URI_SAN%",
                "%DOWNSTREAM_REMOTE_ADDRESS%",
                "%UPSTREAM_LOCAL_ADDRESS%",
                "inbound|u",
            ] {
                assert!(text.contains(operator), "{operator} missing from {text}");
            }
        }
    }

    /// The pod's server certificate is its inbound secret over SDS (the listener warms on
    /// it), a name the outbound side's on-demand selector never uses.
    #[test]
    fn a_pods_server_certificate_is_its_inbound_secret_over_sds() {
        let l: listener::Listener = decode(&listener(
            snapshot_with_pod(MtlsMode::Strict)
                .listeners
                .get("inbound|u")
                .unwrap(),
        ));
        let Some(core::transport_socket::ConfigType::TypedConfig(any)) = &l.filter_chains[0]
            .transport_socket
            .as_ref()
            .unwrap()
            .config_type
        else {
            panic!("a typed transport socket")
        };
        let ctx: tls::DownstreamTlsContext = decode(any);
        let common = ctx.common_tls_context.as_ref().unwrap();
        let names: Vec<&str> = common
            .tls_certificate_sds_secret_configs
            .iter()
            .map(|c| c.name.as_str())
            .collect();
        assert_eq!(names, vec!["spiffe|inbound|u"]);
        assert!(common.custom_tls_certificate_selector.is_none());
        assert_eq!(
            ctx.require_client_certificate,
            Some(BoolValue { value: true })
        );
    }
}
