//! The fields of the ADS messages (incremental and state of the world) that the session
//! rules read, and a codec that keeps every message's bytes as they came.
//!
//! The relay forwards what Envoy and the agent send as the bytes they sent: a field it
//! does not model (a resource's body, Envoy's node description, a status) is never
//! decoded into a type and re-encoded, so nothing is lost or reordered in transit. These
//! views are decoded beside the bytes; prost skips every field they leave out. The node
//! and the error detail are kept as the bytes of their messages.

use std::collections::HashMap;

use bytes::{Buf, Bytes};
use prost::Message;
use tonic::Status;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};

/// The incremental ADS method, on Envoy's side and on the agent's.
pub const DELTA_PATH: &str =
    "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources";
/// The state-of-the-world ADS method.
pub const SOTW_PATH: &str =
    "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources";
pub const ADS_SERVICE: &str = "envoy.service.discovery.v3.AggregatedDiscoveryService";

/// `envoy.service.discovery.v3.DeltaDiscoveryRequest`, the fields the relay reads.
#[derive(Clone, PartialEq, prost::Message)]
pub struct DeltaRequest {
    /// `config.core.v3.Node`, as bytes.
    #[prost(bytes = "bytes", tag = "1")]
    pub node: Bytes,
    #[prost(string, tag = "2")]
    pub type_url: String,
    #[prost(string, repeated, tag = "3")]
    pub resource_names_subscribe: Vec<String>,
    #[prost(string, repeated, tag = "4")]
    pub resource_names_unsubscribe: Vec<String>,
    #[prost(map = "string, string", tag = "5")]
    pub initial_resource_versions: HashMap<String, String>,
    #[prost(string, tag = "6")]
    pub response_nonce: String,
    /// `google.rpc.Status`, as bytes: set on a NACK.
    #[prost(bytes = "bytes", tag = "7")]
    pub error_detail: Bytes,
}

/// `envoy.service.discovery.v3.DeltaDiscoveryResponse`, the fields the relay reads.
#[derive(Clone, PartialEq, prost::Message)]
pub struct DeltaResponse {
    #[prost(message, repeated, tag = "2")]
    pub resources: Vec<Resource>,
    #[prost(string, tag = "4")]
    pub type_url: String,
    #[prost(string, tag = "5")]
    pub nonce: String,
    #[prost(string, repeated, tag = "6")]
    pub removed_resources: Vec<String>,
}

/// `envoy.service.discovery.v3.Resource`: its name and version; the body is skipped.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Resource {
    #[prost(string, tag = "1")]
    pub version: String,
    #[prost(string, tag = "3")]
    pub name: String,
}

/// `envoy.service.discovery.v3.DiscoveryRequest` (state of the world), the fields the
/// relay reads.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SotwRequest {
    #[prost(string, tag = "1")]
    pub version_info: String,
    /// `config.core.v3.Node`, as bytes.
    #[prost(bytes = "bytes", tag = "2")]
    pub node: Bytes,
    #[prost(string, repeated, tag = "3")]
    pub resource_names: Vec<String>,
    #[prost(string, tag = "4")]
    pub type_url: String,
    #[prost(string, tag = "5")]
    pub response_nonce: String,
    /// `google.rpc.Status`, as bytes: set on a NACK.
    #[prost(bytes = "bytes", tag = "6")]
    pub error_detail: Bytes,
}

/// `envoy.service.discovery.v3.DiscoveryResponse`, the fields the relay reads.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SotwResponse {
    #[prost(string, tag = "1")]
    pub version_info: String,
    #[prost(message, repeated, tag = "2")]
    pub resources: Vec<AnyView>,
    #[prost(string, tag = "4")]
    pub type_url: String,
    #[prost(string, tag = "5")]
    pub nonce: String,
}

/// `google.protobuf.Any`: a resource as bytes. The relay reads only its name (field 1 of
/// every type ADS serves: `Cluster.name`, `ClusterLoadAssignment.cluster_name`,
/// `Listener.name`, `RouteConfiguration.name`, `Secret.name`) and hashes the rest as it
/// is; nothing else of the body is decoded.
#[derive(Clone, PartialEq, prost::Message)]
pub struct AnyView {
    #[prost(string, tag = "1")]
    pub type_url: String,
    #[prost(bytes = "bytes", tag = "2")]
    pub value: Bytes,
}

/// Field 1 of a resource: its name. prost skips every other field by its length.
#[derive(Clone, PartialEq, prost::Message)]
struct Named {
    #[prost(string, tag = "1")]
    name: String,
}

/// The `envoy.service.discovery.v3.Resource` wrapper: its name is field 3.
#[derive(Clone, PartialEq, prost::Message)]
struct Wrapped {
    #[prost(string, tag = "3")]
    name: String,
}

impl AnyView {
    /// The resource's name and a hash of its bytes (type URL and body), or None when the
    /// name cannot be read.
    pub fn name_and_hash(&self) -> Option<(String, u64)> {
        use std::hash::{Hash, Hasher};
        let name = if self
            .type_url
            .ends_with("envoy.service.discovery.v3.Resource")
        {
            Wrapped::decode(self.value.clone()).ok()?.name
        } else {
            Named::decode(self.value.clone()).ok()?.name
        };
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.type_url.hash(&mut h);
        self.value.hash(&mut h);
        Some((name, h.finish()))
    }
}

/// A message as it came, with the fields read from it.
#[derive(Clone, Debug)]
pub struct Framed<T> {
    pub bytes: Bytes,
    pub view: T,
}

impl<T: Message + Default> Framed<T> {
    pub fn decode(bytes: Bytes) -> Result<Self, prost::DecodeError> {
        let view = T::decode(bytes.clone())?;
        Ok(Framed { bytes, view })
    }

    /// A message the relay writes itself (a resume, an ACK it answers for Envoy).
    pub fn of(view: T) -> Self {
        Framed {
            bytes: view.encode_to_vec().into(),
            view,
        }
    }
}

/// Encodes the bytes of a [`Framed`] message as they are and decodes into one.
pub struct RawCodec<In, Out>(std::marker::PhantomData<fn(In) -> Out>);

impl<In, Out> Default for RawCodec<In, Out> {
    fn default() -> Self {
        RawCodec(std::marker::PhantomData)
    }
}

impl<In, Out> Codec for RawCodec<In, Out>
where
    In: Send + 'static,
    Out: Message + Default + Send + 'static,
{
    type Encode = Framed<In>;
    type Decode = Framed<Out>;
    type Encoder = RawEncoder<In>;
    type Decoder = RawDecoder<Out>;

    fn encoder(&mut self) -> Self::Encoder {
        RawEncoder(std::marker::PhantomData)
    }

    fn decoder(&mut self) -> Self::Decoder {
        RawDecoder(std::marker::PhantomData)
    }
}

pub struct RawEncoder<T>(std::marker::PhantomData<fn(T)>);

impl<T> Encoder for RawEncoder<T> {
    type Item = Framed<T>;
    type Error = Status;

    fn encode(&mut self, item: Framed<T>, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        bytes::BufMut::put_slice(dst, &item.bytes);
        Ok(())
    }
}

pub struct RawDecoder<T>(std::marker::PhantomData<fn() -> T>);

impl<T: Message + Default> Decoder for RawDecoder<T> {
    type Item = Framed<T>;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Framed<T>>, Status> {
        let bytes = src.copy_to_bytes(src.remaining());
        Framed::decode(bytes)
            .map(Some)
            .map_err(|e| Status::invalid_argument(format!("not an xDS message: {e}")))
    }
}
