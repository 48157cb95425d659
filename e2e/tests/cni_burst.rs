//! A burst of 1,000 concurrent CNI ADDs on a node that already has 110 pods, through the
//! real plugin, with a real Envoy over delta ADS: every call succeeds within the plugin's
//! timeout, ADDs that arrive together share snapshots (at most 50 for the burst), and
//! Envoy holds every pod at the end.

use std::time::Duration;

use aether_e2e::cni_burst;
use aether_e2e::envoy::{self, AdsApi, WorkerRig, envoy_or_skip};
use aether_e2e::testing::{bin, percentile};

/// The plugin's own deadline for a call (`cni-plugin/src/lib.rs`, `Timeouts`).
const PLUGIN_TIMEOUT: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_a_thousand_adds_succeeds_in_few_snapshots_and_every_pod_reaches_envoy() {
    let Some(envoy_bin) = envoy_or_skip(
        "a_burst_of_a_thousand_adds_succeeds_in_few_snapshots_and_every_pod_reaches_envoy",
    ) else {
        return;
    };
    envoy::init_logs("warn");
    let rig = WorkerRig::start(&envoy_bin, &envoy::registry_json(&[]), AdsApi::Delta).await;
    let b = cni_burst::run(&bin("aether-cni"), &rig, 110, 1_000).await;
    let p99 = percentile(&b.calls, 99.0);
    eprintln!(
        "burst of 1,000 ADDs at 110 pods: {} ms in all, p99 per call {:?}, {} snapshots, all in Envoy {:?} after the last answer",
        b.total.as_millis(),
        p99,
        b.snapshots,
        b.all_in_envoy
    );
    assert!(
        b.failures.is_empty(),
        "{} of 1,000 ADDs failed, first: {:?}",
        b.failures.len(),
        b.failures.first()
    );
    assert!(
        b.calls.iter().all(|d| *d < PLUGIN_TIMEOUT),
        "a call took longer than the plugin's timeout: max {:?}",
        b.calls.iter().max()
    );
    assert!(
        b.snapshots <= 50,
        "{} snapshots for a burst of 1,000 ADDs",
        b.snapshots
    );
    assert!(
        b.all_in_envoy.is_some(),
        "Envoy did not hold every pod within 30 s of the last answer"
    );
    assert_eq!(
        rig.metrics.cni_ack_timeouts.get(),
        0,
        "no ADD answered before Envoy ACKed it"
    );
}
