"""A TCP relay to a unix socket, for a test that needs to cut a database's network.

The throwaway PostgreSQL (tests/unit/pg.py) listens on a unix socket only; a
test runs this relay inside a network namespace of its own (``NetLab``) so one
artemisd reaches the database over TCP, through a link the test can take down
and bring back.  A link taken down drops packets without resetting anything,
as a real cut does: the relay itself never closes a connection on its own.

    python -m tests.cluster.relay LISTEN_ADDRESS PORT UNIX_SOCKET
"""

from __future__ import annotations

import socket
import sys
import threading


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while chunk := src.recv(65536):
            dst.sendall(chunk)
    except OSError:
        pass
    finally:
        # Pass the end of one direction on; the other direction ends by itself.
        for sock in (dst, src):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _serve(client: socket.socket, target: str) -> None:
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        upstream.connect(target)
    except OSError:
        client.close()
        upstream.close()
        return
    threading.Thread(target=_pump, args=(upstream, client), daemon=True).start()
    _pump(client, upstream)


def main(address: str, port: int, target: str) -> None:
    listener = socket.create_server((address, port), reuse_port=False)
    print(f"relay {address}:{port} -> {target}", flush=True)
    while True:
        client, _ = listener.accept()
        threading.Thread(target=_serve, args=(client, target), daemon=True).start()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
