"""A server port a command is about to listen on, checked before the command starts.

The worker's and detect's ``/health`` and ``/metrics`` are served by Faust's web server, which
binds its port deep inside the Faust worker's start; a port already in use ends there in a
traceback of Faust's services. :func:`require_free_port` binds the address the same way first (with
``SO_REUSEADDR``, as aiohttp does) and turns a failure into one line that names the address
and the flag that changes it.
"""

from __future__ import annotations

import errno
import socket

from schemas.errors import ConfigError


def require_free_port(
    host: str, port: int, *, port_flag: str = "--web-port", host_flag: str = "--web-host"
) -> None:
    """Return if a server can listen on ``host:port`` now; raise ConfigError (one line: the
    address, why not, the flag to change) otherwise. Binds and closes at once, never blocks
    beyond resolving ``host``. The port may still be taken between this check and the real
    bind; the server's own error covers that race."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ConfigError(f"{host_flag} {host}: cannot resolve it ({e.strerror})") from None
    for family, kind, proto, _name, addr in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(addr)
            except OSError as e:
                raise ConfigError(bind_failure(host, port, e, port_flag, host_flag)) from None


def bind_failure(host: str, port: int, e: OSError, port_flag: str, host_flag: str) -> str:
    """The one line for ``e``, a failure to listen on ``host:port``."""
    where = f"{host}:{port}"
    if e.errno == errno.EADDRINUSE:
        return f"port {where} is already in use: choose another with {port_flag} (0: off)"
    if e.errno == errno.EADDRNOTAVAIL:
        return f"cannot listen on {where}: {host} is no address of this host ({host_flag})"
    return f"cannot listen on {where} ({e.strerror or e}): change {port_flag} or {host_flag}"
