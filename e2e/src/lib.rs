//! Test fixtures, the Envoy rigs and the restart-gap harness for the Aether node agent.
//!
//! [`testing`] runs the real binaries over real sockets in temp dirs: a [`testing::LocalNode`]
//! is a run dir and a state dir shared by agent generations, set up by a
//! [`testing::NodeBuilder`] (metrics on or off, free capture ports, the one loopback address
//! scheme), and a [`testing::Agent`] is one generation (a supervisor, its worker, its own
//! health dir); it also holds the small helpers every test shares (waiting on a condition
//! with a bound, the one HTTP client, free ports, percentiles). [`envoy`] is the one place a
//! real Envoy is started and read, for the tests, the benchmarks and the [`harness`].

pub mod ack_loop;
pub mod cni_burst;
pub mod cnichain;
pub mod datapath;
pub mod envoy;
pub mod flood;
pub mod harness;
pub mod identity;
pub mod kube_api;
pub mod pause;
pub mod quic;
pub mod registrar;
pub mod testing;
