//! SVIDs only for pods the cluster places here: the cross-check of a pod's record (what
//! its CNI ADD said) against this node's pods as the API server lists them
//! ([`crate::kube::PodView`], watched with `spec.nodeName=<node>`). Pure.
//!
//! A pod is placed when the view holds it under the record's uid with the same namespace
//! and name (a record whose ADD carried no uid, keyed by its container id, is looked up
//! by namespace and name), and, once the kubelet has written `status.podIPs` (it does so
//! only after the ADD returns), with exactly the record's addresses, every family of a
//! dual-stack pod included.
//! - Not in the view: deferred, never refused for good. The view may lag the ADD, or be
//!   unsynced while the API server is down or slow; the pod is subscribed when it shows.
//!   A pod on another node, or on none, stays deferred.
//! - In the view with another namespace or name, or other addresses: refused. Its
//!   subscription ends and its SVID leaves the node, until the view agrees again.
//!
//! Either way the ADD itself has succeeded: networking never waits on identity.

use std::collections::BTreeSet;
use std::net::IpAddr;

use aether_model::Pod;

use crate::kube::{ApiPod, PodView};

/// What the cross-check says of one pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Placed,
    /// Not (yet) listed on this node: why.
    Deferred(String),
    /// Listed, but not as the ADD said: why.
    Refused(String),
}

/// The view's pod for `pod`'s record: by uid, or by namespace and name where the ADD
/// carried no uid (the record is then keyed by its container id).
fn find<'a>(pod: &Pod, view: &'a PodView) -> Option<(&'a str, &'a ApiPod)> {
    if let Some((uid, p)) = view.get_key_value(&pod.uid) {
        return Some((uid, p));
    }
    if pod.uid != pod.container_id {
        return None;
    }
    view.find(&pod.namespace, &pod.name)
}

fn ips_text(ips: &BTreeSet<IpAddr>) -> String {
    let v: Vec<String> = ips.iter().map(IpAddr::to_string).collect();
    format!("[{}]", v.join(", "))
}

/// Whether `pod`'s record may have its SVID, by `view`.
pub fn check(pod: &Pod, view: &PodView) -> Verdict {
    let Some((uid, api)) = find(pod, view) else {
        return Verdict::Deferred(if view.synced() {
            format!(
                "the API server lists no pod {}/{} (uid {}) on this node",
                pod.namespace, pod.name, pod.uid
            )
        } else {
            "the pod watch has no current list of this node's pods yet".to_string()
        });
    };
    if (api.namespace.as_str(), api.name.as_str()) != (&pod.namespace, &pod.name) {
        return Verdict::Refused(format!(
            "the API server names uid {uid} {}/{}, the ADD {}/{}",
            api.namespace, api.name, pod.namespace, pod.name
        ));
    }
    if api.ips.is_empty() {
        // The kubelet writes status.podIPs after the ADD returns: checked when it does.
        return Verdict::Placed;
    }
    let listed: BTreeSet<IpAddr> = api.ips.iter().copied().collect();
    let added: BTreeSet<IpAddr> = pod.ips.iter().copied().collect();
    if listed != added {
        return Verdict::Refused(format!(
            "status.podIPs {} differ from the ADD's {}",
            ips_text(&listed),
            ips_text(&added)
        ));
    }
    Verdict::Placed
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kube::PodEvent;

    fn record(uid: &str, name: &str, ips: &[&str]) -> Pod {
        Pod {
            uid: uid.into(),
            namespace: "d".into(),
            name: name.into(),
            container_id: "c1".into(),
            netns: "/n".into(),
            ifname: "eth0".into(),
            ips: ips.iter().map(|i| i.parse().unwrap()).collect(),
            terminating: false,
            no_quic_twin: false,
        }
    }

    fn api(name: &str, ips: &[&str]) -> ApiPod {
        ApiPod {
            namespace: "d".into(),
            name: name.into(),
            deleting: false,
            ips: ips.iter().map(|i| i.parse().unwrap()).collect(),
        }
    }

    fn view(pods: &[(&str, ApiPod)]) -> PodView {
        let mut v = PodView::default();
        v.apply(PodEvent::Init);
        for (uid, p) in pods {
            v.apply(PodEvent::Listed(uid.to_string(), p.clone()));
        }
        v.apply(PodEvent::InitDone);
        v
    }

    #[test]
    fn a_listed_pod_is_placed_before_and_after_its_ips_are_written() {
        let r = record("u1", "web", &["10.1.0.5"]);
        assert_eq!(
            check(&r, &view(&[("u1", api("web", &[]))])),
            Verdict::Placed
        );
        assert_eq!(
            check(&r, &view(&[("u1", api("web", &["10.1.0.5"]))])),
            Verdict::Placed
        );
    }

    #[test]
    fn an_unlisted_pod_is_deferred_and_says_whether_the_view_is_current() {
        let r = record("u1", "web", &["10.1.0.5"]);
        let Verdict::Deferred(why) = check(&r, &view(&[])) else {
            panic!("deferred")
        };
        assert!(why.contains("lists no pod d/web (uid u1)"), "{why}");
        let Verdict::Deferred(why) = check(&r, &PodView::default()) else {
            panic!("deferred")
        };
        assert!(why.contains("no current list"), "{why}");
        // Another pod of the same name (a new uid) is not this one.
        assert!(matches!(
            check(&r, &view(&[("u2", api("web", &[]))])),
            Verdict::Deferred(_)
        ));
    }

    #[test]
    fn other_ips_or_another_name_are_refused_naming_both() {
        let r = record("u1", "web", &["10.1.0.5"]);
        let Verdict::Refused(why) = check(&r, &view(&[("u1", api("web", &["10.1.0.9"]))])) else {
            panic!("refused")
        };
        assert_eq!(
            why,
            "status.podIPs [10.1.0.9] differ from the ADD's [10.1.0.5]"
        );
        let Verdict::Refused(why) = check(&r, &view(&[("u1", api("api", &[]))])) else {
            panic!("refused")
        };
        assert_eq!(why, "the API server names uid u1 d/api, the ADD d/web");
    }

    /// Every address of a dual-stack pod counts: one family missing or different is a
    /// mismatch.
    #[test]
    fn every_ip_of_a_dual_stack_pod_is_checked() {
        let r = record("u1", "web", &["10.1.0.5", "fd00::5"]);
        let both = api("web", &["fd00::5", "10.1.0.5"]);
        assert_eq!(check(&r, &view(&[("u1", both)])), Verdict::Placed);
        for ips in [&["10.1.0.5"][..], &["10.1.0.5", "fd00::6"]] {
            assert!(matches!(
                check(&r, &view(&[("u1", api("web", ips))])),
                Verdict::Refused(_)
            ));
        }
    }

    /// An ADD without a uid (its record keyed by the container id) is found by name.
    #[test]
    fn a_record_without_a_uid_is_found_by_namespace_and_name() {
        let r = record("c1", "web", &["10.1.0.5"]);
        assert_eq!(
            check(&r, &view(&[("u9", api("web", &["10.1.0.5"]))])),
            Verdict::Placed
        );
        assert!(matches!(
            check(&r, &view(&[("u9", api("web", &["10.1.0.6"]))])),
            Verdict::Refused(_)
        ));
    }
}
