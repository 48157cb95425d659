//! The worker's command line. The supervisor builds it; nothing here reads the
//! environment, which the supervisor clears.

use std::path::PathBuf;

use aether_model::MtlsMode;
use clap::{CommandFactory, FromArgMatches, Parser};
use shared_proto::flags::AgentFlags;

#[derive(Debug, Clone, Parser)]
#[command(
    name = "aether-worker",
    version,
    about = "Unprivileged half of the Aether node agent; started by aether-supervisor, not by hand"
)]
pub struct Config {
    /// The inherited control socket (SOCK_SEQPACKET) to the supervisor.
    #[arg(long, default_value_t = 3)]
    pub control_fd: i32,
    /// Used to check that handed-over sockets are bound where expected, and by a released
    /// owner to see its successor answer on `xds.sock`.
    #[arg(long)]
    pub run_dir: PathBuf,
    #[arg(long)]
    pub state_dir: PathBuf,
    #[arg(long)]
    pub health_dir: PathBuf,
    #[arg(long, default_value = "localhost")]
    pub node_name: String,
    #[arg(long, default_value = "aether-agent")]
    pub pod_name: String,
    /// The settings the supervisor passes on (registry, registrar, identity, CNI conf
    /// folder, Kubernetes API access, metrics, logs), defined once for both processes.
    #[command(flatten)]
    pub agent: AgentFlags,
}

/// Workload identity as the flags set it: on when `--spiffe-endpoint` is set.
#[derive(Debug, Clone)]
pub struct IdentityConfig {
    pub workload_api: spiffe::transport::Endpoint,
    /// The flag's text, for logs and `/ready`.
    pub workload_api_text: String,
    pub broker: Option<(spiffe::transport::Endpoint, String)>,
    pub trust_domain: spiffe::TrustDomain,
    pub mode: MtlsMode,
}

impl Config {
    /// The command line, with no environment variable read (the supervisor clears the
    /// environment; a variable set by hand must not change what it passed).
    pub fn from_args(
        args: impl IntoIterator<Item = std::ffi::OsString>,
    ) -> Result<Self, clap::Error> {
        let matches =
            shared_proto::flags::without_env(Self::command()).try_get_matches_from(args)?;
        Self::from_arg_matches(&matches)
    }

    /// Workload identity, when `--spiffe-endpoint` turns it on; an error names the flag at
    /// fault.
    pub fn identity(&self) -> anyhow::Result<Option<IdentityConfig>> {
        // The command line holds the rest: --spiffe-broker-endpoint needs --spiffe-endpoint,
        // which needs --trust-domain.
        let a = &self.agent;
        let Some(workload_api_text) = &a.spiffe_endpoint else {
            return Ok(None);
        };
        let endpoint = |flag: &str, text: &str| {
            spiffe::transport::Endpoint::parse(text)
                .map_err(|e| anyhow::anyhow!("{flag} {text:?}: {e} (expected unix:///path)"))
        };
        let workload_api = endpoint("--spiffe-endpoint", workload_api_text)?;
        let broker = match &a.spiffe_broker_endpoint {
            Some(text) => Some((endpoint("--spiffe-broker-endpoint", text)?, text.clone())),
            None => None,
        };
        let Some(name) = &a.trust_domain else {
            anyhow::bail!(
                "--spiffe-endpoint is set but --trust-domain is not: the trust domain whose SVIDs the agent serves is required with workload identity (AETHER_TRUST_DOMAIN)"
            );
        };
        let trust_domain = parse_trust_domain(name)?;
        let mode = a
            .mtls
            .parse()
            .map_err(|e: String| anyhow::anyhow!("--mtls: {e}"))?;
        Ok(Some(IdentityConfig {
            workload_api,
            workload_api_text: workload_api_text.clone(),
            broker,
            trust_domain,
            mode,
        }))
    }
}

/// A bare trust domain name, as SPIFFE writes it: lower-case letters, digits, `.`, `-`, `_`.
fn parse_trust_domain(name: &str) -> anyhow::Result<spiffe::TrustDomain> {
    let bad = |why: &str| anyhow::anyhow!("--trust-domain {name:?}: {why}");
    if name.contains(':') || name.contains('/') {
        return Err(bad(
            "expected a bare trust domain name such as example.org, not a URI",
        ));
    }
    let td = spiffe::TrustDomain::new(name).map_err(|e| bad(&e.to_string()))?;
    if td.as_str() != name {
        return Err(bad("a trust domain name is lower case"));
    }
    Ok(td)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn try_parse(args: &[&str]) -> Result<Config, clap::Error> {
        Config::from_args(
            [
                &[
                    "aether-worker",
                    "--run-dir=/r",
                    "--state-dir=/s",
                    "--health-dir=/h",
                ],
                args,
            ]
            .concat()
            .into_iter()
            .map(Into::into),
        )
    }

    fn parse(args: &[&str]) -> Config {
        try_parse(args).unwrap()
    }

    #[test]
    fn identity_is_on_with_the_workload_api_and_needs_a_trust_domain() {
        assert!(parse(&[]).identity().unwrap().is_none());
        assert_eq!(parse(&[]).agent.mtls, "permissive");
        let c = parse(&[
            "--spiffe-endpoint=unix:///run/spire/agent.sock",
            "--trust-domain=example.org",
            "--mtls=strict",
        ])
        .identity()
        .unwrap()
        .unwrap();
        assert_eq!(
            (c.trust_domain.as_str(), c.mode),
            ("example.org", MtlsMode::Strict)
        );
        assert_eq!(
            c.workload_api,
            spiffe::transport::Endpoint::Unix("/run/spire/agent.sock".into())
        );
        assert!(c.broker.is_none());
        let c = parse(&[
            "--spiffe-endpoint=unix:///a.sock",
            "--spiffe-broker-endpoint=unix:///b.sock",
            "--trust-domain=t",
        ])
        .identity()
        .unwrap()
        .unwrap();
        assert_eq!(
            c.broker.map(|b| b.0),
            Some(spiffe::transport::Endpoint::Unix("/b.sock".into()))
        );

        for (args, names) in [
            (
                &["--spiffe-endpoint=/a.sock", "--trust-domain=t"][..],
                "--spiffe-endpoint \"/a.sock\"",
            ),
            (
                &[
                    "--spiffe-endpoint=unix:///a.sock",
                    "--spiffe-broker-endpoint=http://x",
                    "--trust-domain=t",
                ][..],
                "--spiffe-broker-endpoint \"http://x\"",
            ),
            (
                &[
                    "--spiffe-endpoint=unix:///a.sock",
                    "--trust-domain=Example.org",
                ][..],
                "--trust-domain \"Example.org\"",
            ),
            (
                &[
                    "--spiffe-endpoint=unix:///a.sock",
                    "--trust-domain=spiffe://example.org",
                ][..],
                "--trust-domain \"spiffe://example.org\"",
            ),
        ] {
            let e = parse(args).identity().unwrap_err().to_string();
            assert!(e.contains(names), "{args:?}: {e}");
        }
        // The companions each flag needs, and the values it takes, are the command line's.
        for (args, names) in [
            (&["--spiffe-endpoint=unix:///a.sock"][..], "--trust-domain"),
            (
                &[
                    "--spiffe-broker-endpoint=unix:///b.sock",
                    "--trust-domain=t",
                ][..],
                "--spiffe-endpoint",
            ),
            (&["--mtls=STRICT"][..], "STRICT"),
        ] {
            let e = try_parse(args).unwrap_err().to_string();
            assert!(e.contains(names), "{args:?}: {e}");
        }
    }
}
