"""Test rig for the mTLS trials: certificates, processes, Envoy admin, clients.

Everything here runs inside the private network namespace run.sh creates, so the
loopback addresses and ports are the trial's own.
"""

import http.client
import json
import os
import signal
import socket
import ssl
import subprocess
import threading
import time
import traceback
import urllib.request

import configs as C

TD = "aether.test"


def spiffe(path):
    return f"spiffe://{TD}/{path}"


POD_A = spiffe("ns/default/pod/a")
POD_B = spiffe("ns/default/pod/b")
POD_C = spiffe("ns/default/pod/c")
POD_WEB = spiffe("ns/default/pod/web")
AGENT = spiffe("aether/agent")
FOREIGN = "spiffe://other.test/ns/default/pod/x"


# --- results -----------------------------------------------------------------------------

# (name, passed) of every trial reported, in order.
RESULTS = []


def report(name, ok, observation):
    """One PASS or FAIL line with what was observed."""
    RESULTS.append((name, ok))
    print(f"{'PASS' if ok else 'FAIL'}  {name}: {observation}", flush=True)


def trial(fn):
    """A trial that raises is a FAIL under its name; the rest go on."""
    def run(*args, **kwargs):
        try:
            fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - a broken trial is a FAIL, the rest go on
            report(fn.__name__, False, f"error: {e!r}")
            traceback.print_exc()
    run.__name__ = fn.__name__
    return run


# --- certificates (openssl CLI) ----------------------------------------------------------

class Pki:
    """A CA for aether.test, a foreign CA for other.test, and leaves with URI SANs.

    Each leaf has an explicit serial so a rotation is visible: leaf(name, serial).
    """

    def __init__(self, root):
        self.root = root
        os.makedirs(root, exist_ok=True)
        self.ca = self._ca("aether", TD)
        self.other_ca = self._ca("other", "other.test")

    def _run(self, *args):
        subprocess.run(["openssl", *args], check=True, cwd=self.root,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def _ca(self, stem, domain):
        self._run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
                  "-nodes", "-keyout", f"{stem}-ca.key", "-out", f"{stem}-ca.pem", "-days", "2",
                  "-subj", f"/O={domain}/CN={domain} root", "-set_serial", "1",
                  "-addext", "basicConstraints=critical,CA:TRUE",
                  "-addext", "keyUsage=critical,keyCertSign,cRLSign",
                  "-addext", f"subjectAltName=URI:spiffe://{domain}")
        return stem

    def leaf(self, stem, uri, serial, ca=None, dns=None):
        """Issues <stem>.pem/<stem>.key, with a DNS SAN too when `dns` is given; returns
        (cert_path, key_path)."""
        ca = ca or self.ca
        ext = os.path.join(self.root, f"{stem}.ext")
        with open(ext, "w") as f:
            f.write(f"subjectAltName=URI:{uri}{f',DNS:{dns}' if dns else ''}\n"
                    "basicConstraints=critical,CA:FALSE\n"
                    "keyUsage=critical,digitalSignature,keyAgreement\n"
                    "extendedKeyUsage=serverAuth,clientAuth\n")
        self._run("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
                  "-nodes", "-keyout", f"{stem}.key", "-out", f"{stem}.csr",
                  "-subj", f"/O={uri.split('/')[2]}")
        self._run("x509", "-req", "-in", f"{stem}.csr", "-CA", f"{ca}-ca.pem",
                  "-CAkey", f"{ca}-ca.key", "-set_serial", str(serial), "-days", "1",
                  "-extfile", ext, "-out", f"{stem}.pem")
        return self.path(f"{stem}.pem"), self.path(f"{stem}.key")

    def path(self, name):
        return os.path.join(self.root, name)

    def ca_pem(self, stem=None):
        return self.path(f"{stem or self.ca}-ca.pem")

    def read(self, name):
        with open(self.path(name), "rb") as f:
            return f.read()


# --- processes ---------------------------------------------------------------------------

class Procs:
    """Every process the trials start, killed by pid at the end (never by name)."""

    def __init__(self):
        self.procs = []

    def start(self, argv, log_path):
        log = open(log_path, "wb")
        # SIGKILL when the trial driver dies, whatever kills it: setpriv sets the parent-death
        # signal and execs the command. No Python runs between fork and exec (a preexec_fn
        # would, in a process whose gRPC threads make that unsafe).
        p = subprocess.Popen(["setpriv", "--pdeathsig", "KILL", "--", *argv], stdout=log,
                             stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.procs.append(p)
        return p

    def stop(self, p):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def stop_all(self):
        for p in reversed(self.procs):
            self.stop(p)


def poll(predicate, timeout=15.0, interval=0.02, what="condition"):
    """Calls predicate until it returns a truthy value; raises after timeout."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except Exception as e:  # noqa: BLE001 - the predicate may race a starting process
            last = e
        else:
            if last:
                return last
        time.sleep(interval)
    raise TimeoutError(f"timed out waiting for {what} (last: {last!r})")


class Envoy:
    """One Envoy process with its admin on a loopback port."""

    def __init__(self, procs, envoy_bin, workdir, name, config, admin_port, concurrency=2):
        self.name = name
        self.admin = f"http://127.0.0.1:{admin_port}"
        cfg = dict(config)
        cfg["admin"] = {"address": {"socket_address": {"address": "127.0.0.1",
                                                       "port_value": admin_port}}}
        self.config_path = os.path.join(workdir, f"{name}.json")
        with open(self.config_path, "w") as f:
            json.dump(cfg, f, indent=1)
        self.log_path = os.path.join(workdir, f"{name}.log")
        self.proc = procs.start(
            [envoy_bin, "-c", self.config_path, "--disable-hot-restart",
             "--file-flush-interval-msec", "20", "--concurrency", str(concurrency),
             "-l", os.environ.get("TRIAL_ENVOY_LOG_LEVEL", "info"),
             "--service-node", name, "--service-cluster", "trial"],
            self.log_path)
        poll(self._ready, timeout=30, what=f"{name} ready")

    def _ready(self):
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited: {self.tail()}")
        with urllib.request.urlopen(self.admin + "/ready", timeout=1) as r:
            return r.status == 200

    def tail(self, n=30):
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def log_grep(self, needle):
        with open(self.log_path, errors="replace") as f:
            return [line.rstrip() for line in f if needle in line]

    def get(self, path):
        with urllib.request.urlopen(self.admin + path, timeout=5) as r:
            return r.read().decode()

    def post(self, path):
        req = urllib.request.Request(self.admin + path, method="POST", data=b"")
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.read().decode()

    def stats(self, prefix=""):
        out = {}
        for line in self.get("/stats?usedonly").splitlines():
            k, _, v = line.partition(": ")
            if k.startswith(prefix):
                try:
                    out[k] = int(v)
                except ValueError:
                    out[k] = v
        return out

    def stat(self, name, default=0):
        return self.stats(name).get(name, default)

    def certs(self):
        return json.loads(self.get("/certs"))


def push_config(node, work, lds=None, cds=None):
    """Writes the node's LDS and/or CDS file (atomically, `{name: resource}` each; None
    leaves a file as it is) and, when the node runs, waits until it applied them and
    nothing warms."""
    counters = []
    for kind, resources, type_url, stat in (
            ("cds", cds, C.CLUSTER, "cluster_manager.cds.update_success"),
            ("lds", lds, C.LISTENER, "listener_manager.lds.update_success")):
        if resources is None:
            continue
        before = node.stat(stat) if node else 0
        tmp = f"{work}/{kind}.json.tmp"
        with open(tmp, "w") as f:
            json.dump(C.discovery_response(type_url, list(resources.values())), f, indent=1)
        os.rename(tmp, f"{work}/{kind}.json")
        counters.append((stat, before))
    if node:
        for stat, before in counters:
            poll(lambda: node.stat(stat) > before, what=stat)
        poll(lambda: node.stat("cluster_manager.warming_clusters") == 0
             and node.stat("listener_manager.total_listeners_warming") == 0,
             what="no warming clusters or listeners")


# --- clients -----------------------------------------------------------------------------

def http_get(src, dst, port, host, path="/", timeout=20.0, headers=None):
    """One HTTP/1.1 request on a fresh connection from `src`; returns a dict."""
    t0 = time.monotonic()
    conn = http.client.HTTPConnection(dst, port, timeout=timeout, source_address=(src, 0))
    try:
        conn.request("GET", path, headers={"Host": host, **(headers or {})})
        r = conn.getresponse()
        body = r.read().decode(errors="replace")
        return {"src": src, "status": r.status, "peer": r.getheader("x-peer", ""),
                "serial": r.getheader("x-peer-serial", ""),
                "conn": r.getheader("x-upstream-conn", ""),
                "backend": r.getheader("x-backend", ""), "body": body,
                "secs": time.monotonic() - t0}
    except Exception as e:  # noqa: BLE001 - reported as an observation
        return {"src": src, "status": None, "error": repr(e), "secs": time.monotonic() - t0}
    finally:
        conn.close()


def interleave(dst, port, host, sources, rounds=4, concurrent=4):
    """Requests from every source, alternating, then all at once; a list of results."""
    results = []
    for _ in range(rounds):
        for src in sources:
            results.append(http_get(src, dst, port, host))
    lock = threading.Lock()

    def one(src):
        r = http_get(src, dst, port, host)
        with lock:
            results.append(r)

    threads = [threading.Thread(target=one, args=(src,))
               for _ in range(concurrent) for src in sources]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


class TlsClient:
    """A raw TCP (optionally TLS) client: connect from `src`, speak HTTP/1.1 over it.

    `cert` is None for no client certificate. The server is verified against `ca` when
    given (chain only: SPIFFE leaves carry no DNS name); its URI SAN and serial are kept.
    """

    def __init__(self, src, dst, port, tls=False, cert=None, key=None, ca=None, timeout=5.0):
        self.src = src
        self.error = None
        self.server_uri = self.server_serial = None
        raw = socket.socket()
        raw.settimeout(timeout)
        raw.bind((src, 0))
        self.local_port = raw.getsockname()[1]
        try:
            raw.connect((dst, port))
            if tls:
                ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
                ctx.check_hostname = False
                if ca:
                    ctx.load_verify_locations(ca)
                else:
                    ctx.verify_mode = ssl.CERT_NONE
                if cert:
                    ctx.load_cert_chain(cert, key)
                raw = ctx.wrap_socket(raw)
                pc = raw.getpeercert()
                if pc:
                    self.server_uri = [v for k, v in pc.get("subjectAltName", ()) if k == "URI"]
                    self.server_serial = pc.get("serialNumber")
        except Exception as e:  # noqa: BLE001
            self.error = f"{type(e).__name__}: {e}"
        self.sock = raw

    def request(self, host="pod"):
        """One GET; returns (status_line, body) or raises."""
        self.sock.sendall(f"GET / HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise ConnectionError(f"closed after {buf!r}")
            buf += chunk
        head, _, rest = buf.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        length = 0
        for line in lines[1:]:
            k, _, v = line.partition(":")
            if k.lower() == "content-length":
                length = int(v)
        while len(rest) < length:
            chunk = self.sock.recv(4096)
            if not chunk:
                break
            rest += chunk
        return lines[0], rest[:length].decode(errors="replace")

    def try_request(self, host="pod"):
        if self.error:
            return {"ok": False, "error": self.error}
        try:
            status, body = self.request(host)
            return {"ok": status.startswith("HTTP/1.1 200"), "status": status, "body": body}
        except Exception as e:  # noqa: BLE001
            return {"ok": False, "error": f"{type(e).__name__}: {e}"}

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass
