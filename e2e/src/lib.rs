//! Test fixtures and the restart-gap harness for the Aether node agent.
//!
//! [`testing`] runs the real binaries over real sockets in temp dirs: a [`testing::LocalNode`]
//! is a run dir and a state dir shared by agent generations, and a [`testing::Agent`]
//! is one generation (a supervisor, its worker, its own health dir).

pub mod testing;
pub mod harness;
pub mod cnichain;
