//! Who is calling and what they may do: one bearer token per user, the RBAC rules
//! granted to each user (resource and verbs, cluster-wide, nothing granted by default),
//! and the record of each user's requests.

use std::collections::BTreeMap;
use std::hash::{BuildHasher, RandomState};

#[derive(Default)]
pub struct User {
    pub token: String,
    /// Granted (resource, verbs); a verb "*" grants every verb.
    rules: Vec<(String, Vec<String>)>,
    /// "METHOD /path?query" per request, in arrival order.
    pub requests: Vec<String>,
    /// PATCH requests on a node, whatever their outcome.
    pub node_patches: usize,
    /// The node a TokenReview of this user's token names.
    pub node: Option<String>,
}

pub struct Access {
    users: BTreeMap<String, User>,
    random: RandomState,
}

impl Access {
    pub fn new() -> Access {
        Access {
            users: BTreeMap::new(),
            random: RandomState::new(),
        }
    }

    /// The user, created with a fresh token if new.
    pub fn user(&mut self, name: &str) -> &mut User {
        if !self.users.contains_key(name) {
            let token = self.new_token(name);
            self.users.insert(
                name.to_owned(),
                User {
                    token,
                    ..User::default()
                },
            );
        }
        self.users.get_mut(name).expect("inserted above")
    }

    pub fn get(&self, name: &str) -> Option<&User> {
        self.users.get(name)
    }

    /// The name of the user holding `token`.
    pub fn authenticate(&self, token: &str) -> Option<String> {
        self.users
            .iter()
            .find(|(_, u)| u.token == token)
            .map(|(n, _)| n.clone())
    }

    pub fn grant(&mut self, name: &str, resource: &str, verbs: &[&str]) {
        let verbs = verbs.iter().map(|v| (*v).to_owned()).collect();
        self.user(name).rules.push((resource.to_owned(), verbs));
    }

    pub fn allowed(&self, name: &str, resource: &str, verb: &str) -> bool {
        self.users.get(name).is_some_and(|u| {
            u.rules
                .iter()
                .any(|(r, verbs)| r == resource && verbs.iter().any(|v| v == verb || v == "*"))
        })
    }

    /// Shaped as a projected service-account token, a JWT whose claims name the audiences
    /// a registrar reviewing it asks for (`aether-registrar`) and the API server's, and
    /// expire in an hour; its signature is 32 hex digits no other server or user will
    /// have, unguessable within a test run. Only the whole token is ever compared.
    fn new_token(&self, name: &str) -> String {
        use base64::Engine;
        let half = |salt: u8| self.random.hash_one((name, salt, self.users.len()));
        let b64 = |v: serde_json::Value| {
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v.to_string())
        };
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let claims = serde_json::json!({
            "aud": ["https://kubernetes.default.svc.cluster.local", "aether-registrar"],
            "sub": name, "iat": now, "exp": now + 3600,
        });
        format!(
            "{}.{}.{:016x}{:016x}",
            b64(serde_json::json!({"alg": "RS256", "kid": "test"})),
            b64(claims),
            half(0),
            half(1)
        )
    }
}

/// The groups the real API server puts a user in: service accounts get theirs and their
/// namespace's; everybody who authenticated gets `system:authenticated`.
pub fn groups(username: &str) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(rest) = username.strip_prefix("system:serviceaccount:") {
        out.push("system:serviceaccounts".to_owned());
        if let Some((ns, _)) = rest.split_once(':') {
            out.push(format!("system:serviceaccounts:{ns}"));
        }
    }
    out.push("system:authenticated".to_owned());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_identify_users_and_rules_grant_verbs() {
        let mut a = Access::new();
        a.grant("agent", "pods", &["get", "list", "watch"]);
        a.grant("agent", "nodes", &["patch"]);
        a.grant("admin", "nodes", &["*"]);
        let (agent, admin) = (a.user("agent").token.clone(), a.user("admin").token.clone());
        assert_ne!(agent, admin);
        assert_eq!(a.authenticate(&agent).as_deref(), Some("agent"));
        assert_eq!(a.authenticate("nobody"), None);
        assert!(a.allowed("agent", "pods", "watch") && a.allowed("agent", "nodes", "patch"));
        assert!(!a.allowed("agent", "pods", "patch") && !a.allowed("agent", "nodes", "get"));
        assert!(a.allowed("admin", "nodes", "delete") && !a.allowed("admin", "pods", "get"));
        assert!(!a.allowed("stranger", "pods", "get"));
    }

    #[test]
    fn service_accounts_get_their_groups() {
        assert_eq!(
            groups("system:serviceaccount:aether:agent"),
            [
                "system:serviceaccounts",
                "system:serviceaccounts:aether",
                "system:authenticated"
            ]
        );
        assert_eq!(groups("alice"), ["system:authenticated"]);
    }
}
