"""Small network helpers shared by every HTTP front of the project (engine server, router)."""

from __future__ import annotations

import socket


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket for uvicorn, with TCP_NODELAY.

    Raises:
        OSError: naming the address when it cannot be bound.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # NOTE: proto must say TCP: asyncio sets TCP_NODELAY only on sockets whose
    # proto is IPPROTO_TCP, and accepted sockets inherit the listener's (0 by
    # default). Without it Nagle's algorithm holds each small SSE event until
    # the client's delayed ACK: streamed tokens arrived up to ~40 ms late.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    # NOTE: listen now, not when uvicorn starts serving: the address is announced
    # before that (loading the model, the app's start-up), and a client that
    # connected in between was refused; now it waits in the backlog until accepted.
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock
