"""The Python scripts `afe doctor` runs inside its probe containers (and, for
LISTENER, on this host): a target HTTP server, fetches through the egress
proxy, direct connections, a fork bomb bounded by the pids limit, what the
sandbox's kernel reports (interfaces, no_new_privs), and the
R31 probe of every host address. Each is passed to `python -c` as text."""

from __future__ import annotations

TARGET_SERVER = r'''
import http.server, socketserver, threading
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        b = b"TARGET-OK"
        self.send_response(200); self.send_header("Content-Length", str(len(b))); self.end_headers()
        self.wfile.write(b)
    def log_message(self, *a): pass
socketserver.ThreadingTCPServer.allow_reuse_address = True
for port in (80, 443, 8080):
    s = socketserver.ThreadingTCPServer(("0.0.0.0", port), H)
    threading.Thread(target=s.serve_forever, daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
'''

FETCH = """import urllib.request, urllib.error, sys
try:
    print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())
except urllib.error.HTTPError as e:
    print("HTTP", e.code)
except Exception as e:
    print("ERR", type(e).__name__)
"""

DIRECT = """import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3).close(); print("CONNECTED")
except Exception as e:
    print("ERR", type(e).__name__)
"""

CONNECT = """import socket, os, sys
host, port = os.environ["HTTPS_PROXY"].split("//")[1].split(":")
s = socket.create_connection((host, int(port)), timeout=10)
s.sendall(b"CONNECT " + sys.argv[1].encode() + b" HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")
print(s.recv(200).split(b"\\r\\n")[0].decode())
"""

# The network interfaces the sandbox sees, from /proc/net/dev (gVisor has no /sys/class/net).
INTERFACES = """print(" ".join(line.split(":")[0].strip() for line in open("/proc/net/dev").readlines()[2:]))"""

# The no_new_privs bit as the kernel (Linux or gVisor's) reports it: prctl(PR_GET_NO_NEW_PRIVS).
NO_NEW_PRIVS = """import ctypes; print(ctypes.CDLL(None).prctl(39, 0, 0, 0, 0))"""

FORK = """import os, signal
pids, err = [], "none"
try:
    for i in range(200):
        pid = os.fork()
        if pid == 0:
            signal.pause(); os._exit(0)
        pids.append(pid)
except OSError as e:
    err = "EAGAIN" if e.errno == 11 else str(e.errno)
print(len(pids), err, flush=True)
for p in pids:
    os.kill(p, 9); os.waitpid(p, 0)
"""


# R31: a listener on every host address (TCP and UDP on 0.0.0.0 and ::, one
# port) that prints each connection's first line and each datagram, so a
# probe's arrival is seen by the host itself, not only by the prober.
LISTENER = r'''
import socket, sys, threading
port = int(sys.argv[1]) if len(sys.argv) > 1 else 0
lock = threading.Lock()
def out(kind, data):
    with lock:
        print(kind, data.decode("utf-8", "replace").strip(), flush=True)
def bind(fam, typ, addr, port):
    s = socket.socket(fam, typ)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if fam == socket.AF_INET6:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    s.bind((addr, port))
    if typ == socket.SOCK_STREAM:
        s.listen(64)
    return s
for _ in range(50):
    socks = []
    try:
        socks.append(bind(socket.AF_INET, socket.SOCK_STREAM, "0.0.0.0", port))
        p = socks[0].getsockname()[1]
        socks.append(bind(socket.AF_INET, socket.SOCK_DGRAM, "0.0.0.0", p))
        try:
            socks += [bind(socket.AF_INET6, socket.SOCK_STREAM, "::", p),
                      bind(socket.AF_INET6, socket.SOCK_DGRAM, "::", p)]
        except OSError as e:
            if e.errno == 98:
                raise
        break
    except OSError:
        for s in socks:
            s.close()
        if port:
            raise
def conn(c):
    c.settimeout(5)
    try:
        out("tcp", c.recv(200))
    except OSError:
        pass
    c.close()
def serve(s):
    while True:
        if s.type == socket.SOCK_STREAM:
            c, _ = s.accept()
            threading.Thread(target=conn, args=(c,), daemon=True).start()
        else:
            out("udp", s.recvfrom(2048)[0])
for s in socks:
    threading.Thread(target=serve, args=(s,), daemon=True).start()
print("ready", p, flush=True)
threading.Event().wait()
'''

# R31: try TCP connect, a UDP datagram and an ICMP echo (an unprivileged ICMP
# datagram socket) to each address; prints one JSON object. Every packet
# carries the token, so a listener knows whose it is.
PROBE = r'''
import json, socket, struct, sys, threading
token, port, addrs = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
res = {}
def err(e):
    return "ERR " + (type(e).__name__ if isinstance(e, TimeoutError) or not e.errno else str(e.errno))
def tcp(a):
    try:
        fam, typ, proto, _, sa = socket.getaddrinfo(a, port, 0, socket.SOCK_STREAM)[0]
        with socket.socket(fam, typ, proto) as s:
            s.settimeout(2)
            s.connect(sa)
            s.sendall(f"{token} tcp {a}\n".encode())
        return "CONNECTED"
    except OSError as e:
        return err(e)
def udp(a):
    try:
        fam, typ, proto, _, sa = socket.getaddrinfo(a, port, 0, socket.SOCK_DGRAM)[0]
        with socket.socket(fam, typ, proto) as s:
            s.sendto(f"{token} udp {a}".encode(), sa)
        return "SENT"
    except OSError as e:
        return err(e)
def icmp(a):
    v6 = ":" in a
    fam = socket.AF_INET6 if v6 else socket.AF_INET
    try:
        s = socket.socket(fam, socket.SOCK_DGRAM, socket.IPPROTO_ICMPV6 if v6 else socket.IPPROTO_ICMP)
    except OSError as e:
        return "NOSOCK " + err(e)
    with s:
        s.settimeout(2)
        try:
            sa = socket.getaddrinfo(a, 0, fam, socket.SOCK_DGRAM)[0][4]
            s.sendto(struct.pack("!BBHHH", 128 if v6 else 8, 0, 0, 0, 1) + token.encode(), sa)
            while True:
                d = s.recvfrom(2048)[0]
                if d[0] == (129 if v6 else 0) and token.encode() in d:
                    return "REPLY"
        except OSError as e:
            return err(e)
def one(a):
    res[a] = {"tcp": tcp(a), "udp": udp(a), "icmp": icmp(a)}
ts = [threading.Thread(target=one, args=(a,)) for a in addrs]
for t in ts:
    t.start()
for t in ts:
    t.join()
print(json.dumps(res))
'''
