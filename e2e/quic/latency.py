"""Per-request latency of the same GET over HTTP/3 through a pod's QUIC twin and over TCP
mTLS through the pod's inbound, for the bench e2e/benches/quic_latency.rs.

    latency.py h3  HOST PORT SNI CERT KEY --n N --warmup W
    latency.py tcp HOST PORT -   CERT KEY --n N --warmup W
    latency.py h3-floor - 0 SNI  CERT KEY --n N --warmup W

Both open one connection, send W untimed GETs, then N timed ones back to back, and print
{"ok", "micros": [...], "error"} as one JSON line. The two paths share this interpreter,
its event loop and its timer, so what differs between them is the path: QUIC + HTTP/3
terminated by Envoy and forwarded over HTTP/1.1 (the twin), against TLS over TCP
terminated by Envoy and proxied at L4 (the inbound). The server's chain is not verified,
as in h3_client.py; the tests check identities, this measures time.

`h3-floor` measures the client's own stack: the same client against an aioquic HTTP/3
server in this process on 127.0.0.1 (CERT/KEY serve as its certificate too), no Envoy and
no pod. Client and server share one interpreter, so the floor is at least the client's
cost; an HTTP/3 figure near it is the client's, not the path's.
"""

import asyncio
import json
import ssl
import sys
import time

from aioquic.asyncio.client import connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.asyncio.server import serve
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import HeadersReceived
from aioquic.quic.configuration import QuicConfiguration

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from h3_client import _Protocol  # noqa: E402


async def h3(host, port, sni, cert, key, n, warmup):
    cfg = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, server_name=sni,
                            verify_mode=ssl.CERT_NONE)
    cfg.load_cert_chain(cert, key)
    micros = []
    async with connect(host, port, configuration=cfg, create_protocol=_Protocol) as c:
        for i in range(warmup + n):
            t = time.perf_counter_ns()
            r = await asyncio.wait_for(c.get(sni), 5.0)
            if r["headers"].get(":status") != "200":
                raise RuntimeError(f"request {i}: status {r['headers'].get(':status')}")
            if i >= warmup:
                micros.append((time.perf_counter_ns() - t) / 1e3)
    return micros


class _Server(QuicConnectionProtocol):
    """Answers every HTTP/3 request 200 with a short body."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.h3 = H3Connection(self._quic)

    def quic_event_received(self, event):
        for ev in self.h3.handle_event(event):
            if isinstance(ev, HeadersReceived) and ev.stream_ended:
                self.h3.send_headers(ev.stream_id, [(b":status", b"200"),
                                                    (b"content-length", b"6")])
                self.h3.send_data(ev.stream_id, b"floor\n", end_stream=True)
                self.transmit()


async def h3_floor(sni, cert, key, n, warmup):
    cfg = QuicConfiguration(is_client=False, alpn_protocols=H3_ALPN)
    cfg.load_cert_chain(cert, key)
    server = await serve("127.0.0.1", 0, configuration=cfg, create_protocol=_Server)
    try:
        port = server._transport.get_extra_info("sockname")[1]
        return await h3("127.0.0.1", port, sni, cert, key, n, warmup)
    finally:
        server.close()


def read_response(f):
    """Reads one HTTP/1.1 response with a Content-Length from the file `f`; its status."""
    status = f.readline().split()[1].decode()
    length = 0
    while True:
        line = f.readline()
        if line in (b"\r\n", b""):
            break
        k, _, v = line.decode().partition(":")
        if k.strip().lower() == "content-length":
            length = int(v)
    f.read(length)
    return status


def tcp(host, port, cert, key, n, warmup):
    import socket

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.load_cert_chain(cert, key)
    micros = []
    with socket.create_connection((host, port), timeout=5.0) as raw:
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with ctx.wrap_socket(raw) as s, s.makefile("rb") as f:
            req = f"GET / HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
            for i in range(warmup + n):
                t = time.perf_counter_ns()
                s.sendall(req)
                status = read_response(f)
                if status != "200":
                    raise RuntimeError(f"request {i}: status {status}")
                if i >= warmup:
                    micros.append((time.perf_counter_ns() - t) / 1e3)
    return micros


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=["h3", "tcp", "h3-floor"])
    p.add_argument("host")
    p.add_argument("port", type=int)
    p.add_argument("sni")
    p.add_argument("cert")
    p.add_argument("key")
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    a = p.parse_args()
    out = {"ok": False, "micros": [], "error": None}
    try:
        if a.mode == "h3-floor":
            out["micros"] = asyncio.run(h3_floor(a.sni, a.cert, a.key, a.n, a.warmup))
        elif a.mode == "h3":
            out["micros"] = asyncio.run(h3(a.host, a.port, a.sni, a.cert, a.key, a.n,
                                           a.warmup))
        else:
            out["micros"] = tcp(a.host, a.port, a.cert, a.key, a.n, a.warmup)
        out["ok"] = len(out["micros"]) == a.n
    except Exception as e:  # noqa: BLE001 - a failure is reported, the bench fails on it
        out["error"] = f"{type(e).__name__}: {e}"
    print(json.dumps(out))
