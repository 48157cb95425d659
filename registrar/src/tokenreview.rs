//! Bearer tokens of TCP callers, checked with the Kubernetes TokenReview API
//! (`--token-review`): a pod's projected service-account token, minted for the audience
//! `aether-registrar`, names its service account and the node its pod runs on.
//!
//! Answers are cached by a hash of the token (a minute for an authenticated one, a few
//! seconds for a refusal), so a reconnect storm after a registrar restart costs one review
//! per agent, not one per call. The registrar's service account needs `create` on
//! `tokenreviews` (the `system:auth-delegator` role).

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use kube::api::PostParams;

use crate::authz::TokenIdentity;

/// The `extra` key under which TokenReview reports the node a token is bound to.
pub const NODE_NAME_EXTRA: &str = "authentication.kubernetes.io/node-name";
const OK_TTL: Duration = Duration::from_secs(60);
const REFUSED_TTL: Duration = Duration::from_secs(5);
/// Cached answers kept at most; the oldest half goes when full.
const CACHE_MAX: usize = 4096;

pub struct Reviewer {
    api: kube::Api<TokenReview>,
    audience: String,
    /// A random key, so that the cache's keys say nothing about the tokens.
    hasher: std::collections::hash_map::RandomState,
    cache: Mutex<HashMap<u64, Cached>>,
}

/// A review's answer (the identity, or why the token was refused) and when it was cached.
type Cached = (Result<TokenIdentity, String>, Instant);

impl Reviewer {
    /// A reviewer using `client` (see [`crate::kubernetes::client`]).
    pub fn new(client: kube::Client, audience: String) -> Self {
        Self {
            api: kube::Api::all(client),
            audience,
            hasher: Default::default(),
            cache: Mutex::new(HashMap::new()),
        }
    }

    /// Who `token` belongs to, or why it is refused.
    pub async fn review(&self, token: &str) -> Result<TokenIdentity, String> {
        let key = {
            let mut h = self.hasher.build_hasher();
            h.write(token.as_bytes());
            h.finish()
        };
        if let Some((answer, at)) = lock(&self.cache).get(&key) {
            let ttl = if answer.is_ok() { OK_TTL } else { REFUSED_TTL };
            if at.elapsed() < ttl {
                return answer.clone();
            }
        }
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: token.to_owned(),
                audiences: Some(vec![self.audience.clone()]),
            },
            ..Default::default()
        };
        let answer = match self.api.create(&PostParams::default(), &review).await {
            Ok(r) => identity(&r, &self.audience),
            // Not cached: the API server may be back at the next call.
            Err(e) => return Err(format!("TokenReview failed: {e}")),
        };
        let mut cache = lock(&self.cache);
        if cache.len() >= CACHE_MAX {
            let mut ages: Vec<(u64, Instant)> =
                cache.iter().map(|(k, (_, at))| (*k, *at)).collect();
            ages.sort_by_key(|(_, at)| *at);
            for (k, _) in ages.iter().take(CACHE_MAX / 2) {
                cache.remove(k);
            }
        }
        cache.insert(key, (answer.clone(), Instant::now()));
        answer
    }
}

/// The identity a TokenReview answer gives, or why there is none.
pub fn identity(r: &TokenReview, audience: &str) -> Result<TokenIdentity, String> {
    let Some(status) = &r.status else {
        return Err("TokenReview answered without a status".into());
    };
    if status.authenticated != Some(true) {
        return Err(format!(
            "token not authenticated{}",
            status
                .error
                .as_deref()
                .map(|e| format!(": {e}"))
                .unwrap_or_default()
        ));
    }
    if let Some(auds) = &status.audiences
        && !auds.iter().any(|a| a == audience)
    {
        return Err(format!(
            "token not minted for the audience {audience:?} (it is for {auds:?})"
        ));
    }
    let user = status
        .user
        .as_ref()
        .and_then(|u| u.username.clone())
        .ok_or("TokenReview named no user")?;
    let node = status
        .user
        .as_ref()
        .and_then(|u| u.extra.as_ref())
        .and_then(|extra| extra.get(NODE_NAME_EXTRA))
        .and_then(|v| v.first().cloned());
    Ok(TokenIdentity { user, node })
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::authentication::v1::{TokenReviewStatus, UserInfo};
    use std::collections::BTreeMap;

    fn answer(authenticated: bool, audiences: Option<&[&str]>, node: Option<&str>) -> TokenReview {
        let extra =
            node.map(|n| BTreeMap::from([(NODE_NAME_EXTRA.to_string(), vec![n.to_string()])]));
        TokenReview {
            status: Some(TokenReviewStatus {
                authenticated: Some(authenticated),
                audiences: audiences.map(|a| a.iter().map(|s| s.to_string()).collect()),
                user: Some(UserInfo {
                    username: Some("system:serviceaccount:a:agent".into()),
                    extra,
                    ..Default::default()
                }),
                error: (!authenticated).then(|| "invalid bearer token".into()),
            }),
            ..Default::default()
        }
    }

    #[test]
    fn an_answer_gives_the_user_and_the_bound_node_or_says_why_not() {
        let id = identity(
            &answer(true, Some(&["aether-registrar"]), Some("node-a")),
            "aether-registrar",
        )
        .unwrap();
        assert_eq!(
            (id.user.as_str(), id.node.as_deref()),
            ("system:serviceaccount:a:agent", Some("node-a"))
        );
        assert_eq!(
            identity(&answer(true, None, None), "aether-registrar")
                .unwrap()
                .node,
            None
        );
        let e = identity(&answer(false, None, None), "aether-registrar").unwrap_err();
        assert!(e.contains("not authenticated: invalid bearer token"), "{e}");
        let e = identity(
            &answer(true, Some(&["https://kubernetes.default.svc"]), Some("n")),
            "aether-registrar",
        )
        .unwrap_err();
        assert!(e.contains("audience"), "{e}");
        assert!(
            identity(&TokenReview::default(), "x")
                .unwrap_err()
                .contains("without a status")
        );
    }
}
