"""Whether a TCP port is free to listen on (msrun's MASTER_PORT, checked by run_grpo.sh before any work).

Standard library only: `python3 -m mindrlhf.utils.ports HOST PORT` runs before the project's virtualenv exists.
It exits 0 when the port is free (or cannot be checked), and 3 when another process holds it, printing a free
port near it to suggest instead.
"""
from __future__ import annotations

import errno
import socket
import sys

IN_USE = 3  # exit code of `python -m mindrlhf.utils.ports` for a port another process holds


def port_in_use(host: str, port: int) -> bool:
    """True when binding `host:port` fails because another socket holds it; False when it binds, and when the
    host is not an address of this machine (nothing this machine could listen on to tell)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # as a server does: a port left in TIME_WAIT by a finished run is free
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as err:
            return err.errno == errno.EADDRINUSE
    return False


def free_port_near(host: str, port: int, tries: int = 50) -> int | None:
    """The first port after `port` that `port_in_use` finds free (None when `tries` ports are all taken)."""
    for candidate in range(port + 1, min(port + 1 + tries, 65536)):
        if not port_in_use(host, candidate):
            return candidate
    return None


def main(argv: list[str]) -> int:
    """`HOST PORT`: 0 when the port is free, `IN_USE` (printing a free port near it, if any) when it is not."""
    host, port = argv[0], int(argv[1])
    if not port_in_use(host, port):
        return 0
    print(free_port_near(host, port) or "")
    return IN_USE


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
