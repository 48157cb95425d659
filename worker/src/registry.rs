//! The registry view of services and endpoints; the embedded registry reads it from a JSON
//! file and reloads it on change.
//!
//! INTERFACE STUB (owned by the xDS work).

#[derive(Debug, Clone, Default, PartialEq)]
pub struct RegistryView {}
