//! The reference registrar of the Aether mesh (`aether-registrar`): the registry API
//! (`aether.registry.v1`) served from etcd v3.
//!
//! Pure core, I/O at the edges: [`keys`] (the etcd key layout), [`values`] (the JSON
//! stored under the keys and its conversion to the API's messages), [`view`] (full views
//! and change batches from etcd reads and watch events, and a client's view of them),
//! [`validate`], [`plan`] (the writes a request makes) and [`authz`] (who may call what)
//! know no etcd client, socket or runtime. [`store`] is the etcd edge, [`gate`] the
//! authentication and authorization in front of the tonic service [`service`], [`conns`]
//! the connection caps, [`listen`] the sockets, [`tls`] the TLS on a TCP one, [`metrics`] the
//! Prometheus endpoint, [`health`] the probes, [`http`] the server of those two ports,
//! [`serve`] the wiring, and [`client`] the operator's commands.
#![forbid(unsafe_code)]

pub mod addrs;
pub mod authz;
pub mod cli;
pub mod client;
pub mod conns;
pub mod gate;
pub mod health;
pub mod http;
pub mod kept;
pub mod keys;
pub mod kubernetes;
pub mod listen;
pub mod metrics;
pub mod mtls;
pub mod plan;
pub mod serve;
pub mod service;
pub mod store;
pub mod streams;
pub mod tls;
pub mod tokenreview;
pub mod validate;
pub mod values;
pub mod view;
pub mod writes;

#[cfg(feature = "testing")]
pub mod testing;
