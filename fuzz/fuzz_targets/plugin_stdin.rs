//! The plugin's input parsing: the first byte picks the command, the bytes up to the
//! first NUL after it are CNI_ARGS, the rest is stdin. Nothing may panic, and an accepted
//! ADD must print a result that is JSON again.
#![no_main]

use std::ffi::OsString;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&selector, rest)) = data.split_first() else {
        return;
    };
    let command = ["ADD", "DEL", "CHECK", "VERSION"][usize::from(selector) % 4];
    let (args, stdin) = match rest.iter().position(|&b| b == 0) {
        Some(i) => (&rest[..i], &rest[i + 1..]),
        None => (&[][..], rest),
    };
    let args = String::from_utf8_lossy(args).into_owned();
    let env = |name: &str| -> Option<OsString> {
        match name {
            "CNI_COMMAND" => Some(command.into()),
            "CNI_CONTAINERID" => Some("0123456789abcdef".into()),
            "CNI_NETNS" => Some("/var/run/netns/fuzz".into()),
            "CNI_IFNAME" => Some("eth0".into()),
            "CNI_ARGS" => Some(args.clone().into()),
            _ => None,
        }
    };
    let Ok(bytes) = aether_cni::read_stdin(stdin) else {
        return;
    };
    match aether_cni::input::parse(&env, &bytes) {
        Ok(inv) => {
            if inv.command == aether_cni::Command::Add {
                let out = aether_cni::input::add_result(&inv.config);
                assert!(serde_json_valid(&out), "ADD result is not JSON: {out}");
                assert!(!inv.request.ips.is_empty());
            }
        }
        Err(e) => {
            assert!(!e.msg.is_empty());
            assert!(serde_json_valid(&e.to_json("1.0.0")));
        }
    }
});

fn serde_json_valid(s: &str) -> bool {
    serde_json::from_str::<serde_json::Value>(s).is_ok_and(|v| v.is_object())
}
