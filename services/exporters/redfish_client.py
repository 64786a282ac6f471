"""A Redfish service over HTTPS (stdlib ``urllib``/``ssl``): GET JSON documents with basic or
session authentication, each stamped with the local times it was sent and received (for the
BMC clock's offset). What the documents mean is :mod:`services.exporters.redfish`."""

from __future__ import annotations

import base64
import json
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from schemas.errors import RefineryError


class RedfishError(RefineryError):
    """The Redfish service cannot be reached or answered something that is not Redfish."""


class NotFound(RedfishError):
    pass


@dataclass(frozen=True)
class Fetched:
    doc: dict[str, Any]
    sent_ns: int
    received_ns: int


class RedfishClient:
    """GET JSON from a Redfish service over HTTPS. Blocks up to ``timeout`` per request.

    ``ca_file`` verifies the BMC certificate; ``insecure`` disables verification (lab use).
    Authentication is HTTP basic, or a session (``X-Auth-Token``) when ``session`` is set."""

    def __init__(
        self,
        base_url: str,
        user: str | None = None,
        password: str | None = None,
        *,
        ca_file: str | None = None,
        insecure: bool = False,
        session: bool = False,
        timeout: float = 10.0,
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        self.base = base_url.rstrip("/")
        if not self.base.startswith(("https://", "http://")):
            raise RedfishError(f"not an http(s) URL: {base_url!r}")
        if insecure:
            ctx = ssl.create_default_context()
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        else:
            ctx = ssl.create_default_context(cafile=ca_file)
        self._ctx = ctx
        self._timeout = timeout
        self._clock = clock
        self._headers = {"Accept": "application/json", "OData-Version": "4.0"}
        self._user, self._password, self._session = user, password, session
        if user is not None and password is not None and not session:
            token = base64.b64encode(f"{user}:{password}".encode()).decode()
            self._headers["Authorization"] = f"Basic {token}"
        self._token: str | None = None

    def _open(self, req: urllib.request.Request) -> tuple[bytes, dict[str, str]]:
        try:
            with urllib.request.urlopen(req, timeout=self._timeout, context=self._ctx) as resp:
                return resp.read(), dict(resp.headers.items())
        except urllib.error.HTTPError as e:
            if e.code == 404:
                raise NotFound(f"{req.full_url}: 404") from e
            raise RedfishError(f"{req.full_url}: HTTP {e.code} {e.reason}") from e
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise RedfishError(f"{req.full_url}: {reason}") from e

    def login(self) -> None:
        """Open a session (POST SessionService/Sessions) when session auth was asked for."""
        if not self._session or self._token is not None:
            return
        body = json.dumps({"UserName": self._user, "Password": self._password}).encode()
        req = urllib.request.Request(
            self.base + "/redfish/v1/SessionService/Sessions",
            data=body,
            headers={**self._headers, "Content-Type": "application/json"},
            method="POST",
        )
        _, headers = self._open(req)
        token = {k.lower(): v for k, v in headers.items()}.get("x-auth-token")
        if not token:
            raise RedfishError("session login returned no X-Auth-Token")
        self._token = token
        self._headers["X-Auth-Token"] = token

    def get(self, path: str) -> Fetched:
        """GET ``path`` (an ``@odata.id``); raises NotFound on 404, RedfishError otherwise."""
        self.login()
        url = path if path.startswith("http") else self.base + path
        sent = self._clock()
        body, _ = self._open(urllib.request.Request(url, headers=self._headers))
        received = self._clock()
        try:
            doc = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RedfishError(f"{url}: not JSON") from e
        if not isinstance(doc, dict):
            raise RedfishError(f"{url}: not a JSON object")
        return Fetched(doc, sent, received)
