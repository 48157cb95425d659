//! `aether-registrar`: see `aether-registrar --help`.
#![forbid(unsafe_code)]

use std::process::ExitCode;

use aether_registrar::cli::{Cli, Command};
use clap::Parser;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("aether-registrar: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Serve(args) => {
                shared_proto::logging::init(&args.log_format);
                aether_registrar::serve::serve(*args).await
            }
            Command::Apply { client, file } => {
                aether_registrar::client::apply(&client, &file).await
            }
            Command::Delete { client, service } => {
                aether_registrar::client::delete(&client, &service).await
            }
            Command::Dump { client } => aether_registrar::client::dump(&client).await,
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("aether-registrar: {e:#}");
            ExitCode::FAILURE
        }
    }
}
