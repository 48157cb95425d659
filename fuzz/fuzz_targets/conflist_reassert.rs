//! The conflist re-assertion (`shared-proto/src/conflist.rs`, run as root by `aether-cni
//! chain` for the node's owner), on arbitrary file contents. What must hold:
//! no panic; when the file is rewritten, the result is JSON whose `plugins` are the old
//! ones plus exactly one `aether-cni` entry at the end and every other key unchanged;
//! when it is not (already chained, or refused), the file is byte for byte as it was.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use serde_json::Value;
use shared_proto::conflist;

fuzz_target!(|data: &[u8]| {
    // tmpfs when there is one: the rewrite fsyncs.
    let base = if Path::new("/dev/shm").is_dir() {
        Path::new("/dev/shm")
    } else {
        Path::new("/tmp")
    };
    let dir = base.join(format!("aether-fuzz-conflist-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("10-fuzz.conflist");
    std::fs::write(&path, data).unwrap();
    let entry = conflist::entry(Path::new("/run/aether/cni.sock"));

    let outcome = conflist::reassert(&dir, &entry);
    let after = std::fs::read(&path).unwrap();
    match outcome {
        Ok(conflist::Outcome::Repaired(p)) => {
            assert_eq!(p, path);
            let before: Value = serde_json::from_slice(data).expect("a rewritten file was JSON");
            let now: Value = serde_json::from_slice(&after).expect("the rewrite is JSON");
            let (mut b, mut n) = (
                before.as_object().unwrap().clone(),
                now.as_object().unwrap().clone(),
            );
            let old = b.remove("plugins").unwrap();
            let new = n.remove("plugins").unwrap();
            assert_eq!(b, n, "keys other than plugins changed");
            let (old, new) = (old.as_array().unwrap(), new.as_array().unwrap());
            assert_eq!(new.len(), old.len() + 1);
            assert_eq!(&new[..old.len()], &old[..]);
            assert_eq!(new[old.len()], entry);
        }
        Ok(conflist::Outcome::Chained(_)) | Err(_) => {
            assert_eq!(after, data, "an untouched file changed")
        }
        Ok(conflist::Outcome::NoConflist) => panic!("the conflist was not found"),
    }
    assert!(
        !dir.join(".aether-cni-conflist.tmp").exists(),
        "a temp file was left behind"
    );
    let _ = std::fs::remove_dir_all(&dir);
});
