//! Stale pod records: which stored pods the API server no longer has. Pure, with the
//! clock passed in.
//!
//! A record is a candidate once it is absent from a current, complete view of this
//! node's pods ([`PodView::synced`]); it is due once it has stayed absent for the grace
//! period. Absence is judged only from a current view: a pod ADDed while the watch was
//! down is not in the view yet and must not start a timer. A timer started from a
//! current view keeps running while the watch is away (a uid never comes back), but
//! nothing is due until the view is current again, and the fresh list then clears any
//! record whose pod it holds.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use super::view::PodView;

#[derive(Debug)]
pub struct Stale {
    grace: Duration,
    /// Records absent from the view, and since when.
    absent: BTreeMap<String, Instant>,
}

impl Stale {
    pub fn new(grace: Duration) -> Self {
        Self {
            grace,
            absent: BTreeMap::new(),
        }
    }

    /// Notes which of `records` (stored pod uids) are absent from `view` at `now`, and
    /// returns those due for removal, oldest first.
    pub fn check<'a>(
        &mut self,
        now: Instant,
        view: &PodView,
        records: impl IntoIterator<Item = &'a str>,
    ) -> Vec<String> {
        let records: BTreeSet<&str> = records.into_iter().collect();
        self.absent
            .retain(|uid, _| records.contains(uid.as_str()) && !view.contains(uid));
        if !view.synced() {
            return Vec::new();
        }
        for uid in records.iter().filter(|uid| !view.contains(uid)) {
            self.absent.entry(uid.to_string()).or_insert(now);
        }
        let mut due: Vec<(Instant, String)> = self
            .absent
            .iter()
            .filter(|(_, since)| now.saturating_duration_since(**since) >= self.grace)
            .map(|(u, s)| (*s, u.clone()))
            .collect();
        due.sort();
        due.into_iter().map(|(_, uid)| uid).collect()
    }

    /// When the next record falls due, if any is absent.
    pub fn next_due(&self) -> Option<Instant> {
        self.absent.values().min().map(|since| *since + self.grace)
    }

    /// How long `uid` has been absent at `now`.
    pub fn absent_for(&self, uid: &str, now: Instant) -> Option<Duration> {
        self.absent
            .get(uid)
            .map(|since| now.saturating_duration_since(*since))
    }

    /// Stops tracking `uid` (its record is gone).
    pub fn forget(&mut self, uid: &str) {
        self.absent.remove(uid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kube::view::{ApiPod, PodEvent};

    fn listed(uids: &[&str]) -> PodView {
        let mut v = PodView::default();
        v.apply(PodEvent::Init);
        for u in uids {
            v.apply(PodEvent::Listed(
                u.to_string(),
                ApiPod {
                    namespace: "d".into(),
                    name: u.to_string(),
                    deleting: false,
                    ips: vec![],
                },
            ));
        }
        v.apply(PodEvent::InitDone);
        v
    }

    const GRACE: Duration = Duration::from_secs(60);

    /// One table: (seconds after start, what happens to the view, records, due).
    #[test]
    fn records_absent_from_a_current_list_for_the_grace_period_are_due() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut s = Stale::new(GRACE);
        let mut v = listed(&["live"]);

        assert!(s.check(at(0), &v, ["live", "gone"]).is_empty());
        assert_eq!(s.next_due(), Some(at(60)));
        assert!(s.check(at(59), &v, ["live", "gone"]).is_empty());
        assert_eq!(s.check(at(60), &v, ["live", "gone"]), ["gone"]);

        // The watch fails: the timer keeps running but nothing is due until it is back.
        v.apply(PodEvent::Failed);
        assert!(s.check(at(70), &v, ["live", "gone"]).is_empty());
        // A record ADDed while the watch is down starts no timer.
        assert!(s.check(at(71), &v, ["live", "gone", "new"]).is_empty());
        assert_eq!(s.absent_for("new", at(71)), None);
        // The fresh list holds the new pod: only the old record is due, at once.
        let v = listed(&["live", "new"]);
        assert_eq!(s.check(at(200), &v, ["live", "gone", "new"]), ["gone"]);
        s.forget("gone");
        assert!(s.check(at(201), &v, ["live", "new"]).is_empty());
        assert_eq!(s.next_due(), None);
    }

    #[test]
    fn a_pod_that_shows_up_late_clears_its_timer() {
        let t0 = Instant::now();
        let mut s = Stale::new(GRACE);
        let mut v = listed(&[]);
        // The ADD wrote the record before the watch delivered the pod.
        assert!(s.check(t0, &v, ["p"]).is_empty());
        v.apply(PodEvent::Applied(
            "p".into(),
            ApiPod {
                namespace: "d".into(),
                name: "p".into(),
                deleting: false,
                ips: vec![],
            },
        ));
        assert!(s.check(t0 + GRACE * 2, &v, ["p"]).is_empty());
        assert_eq!(s.next_due(), None);
    }

    #[test]
    fn nothing_is_due_before_the_first_complete_list() {
        let mut s = Stale::new(Duration::ZERO);
        let mut v = PodView::default();
        v.apply(PodEvent::Init);
        assert!(s.check(Instant::now(), &v, ["a"]).is_empty());
    }
}
