//! Who may call what.
//!
//! - Over a unix socket the caller is the uid the kernel reports for the connection
//!   (SO_PEERCRED): agents (`--agent-uid`) may watch and set drain marks and QUIC pairs
//!   (the agents' writes), operators
//!   (`--operator-uid`, by default the registrar's own uid) may also apply and delete
//!   services, and nobody else may call anything.
//! - Over TCP with `--token-review`, the caller is who the Kubernetes TokenReview API says
//!   its bearer token belongs to: the agents' service accounts
//!   (`--agent-service-account`) may watch and make the agents' writes, and only for the
//!   node their token is bound to; `--operator-user` names may do everything.
//! - Over mutual TLS (`--spiffe-endpoint` or `--client-ca-bundle`), the caller is the
//!   SPIFFE ID of its X.509-SVID: `--operator-spiffe-id` may do everything,
//!   `--agent-spiffe-id` may watch and make the agents' writes for one node. The node comes from
//!   the ID itself, where the pattern holds `{node}` (per-node agent IDs), or else from
//!   the node-bound token the agent sends beside it, which is then required. A caller that
//!   sends both an SVID and a token must pass with each: the token is authorized as if it
//!   came alone, and where both name a node they must name the same one.
//! - Over TCP with `--insecure-listen`, every caller may do everything.

use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    WatchEndpoints,
    SetEndpointState,
    SetQuicPairs,
    ApplyServices,
    DeleteService,
}

impl Method {
    /// The method's name in the API.
    pub fn name(self) -> &'static str {
        match self {
            Method::WatchEndpoints => "WatchEndpoints",
            Method::SetEndpointState => "SetEndpointState",
            Method::SetQuicPairs => "SetQuicPairs",
            Method::ApplyServices => "ApplyServices",
            Method::DeleteService => "DeleteService",
        }
    }

    fn for_agents(self) -> bool {
        matches!(
            self,
            Method::WatchEndpoints | Method::SetEndpointState | Method::SetQuicPairs
        )
    }
}

/// A caller that TokenReview authenticated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenIdentity {
    /// The user name, e.g. `system:serviceaccount:aether-system:aether-agent`.
    pub user: String,
    /// The node the token is bound to (a pod's projected token, Kubernetes 1.30+).
    pub node: Option<String>,
}

/// A caller that presented an X.509-SVID at the handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SvidIdentity {
    pub spiffe_id: String,
    /// The leaf's serial, lowercase hex.
    pub serial: String,
    /// The leaf's notAfter, seconds since the Unix epoch: a watch stream ends then.
    pub not_after: u64,
    /// The node an `--agent-spiffe-id` pattern with `{node}` read out of the ID.
    pub node: Option<String>,
    /// The bearer token it also sent, as TokenReview authenticated it.
    pub token: Option<TokenIdentity>,
}

/// An `--agent-spiffe-id`: a SPIFFE ID, or one with `{node}` standing for one path
/// segment, the node's name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdPattern {
    prefix: String,
    /// After `{node}`; None without it.
    suffix: Option<String>,
}

impl IdPattern {
    /// Parses `spiffe://TD/PATH`, with at most one `{node}` standing alone in a segment.
    pub fn parse(s: &str) -> Result<IdPattern, String> {
        if crate::mtls::trust_domain_of(s).is_none() {
            return Err(format!(
                "{s:?} is not a SPIFFE ID (spiffe://TRUST-DOMAIN/PATH)"
            ));
        }
        let Some((prefix, suffix)) = s.split_once("{node}") else {
            return Ok(IdPattern {
                prefix: s.to_owned(),
                suffix: None,
            });
        };
        if suffix.contains("{node}")
            || !prefix.ends_with('/')
            || !(suffix.is_empty() || suffix.starts_with('/'))
        {
            return Err(format!(
                "{s:?}: {{node}} must stand alone in one path segment, once, as in spiffe://example.org/aether-agent/{{node}}"
            ));
        }
        Ok(IdPattern {
            prefix: prefix.to_owned(),
            suffix: Some(suffix.to_owned()),
        })
    }

    /// Whether the pattern reads a node out of the ID.
    pub fn has_node(&self) -> bool {
        self.suffix.is_some()
    }

    /// Whether `id` matches, and the node it names (a pattern with `{node}`).
    pub fn matches(&self, id: &str) -> Option<Option<String>> {
        let rest = id.strip_prefix(&self.prefix)?;
        match &self.suffix {
            None => rest.is_empty().then_some(None),
            Some(suffix) => {
                let node = rest.strip_suffix(suffix.as_str())?;
                (!node.is_empty() && !node.contains('/')).then(|| Some(node.to_owned()))
            }
        }
    }
}

impl fmt::Display for IdPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.suffix {
            None => f.write_str(&self.prefix),
            Some(s) => write!(f, "{}{{node}}{s}", self.prefix),
        }
    }
}

/// The caller, as the transport identifies it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Peer {
    /// A TCP connection to a registrar started with `--insecure-listen`.
    InsecureTcp,
    /// A unix socket connection and its peer's uid.
    Unix { uid: u32 },
    /// A unix socket connection whose credentials could not be read.
    UnixUnknown,
    /// A TCP caller whose bearer token TokenReview authenticated.
    Token(TokenIdentity),
    /// A mutual-TLS caller and its SVID (and token, if it sent one).
    Svid(Box<SvidIdentity>),
}

impl Peer {
    /// The node this caller may speak for, if it is bound to one.
    pub fn bound_node(&self) -> Option<&str> {
        match self {
            Peer::Token(t) => t.node.as_deref(),
            Peer::Svid(s) => s
                .node
                .as_deref()
                .or_else(|| s.token.as_ref().and_then(|t| t.node.as_deref())),
            _ => None,
        }
    }

    /// When this caller's credentials lapse (an SVID's notAfter), seconds since the epoch.
    pub fn expires(&self) -> Option<u64> {
        match self {
            Peer::Svid(s) => Some(s.not_after),
            _ => None,
        }
    }
}

impl fmt::Display for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Peer::InsecureTcp => write!(f, "a TCP caller"),
            Peer::Unix { uid } => write!(f, "uid {uid}"),
            Peer::UnixUnknown => write!(f, "a unix socket caller without credentials"),
            Peer::Token(TokenIdentity {
                user,
                node: Some(n),
            }) => write!(f, "{user} (node {n})"),
            Peer::Token(TokenIdentity { user, node: None }) => write!(f, "{user}"),
            Peer::Svid(s) => {
                write!(f, "{} (serial {})", s.spiffe_id, s.serial)?;
                if let Some(n) = &s.node {
                    write!(f, " (node {n})")?;
                }
                match &s.token {
                    Some(t) => write!(f, " with the token of {}", Peer::Token(t.clone())),
                    None => Ok(()),
                }
            }
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Policy {
    pub agent_uids: Vec<u32>,
    pub operator_uids: Vec<u32>,
    /// Service accounts, as `NAMESPACE/NAME`, whose tokens are agents'.
    pub agent_accounts: Vec<String>,
    /// User names that may do everything over token-reviewed TCP.
    pub operator_users: Vec<String>,
    /// The agents' SPIFFE IDs (mutual TLS), some per node with `{node}`.
    pub agent_ids: Vec<IdPattern>,
    /// SPIFFE IDs that may do everything (mutual TLS).
    pub operator_ids: Vec<String>,
}

impl Policy {
    /// Whether `id` is an agent's, and the node its pattern names.
    pub fn agent_id(&self, id: &str) -> Option<Option<String>> {
        self.agent_ids.iter().find_map(|p| p.matches(id))
    }

    fn is_agent_account(&self, user: &str) -> bool {
        let Some(account) = user.strip_prefix("system:serviceaccount:") else {
            return false;
        };
        self.agent_accounts
            .iter()
            .any(|a| a.replacen('/', ":", 1) == account)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{peer} may not call {method:?}: {why}")]
pub struct Denied {
    pub peer: Peer,
    pub method: Method,
    pub why: String,
}

pub fn authorize(policy: &Policy, peer: &Peer, method: Method) -> Result<(), Denied> {
    let deny = |why: &str| {
        Err(Denied {
            peer: peer.clone(),
            method,
            why: why.to_owned(),
        })
    };
    let agent = |method: Method, role: &str| {
        if method.for_agents() {
            Ok(())
        } else {
            deny(&format!(
                "agents ({role}) may only watch and set drain marks and QUIC pairs; this is for operators"
            ))
        }
    };
    match peer {
        Peer::InsecureTcp => Ok(()),
        Peer::UnixUnknown => deny("the peer's credentials are unknown"),
        Peer::Unix { uid } if policy.operator_uids.contains(uid) => Ok(()),
        Peer::Unix { uid } if policy.agent_uids.contains(uid) => agent(method, "--agent-uid"),
        Peer::Unix { .. } => {
            deny("neither an agent (--agent-uid) nor an operator (--operator-uid)")
        }
        Peer::Token(id) if policy.operator_users.contains(&id.user) => Ok(()),
        Peer::Token(id) if policy.is_agent_account(&id.user) => match &id.node {
            Some(_) => agent(method, "--agent-service-account"),
            None => deny(
                "the agent's token is bound to no node: use the pod's projected service-account token (audience aether-registrar; Kubernetes 1.30+ binds it to the pod's node)",
            ),
        },
        Peer::Token(_) => {
            deny("neither an agent (--agent-service-account) nor an operator (--operator-user)")
        }
        Peer::Svid(s) => {
            // Both credentials must hold: the token as if it came alone.
            if let Some(t) = &s.token
                && let Err(e) = authorize(policy, &Peer::Token(t.clone()), method)
            {
                return deny(&format!(
                    "the SVID and the bearer token must both hold, and the token does not: {}",
                    e.why
                ));
            }
            if policy.operator_ids.contains(&s.spiffe_id) {
                return Ok(());
            }
            let Some(id_node) = policy.agent_id(&s.spiffe_id) else {
                return deny(
                    "neither an agent (--agent-spiffe-id) nor an operator (--operator-spiffe-id)",
                );
            };
            agent(method, "--agent-spiffe-id")?;
            let token_node = s.token.as_ref().and_then(|t| t.node.as_deref());
            match (id_node.as_deref(), token_node) {
                (None, None) => deny(
                    "the agent's SPIFFE ID names no node (an --agent-spiffe-id without {node}): send the node-bound projected service-account token beside it",
                ),
                (Some(a), Some(b)) if a != b => deny(&format!(
                    "the SVID names node {a:?} but the token is bound to node {b:?}"
                )),
                _ => Ok(()),
            }
        }
    }
}

/// A request naming `node` (a watch's key, a drain mark's caller, a QUIC pair set's
/// node) from `peer`: a caller
/// whose token is bound to a node may speak for that node only.
pub fn check_node(peer: &Peer, method: Method, node: &str) -> Result<(), Denied> {
    match peer.bound_node() {
        Some(bound) if bound != node => Err(Denied {
            peer: peer.clone(),
            method,
            why: match peer {
                Peer::Svid(s) if s.node.is_some() => format!(
                    "the request names node {node:?}, but the caller's SVID is bound to node {bound:?}"
                ),
                _ => format!(
                    "the request names node {node:?}, but the caller's token is bound to node {bound:?}"
                ),
            },
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Method::*;

    const ALL: [Method; 5] = [
        WatchEndpoints,
        SetEndpointState,
        SetQuicPairs,
        ApplyServices,
        DeleteService,
    ];

    fn token(user: &str, node: Option<&str>) -> Peer {
        Peer::Token(TokenIdentity {
            user: user.into(),
            node: node.map(String::from),
        })
    }

    #[test]
    fn agents_watch_and_mark_operators_do_everything_others_nothing() {
        let policy = Policy {
            agent_uids: vec![65532],
            operator_uids: vec![0],
            agent_accounts: vec!["aether-system/aether-agent".into()],
            operator_users: vec!["ci@example".into()],
            ..Default::default()
        };
        let agent_sa = "system:serviceaccount:aether-system:aether-agent";
        for (peer, allowed) in [
            (Peer::InsecureTcp, &ALL[..]),
            (Peer::Unix { uid: 0 }, &ALL[..]),
            (
                Peer::Unix { uid: 65532 },
                &[WatchEndpoints, SetEndpointState, SetQuicPairs][..],
            ),
            (Peer::Unix { uid: 1000 }, &[][..]),
            (Peer::UnixUnknown, &[][..]),
            (
                token(agent_sa, Some("node-a")),
                &[WatchEndpoints, SetEndpointState, SetQuicPairs][..],
            ),
            (token(agent_sa, None), &[][..]),
            (
                token("system:serviceaccount:aether-system:other", Some("node-a")),
                &[][..],
            ),
            (
                token(
                    "system:serviceaccount:aether-system:aether-agent-x",
                    Some("node-a"),
                ),
                &[][..],
            ),
            (token("ci@example", None), &ALL[..]),
        ] {
            for m in ALL {
                assert_eq!(
                    authorize(&policy, &peer, m).is_ok(),
                    allowed.contains(&m),
                    "{peer} {m:?}"
                );
            }
        }
        let e = authorize(&policy, &Peer::Unix { uid: 65532 }, ApplyServices)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("uid 65532 may not call ApplyServices: agents"),
            "{e}"
        );
        let e = authorize(&policy, &token(agent_sa, None), WatchEndpoints)
            .unwrap_err()
            .to_string();
        assert!(e.contains("bound to no node"), "{e}");
    }

    /// Node B's agent may not set node A's QUIC pairs, by its token or by its SVID (as
    /// for drain marks); an operator, bound to no node, may (to clear a node that is gone).
    #[test]
    fn an_agent_sets_only_its_own_nodes_quic_pairs() {
        let policy = Policy {
            agent_accounts: vec!["sys/agent".into()],
            operator_users: vec!["ops".into()],
            agent_ids: vec![IdPattern::parse("spiffe://td/agent/{node}").unwrap()],
            ..Default::default()
        };
        let sa = "system:serviceaccount:sys:agent";
        for b in [
            token(sa, Some("node-b")),
            svid("spiffe://td/agent/node-b", Some("node-b"), None),
        ] {
            assert!(authorize(&policy, &b, SetQuicPairs).is_ok(), "{b}");
            assert!(check_node(&b, SetQuicPairs, "node-b").is_ok(), "{b}");
            let e = check_node(&b, SetQuicPairs, "node-a")
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("may not call SetQuicPairs")
                    && e.contains("names node \"node-a\"")
                    && e.contains("bound to node \"node-b\""),
                "{e}"
            );
        }
        let ops = token("ops", None);
        assert!(authorize(&policy, &ops, SetQuicPairs).is_ok());
        assert!(check_node(&ops, SetQuicPairs, "node-a").is_ok());
    }

    #[test]
    fn a_token_bound_to_a_node_speaks_for_that_node_only() {
        let peer = token("system:serviceaccount:a:b", Some("node-a"));
        assert!(check_node(&peer, SetEndpointState, "node-a").is_ok());
        let e = check_node(&peer, SetEndpointState, "node-b")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("names node \"node-b\"") && e.contains("bound to node \"node-a\""),
            "{e}"
        );
        // Other transports carry no node binding: the request's node stands.
        for p in [Peer::InsecureTcp, Peer::Unix { uid: 1 }, token("ci", None)] {
            assert!(check_node(&p, WatchEndpoints, "any").is_ok());
        }
    }

    fn svid(id: &str, node: Option<&str>, token: Option<(&str, Option<&str>)>) -> Peer {
        Peer::Svid(Box::new(SvidIdentity {
            spiffe_id: id.into(),
            serial: "1".into(),
            not_after: u64::MAX,
            node: node.map(String::from),
            token: token.map(|(user, node)| TokenIdentity {
                user: user.into(),
                node: node.map(String::from),
            }),
        }))
    }

    #[test]
    fn id_patterns_read_the_node_out_of_one_segment() {
        let p = IdPattern::parse("spiffe://td/aether-agent/{node}").unwrap();
        assert!(p.has_node());
        assert_eq!(
            p.matches("spiffe://td/aether-agent/node-a"),
            Some(Some("node-a".into()))
        );
        for other in [
            "spiffe://td/aether-agent/",
            "spiffe://td/aether-agent/a/b",
            "spiffe://td/aether-agentx/a",
            "spiffe://other/aether-agent/a",
        ] {
            assert_eq!(p.matches(other), None, "{other}");
        }
        let p = IdPattern::parse("spiffe://td/n/{node}/agent").unwrap();
        assert_eq!(p.matches("spiffe://td/n/b/agent"), Some(Some("b".into())));
        assert_eq!(p.to_string(), "spiffe://td/n/{node}/agent");
        let exact = IdPattern::parse("spiffe://td/sa/agent").unwrap();
        assert_eq!(exact.matches("spiffe://td/sa/agent"), Some(None));
        assert_eq!(exact.matches("spiffe://td/sa/agent/x"), None);
        for bad in [
            "https://td/a",
            "spiffe://td",
            "spiffe://td/a{node}",
            "spiffe://td/{node}/{node}",
            "spiffe://td/{node}x",
        ] {
            assert!(IdPattern::parse(bad).is_err(), "{bad}");
        }
    }

    /// The SVID rules: an operator ID does everything; an agent ID watches and marks for
    /// the node its ID or its token names, and needs the token when the ID names none;
    /// with both credentials both must hold and agree.
    #[test]
    fn an_svid_is_an_agent_of_one_node_or_an_operator_and_a_token_beside_it_must_hold_too() {
        let policy = Policy {
            agent_accounts: vec!["sys/agent".into()],
            operator_users: vec!["ops".into()],
            agent_ids: vec![
                IdPattern::parse("spiffe://td/sa/agent").unwrap(),
                IdPattern::parse("spiffe://td/agent/{node}").unwrap(),
            ],
            operator_ids: vec!["spiffe://td/ops".into()],
            ..Default::default()
        };
        let sa = "system:serviceaccount:sys:agent";
        let agent_methods = &[WatchEndpoints, SetEndpointState, SetQuicPairs][..];
        for (peer, allowed, why) in [
            (svid("spiffe://td/ops", None, None), &ALL[..], ""),
            (
                svid("spiffe://td/ops", None, Some(("ops", None))),
                &ALL[..],
                "",
            ),
            // An operator SVID with an agent's token: the token must allow the call too.
            (
                svid("spiffe://td/ops", None, Some((sa, Some("a")))),
                agent_methods,
                "token does not",
            ),
            (
                svid("spiffe://td/agent/a", Some("a"), None),
                agent_methods,
                "for operators",
            ),
            (
                svid("spiffe://td/agent/a", Some("a"), Some((sa, Some("a")))),
                agent_methods,
                "",
            ),
            (
                svid("spiffe://td/agent/a", Some("a"), Some((sa, Some("b")))),
                &[][..],
                "names node \"a\" but the token is bound to node \"b\"",
            ),
            (
                svid("spiffe://td/sa/agent", None, None),
                &[][..],
                "names no node",
            ),
            (
                svid("spiffe://td/sa/agent", None, Some((sa, Some("a")))),
                agent_methods,
                "",
            ),
            (
                svid("spiffe://td/sa/agent", None, Some(("ops", None))),
                &[][..],
                "names no node",
            ),
            (
                svid("spiffe://td/sa/agent", None, Some(("nobody", Some("a")))),
                &[][..],
                "token does not",
            ),
            (
                svid("spiffe://td/other", None, None),
                &[][..],
                "neither an agent (--agent-spiffe-id)",
            ),
        ] {
            for m in ALL {
                let r = authorize(&policy, &peer, m);
                assert_eq!(r.is_ok(), allowed.contains(&m), "{peer} {m:?}: {r:?}");
                if let Err(e) = r
                    && !why.is_empty()
                    && !allowed.is_empty()
                    && m == ApplyServices
                {
                    assert!(
                        e.why.contains(why) || e.why.contains("operators"),
                        "{peer}: {e}"
                    );
                }
            }
            if allowed.is_empty() {
                let e = authorize(&policy, &peer, WatchEndpoints).unwrap_err();
                assert!(e.why.contains(why), "{peer}: {} lacks {why}", e.why);
            }
        }
        // The node a request names must be the SVID's, or its token's.
        let by_id = svid("spiffe://td/agent/a", Some("a"), None);
        assert!(check_node(&by_id, SetEndpointState, "a").is_ok());
        let e = check_node(&by_id, SetEndpointState, "b")
            .unwrap_err()
            .to_string();
        assert!(e.contains("SVID is bound to node \"a\""), "{e}");
        let by_token = svid("spiffe://td/sa/agent", None, Some((sa, Some("a"))));
        assert!(check_node(&by_token, WatchEndpoints, "a").is_ok());
        assert!(check_node(&by_token, WatchEndpoints, "b").is_err());
    }
}
