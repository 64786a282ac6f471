"""A throwaway local PostgreSQL for tests: the Debian server binaries (``initdb``,
``pg_ctl``), a data directory of its own, one free 127.0.0.1 port, trust authentication.

    pg = LocalPostgres.start()           # initdb + pg_ctl start -w (a second or two)
    url = pg.url                         # postgresql+psycopg2://refinery@127.0.0.1:PORT/postgres
    url = pg.create_database("t1")       # the same server, database t1
    pg.restart()                         # pg_ctl restart -m fast: every connection dropped
    pg.stop()                            # pg_ctl stop -m immediate, data directory removed

initdb refuses to run as root: as root the server runs as the ``postgres`` user (the
Debian package creates it) through ``runuser``, in a data directory it owns under the
system temp directory (a pytest ``tmp_path`` is not readable by other users).
:class:`PostgresUnavailable` (one line) when the binaries or that user are missing.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from lab.broker import free_ports
from schemas.errors import RefineryError

USER = "refinery"  # the database superuser initdb creates (trust: no password)


class PostgresUnavailable(RefineryError):
    """No PostgreSQL server binaries (or no unprivileged user to run them as root)."""


def server_bin() -> Path:
    """The directory holding ``initdb`` and ``pg_ctl``: on PATH, else the newest
    ``/usr/lib/postgresql/<major>/bin`` (Debian keeps them off PATH)."""
    found = shutil.which("pg_ctl")
    if found and shutil.which("initdb"):
        return Path(found).resolve().parent
    majors = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=_major, reverse=True)
    if not majors:
        raise PostgresUnavailable(
            "PostgreSQL server binaries not found (apt-get install postgresql)"
        )
    return Path(majors[0]).parent


def _major(path: str) -> int:
    part = Path(path).parent.parent.name
    return int(part) if part.isdigit() else 0


def _run_as() -> list[str]:
    """The command prefix that runs the server unprivileged (empty unless root)."""
    if os.geteuid() != 0:
        return []
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        raise PostgresUnavailable("running as root and no 'postgres' user to run as") from None
    runuser = shutil.which("runuser")
    if runuser is None:
        raise PostgresUnavailable("running as root and no runuser to drop privileges")
    return [runuser, "-u", "postgres", "--"]


@dataclass
class LocalPostgres:
    """A running server (see the module docstring); ``port`` on 127.0.0.1."""

    bin: Path
    data: Path
    port: int
    prefix: list[str]

    @classmethod
    def start(cls) -> LocalPostgres:
        """initdb into a new temp directory, start on a free port, wait until it accepts
        connections. Raises PostgresUnavailable, or CalledProcessError if the server fails."""
        bin_dir, prefix = server_bin(), _run_as()
        root = Path(tempfile.mkdtemp(prefix="refinery-pg-"))
        if prefix:
            shutil.chown(root, "postgres", "postgres")
        pg = cls(bin_dir, root / "data", free_ports(1)[0], prefix)
        pg._pg("initdb", "-D", str(pg.data), "-U", USER, "--auth=trust", "-E", "UTF8")
        conf = (
            f"listen_addresses = '127.0.0.1'\nport = {pg.port}\n"
            f"unix_socket_directories = '{root}'\nfsync = off\n"
        )
        with (pg.data / "postgresql.conf").open("a") as f:
            f.write(conf)
        pg._ctl("start")
        return pg

    @property
    def url(self) -> str:
        """The SQLAlchemy URL of database ``postgres``."""
        return f"postgresql+psycopg2://{USER}@127.0.0.1:{self.port}/postgres"

    def create_database(self, name: str) -> str:
        """Create database ``name`` (letters, digits, ``_``); its SQLAlchemy URL."""
        import sqlalchemy

        if not name.replace("_", "").isalnum():
            raise ValueError(f"database name {name!r}")
        engine = sqlalchemy.create_engine(self.url, isolation_level="AUTOCOMMIT")
        try:
            with engine.connect() as con:
                con.execute(sqlalchemy.text(f'CREATE DATABASE "{name}"'))
        finally:
            engine.dispose()
        return self.url.rsplit("/", 1)[0] + f"/{name}"

    def restart(self) -> None:
        """``pg_ctl restart -m fast``: open connections are dropped, in-flight transactions
        rolled back; returns once the server accepts connections again."""
        self._ctl("restart", "-m", "fast")

    def stop_server(self) -> None:
        """Stop the server (fast), keeping its data: :meth:`start_server` brings it back."""
        self._ctl("stop", "-m", "fast")

    def start_server(self) -> None:
        self._ctl("start")

    def running(self) -> bool:
        """Whether the server is up (``pg_ctl status``)."""
        ctl = [*self.prefix, str(self.bin / "pg_ctl"), "-D", str(self.data), "status"]
        return subprocess.run(ctl, capture_output=True, timeout=60).returncode == 0

    def stop(self) -> None:
        """Stop at once and remove the data directory. Never raises."""
        subprocess.run(
            [
                *self.prefix,
                str(self.bin / "pg_ctl"),
                "-D",
                str(self.data),
                "stop",
                "-m",
                "immediate",
            ],
            capture_output=True,
            timeout=60,
        )
        shutil.rmtree(self.data.parent, ignore_errors=True)

    def _ctl(self, *args: str) -> None:
        log = str(self.data.parent / "server.log")
        self._pg("pg_ctl", "-D", str(self.data), "-l", log, "-w", "-t", "60", *args)

    def _pg(self, tool: str, *args: str) -> None:
        subprocess.run(
            [*self.prefix, str(self.bin / tool), *args],
            check=True,
            capture_output=True,
            timeout=120,
        )
