"""A real HTTP/3 client for the QUIC twin tests (e2e/tests/quic_twins.rs): aioquic, one
connection, GETs on it, the outcome printed as one JSON line.

    h3_client.py HOST PORT SNI [CERT KEY] [--timeout S]

connects to HOST:PORT (UDP) naming SNI, presents CERT/KEY (PEM files) when given, sends
one GET and prints {"ok", "responses", "server_uri", "server_serial", "error"}. The
server's chain is not verified (SVIDs carry no DNS name, and aioquic checks one against
the SNI): the tests check the identity the server presented and the answer. A refused
handshake is never an error the client sees, only a handshake that does not complete
within the timeout; the tests keep it short.
"""

import asyncio
import ssl

from aioquic.asyncio.client import connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from cryptography import x509


class _Protocol(QuicConnectionProtocol):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.h3 = H3Connection(self._quic)
        self.waiters = {}
        self.responses = {}

    def quic_event_received(self, event):
        for ev in self.h3.handle_event(event):
            if isinstance(ev, (HeadersReceived, DataReceived)):
                r = self.responses.setdefault(ev.stream_id, {"headers": {}, "body": b""})
                if isinstance(ev, HeadersReceived):
                    r["headers"].update((k.decode(), v.decode()) for k, v in ev.headers)
                else:
                    r["body"] += ev.data
                if ev.stream_ended and ev.stream_id in self.waiters:
                    self.waiters.pop(ev.stream_id).set_result(r)

    async def get(self, authority, path="/"):
        sid = self._quic.get_next_available_stream_id()
        self.h3.send_headers(sid, [(b":method", b"GET"), (b":scheme", b"https"),
                                   (b":authority", authority.encode()),
                                   (b":path", path.encode())], end_stream=True)
        fut = asyncio.get_running_loop().create_future()
        self.waiters[sid] = fut
        self.transmit()
        return await fut


def leaf_identity(cert):
    """(URI SANs, serial as hex) of a cryptography certificate, or (None, None)."""
    if cert is None:
        return None, None
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = sans.get_values_for_type(x509.UniformResourceIdentifier)
    except x509.ExtensionNotFound:
        uris = []
    return uris, format(cert.serial_number, "X")


def request(host, port, sni=None, cert=None, key=None, authority="pod", n=1, timeout=5.0,
            between=None):
    """Opens one HTTP/3 connection and sends `n` GETs on it, calling `between(i)` after the
    i-th (0-based) before the next. Returns a dict: ok, status codes, headers and bodies of
    each response, the server's URI SANs and serial, or the error."""
    return asyncio.run(_request(host, port, sni, cert, key, authority, n, timeout, between))


async def _request(host, port, sni, cert, key, authority, n, timeout, between):
    cfg = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, server_name=sni,
                            verify_mode=ssl.CERT_NONE)
    if cert:
        cfg.load_cert_chain(cert, key)
    out = {"ok": False, "responses": [], "server_uri": None, "server_serial": None}
    cm = connect(host, port, configuration=cfg, create_protocol=_Protocol)
    try:
        # A refused handshake is never answered with an error the client sees: the connect
        # is bounded on its own, each request on its own, and `between` not at all.
        c = await asyncio.wait_for(cm.__aenter__(), timeout)
    except Exception as e:  # noqa: BLE001 - a refusal is an observation
        out["error"] = f"handshake: {type(e).__name__}: {e}"
        return out
    try:
        out["server_uri"], out["server_serial"] = leaf_identity(c._quic.tls._peer_certificate)
        for i in range(n):
            r = await asyncio.wait_for(c.get(authority), timeout)
            out["responses"].append(r)
            if between and i + 1 < n:
                await asyncio.get_running_loop().run_in_executor(None, between, i)
        out["ok"] = bool(out["responses"]) and all(
            r["headers"].get(":status") == "200" for r in out["responses"])
    except Exception as e:  # noqa: BLE001 - a failure is an observation
        out["error"] = f"request {len(out['responses'])}: {type(e).__name__}: {e}"
    finally:
        await cm.__aexit__(None, None, None)
    return out


if __name__ == "__main__":
    import argparse
    import json

    p = argparse.ArgumentParser()
    p.add_argument("host")
    p.add_argument("port", type=int)
    p.add_argument("sni")
    p.add_argument("cert", nargs="?")
    p.add_argument("key", nargs="?")
    p.add_argument("--timeout", type=float, default=3.0)
    a = p.parse_args()
    out = request(a.host, a.port, a.sni, a.cert, a.key, authority=a.sni, timeout=a.timeout)
    for r in out["responses"]:
        r["body"] = r["body"].decode(errors="replace")
    print(json.dumps(out))
