//! `aether-cni`: the CNI plugin binary. All logic lives in the library so that tests and
//! the fuzz target reach it; this only wires the process's env, stdin and stdout.
#![forbid(unsafe_code)]

fn main() -> std::process::ExitCode {
    aether_cni::run(|name: &str| std::env::var_os(name), std::io::stdin().lock(), std::io::stdout().lock())
}
