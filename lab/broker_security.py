"""Key material and broker settings for ``refinery broker start --secure``.

Everything lives under ``<data_dir>/security`` (created once, reused on restart)::

    ca.key, ca.crt                       a local CA (EC P-256, 10 years); ca.key is 0600
    broker.key, broker.crt, broker.p12   the brokers' identity (CN=broker, SAN 127.0.0.1),
                                         PKCS12 keystore with the CA chain; 0600
    truststore.p12                       the CA as a PKCS12 truststore (keytool)
    broker.secret                        the keystores' password (0600)
    clients/<principal>.env              REFINERY_* settings for that principal: SASL_SSL,
                                         SCRAM-SHA-512 user and password, CA; 0600
    clients/<principal>.crt / .key       that principal's client certificate (mutual TLS on
                                         the SSL listener); the key is 0600

Listeners of each node: ``SASL_SSL`` (clients, SCRAM-SHA-512), ``SSL`` (clients, mutual TLS,
``ssl.client.auth=required``), ``INTERNAL`` (inter-broker, mutual TLS) and ``CONTROLLER``
(KRaft, mutual TLS). A certificate ``CN=x`` maps to principal ``User:x``; the brokers and
controllers authenticate as ``User:broker``, a super user with ``User:admin``. No listener is
unauthenticated, so ``User:ANONYMOUS`` is never a super user. SCRAM users are created when the
storage is formatted (:meth:`SecureMaterial.scram_args`).

Passwords come from :func:`secrets.token_hex`, are written only to 0600 files and the brokers'
0600 ``server.properties``, and are never printed or logged: openssl and keytool receive them
through the environment. (The one exception: ``kafka-storage format --add-scram`` takes them
on its command line for the second it runs; it runs as the same user.)
"""

from __future__ import annotations

import os
import secrets
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from schemas.errors import BrokerError

PRINCIPALS: tuple[str, ...] = (
    "admin",
    "refinery-exporter",
    "refinery-worker",
    "refinery-detect",
    "refinery-alerts",
    "refinery-lake",
)
BROKER_PRINCIPAL = "broker"
SUPER_USERS: tuple[str, ...] = ("User:admin", f"User:{BROKER_PRINCIPAL}")
SCRAM = "SCRAM-SHA-512"
AUTHORIZER = "org.apache.kafka.metadata.authorizer.StandardAuthorizer"
_EC = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"


def _argv(template: str, **paths: Path) -> list[str]:
    """Split ``template`` on spaces, then fill ``{name}`` placeholders with paths (which may
    contain spaces themselves)."""
    return [word.format(**{k: str(v) for k, v in paths.items()}) for word in template.split()]


def _private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by the owner only (created 0600, never wider)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)


def _run(cmd: list[str], env: dict[str, str] | None = None) -> None:
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, check=False
    )
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
        raise BrokerError(f"{Path(cmd[0]).name} {cmd[1]} failed: {tail[0][:200]}")


def _read_env_file(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#") and "=" in line:
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip()
    return out


@dataclass(frozen=True)
class SecureMaterial:
    """The key material of one secure local cluster, rooted at ``root``."""

    root: Path

    @property
    def ca(self) -> Path:
        return self.root / "ca.crt"

    @property
    def clients(self) -> Path:
        return self.root / "clients"

    def client_env(self, principal: str) -> Path:
        return self.clients / f"{principal}.env"

    def client_cert(self, principal: str) -> tuple[Path, Path]:
        return self.clients / f"{principal}.crt", self.clients / f"{principal}.key"

    def ensure(self) -> None:
        """Create whatever is missing (idempotent). Blocks for openssl/keytool (~1 s).
        Raises BrokerError when a tool is missing or fails."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.clients.mkdir(exist_ok=True)
        os.chmod(self.root, 0o700)
        if not self.ca.exists():
            _run(
                _argv(
                    f"openssl req -x509 {_EC} -keyout {{key}} -out {{crt}} -days 3650"
                    " -subj /CN=refinery-local-ca -addext basicConstraints=critical,CA:TRUE"
                    " -addext keyUsage=critical,keyCertSign,cRLSign",
                    key=self.root / "ca.key",
                    crt=self.ca,
                )
            )
            os.chmod(self.root / "ca.key", 0o600)
        secret = self.root / "broker.secret"
        if not secret.exists():
            _private(secret, secrets.token_hex(24))
        store_pw = secret.read_text().strip()
        if not (self.root / "broker.p12").exists():
            key, crt = self._issue(self.root, BROKER_PRINCIPAL)
            _run(
                _argv(
                    "openssl pkcs12 -export -in {crt} -inkey {key} -certfile {ca} -name broker"
                    " -out {out} -passout env:REFINERY_STORE_PW",
                    crt=crt,
                    key=key,
                    ca=self.ca,
                    out=self.root / "broker.p12",
                ),
                {"REFINERY_STORE_PW": store_pw},
            )
            os.chmod(self.root / "broker.p12", 0o600)
        if not (self.root / "truststore.p12").exists():
            _run(
                _argv(
                    "keytool -importcert -noprompt -alias refinery-ca -file {ca} -keystore {out}"
                    " -storetype PKCS12 -storepass:env REFINERY_STORE_PW",
                    ca=self.ca,
                    out=self.root / "truststore.p12",
                ),
                {"REFINERY_STORE_PW": store_pw},
            )
        for name in PRINCIPALS:
            if not self.client_cert(name)[0].exists():
                self._issue(self.clients, name)
            if not self.client_env(name).exists():
                _private(self.client_env(name), self._env_text(name, secrets.token_hex(24)))

    def _issue(self, where: Path, cn: str) -> tuple[Path, Path]:
        key, crt = where / f"{cn}.key", where / f"{cn}.crt"
        _run(
            _argv(
                f"openssl req -x509 {_EC} -keyout {{key}} -out {{crt}} -days 825"
                f" -subj /CN={cn} -CA {{ca}} -CAkey {{ca_key}}"
                " -addext subjectAltName=IP:127.0.0.1,DNS:localhost"
                " -addext basicConstraints=critical,CA:FALSE"
                " -addext extendedKeyUsage=serverAuth,clientAuth",
                key=key,
                crt=crt,
                ca=self.ca,
                ca_key=self.root / "ca.key",
            )
        )
        os.chmod(key, 0o600)
        return key, crt

    def _env_text(self, name: str, password: str) -> str:
        crt, key = self.client_cert(name)
        return (
            f"# Refinery client settings for principal {name}; keep private (0600).\n"
            "REFINERY_SECURITY_PROTOCOL=SASL_SSL\n"
            f"REFINERY_SASL_MECHANISM={SCRAM}\n"
            f"REFINERY_SASL_USERNAME={name}\n"
            f"REFINERY_SASL_PASSWORD={password}\n"
            f"REFINERY_SSL_CA_LOCATION={self.ca}\n"
            f"# mutual TLS on the SSL listener instead: REFINERY_SECURITY_PROTOCOL=SSL and\n"
            f"# REFINERY_SSL_CERT_LOCATION={crt}\n"
            f"# REFINERY_SSL_KEY_LOCATION={key}\n"
        )

    def password(self, principal: str) -> str:
        """The SCRAM password of ``principal`` (read from its 0600 env file)."""
        return _read_env_file(self.client_env(principal))["REFINERY_SASL_PASSWORD"]

    def client_environ(self, principal: str, bootstrap: str) -> dict[str, str]:
        """``REFINERY_*`` variables for a client process of ``principal`` over SASL_SSL."""
        env = _read_env_file(self.client_env(principal))
        return {**env, "REFINERY_BOOTSTRAP_SERVERS": bootstrap}

    def client_settings(self, principal: str, bootstrap: str, *, mtls: bool = False) -> Any:
        """A :class:`~services.settings.KafkaSettings` for ``principal`` (SASL_SSL, or SSL
        with its client certificate when ``mtls``)."""
        from services.settings import KafkaSettings

        env = (self.mtls_environ if mtls else self.client_environ)(principal, bootstrap)
        prefix = len("REFINERY_")
        fields: dict[str, Any] = {k[prefix:].lower(): v for k, v in env.items()}
        return KafkaSettings(**fields)

    def mtls_environ(self, principal: str, bootstrap: str) -> dict[str, str]:
        """``REFINERY_*`` variables for a client of ``principal`` over SSL (mutual TLS)."""
        crt, key = self.client_cert(principal)
        return {
            "REFINERY_BOOTSTRAP_SERVERS": bootstrap,
            "REFINERY_SECURITY_PROTOCOL": "SSL",
            "REFINERY_SSL_CA_LOCATION": str(self.ca),
            "REFINERY_SSL_CERT_LOCATION": str(crt),
            "REFINERY_SSL_KEY_LOCATION": str(key),
        }

    def scram_args(self) -> list[str]:
        """``--add-scram`` arguments for ``kafka-storage format`` (one per principal)."""
        out: list[str] = []
        for name in PRINCIPALS:
            out += ["--add-scram", f"{SCRAM}=[name={name},password={self.password(name)}]"]
        return out

    def broker_properties(self) -> dict[str, Any]:
        """Security properties shared by every node (listeners are set per node)."""
        pw = (self.root / "broker.secret").read_text().strip()
        return {
            "listener.security.protocol.map": (
                "SASL_SSL:SASL_SSL,SSL:SSL,INTERNAL:SSL,CONTROLLER:SSL"
            ),
            "inter.broker.listener.name": "INTERNAL",
            "controller.listener.names": "CONTROLLER",
            "sasl.enabled.mechanisms": SCRAM,
            "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config": (
                "org.apache.kafka.common.security.scram.ScramLoginModule required;"
            ),
            "ssl.keystore.type": "PKCS12",
            "ssl.keystore.location": str(self.root / "broker.p12"),
            "ssl.keystore.password": pw,
            "ssl.key.password": pw,
            "ssl.truststore.type": "PKCS12",
            "ssl.truststore.location": str(self.root / "truststore.p12"),
            "ssl.truststore.password": pw,
            "ssl.client.auth": "required",
            "listener.name.sasl_ssl.ssl.client.auth": "none",
            "ssl.endpoint.identification.algorithm": "https",
            "ssl.principal.mapping.rules": "RULE:^CN=([A-Za-z0-9._-]+)$/$1/,DEFAULT",
            "authorizer.class.name": AUTHORIZER,
            "allow.everyone.if.no.acl.found": "false",
            "super.users": ";".join(SUPER_USERS),
        }

    def files(self) -> dict[str, Any]:
        """Paths (never contents) for ``broker status --json``."""
        return {
            "ca": str(self.ca),
            "keystore": str(self.root / "broker.p12"),
            "truststore": str(self.root / "truststore.p12"),
            "clients": {
                name: {
                    "env": str(self.client_env(name)),
                    "cert": str(self.client_cert(name)[0]),
                    "key": str(self.client_cert(name)[1]),
                }
                for name in PRINCIPALS
            },
        }
