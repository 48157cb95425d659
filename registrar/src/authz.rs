//! Who may call what. Over a unix socket the caller is the uid the kernel reports for the
//! connection (SO_PEERCRED): agents (`--agent-uid`) may watch and set drain marks,
//! operators (`--operator-uid`, by default the registrar's own uid) may also apply and
//! delete services, and nobody else may call anything. Over TCP, served only with
//! `--insecure-listen`, every caller may do everything.

use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    WatchEndpoints,
    SetEndpointState,
    ApplyServices,
    DeleteService,
}

impl Method {
    fn for_agents(self) -> bool {
        matches!(self, Method::WatchEndpoints | Method::SetEndpointState)
    }
}

/// The caller, as the transport identifies it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peer {
    /// A TCP connection to a registrar started with `--insecure-listen`.
    InsecureTcp,
    /// A unix socket connection and its peer's uid.
    Unix { uid: u32 },
    /// A unix socket connection whose credentials could not be read.
    UnixUnknown,
}

impl fmt::Display for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Peer::InsecureTcp => write!(f, "a TCP caller"),
            Peer::Unix { uid } => write!(f, "uid {uid}"),
            Peer::UnixUnknown => write!(f, "a unix socket caller without credentials"),
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Policy {
    pub agent_uids: Vec<u32>,
    pub operator_uids: Vec<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{peer} may not call {method:?}: {why}")]
pub struct Denied {
    pub peer: Peer,
    pub method: Method,
    pub why: &'static str,
}

pub fn authorize(policy: &Policy, peer: Peer, method: Method) -> Result<(), Denied> {
    let deny = |why| Err(Denied { peer, method, why });
    match peer {
        Peer::InsecureTcp => Ok(()),
        Peer::UnixUnknown => deny("the peer's credentials are unknown"),
        Peer::Unix { uid } if policy.operator_uids.contains(&uid) => Ok(()),
        Peer::Unix { uid } if policy.agent_uids.contains(&uid) => {
            if method.for_agents() {
                Ok(())
            } else {
                deny("agents (--agent-uid) may only watch and set drain marks; this is for operators (--operator-uid)")
            }
        }
        Peer::Unix { .. } => deny("neither an agent (--agent-uid) nor an operator (--operator-uid)"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Method::*;

    #[test]
    fn agents_watch_and_mark_operators_do_everything_others_nothing() {
        let policy = Policy { agent_uids: vec![65532], operator_uids: vec![0] };
        let all = [WatchEndpoints, SetEndpointState, ApplyServices, DeleteService];
        for (peer, allowed) in [
            (Peer::InsecureTcp, &all[..]),
            (Peer::Unix { uid: 0 }, &all[..]),
            (Peer::Unix { uid: 65532 }, &[WatchEndpoints, SetEndpointState][..]),
            (Peer::Unix { uid: 1000 }, &[][..]),
            (Peer::UnixUnknown, &[][..]),
        ] {
            for m in all {
                assert_eq!(authorize(&policy, peer, m).is_ok(), allowed.contains(&m), "{peer} {m:?}");
            }
        }
        let e = authorize(&policy, Peer::Unix { uid: 65532 }, ApplyServices).unwrap_err().to_string();
        assert!(e.starts_with("uid 65532 may not call ApplyServices: agents"), "{e}");
    }
}
