//! Where an ADD learns that the proxy serves its pod, and how long it waits.

use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::time::Duration;

use aether_model::Snapshot;

use crate::acks::Acks;

/// How long an Add waits for the proxy to ACK a snapshot holding the pod. Best effort:
/// past it the Add answers success anyway, and the timeout is logged and counted.
pub const ACK_TIMEOUT: Duration = Duration::from_secs(2);

/// Where an Add learns that the proxy serves the pod. [`Acks`] in production; tests and
/// the benchmark use other sources.
pub trait AckSource: Send + Sync + 'static {
    /// Resolves true once the proxy has ACKed a snapshot holding `uid` with `ips`, false
    /// after `timeout`.
    fn wait_for_pod<'a>(
        &'a self,
        uid: &'a str,
        ips: &'a [IpAddr],
        timeout: Duration,
    ) -> Pin<Box<dyn Future<Output = bool> + Send + 'a>>;
}

impl AckSource for Acks {
    fn wait_for_pod<'a>(
        &'a self,
        uid: &'a str,
        ips: &'a [IpAddr],
        timeout: Duration,
    ) -> Pin<Box<dyn Future<Output = bool> + Send + 'a>> {
        Box::pin(self.wait_until(move |s: &Snapshot| s.holds_pod(uid, ips), timeout))
    }
}

/// An ACK source standing in for a proxy that ACKs every snapshot the moment the node
/// publishes it. For tests and the ADD latency benchmark, where no Envoy runs.
#[cfg(any(test, feature = "testing"))]
pub struct PublishedAcks(pub std::sync::Arc<crate::node::Node>);

#[cfg(any(test, feature = "testing"))]
impl AckSource for PublishedAcks {
    fn wait_for_pod<'a>(
        &'a self,
        uid: &'a str,
        ips: &'a [IpAddr],
        timeout: Duration,
    ) -> Pin<Box<dyn Future<Output = bool> + Send + 'a>> {
        Box::pin(crate::acks::wait_for(
            self.0.subscribe(),
            move |s| s.holds_pod(uid, ips),
            timeout,
        ))
    }
}
