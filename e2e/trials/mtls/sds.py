"""A small in-process SDS server for the mTLS trials.

Serves envoy.service.secret.v3.SecretDiscoveryService (StreamSecrets and DeltaSecrets),
and the same for secrets over the aggregated service (ADS), over gRPC on a unix socket. Messages are encoded and decoded by hand (a handful of
fields), so it needs grpcio and nothing generated.

The harness owns the secrets: `set_cert(name, cert_pem, key_pem)`, `set_ca(name, ca_pem)`,
`remove(name)` push to every stream subscribed to `name`. `unknown_policy` decides what a
subscription to a name the server does not have gets: "silent" (nothing, as a SotW server
must do) or "remove" (a delta response listing it in removed_resources).
"""

import hashlib
import queue
import threading
import time
from concurrent import futures

import grpc

SECRET_TYPE = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"
SERVICE = "envoy.service.secret.v3.SecretDiscoveryService"
# The same streams over ADS, for config sources that say `ads: {}` (secrets only).
ADS_SERVICE = "envoy.service.discovery.v3.AggregatedDiscoveryService"


# --- protobuf wire format, just enough -------------------------------------------------

def _varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _ld(field, payload):
    """A length-delimited field (strings, bytes, messages)."""
    if isinstance(payload, str):
        payload = payload.encode()
    return _varint((field << 3) | 2) + _varint(len(payload)) + payload


def _decode(buf):
    """Top-level fields of a message: {field: [value, ...]} (bytes for length-delimited)."""
    fields = {}
    i = 0
    while i < len(buf):
        key, i = _read_varint(buf, i)
        field, wt = key >> 3, key & 7
        if wt == 0:
            val, i = _read_varint(buf, i)
        elif wt == 2:
            ln, i = _read_varint(buf, i)
            val, i = buf[i:i + ln], i + ln
        elif wt == 1:
            val, i = buf[i:i + 8], i + 8
        elif wt == 5:
            val, i = buf[i:i + 4], i + 4
        else:
            raise ValueError(f"wire type {wt}")
        fields.setdefault(field, []).append(val)
    return fields


def _read_varint(buf, i):
    shift = n = 0
    while True:
        b = buf[i]
        i += 1
        n |= (b & 0x7F) << shift
        if not b & 0x80:
            return n, i
        shift += 7


def _strings(fields, field):
    return [v.decode() for v in fields.get(field, [])]


def _secret_tls(name, cert_pem, key_pem):
    # Secret{name=1, tls_certificate=2{certificate_chain=1 DataSource, private_key=2}}
    # DataSource{inline_bytes=2}
    tls = _ld(1, _ld(2, cert_pem)) + _ld(2, _ld(2, key_pem))
    return _ld(1, name) + _ld(2, tls)


def _secret_ca(name, ca_pem):
    # Secret{name=1, validation_context=4{trusted_ca=1 DataSource}}
    return _ld(1, name) + _ld(4, _ld(1, _ld(2, ca_pem)))


def _any(type_url, value):
    return _ld(1, type_url) + _ld(2, value)


# --- the server ------------------------------------------------------------------------

class SdsServer:
    def __init__(self, socket_path, log=None):
        self._lock = threading.Lock()
        self._secrets = {}        # name -> (version, encoded Secret)
        self._streams = set()     # _Stream
        self._nonce = 0
        self.unknown_policy = "silent"
        self.requests = []        # (time, kind, names) every subscription the proxy made
        self._log = log or (lambda msg: None)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=64))
        handlers = {
            "StreamSecrets": grpc.stream_stream_rpc_method_handler(self._sotw),
            "DeltaSecrets": grpc.stream_stream_rpc_method_handler(self._delta),
        }
        ads = {
            "StreamAggregatedResources": grpc.stream_stream_rpc_method_handler(self._sotw),
            "DeltaAggregatedResources": grpc.stream_stream_rpc_method_handler(self._delta),
        }
        self._server.add_generic_rpc_handlers((
            grpc.method_handlers_generic_handler(SERVICE, handlers),
            grpc.method_handlers_generic_handler(ADS_SERVICE, ads)))
        self._server.add_insecure_port("unix:" + socket_path)

    def start(self):
        self._server.start()

    def stop(self):
        self._server.stop(grace=None)

    # secrets

    def set_cert(self, name, cert_pem, key_pem):
        self._put(name, _secret_tls(name, cert_pem, key_pem))

    def set_ca(self, name, ca_pem):
        self._put(name, _secret_ca(name, ca_pem))

    def remove(self, name):
        with self._lock:
            self._secrets.pop(name, None)
            streams = list(self._streams)
        for s in streams:
            s.events.put(("removed", name))

    def _put(self, name, encoded):
        version = hashlib.sha256(encoded).hexdigest()[:12]
        with self._lock:
            self._secrets[name] = (version, encoded)
            streams = list(self._streams)
        for s in streams:
            s.events.put(("changed", name))

    def subscribed(self, name):
        """Whether any stream currently subscribes to `name`."""
        with self._lock:
            return any(name in s.names for s in self._streams)

    def wait_subscribed(self, name, timeout=10.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.subscribed(name):
                return True
            time.sleep(0.01)
        return False

    # streams

    def _next_nonce(self):
        with self._lock:
            self._nonce += 1
            return str(self._nonce)

    def _open(self, request_iterator, context):
        stream = _Stream()
        with self._lock:
            self._streams.add(stream)

        def pump():
            try:
                for req in request_iterator:
                    stream.events.put(("request", req))
            except Exception:  # stream cancelled
                pass
            stream.events.put(("end", None))

        threading.Thread(target=pump, daemon=True).start()
        context.add_callback(lambda: stream.events.put(("end", None)))
        return stream

    def _close(self, stream):
        with self._lock:
            self._streams.discard(stream)

    def _sotw(self, request_iterator, context):
        # DiscoveryRequest{version_info=1, node=2, resource_names=3, type_url=4,
        #                  response_nonce=5, error_detail=6}
        # DiscoveryResponse{version_info=1, resources=2, type_url=4, nonce=5}
        stream = self._open(request_iterator, context)
        try:
            while True:
                kind, payload = stream.events.get()
                if kind == "end":
                    return
                if kind == "request":
                    f = _decode(payload)
                    if f.get(6):
                        self._log(f"sds sotw NACK: {_decode(f[6][0]).get(3, [b''])[0].decode()}")
                    names = set(_strings(f, 3))
                    if names == stream.names and f.get(5):
                        continue  # an ACK
                    self.requests.append((time.monotonic(), "sotw", sorted(names)))
                    with self._lock:
                        stream.names = names
                elif kind in ("changed", "removed"):
                    if payload not in stream.names:
                        continue
                with self._lock:
                    present = [(n, self._secrets[n]) for n in sorted(stream.names)
                               if n in self._secrets]
                    sent = {n: v for n, (v, _) in present}
                if not present or sent == stream.sent:
                    continue
                stream.sent = sent
                version = hashlib.sha256(repr(sorted(sent.items())).encode()).hexdigest()[:12]
                msg = _ld(1, version) + b"".join(_ld(2, _any(SECRET_TYPE, enc))
                                                 for _, (_, enc) in present)
                msg += _ld(4, SECRET_TYPE) + _ld(5, self._next_nonce())
                yield msg
        finally:
            self._close(stream)

    def _delta(self, request_iterator, context):
        # DeltaDiscoveryRequest{node=1, type_url=2, subscribe=3, unsubscribe=4,
        #                       initial_resource_versions=5, response_nonce=6, error_detail=7}
        # DeltaDiscoveryResponse{system_version_info=1, resources=2, type_url=4, nonce=5,
        #                        removed_resources=6}
        # Resource{version=1, resource=2, name=3}
        stream = self._open(request_iterator, context)
        try:
            while True:
                kind, payload = stream.events.get()
                if kind == "end":
                    return
                send, removed = [], []
                if kind == "request":
                    f = _decode(payload)
                    if f.get(7):
                        self._log(f"sds delta NACK: {_decode(f[7][0]).get(3, [b''])[0].decode()}")
                    sub, unsub = _strings(f, 3), _strings(f, 4)
                    if sub or unsub:
                        self.requests.append((time.monotonic(), "delta+", sorted(sub)))
                    with self._lock:
                        stream.names |= set(sub)
                        stream.names -= set(unsub)
                        for n in unsub:
                            stream.sent.pop(n, None)
                        for n in sub:
                            if n in self._secrets:
                                send.append(n)
                            elif self.unknown_policy == "remove":
                                removed.append(n)
                elif kind == "changed":
                    if payload in stream.names:
                        send.append(payload)
                elif kind == "removed":
                    if payload in stream.names:
                        removed.append(payload)
                        stream.sent.pop(payload, None)
                resources = []
                with self._lock:
                    for n in send:
                        if n not in self._secrets:
                            continue
                        version, enc = self._secrets[n]
                        if stream.sent.get(n) == version:
                            continue
                        stream.sent[n] = version
                        resources.append(_ld(1, version) + _ld(2, _any(SECRET_TYPE, enc)) + _ld(3, n))
                if not resources and not removed:
                    continue
                msg = b"".join(_ld(2, r) for r in resources) + _ld(4, SECRET_TYPE)
                msg += _ld(5, self._next_nonce()) + b"".join(_ld(6, n) for n in removed)
                yield msg
        finally:
            self._close(stream)


class _Stream:
    def __init__(self):
        self.events = queue.Queue()
        self.names = set()
        self.sent = {}
