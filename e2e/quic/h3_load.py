"""HTTP/3 load for the QUIC pair rolls (e2e/tests/quic_pairs.rs): until the file STOP
exists, a GET through each named twin in turn, each on a new connection (a new QUIC
handshake with the client certificate), every PERIOD seconds; then one JSON line with
the counts and the first failures.

    h3_load.py HOST PORT CERT KEY STOP --twin SNI=PREFIX [--twin ...] [--period S]
               [--progress FILE]

With --progress, the number of requests answered or failed so far is written to FILE
(replaced atomically) after each request, so that a test can pace itself on the load.

A request counts as failed unless it is answered 200 with a body that starts with the
twin's PREFIX (the pod's name: the pod behind that twin answered).
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from h3_client import request  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("host")
    p.add_argument("port", type=int)
    p.add_argument("cert")
    p.add_argument("key")
    p.add_argument("stop")
    p.add_argument("--twin", action="append", required=True)
    p.add_argument("--period", type=float, default=0.05)
    p.add_argument("--progress")
    a = p.parse_args()
    twins = [t.split("=", 1) for t in a.twin]
    per = {sni: {"ok": 0, "failed": 0} for sni, _ in twins}
    failures = []
    started = time.time()
    while not os.path.exists(a.stop):
        for sni, prefix in twins:
            t = time.time()
            r = request(a.host, a.port, sni, a.cert, a.key, authority=sni, n=1, timeout=3.0)
            body = r["responses"][0]["body"].decode(errors="replace") if r["responses"] else ""
            if r["ok"] and body.startswith(prefix):
                per[sni]["ok"] += 1
            else:
                per[sni]["failed"] += 1
                if len(failures) < 20:
                    failures.append({"at": t, "sni": sni, "error": r.get("error"), "body": body})
            if a.progress:
                done = sum(c["ok"] + c["failed"] for c in per.values())
                with open(a.progress + ".tmp", "w") as f:
                    f.write(str(done))
                os.replace(a.progress + ".tmp", a.progress)
        time.sleep(a.period)
    ok = sum(c["ok"] for c in per.values())
    failed = sum(c["failed"] for c in per.values())
    print(json.dumps({"requests": ok + failed, "failed": failed, "seconds": time.time() - started,
                      "per_twin": per, "failures": failures}))


if __name__ == "__main__":
    main()
