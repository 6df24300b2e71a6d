"""The proxy container's socket server as it was before issue 34 (it
started two threads per connection, outside any `try`), kept only as the
positive control of tests/sandbox/egress/test_egress_socket_flood.py: with the
proxy's pids limit of 128, about 60 held connections kill its accept thread
(`RuntimeError: can't start new thread`) and the ticket's egress is gone
for good. Never used outside tests."""

THREADED_PROXY_MAIN = r'''
import os, socket, subprocess, sys, threading, time
SOCK = '/run/afe-egress/proxy.sock'
with open("/tmp/squid.conf", "w") as f:
    f.write(os.environ["AFE_SQUID_CONF"])
squid = subprocess.Popen(["squid", "-N", "-f", "/tmp/squid.conf"])
for _ in range(400):
    try:
        socket.create_connection(("127.0.0.1", 3128), 1).close()
        break
    except OSError:
        if squid.poll() is not None:
            sys.exit(squid.returncode or 1)
        time.sleep(0.05)
try:
    os.unlink(SOCK)
except FileNotFoundError:
    pass
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(SOCK)
os.chmod(SOCK, 0o666)
s.listen(128)


def pipe(a, b):
    try:
        while True:
            d = a.recv(65536)
            if not d:
                break
            b.sendall(d)
    except OSError:
        pass
    try:
        b.shutdown(socket.SHUT_WR)
    except OSError:
        pass

def serve(c):
    try:
        u = socket.create_connection(("127.0.0.1", 3128))
    except OSError:
        c.close()
        return
    u.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    t = threading.Thread(target=pipe, args=(c, u), daemon=True)
    t.start()
    pipe(u, c)
    t.join()
    c.close()
    u.close()

def accept():
    while True:
        try:
            c, _ = s.accept()
        except OSError:
            continue
        threading.Thread(target=serve, args=(c,), daemon=True).start()

threading.Thread(target=accept, daemon=True).start()
sys.exit(squid.wait())
'''
