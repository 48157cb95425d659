//! A real CNI chain in a real network namespace, driven as a container runtime drives it:
//! Debian's reference `ptp` plugin with `host-local` IPAM builds the pod's interface and
//! address, then `aether-cni` registers the pod with a running agent. The pod's address
//! must reach the agent's record and the proxy's config; DEL, in reverse order, must
//! undo all of it.
//!
//! Needs root (network namespaces, veth pairs) and the `containernetworking-plugins`
//! package; CI runs as root and `scripts/test.sh` installs the package. Everything the
//! plugins build lives in two namespaces this test creates and deletes: one for the pod,
//! one standing in for the node (the plugins and Envoy run there), so the machine's own
//! network is never touched.

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use aether_e2e::cnichain::{self, Chain, Sandbox};
use aether_e2e::envoy::{Envoy, EnvoyPods};
use aether_e2e::testing::{LocalNode, Netns, bin, is_root, pod_records, unique_suffix};
use serde_json::json;

const T: Duration = Duration::from_secs(10);

#[test]
fn a_real_cni_chain_reaches_the_record_and_envoy_and_del_undoes_it() {
    const NAME: &str = "a_real_cni_chain_reaches_the_record_and_envoy_and_del_undoes_it";
    if !is_root() {
        eprintln!(
            "SKIPPED {NAME}: needs root to create network namespaces and veth pairs (CI runs as root)"
        );
        return;
    }
    let Some(ptp) = cnichain::reference_plugin("ptp")
        .filter(|_| cnichain::reference_plugin("host-local").is_some())
    else {
        eprintln!(
            "SKIPPED {NAME}: {}/ptp or host-local is missing; install Debian's containernetworking-plugins (scripts/test.sh does, as root)",
            cnichain::DEBIAN_CNI_DIR
        );
        return;
    };

    let suffix = unique_suffix();
    let pod_ns = Netns::create(&format!("aether-test-{suffix}"))
        .expect("create the pod's network namespace");
    let host_ns = Netns::create(&format!("aether-test-{suffix}-node"))
        .expect("create the node's stand-in namespace");
    // 10.250.<x>.0/24, x from the suffix: concurrent runs rarely share a subnet, and even
    // then each lives in its own namespaces.
    let x = 1 + u8::from_str_radix(&suffix[..2], 16).expect("hex suffix") % 254;
    let subnet = format!("10.250.{x}.0/24");

    let mut node = LocalNode::new();
    let agent = node.start_agent();
    agent.wait_role("owner", T);
    let envoy = Envoy::start_on(&node, Some(&host_ns));
    match &envoy {
        Some(e) => e.wait_connected(T),
        None => eprintln!(
            "SKIPPED part of {NAME}: no Envoy (set ENVOY_BIN or run scripts/install-envoy.sh); the proxy's config is not checked and ADD waits out the 2 s ACK bound"
        ),
    }

    let ipam_dir = node.root.path().join("ipam");
    let net = "aether-chain-test";
    let chain = Chain {
        name: net.into(),
        cni_version: "1.0.0".into(),
        plugins: vec![
            json!({
                "type": "ptp",
                "ipMasq": false,
                "ipam": { "type": "host-local", "ranges": [[{ "subnet": subnet }]], "dataDir": ipam_dir },
            }),
            json!({ "type": "aether-cni", "agentSocket": node.cni_sock() }),
        ],
        cni_path: vec![
            ptp.parent().expect("plugin dir").to_path_buf(),
            bin("aether-cni").parent().expect("bin dir").to_path_buf(),
        ],
        host_netns: Some(host_ns.name.clone()),
    };
    let uid = format!("chain-{suffix}-uid");
    let container_id = format!("ctr{suffix}");
    let sandbox = Sandbox {
        container_id: container_id.clone(),
        netns: pod_ns.path(),
        ifname: "eth0".into(),
        args: vec![
            ("IgnoreUnknown".into(), "1".into()),
            ("K8S_POD_NAMESPACE".into(), "chain".into()),
            ("K8S_POD_NAME".into(), "web-0".into()),
            ("K8S_POD_UID".into(), uid.clone()),
        ],
    };

    // ADD, in order.
    let added = chain
        .add(&sandbox)
        .unwrap_or_else(|e| panic!("chain ADD: {e}\nagent log:\n{}", agent.log()));
    eprintln!(
        "ADD: {}",
        added
            .steps
            .iter()
            .map(|s| format!("{} {:?}", s.plugin, s.took))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let ips = cnichain::result_ips(&added.result);
    assert_eq!(
        ips.len(),
        1,
        "one address from host-local: {}",
        added.result
    );
    let (ip, len) = ips[0];
    let IpAddr::V4(v4) = ip else {
        panic!("host-local gave {ip}, not IPv4")
    };
    assert_eq!(
        (&v4.octets()[..3], len),
        (&[10, 250, x][..], 24),
        "address {ip}/{len} from the configured subnet {subnet}"
    );
    assert!(
        pod_ns.addrs("eth0").contains(&format!("{ip}/{len}")),
        "eth0 in the pod namespace holds {ip}: {:?}",
        pod_ns.addrs("eth0")
    );
    let lease = ipam_dir.join(net).join(ip.to_string());
    assert!(
        lease.is_file(),
        "host-local's lease {} exists",
        lease.display()
    );

    // The record: whole, with the address host-local chose.
    let records = pod_records(&node.state_dir);
    let record = records
        .get(&format!("{uid}.json"))
        .unwrap_or_else(|| panic!("no record for {uid}: {records:?}"));
    let pod = record
        .as_ref()
        .unwrap_or_else(|e| panic!("record of {uid} does not decode: {e}"));
    assert_eq!(pod.ips, vec![ip]);
    assert_eq!(
        (pod.container_id.as_str(), pod.ifname.as_str()),
        (container_id.as_str(), "eth0")
    );
    assert_eq!(PathBuf::from(&pod.netns), pod_ns.path());
    assert_eq!(
        (pod.namespace.as_str(), pod.name.as_str()),
        ("chain", "web-0")
    );
    assert_eq!(records.len(), 1, "only this pod's record: {records:?}");

    // Envoy: an inbound filter chain matching the pod's address, and its cluster. ADD
    // waited for Envoy's ACK, so the dump already holds it; the wait only covers the
    // admin catching up with the worker thread that applied it.
    let expected = EnvoyPods::expected([(&uid, &ip)]);
    if let Some(envoy) = &envoy
        && let Err(seen) = EnvoyPods::wait_until(envoy, &expected, Duration::from_secs(5))
    {
        panic!(
            "Envoy's config_dump after ADD: {}\nagent log:\n{}",
            seen.diff(&expected),
            agent.log()
        );
    }

    // CHECK, in order, with the ADD's result.
    chain
        .check(&sandbox, &added.result)
        .unwrap_or_else(|e| panic!("chain CHECK after ADD: {e}"));

    // DEL, in reverse order.
    let deleted = chain
        .del(&sandbox, Some(&added.result))
        .unwrap_or_else(|e| panic!("chain DEL: {e}\nagent log:\n{}", agent.log()));
    assert_eq!(
        deleted
            .steps
            .iter()
            .map(|s| s.plugin.as_str())
            .collect::<Vec<_>>(),
        ["aether-cni", "ptp"]
    );
    eprintln!(
        "DEL: {}",
        deleted
            .steps
            .iter()
            .map(|s| format!("{} {:?}", s.plugin, s.took))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let records = pod_records(&node.state_dir);
    assert!(
        records.is_empty(),
        "the record is gone after DEL: {records:?}"
    );
    assert!(
        !pod_ns.links().contains(&"eth0".to_string()),
        "eth0 is gone from the pod namespace: {:?}",
        pod_ns.links()
    );
    assert!(
        host_ns.links().iter().all(|l| l == "lo"),
        "ptp's host-side veth is gone from the node namespace: {:?}",
        host_ns.links()
    );
    assert!(
        !lease.exists(),
        "host-local released the lease {}",
        lease.display()
    );
    if let Some(envoy) = &envoy
        && let Err(seen) =
            EnvoyPods::wait_until(envoy, &EnvoyPods::default(), Duration::from_secs(5))
    {
        panic!(
            "Envoy's config_dump after DEL: {}\nagent log:\n{}",
            seen.diff(&EnvoyPods::default()),
            agent.log()
        );
    }

    // A runtime may repeat DEL (the spec requires it to succeed); nothing comes back.
    chain
        .del(&sandbox, Some(&added.result))
        .unwrap_or_else(|e| panic!("a second chain DEL: {e}"));
    assert!(pod_records(&node.state_dir).is_empty());
    assert!(
        agent
            .log()
            .contains("CNI DEL of a pod the agent does not know"),
        "the repeated DEL reached the agent"
    );

    // DEL while no agent answers: aether-cni, first on DEL, lets the chain go on after its
    // bound, so the primary plugin still tears the interface down and releases the
    // address. The record stays for the agent to collect later.
    let added = chain
        .add(&sandbox)
        .unwrap_or_else(|e| panic!("chain ADD again: {e}\nagent log:\n{}", agent.log()));
    let (ip, _) = cnichain::result_ips(&added.result)[0];
    let lease = ipam_dir.join(net).join(ip.to_string());
    assert!(
        lease.is_file(),
        "host-local's lease {} exists",
        lease.display()
    );
    let mut agent = agent;
    agent.kill_generation();
    let deleted = chain
        .del(&sandbox, Some(&added.result))
        .unwrap_or_else(|e| panic!("chain DEL without an agent: {e}"));
    assert_eq!(
        deleted
            .steps
            .iter()
            .map(|s| s.plugin.as_str())
            .collect::<Vec<_>>(),
        ["aether-cni", "ptp"]
    );
    assert!(
        !lease.exists(),
        "host-local released the lease {} with the agent stopped",
        lease.display()
    );
    assert!(
        !pod_ns.links().contains(&"eth0".to_string()),
        "eth0 is gone: {:?}",
        pod_ns.links()
    );
    assert_eq!(
        pod_records(&node.state_dir).len(),
        1,
        "the record stays for the agent to collect"
    );
}
