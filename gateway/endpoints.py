"""Worker endpoints as configured, expanded to one ZeroMQ address per worker.

`tcp://NAME:PORT` whose NAME resolves to several addresses means a worker at each of them:
compose's `--scale worker=N` and a Kubernetes headless Service both answer DNS that way.
IP literals and other transports (ipc://, inproc://) stand for themselves.
"""

from __future__ import annotations

import ipaddress
import socket


def expand(endpoint: str) -> list[str]:
    """Every worker address `endpoint` stands for, in resolver order; blocking (DNS).

    Raises OSError (socket.gaierror) when the name does not resolve.
    """
    host, port = split_tcp(endpoint)
    if host is None or _is_ip(host):
        return [endpoint]
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    addresses = dict.fromkeys(str(info[4][0]) for info in infos)  # unique, order kept
    return [tcp_endpoint(address, port) for address in addresses]


def needs_resolving(endpoint: str) -> bool:
    """Whether `endpoint` names a host to look up (so its addresses may change)."""
    host, _ = split_tcp(endpoint)
    return host is not None and not _is_ip(host)


def split_tcp(endpoint: str) -> tuple[str | None, int]:
    """(host, port) of a tcp:// endpoint; (None, 0) for any other transport."""
    if not endpoint.startswith("tcp://"):
        return None, 0
    address = endpoint.removeprefix("tcp://")
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"worker endpoint {endpoint!r} is not tcp://HOST:PORT")
    return host.removeprefix("[").removesuffix("]"), int(port)


def tcp_endpoint(address: str, port: int) -> str:
    """The ZeroMQ endpoint of an IP address and port (IPv6 in brackets)."""
    return f"tcp://[{address}]:{port}" if ":" in address else f"tcp://{address}:{port}"


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
