//! The drain marks the owner has still to write, kept on disk so that they outlive the
//! worker that took them on: `<state-dir>/drain-marks/`, one empty file per address
//! (`10.77.0.5`, `fd00::5`), made durable before the DEL that asks for the mark is
//! answered and removed once the registrar has answered the mark.
//!
//! Without it a DEL's mark lived in the owner's memory until the registrar took it: an
//! owner that died a few milliseconds after answering a DEL (a roll's SIGTERM, a crash)
//! took the mark with it, and the other nodes never saw that pod's endpoints draining.
//! Each owner restores the folder when it starts to write marks ([`super::Marks::spawn`]),
//! so the next one, after a roll or a worker restart, writes what its predecessor left.
//! A mark is idempotent at the registrar, and one for an address no endpoint has any more
//! is answered NotFound and dropped, so a mark written twice costs nothing.
//!
//! Only an owner has a [`super::Marks`], so a standby never writes here. A file whose name
//! is not an address is logged and left alone. At most [`MAX_PENDING`] marks are kept on
//! disk; past that a mark is kept in memory only, and a warning says so.

use std::fs;
use std::io;
use std::net::IpAddr;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// The folder under the state directory.
pub const DIR: &str = "drain-marks";
/// At most this many marks on disk: a node has a few hundred pod addresses at most, and a
/// registrar down for long makes them wait, not grow past the node's own pods.
pub const MAX_PENDING: usize = 4096;

/// The owner's folder of pending marks.
#[derive(Debug)]
pub struct Pending {
    dir: PathBuf,
}

impl Pending {
    /// The folder `<state_dir>/drain-marks`; nothing is created until a mark is written.
    pub fn new(state_dir: &Path) -> Pending {
        Pending {
            dir: state_dir.join(DIR),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The marks a previous owner left, each address once, in order.
    pub fn restore(&self) -> Vec<IpAddr> {
        let entries = match fs::read_dir(&self.dir) {
            Ok(e) => e,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Vec::new(),
            Err(e) => {
                tracing::warn!(dir = %self.dir.display(), error = %e, "drain marks: cannot read the pending marks a previous owner left");
                return Vec::new();
            }
        };
        let mut out = Vec::new();
        for entry in entries.flatten() {
            let name = entry.file_name();
            match name.to_str().and_then(|n| n.parse::<IpAddr>().ok()) {
                Some(ip) => out.push(ip),
                None => {
                    tracing::warn!(path = %entry.path().display(), "drain marks: a file in the pending marks folder is not named by an address; left alone")
                }
            }
        }
        out.sort();
        out.dedup();
        out
    }

    /// Makes the marks of `ips` durable: one file each, then the folder synced. Blocking
    /// (run it off the runtime thread). An address already pending is not written again.
    pub fn add(&self, ips: &[IpAddr]) -> io::Result<()> {
        if ips.is_empty() {
            return Ok(());
        }
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.dir)?;
        let held = fs::read_dir(&self.dir)?.count();
        if held + ips.len() > MAX_PENDING {
            return Err(io::Error::other(format!(
                "{} holds {held} pending marks, the most it keeps is {MAX_PENDING}",
                self.dir.display()
            )));
        }
        for ip in ips {
            let path = self.path(*ip);
            match fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&path)
            {
                Ok(f) => f.sync_all()?,
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(e),
            }
        }
        fs::File::open(&self.dir)?.sync_all()
    }

    /// Forgets `ip`'s mark once the registrar answered it. Not synced: a mark that comes
    /// back after a crash is written once more, which is harmless.
    pub fn done(&self, ip: IpAddr) {
        match fs::remove_file(self.path(ip)) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(path = %self.path(ip).display(), error = %e, "drain marks: cannot remove a written mark; the next owner writes it again")
            }
        }
    }

    fn path(&self, ip: IpAddr) -> PathBuf {
        self.dir.join(ip.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn marks_outlive_the_store_that_wrote_them_until_done() {
        let dir = tempfile::tempdir().unwrap();
        let p = Pending::new(dir.path());
        assert!(p.restore().is_empty(), "nothing before the first mark");
        assert!(!p.dir().exists(), "nothing created before the first mark");
        p.add(&[ip("10.0.0.2"), ip("fd00::5")]).unwrap();
        p.add(&[ip("10.0.0.2")]).unwrap();
        // What the next owner finds.
        let next = Pending::new(dir.path());
        assert_eq!(next.restore(), vec![ip("10.0.0.2"), ip("fd00::5")]);
        next.done(ip("10.0.0.2"));
        next.done(ip("10.9.9.9"));
        assert_eq!(Pending::new(dir.path()).restore(), vec![ip("fd00::5")]);
        let mode = fs::metadata(p.dir()).unwrap().permissions();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777,
            0o700
        );
    }

    #[test]
    fn a_stray_file_is_left_alone_and_the_cap_holds() {
        let dir = tempfile::tempdir().unwrap();
        let p = Pending::new(dir.path());
        p.add(&[ip("10.0.0.1")]).unwrap();
        fs::write(p.dir().join("notes.txt"), b"x").unwrap();
        assert_eq!(p.restore(), vec![ip("10.0.0.1")]);
        assert!(p.dir().join("notes.txt").exists());
        let many: Vec<IpAddr> = (0..MAX_PENDING as u32)
            .map(|i| IpAddr::from(std::net::Ipv4Addr::from(0x0a01_0000 + i)))
            .collect();
        let e = p.add(&many).unwrap_err().to_string();
        assert!(e.contains("pending marks") && e.contains(DIR), "{e}");
    }
}
