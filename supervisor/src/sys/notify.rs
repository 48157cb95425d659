//! systemd's notify protocol (`sd_notify`): the supervisor's status line, and `READY=1`
//! once its worker serves. Without `NOTIFY_SOCKET` it does nothing.

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
