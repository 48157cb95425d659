//! Who may call what.
//!
//! - Over a unix socket the caller is the uid the kernel reports for the connection
//!   (SO_PEERCRED): agents (`--agent-uid`) may watch and set drain marks, operators
//!   (`--operator-uid`, by default the registrar's own uid) may also apply and delete
//!   services, and nobody else may call anything.
//! - Over TCP with `--token-review`, the caller is who the Kubernetes TokenReview API says
//!   its bearer token belongs to: the agents' service accounts
//!   (`--agent-service-account`) may watch and set drain marks, and only for the node
//!   their token is bound to; `--operator-user` names may do everything.
//! - Over TCP with `--insecure-listen`, every caller may do everything.

use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    WatchEndpoints,
    SetEndpointState,
    ApplyServices,
    DeleteService,
}

impl Method {
    /// The method's name in the API.
    pub fn name(self) -> &'static str {
        match self {
            Method::WatchEndpoints => "WatchEndpoints",
            Method::SetEndpointState => "SetEndpointState",
            Method::ApplyServices => "ApplyServices",
            Method::DeleteService => "DeleteService",
        }
    }

    fn for_agents(self) -> bool {
        matches!(self, Method::WatchEndpoints | Method::SetEndpointState)
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
}

impl Policy {
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
                "agents ({role}) may only watch and set drain marks; this is for operators"
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
    }
}

/// A request naming `node` (a watch's key, a drain mark's caller) from `peer`: a caller
/// whose token is bound to a node may speak for that node only.
pub fn check_node(peer: &Peer, method: Method, node: &str) -> Result<(), Denied> {
    match peer {
        Peer::Token(TokenIdentity {
            node: Some(bound), ..
        }) if bound != node => Err(Denied {
            peer: peer.clone(),
            method,
            why: format!(
                "the request names node {node:?}, but the caller's token is bound to node {bound:?}"
            ),
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Method::*;

    const ALL: [Method; 4] = [
        WatchEndpoints,
        SetEndpointState,
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
        };
        let agent_sa = "system:serviceaccount:aether-system:aether-agent";
        for (peer, allowed) in [
            (Peer::InsecureTcp, &ALL[..]),
            (Peer::Unix { uid: 0 }, &ALL[..]),
            (
                Peer::Unix { uid: 65532 },
                &[WatchEndpoints, SetEndpointState][..],
            ),
            (Peer::Unix { uid: 1000 }, &[][..]),
            (Peer::UnixUnknown, &[][..]),
            (
                token(agent_sa, Some("node-a")),
                &[WatchEndpoints, SetEndpointState][..],
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
}
