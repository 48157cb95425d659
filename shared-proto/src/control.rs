//! The control protocol: prost messages in one envelope, at most [`fdpass::MAX_MESSAGE`]
//! bytes each, file descriptors only on the messages that expect them.
//!
//! Two conversations use it:
//! - supervisor and worker over their `SOCK_SEQPACKET` pair ([`Body`]);
//! - an owning supervisor and a standby supervisor over `handoff.sock` ([`HandoffBody`]).
//!
//! Each side runs a closed state machine over these messages (see the supervisor's
//! `monitor` and the worker's `control`); this module only says how many descriptors each
//! message must carry, so that the transport can reject the rest before anyone looks.
//!
//! [`fdpass::MAX_MESSAGE`]: crate::fdpass::MAX_MESSAGE

/// Version of the supervisor/worker conversation, sent in [`Hello`].
pub const CONTROL_VERSION: u32 = 1;
/// Version of the handoff conversation, sent in [`HandoffHello`].
pub const HANDOFF_VERSION: u32 = 1;

#[derive(Clone, PartialEq, prost::Message)]
pub struct Envelope {
    #[prost(oneof = "Body", tags = "1, 2, 3, 4, 5, 6")]
    pub body: Option<Body>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Body {
    /// Worker to supervisor, first message: who it is and which protocol it speaks.
    #[prost(message, tag = "1")]
    Hello(Hello),
    /// Supervisor to worker, once: the node is yours. Carries exactly three descriptors,
    /// in order: the lock file, the `xds.sock` listener, the `cni.sock` listener.
    #[prost(message, tag = "2")]
    Takeover(Takeover),
    /// Worker to supervisor: the worker's phase changed.
    #[prost(message, tag = "3")]
    Status(Status),
    /// Supervisor to worker: heartbeat request.
    #[prost(message, tag = "4")]
    Ping(Ping),
    /// Worker to supervisor: heartbeat answer, same sequence number.
    #[prost(message, tag = "5")]
    Pong(Ping),
    /// Supervisor to worker: stop taking new work, finish in-flight work, give the node
    /// up (status `Released`), exit.
    #[prost(message, tag = "6")]
    Drain(Drain),
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Hello {
    #[prost(uint32, tag = "1")]
    pub version: u32,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Takeover {
    /// The node generation this agent now owns (written into the lock file).
    #[prost(uint64, tag = "1")]
    pub generation: u64,
    /// True when a respawned worker gets the sockets its predecessor served: no takeover
    /// reconcile is needed beyond the first-serve gates.
    #[prost(bool, tag = "2")]
    pub respawn: bool,
    /// How the supervisor got the sockets: true when they came from the previous
    /// generation over `handoff.sock`, false when it bound them.
    #[prost(bool, tag = "3")]
    pub handed_off: bool,
    /// Supervisor-side phase durations in microseconds, for the worker's histogram.
    #[prost(uint64, tag = "4")]
    pub lock_wait_us: u64,
    #[prost(uint64, tag = "5")]
    pub bind_us: u64,
    /// [`monotonic_us`] when the supervisor sent this message, so the worker can measure
    /// fd passing (the two processes share the monotonic clock; a wall-clock jump cannot
    /// skew it).
    #[prost(uint64, tag = "6")]
    pub sent_at_us: u64,
    /// The lock was free at the supervisor's first try: an uncontended start, which runs
    /// no takeover reconcile.
    #[prost(bool, tag = "7")]
    pub uncontended: bool,
    /// How many times the supervisor has respawned a worker, for metrics.
    #[prost(uint64, tag = "8")]
    pub respawns: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum Phase {
    Unspecified = 0,
    Building = 1,
    StandbyComplete = 2,
    Reconciling = 3,
    Serving = 4,
    Draining = 5,
    /// After a drain: no CNI call in flight, the worker's listeners and lock descriptor
    /// closed. The supervisor releases the node lock; the worker's open proxy streams
    /// stay until the successor serves (see [`Drain::successor`]) or the worker exits.
    Released = 6,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Status {
    #[prost(enumeration = "Phase", tag = "1")]
    pub phase: i32,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Ping {
    #[prost(uint64, tag = "1")]
    pub seq: u64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Drain {
    /// A standby holds this node's sockets (it fetched them over `handoff.sock`
    /// recently): after `Released`, the worker keeps its proxy streams open until the
    /// successor answers on `xds.sock`, for a bounded time, so that the proxy's reconnect
    /// finds a serving agent. Without one the worker exits at once.
    #[prost(bool, tag = "1")]
    pub successor: bool,
}

impl Body {
    /// How many descriptors this message must carry; any other count is a protocol error.
    pub fn expected_fds(&self) -> usize {
        match self {
            Body::Takeover(_) => 3,
            _ => 0,
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Body::Hello(_) => "Hello",
            Body::Takeover(_) => "Takeover",
            Body::Status(_) => "Status",
            Body::Ping(_) => "Ping",
            Body::Pong(_) => "Pong",
            Body::Drain(_) => "Drain",
        }
    }
}

/// The handoff conversation on `handoff.sock`: the standby sends [`HandoffHello`], the
/// owner answers one [`HandoffOffer`] with two descriptors (`xds.sock`, `cni.sock`).
#[derive(Clone, PartialEq, prost::Message)]
pub struct HandoffEnvelope {
    #[prost(oneof = "HandoffBody", tags = "1, 2")]
    pub body: Option<HandoffBody>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum HandoffBody {
    #[prost(message, tag = "1")]
    Hello(HandoffHello),
    #[prost(message, tag = "2")]
    Offer(HandoffOffer),
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct HandoffHello {
    #[prost(uint32, tag = "1")]
    pub version: u32,
    /// Sent by the node's socket keeper, which holds the sockets but never takes the
    /// node: the owner does not count it as a successor to wait for at its drain.
    #[prost(bool, tag = "2")]
    pub keeper: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct HandoffOffer {
    #[prost(uint32, tag = "1")]
    pub version: u32,
    #[prost(uint64, tag = "2")]
    pub generation: u64,
    /// Device and inode of each socket path as the owner bound it; the standby checks the
    /// path still names that file before it uses the descriptor.
    #[prost(uint64, tag = "3")]
    pub xds_dev: u64,
    #[prost(uint64, tag = "4")]
    pub xds_ino: u64,
    #[prost(uint64, tag = "5")]
    pub cni_dev: u64,
    #[prost(uint64, tag = "6")]
    pub cni_ino: u64,
}

impl HandoffBody {
    pub fn expected_fds(&self) -> usize {
        match self {
            HandoffBody::Offer(_) => 2,
            HandoffBody::Hello(_) => 0,
        }
    }
}

/// Microseconds on `CLOCK_MONOTONIC`, which every process on the host (in one time
/// namespace) reads alike: a stamp one process sends that another can subtract from.
pub fn monotonic_us() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).map_or(0, |t| {
        t.tv_sec() as u64 * 1_000_000 + t.tv_nsec() as u64 / 1_000
    })
}
