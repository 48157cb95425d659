//! Bearer tokens of TCP callers, checked with the Kubernetes TokenReview API
//! (`--token-review`): a pod's projected service-account token, minted for the audience
//! `aether-registrar`, names its service account and the node its pod runs on.
//!
//! A review is the last resort, in this order:
//! 1. [`prefilter`]: a token that is not a JWT, whose unverified claims name no audience
//!    or another one, or that expired over an hour ago, is refused without a review (the
//!    claims are read, not trusted: whatever passes is still reviewed).
//! 2. The cache, keyed by a keyed hash of the token: an authenticated answer for a minute
//!    (no longer than the token's `exp`), a refusal for five seconds, so that a reconnect
//!    storm after a registrar restart costs one review per agent, not one per call.
//! 3. A token bucket per source address (`--token-reviews-per-source`,
//!    `--token-review-burst`), kept for at most [`SOURCES_MAX`] addresses: past it the
//!    call is RESOURCE_EXHAUSTED without a review.
//! 4. At most `--token-reviews-in-flight` reviews at once; a call waits up to
//!    [`REVIEW_WAIT`] for one, then is UNAVAILABLE.
//!
//! An answer is accepted only if it names the audience the registrar asked for. The
//! registrar's service account needs `create` on `tokenreviews`.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use base64::Engine;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use kube::api::PostParams;

use crate::authz::TokenIdentity;
use crate::metrics::Metrics;

/// The `extra` key under which TokenReview reports the node a token is bound to.
pub const NODE_NAME_EXTRA: &str = "authentication.kubernetes.io/node-name";
const OK_TTL: Duration = Duration::from_secs(60);
const REFUSED_TTL: Duration = Duration::from_secs(5);
/// Cached answers kept at most; the oldest half goes when full.
const CACHE_MAX: usize = 4096;
/// Source addresses whose review budget is kept at most (`Buckets`).
pub const SOURCES_MAX: usize = 4096;
/// How long a call waits for a review slot.
pub const REVIEW_WAIT: Duration = Duration::from_secs(5);
/// How long a review may take.
const REVIEW_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest token reviewed: a projected service-account token is about 1 KiB.
const TOKEN_MAX: usize = 8192;
/// An `exp` this far in the past still passes the pre-filter (clock skew).
const EXP_SKEW: u64 = 3600;

/// Why a token is not taken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReviewError {
    /// The token is refused: by the pre-filter or by TokenReview.
    #[error("{0}")]
    Refused(String),
    /// TokenReview could not be asked.
    #[error("TokenReview failed: {0}")]
    Failed(String),
    #[error("too many token reviews from this address; retry later")]
    RateLimited,
    #[error("too many token reviews in flight; retry later")]
    Busy,
}

/// The review limits (flags of `serve`).
#[derive(Debug, Clone, Copy)]
pub struct ReviewLimits {
    pub in_flight: usize,
    /// Reviews a second per source address, and the burst above it.
    pub per_source: f64,
    pub burst: f64,
}

pub struct Reviewer {
    api: kube::Api<TokenReview>,
    audience: String,
    /// A random key, so that the cache's keys say nothing about the tokens.
    hasher: std::collections::hash_map::RandomState,
    cache: Mutex<HashMap<u64, Cached>>,
    buckets: Mutex<Buckets<IpAddr>>,
    slots: Arc<tokio::sync::Semaphore>,
    metrics: Arc<Metrics>,
}

/// A review's answer (the identity, or why the token was refused) and until when it
/// stands.
type Cached = (Result<TokenIdentity, String>, Instant);

impl Reviewer {
    /// A reviewer using `client` (see [`crate::kubernetes::client`]).
    pub fn new(
        client: kube::Client,
        audience: String,
        limits: ReviewLimits,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            api: kube::Api::all(client),
            audience,
            hasher: Default::default(),
            cache: Mutex::new(HashMap::new()),
            buckets: Mutex::new(Buckets::new(limits.per_source, limits.burst, SOURCES_MAX)),
            slots: Arc::new(tokio::sync::Semaphore::new(limits.in_flight.max(1))),
            metrics,
        }
    }

    /// Who `token`, presented from `source`, belongs to, or why it is not taken.
    pub async fn review(
        &self,
        token: &str,
        source: Option<IpAddr>,
    ) -> Result<TokenIdentity, ReviewError> {
        let count = |result: &str| Metrics::count(&self.metrics.token_reviews, result);
        let now_unix = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let claims = prefilter(token, &self.audience, now_unix).map_err(|why| {
            count("prefiltered");
            ReviewError::Refused(why)
        })?;
        let key = {
            let mut h = self.hasher.build_hasher();
            h.write(token.as_bytes());
            h.finish()
        };
        if let Some((answer, until)) = lock(&self.cache).get(&key)
            && Instant::now() < *until
        {
            count("cached");
            return answer.clone().map_err(ReviewError::Refused);
        }
        if let Some(ip) = source
            && !lock(&self.buckets).take(&ip, Instant::now())
        {
            count("rate_limited");
            return Err(ReviewError::RateLimited);
        }
        let Ok(Ok(_slot)) = tokio::time::timeout(REVIEW_WAIT, self.slots.acquire()).await else {
            count("busy");
            return Err(ReviewError::Busy);
        };
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: token.to_owned(),
                audiences: Some(vec![self.audience.clone()]),
            },
            ..Default::default()
        };
        let answer = match tokio::time::timeout(
            REVIEW_TIMEOUT,
            self.api.create(&PostParams::default(), &review),
        )
        .await
        {
            Ok(Ok(r)) => identity(&r, &self.audience),
            // Not cached: the API server may be back at the next call.
            Ok(Err(e)) => {
                count("failed");
                return Err(ReviewError::Failed(e.to_string()));
            }
            Err(_) => {
                count("failed");
                return Err(ReviewError::Failed(format!(
                    "no answer within {REVIEW_TIMEOUT:?}"
                )));
            }
        };
        count(if answer.is_ok() {
            "authenticated"
        } else {
            "refused"
        });
        let ttl = match &answer {
            // An authenticated answer stands no longer than the token.
            Ok(_) => claims.exp.map_or(OK_TTL, |exp| {
                OK_TTL.min(Duration::from_secs(exp.saturating_sub(now_unix)))
            }),
            Err(_) => REFUSED_TTL,
        };
        let mut cache = lock(&self.cache);
        if cache.len() >= CACHE_MAX {
            let mut ages: Vec<(u64, Instant)> =
                cache.iter().map(|(k, (_, until))| (*k, *until)).collect();
            ages.sort_by_key(|(_, until)| *until);
            for (k, _) in ages.iter().take(CACHE_MAX / 2) {
                cache.remove(k);
            }
        }
        cache.insert(key, (answer.clone(), Instant::now() + ttl));
        answer.map_err(ReviewError::Refused)
    }
}

/// What the pre-filter read from a token's unverified claims.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claims {
    pub exp: Option<u64>,
}

/// Refuses, without asking anyone, a token that cannot be one the registrar would take:
/// not a JWT (three base64url parts, a JSON header and claims), no `aud` naming
/// `audience`, or an `exp` more than an hour before `now_unix` (so a clock up to an hour
/// fast refuses no token that is still valid; the API server judges expiry on its own).
pub fn prefilter(token: &str, audience: &str, now_unix: u64) -> Result<Claims, String> {
    let not_jwt = |what: &str| Err(format!("the bearer token is not a JWT: {what}"));
    if token.len() > TOKEN_MAX {
        return not_jwt(&format!("over {TOKEN_MAX} bytes"));
    }
    let parts: Vec<&str> = token.split('.').collect();
    if parts.len() != 3 || parts.iter().any(|p| p.is_empty()) {
        return not_jwt("not three dot-separated parts");
    }
    let decode = |p: &str| {
        base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(p.trim_end_matches('='))
            .ok()
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
            .filter(serde_json::Value::is_object)
    };
    if decode(parts[0]).is_none() {
        return not_jwt("the header is not base64url JSON");
    }
    let Some(claims) = decode(parts[1]) else {
        return not_jwt("the claims are not base64url JSON");
    };
    let auds: Vec<&str> = match &claims["aud"] {
        serde_json::Value::String(a) => vec![a.as_str()],
        serde_json::Value::Array(a) => a.iter().filter_map(|v| v.as_str()).collect(),
        _ => vec![],
    };
    if !auds.contains(&audience) {
        return Err(format!(
            "token not minted for the audience {audience:?} (its claims name {auds:?})"
        ));
    }
    let exp = claims["exp"].as_u64();
    if let Some(exp) = exp
        && exp.saturating_add(EXP_SKEW) < now_unix
    {
        return Err(format!(
            "token expired {} s ago",
            now_unix.saturating_sub(exp)
        ));
    }
    Ok(Claims { exp })
}

/// A token bucket per key (a source address, a node), for at most `max` keys. When the
/// map is full, the keys whose buckets have refilled are forgotten (they are as if new);
/// if none has, a new key gets nothing until one has.
pub struct Buckets<K = IpAddr> {
    rate: f64,
    burst: f64,
    max: usize,
    by_key: HashMap<K, (f64, Instant)>,
}

impl<K: std::hash::Hash + Eq + Clone> Buckets<K> {
    pub fn new(rate: f64, burst: f64, max: usize) -> Self {
        Buckets {
            rate,
            burst: burst.max(1.0),
            max,
            by_key: HashMap::new(),
        }
    }

    fn level(&self, (tokens, at): (f64, Instant), now: Instant) -> f64 {
        (tokens + now.saturating_duration_since(at).as_secs_f64() * self.rate).min(self.burst)
    }

    /// Takes one from `key`'s bucket; false if it is empty.
    pub fn take(&mut self, key: &K, now: Instant) -> bool {
        if !self.by_key.contains_key(key) && self.by_key.len() >= self.max {
            let full: Vec<K> = self
                .by_key
                .iter()
                .filter(|(_, b)| self.level(**b, now) >= self.burst)
                .map(|(k, _)| k.clone())
                .collect();
            for k in full {
                self.by_key.remove(&k);
            }
            if self.by_key.len() >= self.max {
                return false;
            }
        }
        let b = self.by_key.get(key).copied().unwrap_or((self.burst, now));
        let level = self.level(b, now);
        if level < 1.0 {
            return false;
        }
        self.by_key.insert(key.clone(), (level - 1.0, now));
        true
    }

    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
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
    // An answer that does not say the token is for this audience is not taken: an API
    // server that ignored the requested audiences would otherwise pass any token.
    let auds = status.audiences.as_deref().unwrap_or_default();
    if !auds.iter().any(|a| a == audience) {
        return Err(format!(
            "token not minted for the audience {audience:?} (TokenReview says it is for {auds:?})"
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
            identity(
                &answer(true, Some(&["aether-registrar"]), None),
                "aether-registrar"
            )
            .unwrap()
            .node,
            None
        );
        // An answer that names no audience is not taken.
        let e = identity(&answer(true, None, Some("n")), "aether-registrar").unwrap_err();
        assert!(e.contains("audience"), "{e}");
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

    fn jwt(claims: serde_json::Value) -> String {
        let b64 = |v: serde_json::Value| {
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v.to_string())
        };
        format!(
            "{}.{}.c2lnbmF0dXJl",
            b64(serde_json::json!({"alg": "RS256"})),
            b64(claims)
        )
    }

    #[test]
    fn the_prefilter_refuses_what_no_review_would_take() {
        let now = 1_800_000_000;
        let ok = jwt(serde_json::json!({"aud": ["aether-registrar"], "exp": now + 3600}));
        assert_eq!(
            prefilter(&ok, "aether-registrar", now),
            Ok(Claims {
                exp: Some(now + 3600)
            })
        );
        let single = jwt(serde_json::json!({"aud": "aether-registrar"}));
        assert_eq!(
            prefilter(&single, "aether-registrar", now),
            Ok(Claims { exp: None })
        );
        for (token, why) in [
            ("random-opaque-token".to_owned(), "not a JWT"),
            ("a.b.c".to_owned(), "not a JWT"),
            (format!("{ok}.x"), "not a JWT"),
            ("x".repeat(9000), "not a JWT"),
            (
                jwt(serde_json::json!({"aud": ["https://kubernetes.default.svc"]})),
                "audience",
            ),
            (jwt(serde_json::json!({"sub": "x"})), "audience"),
            (
                jwt(serde_json::json!({"aud": "aether-registrar", "exp": now - 3601})),
                "expired",
            ),
        ] {
            let e = prefilter(&token, "aether-registrar", now).unwrap_err();
            assert!(e.contains(why), "{token}: {e}");
        }
        // Within the skew an expired token is still reviewed (the API server decides).
        let skew = jwt(serde_json::json!({"aud": "aether-registrar", "exp": now - 3600}));
        assert!(prefilter(&skew, "aether-registrar", now).is_ok());
    }

    #[test]
    fn each_source_gets_a_burst_then_the_rate_and_the_map_stays_bounded() {
        let t0 = Instant::now();
        let ip = |n: u8| IpAddr::from([10, 0, 0, n]);
        let mut b = Buckets::new(2.0, 3.0, 2);
        assert!((0..3).all(|_| b.take(&ip(1), t0)));
        assert!(!b.take(&ip(1), t0), "the burst is spent");
        assert!(
            b.take(&ip(1), t0 + Duration::from_millis(500)),
            "one more after 1/rate"
        );
        assert!(!b.take(&ip(1), t0 + Duration::from_millis(500)));
        assert!(
            b.take(&ip(2), t0 + Duration::from_millis(500)),
            "another source has its own bucket"
        );
        // Full, with no idle bucket: a third source waits.
        assert!(!b.take(&ip(3), t0 + Duration::from_millis(500)));
        assert_eq!(b.len(), 2);
        // Once a bucket has refilled, its source is forgotten to make room.
        assert!(b.take(&ip(3), t0 + Duration::from_secs(5)));
        assert!(b.len() <= 2);
    }
}
