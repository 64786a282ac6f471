"""Where a lake lives: a local directory or ``s3://bucket/prefix``, told apart in one place.

:func:`parse_location` takes ``REFINERY_LAKE`` (a string, or the :class:`~pathlib.Path` the
settings made of it: ``Path("s3://b/p")`` reads back as ``s3:/b/p``) and returns a
:class:`LakeLocation`. A value with any other scheme (``gs://``, ``http://``, ``s3a://``...) is
refused with one line (:class:`~schemas.errors.ConfigError`), never taken for a relative
directory named ``gs:``::

    >>> parse_location("s3://telemetry/lake").url
    's3://telemetry/lake'
    >>> parse_location(Path("s3://telemetry/lake/")).prefix
    'lake'
    >>> parse_location("/data/lake").is_local
    True
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from schemas.errors import ConfigError

# a scheme followed by ":/": what a URL looks like once Path() has collapsed its "//"
_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):/")
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
SUPPORTED = "a directory or s3://bucket/prefix"


@dataclass(frozen=True)
class LakeLocation:
    """A lake root: ``path`` for a local directory, else ``bucket`` and ``prefix`` (no
    leading or trailing slash, may be empty) of an S3-compatible object store."""

    path: Path | None = None
    bucket: str = ""
    prefix: str = ""

    @property
    def is_local(self) -> bool:
        return self.path is not None

    @property
    def url(self) -> str:
        """The root as DuckDB and users spell it: an absolute path or ``s3://bucket/prefix``."""
        if self.path is not None:
            return str(self.path)
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/")

    def key(self, rel: str) -> str:
        """The object key of ``rel`` (a path relative to the lake root)."""
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def __str__(self) -> str:
        return self.url


def parse_location(value: Path | str) -> LakeLocation:
    """The lake root ``value`` names; raises ConfigError for an unsupported scheme or an
    invalid bucket name. Touches nothing."""
    text = str(value)
    m = _SCHEME_RE.match(text)
    if m is None:
        return LakeLocation(path=Path(os.path.abspath(text)))
    scheme = m.group(1).lower()
    rest = text[m.end() :].lstrip("/")
    if scheme == "file":
        return LakeLocation(path=Path("/" + rest))
    text = f"{scheme}://{rest}"  # as the user wrote it, before Path() collapsed the "//"
    if scheme != "s3":
        raise ConfigError(f"lake {text}: unsupported scheme {scheme}:// (use {SUPPORTED})")
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET_RE.match(bucket):
        raise ConfigError(f"lake {text}: {bucket!r} is not an S3 bucket name")
    prefix = prefix.strip("/")
    if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
        raise ConfigError(f"lake {text}: the prefix may not hold empty, . or .. parts")
    return LakeLocation(bucket=bucket, prefix=prefix)


def local_root(value: Path | str) -> Path:
    """The directory of a local lake; raises ConfigError when ``value`` names an object store
    (open it through :mod:`services.lake.backend` instead) or an unsupported scheme, so that
    no code path ever creates a directory called ``s3:``."""
    loc = parse_location(value)
    if loc.path is None:
        raise ConfigError(f"lake {loc.url} is on object storage; this needs a local directory")
    return loc.path
