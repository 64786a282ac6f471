"""The lake on S3-compatible object storage: settings, the obstore-backed store, DuckDB's view.

=================================  ==========================================  ===============
variable                           meaning                                     default
=================================  ==========================================  ===============
REFINERY_LAKE=s3://bucket/prefix   the lake on object storage                  ./lake
REFINERY_S3_ENDPOINT               endpoint URL (else AWS_ENDPOINT_URL_S3,     AWS
                                   AWS_ENDPOINT_URL); http:// allowed
REFINERY_S3_REGION                 region (else AWS_REGION, AWS_DEFAULT_REGION) us-east-1
REFINERY_S3_PATH_STYLE             path-style requests (bucket in the path)    true with an
                                                                               endpoint
AWS_ACCESS_KEY_ID / _SECRET_...    credentials (secrets); AWS_SESSION_TOKEN    the client's
                                                                               chain
REFINERY_S3_TIMEOUT_S              one request's timeout                       30
REFINERY_S3_RETRIES                retries of a failed request (backoff)       5
REFINERY_S3_READ_BLOCK_MIB         DuckDB reads objects by blocks of this size 8
REFINERY_S3_READ_CACHE_MIB         cache of read blocks, per connection        256
REFINERY_S3_READ_MIRROR_MIB        local copies of objects up to a block, per  1024
                                   connection (0: none)
REFINERY_S3_READ_MIRROR_DIR        where those copies go (a directory of the   system temp
                                   connection's own is made there)
=================================  ==========================================  ===============

Writes go through obstore (its ``PutMode.Create`` sends ``If-None-Match: *``; pyarrow's S3
file system silently drops that header and overwrites). DuckDB reads through
:class:`~services.lake.s3read.LakeReadFS` registered on the connection
(:meth:`S3Settings.register`), since its httpfs extension is not available for every DuckDB
release.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import obstore as obs
import obstore.exceptions as ox
from obstore.store import S3Store
from pydantic import AliasChoices, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.lake.location import LakeLocation
from services.lake.store import (
    ObjectExists,
    ObjectInfo,
    ObjectMissing,
    PreconditionFailed,
    StoreAccessError,
    StoreError,
    StoreUnavailable,
)


def _env(*names: str) -> Any:
    return Field(default=None, validation_alias=AliasChoices(*names))


class S3Settings(BaseSettings):
    """How to reach the object store of an ``s3://`` lake (table in the module docstring)."""

    model_config = SettingsConfigDict(
        env_prefix="REFINERY_S3_", frozen=True, extra="ignore", populate_by_name=True
    )

    endpoint: str | None = _env("REFINERY_S3_ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
    region: str | None = _env("REFINERY_S3_REGION", "AWS_REGION", "AWS_DEFAULT_REGION")
    path_style: bool | None = None
    access_key_id: str | None = _env("AWS_ACCESS_KEY_ID")
    secret_access_key: SecretStr | None = _env("AWS_SECRET_ACCESS_KEY")
    session_token: SecretStr | None = _env("AWS_SESSION_TOKEN")
    timeout_s: float = Field(default=30.0, gt=0)
    retries: int = Field(default=5, ge=0, le=20)
    read_block_mib: int = Field(default=8, ge=1, le=1024)
    read_cache_mib: int = Field(default=256, ge=0)
    read_mirror_mib: int = Field(default=1024, ge=0)
    read_mirror_dir: str | None = None

    @property
    def region_name(self) -> str:
        return self.region or "us-east-1"

    @property
    def use_path_style(self) -> bool:
        return self.path_style if self.path_style is not None else self.endpoint is not None

    def where(self) -> str:
        return self.endpoint or f"AWS S3 ({self.region_name})"

    def obstore(self, loc: LakeLocation) -> S3Store:
        """An obstore S3Store rooted at the lake's bucket and prefix."""
        kw: dict[str, Any] = {"region": self.region_name}
        if self.endpoint:
            kw["endpoint"] = self.endpoint
        kw["virtual_hosted_style_request"] = not self.use_path_style
        if self.access_key_id:
            kw["access_key_id"] = self.access_key_id
        if self.secret_access_key is not None:
            kw["secret_access_key"] = self.secret_access_key.get_secret_value()
        if self.session_token is not None:
            kw["session_token"] = self.session_token.get_secret_value()
        timeout = f"{int(self.timeout_s * 1000)}ms"
        return S3Store(
            loc.bucket,
            prefix=loc.prefix or None,
            client_options={
                "allow_http": bool(self.endpoint and self.endpoint.startswith("http://")),
                "connect_timeout": "5s",
                "timeout": timeout,
            },
            retry_config={
                "max_retries": self.retries,
                "retry_timeout": dt.timedelta(seconds=self.timeout_s * 2),
                "backoff": {
                    "init_backoff": dt.timedelta(milliseconds=100),
                    "max_backoff": dt.timedelta(seconds=5),
                    "base": 2.0,
                },
            },
            **kw,
        )

    def filesystem(self) -> Any:
        """The read-only ``s3://`` file system DuckDB reads through
        (:class:`~services.lake.s3read.LakeReadFS`: obstore, the lake's own listing, a block
        cache of immutable objects)."""
        from services.lake.s3read import LakeReadFS

        return LakeReadFS(
            lambda bucket: self.obstore(LakeLocation(bucket=bucket)),
            block_bytes=self.read_block_mib << 20,
            cache_bytes=self.read_cache_mib << 20,
            mirror_bytes=self.read_mirror_mib << 20,
            mirror_dir=self.read_mirror_dir,
        )

    def register(self, con: Any) -> Any:
        """Let DuckDB connection ``con`` read ``s3://`` through this configuration; returns
        the file system registered."""
        fs = self.filesystem()
        con.register_filesystem(fs)
        return fs


def _meta(m: Any) -> ObjectInfo:
    return ObjectInfo(str(m["path"]), int(m["size"]), m["last_modified"].timestamp(), m["e_tag"])


class S3ObjectStore:
    """An :class:`~services.lake.store.ObjectStore` on one bucket and prefix of an
    S3-compatible service. Every put is a single PUT (no multipart: atomic, nothing left
    behind by a kill; up to 5 GB). Transient failures are retried by the client with
    backoff (``S3Settings.retries``) before StoreUnavailable is raised."""

    def __init__(self, loc: LakeLocation, settings: S3Settings | None = None) -> None:
        if loc.is_local:
            raise StoreError(f"{loc.url} is not an object-store location")
        self.loc = loc
        self.settings = settings if settings is not None else S3Settings()
        self.store = self.settings.obstore(loc)

    @property
    def root_url(self) -> str:
        return self.loc.url

    def url(self, key: str) -> str:
        return f"s3://{self.loc.bucket}/{self.loc.key(key)}"

    def _error(self, e: Exception, key: str) -> StoreError:
        text = " ".join(str(e).split("Debug source:", 1)[0].split())
        where = f"{self.loc.url} at {self.settings.where()}"
        if isinstance(e, ox.AlreadyExistsError):
            return ObjectExists(f"{where}: {key} exists")
        if isinstance(e, ox.PreconditionError):
            return PreconditionFailed(f"{where}: {key} changed meanwhile")
        if "NoSuchBucket" in text:
            return StoreAccessError(f"{where}: bucket {self.loc.bucket!r} does not exist")
        if isinstance(e, FileNotFoundError):
            return ObjectMissing(f"{where}: no object {key}")
        denied = ("403 Forbidden", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied")
        if isinstance(e, ox.PermissionDeniedError | ox.UnauthenticatedError) or any(
            d in text for d in denied
        ):
            return StoreAccessError(
                f"{where}: access denied (check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)"
            )
        if "error sending request" in text or "retries" in text or " 50" in text:
            cause = text.split(" - ", 1)[-1][:160]
            return StoreUnavailable(f"{where}: cannot reach the store ({cause})")
        return StoreError(f"{where}: {key}: {text[:200]}")

    def put(
        self, key: str, data: bytes, *, create: bool = False, if_match: str | None = None
    ) -> str:
        mode: Any = "create" if create else {"e_tag": if_match} if if_match else "overwrite"
        try:
            r = obs.put(self.store, key, data, mode=mode, use_multipart=False)
        except Exception as e:
            raise self._error(e, key) from None
        return str(r["e_tag"])

    def get(self, key: str) -> bytes:
        try:
            return bytes(obs.get(self.store, key).bytes())
        except Exception as e:
            raise self._error(e, key) from None

    def head(self, key: str) -> ObjectInfo | None:
        try:
            return _meta(obs.head(self.store, key))
        except Exception as e:
            err = self._error(e, key)
            if isinstance(err, ObjectMissing):
                return None
            raise err from None

    def list(self, prefix: str) -> list[ObjectInfo]:
        try:
            return [_meta(m) for m in obs.list(self.store, prefix.rstrip("/")).collect()]
        except Exception as e:
            raise self._error(e, prefix) from None

    def delete(self, key: str) -> None:
        try:
            obs.delete(self.store, key)
        except Exception as e:
            err = self._error(e, key)
            if not isinstance(err, ObjectMissing):
                raise err from None

    def copy(self, src: str, dst: str) -> None:
        try:
            obs.copy(self.store, src, dst)
        except Exception as e:
            raise self._error(e, src) from None

    def check(self) -> None:
        try:
            obs.list_with_delimiter(self.store)
        except Exception as e:
            raise self._error(e, "") from None

    def register(self, con: Any) -> None:
        self.settings.register(con)
