//! systemd's notify protocol (`sd_notify`): the supervisor's status line, `READY=1` once
//! its worker serves, and `WATCHDOG=1` while its worker answers heartbeats. Without
//! `NOTIFY_SOCKET` it does nothing.

use sd_notify::NotifyState;

/// Sets the unit's status line, and tells systemd the service is ready when `ready`.
pub fn status(ready: bool, text: &str) {
    let mut states = vec![NotifyState::Status(text)];
    if ready {
        states.insert(0, NotifyState::Ready);
    }
    if let Err(e) = sd_notify::notify(&states) {
        tracing::warn!(error = %e, "sd_notify failed");
    }
}

/// Whether systemd watches this process (`WatchdogSec=`: `WATCHDOG_USEC`, and
/// `WATCHDOG_PID` naming this process when set).
pub fn watchdog_enabled() -> bool {
    sd_notify::watchdog_enabled().is_some()
}

/// `WATCHDOG=1`: the supervisor's loop runs and its worker answered a heartbeat.
pub fn watchdog() {
    if let Err(e) = sd_notify::notify(&[NotifyState::Watchdog]) {
        tracing::warn!(error = %e, "sd_notify WATCHDOG=1 failed");
    }
}
