"""Build the third-party producers of the ingest tests, or find them built.

    python -m lab.producers.build [--dir DIR] [otelcol] [telegraf]

builds each named producer (both by default) into ``DIR/<name>-<version>/`` and prints its
path; a binary already there, built from the same sources (``source.sha256`` beside it),
is reused without running Go. ``DIR`` defaults to ``$REFINERY_PRODUCERS_DIR``, else
``$HOME/.cache/refinery/producers``; Go's module and build caches go to ``GOMODCACHE`` and
``GOCACHE`` when set, else under ``$HOME/.cache/refinery/go``, so a CI cache of
``$HOME/.cache`` keeps all three. Exits 1, naming the producer and Go's last lines, when a
build fails (no Go, no module proxy); the tests then skip.

Cold, on one core of this project's machine: the Collector ~6 minutes, Telegraf ~2.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Producer:
    """One producer: what ``go`` builds, where it lands, and what its build depends on."""

    name: str
    version: str
    binary: str
    go_args: tuple[str, ...]  # after ``go``; ``{out}``: the binary's path
    workdir: Path  # where ``go`` runs
    inputs: tuple[Path, ...]  # files whose bytes select the build

    def folder(self, root: Path) -> Path:
        return root / f"{self.name}-{self.version}"

    def stamp(self) -> str:
        h = hashlib.sha256(" ".join(self.go_args).encode())
        for p in self.inputs:
            h.update(p.name.encode() + b"\0" + p.read_bytes())
        return h.hexdigest()


_OTELCOL = HERE / "otelcol"
OTELCOL = Producer(
    name="otelcol",
    version="v0.160.0",
    binary="otelcol-refinery",
    go_args=("build", "-trimpath", "-ldflags=-s -w", "-o", "{out}", "."),
    workdir=_OTELCOL,
    inputs=(_OTELCOL / "go.mod", _OTELCOL / "go.sum", _OTELCOL / "main.go"),
)

# docs/CUSTOMIZATION.md of Telegraf: ``custom`` plus each plugin; the inputs of the
# Telegraf configuration in docs/ingest.md that need no hardware
TELEGRAF_TAGS = (
    "custom,inputs.cpu,inputs.mem,inputs.disk,inputs.diskio,inputs.net,inputs.system,"
    "inputs.kernel,inputs.processes,inputs.swap,outputs.kafka,serializers.influx"
)
TELEGRAF = Producer(
    name="telegraf",
    version="v1.37.2",
    binary="telegraf",
    # `go install pkg@version` builds the released module as published (no replace
    # directives in its go.mod), with its own go.sum; GOBIN is pointed at the folder
    go_args=(
        "install",
        "-trimpath",
        "-tags",
        TELEGRAF_TAGS,
        "-ldflags=-s -w -X github.com/influxdata/telegraf/internal.Version=1.37.2",
        "github.com/influxdata/telegraf/cmd/telegraf@v1.37.2",
    ),
    workdir=HERE,
    inputs=(),
)

PRODUCERS = {p.name: p for p in (OTELCOL, TELEGRAF)}


def default_root(env: Mapping[str, str]) -> Path:
    """``$REFINERY_PRODUCERS_DIR``, else ``$HOME/.cache/refinery/producers``."""
    given = env.get("REFINERY_PRODUCERS_DIR")
    if given:
        return Path(given)
    return Path(env.get("HOME", str(Path.home()))) / ".cache" / "refinery" / "producers"


def cached(p: Producer, root: Path) -> Path | None:
    """The binary of ``p`` under ``root`` when it was built from the current sources."""
    folder = p.folder(root)
    exe = folder / p.binary
    stamp = folder / "source.sha256"
    if exe.is_file() and stamp.is_file() and stamp.read_text().strip() == p.stamp():
        return exe
    return None


class BuildError(Exception):
    """A producer could not be built: no Go, no module proxy, a compile error."""


def build(p: Producer, root: Path, env: Mapping[str, str]) -> Path:
    """The binary of ``p``, built into ``root`` unless :func:`cached` finds it. Blocks for
    the build (minutes); raises :class:`BuildError` with Go's last lines."""
    got = cached(p, root)
    if got is not None:
        return got
    go = shutil.which("go", path=env.get("PATH"))
    if go is None:
        raise BuildError(f"{p.name}: no `go` on PATH")
    folder = p.folder(root)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".build-{os.getpid()}"
    tmp.mkdir(exist_ok=True)
    home = Path(env.get("HOME", str(Path.home())))
    go_env = {
        **env,
        "GOMODCACHE": env.get("GOMODCACHE") or str(home / ".cache/refinery/go/mod"),
        "GOCACHE": env.get("GOCACHE") or str(home / ".cache/refinery/go/build"),
        # a module cache that `rm -rf` can clear; no VCS stamp (a checkout git may refuse)
        "GOFLAGS": "-modcacherw -buildvcs=false",
        "GOTOOLCHAIN": "local",  # the installed Go, never one downloaded
        "CGO_ENABLED": "0",
        "GOBIN": str(tmp),
    }
    args = [a.replace("{out}", str(tmp / p.binary)) for a in p.go_args]
    log = folder / "build.log"
    with log.open("wb") as out:
        rc = subprocess.run(
            [go, *args], cwd=p.workdir, env=go_env, stdout=out, stderr=subprocess.STDOUT
        ).returncode
    if rc != 0 or not (tmp / p.binary).is_file():
        shutil.rmtree(tmp, ignore_errors=True)
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise BuildError(f"{p.name} {p.version}: go {args[0]} exited {rc} ({log}):\n{tail}")
    os.replace(tmp / p.binary, folder / p.binary)
    tmp.rmdir()
    (folder / "source.sha256").write_text(p.stamp() + "\n")
    return folder / p.binary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lab.producers.build", description=__doc__)
    ap.add_argument("names", nargs="*", metavar="NAME", help=f"of {sorted(PRODUCERS)}")
    ap.add_argument("--dir", type=Path, help="the cache (default: see above)")
    a = ap.parse_args(argv)
    if unknown := set(a.names) - set(PRODUCERS):
        ap.error(f"no producer {sorted(unknown)}: one of {sorted(PRODUCERS)}")
    env = dict(os.environ)
    root = a.dir or default_root(env)
    failed = 0
    for name in a.names or list(PRODUCERS):
        p = PRODUCERS[name]
        if (exe := cached(p, root)) is not None:
            print(f"{name} {p.version}: cached {exe} ({exe.stat().st_size / 2**20:.0f} MiB)")
            continue
        t0 = time.monotonic()
        try:
            exe = build(p, root, env)
        except BuildError as e:
            print(f"not built: {e}", file=sys.stderr)
            failed = 1
            continue
        size = exe.stat().st_size / 2**20
        print(f"{name} {p.version}: built {exe} ({size:.0f} MiB) in {time.monotonic() - t0:.0f} s")
    return failed


if __name__ == "__main__":
    sys.exit(main())
