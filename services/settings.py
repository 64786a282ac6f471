"""Settings, read from ``REFINERY_*`` environment variables in one place.

``main()`` builds one :class:`RefinerySettings` and hands its parts to the objects it creates;
nothing else reads the environment. Field names map onto librdkafka option names through
:meth:`KafkaSettings.librdkafka` (and onto aiokafka's through :meth:`KafkaSettings.aiokafka`).

=================================  ==========================================  ===============
variable                           meaning                                     default
=================================  ==========================================  ===============
REFINERY_BOOTSTRAP_SERVERS         Kafka bootstrap servers                     127.0.0.1:9092
REFINERY_SECURITY_PROTOCOL         PLAINTEXT, SSL, SASL_PLAINTEXT, SASL_SSL    PLAINTEXT
REFINERY_SASL_MECHANISM            SCRAM-SHA-512, SCRAM-SHA-256, PLAIN         SCRAM-SHA-512
REFINERY_SASL_USERNAME / _PASSWORD SASL credentials (password is a secret)     unset
REFINERY_SSL_CA_LOCATION           CA bundle for the brokers' certificates     unset
REFINERY_SSL_CERT_LOCATION / _KEY  client certificate and key (mutual TLS)     unset
REFINERY_LAKE                      lake root: a directory or s3://bucket/prefix ./lake
REFINERY_HOME                      local state: broker data, jar cache, pids   ./.refinery
REFINERY_OTLP_ENDPOINT             OTLP/HTTP endpoint for the service's own    unset (local)
                                   metrics and traces
REFINERY_SESSION_TIMEOUT_S         how long the group coordinator waits for    15
                                   a silent Faust member (worker, detect)
                                   before its partitions move
=================================  ==========================================  ===============
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class KafkaSettings(BaseSettings):
    """How to reach Kafka. Immutable; secrets stay :class:`SecretStr` until handed to a client."""

    model_config = SettingsConfigDict(env_prefix="REFINERY_", frozen=True, extra="ignore")

    bootstrap_servers: str = "127.0.0.1:9092"
    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str = "SCRAM-SHA-512"
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None
    ssl_ca_location: Path | None = None
    ssl_cert_location: Path | None = None
    ssl_key_location: Path | None = None
    ssl_key_password: SecretStr | None = None
    # A killed worker's partitions move once its session expires: the consumer group's
    # failover time, and with it the freshness of everything it owned. Faust's default is
    # 60 s; heartbeats are sent from the consumer's own thread (not the refining one) ten
    # times per session. The broker accepts 6..1800 s (group.min/max.session.timeout.ms).
    session_timeout_s: float = Field(default=15.0, ge=6.0, le=1800.0)

    @property
    def heartbeat_interval_s(self) -> float:
        return self.session_timeout_s / 10

    def librdkafka(self) -> dict[str, Any]:
        """Options for confluent-kafka clients (librdkafka names)."""
        from services.kafka.log import KAFKA_LOG

        conf: dict[str, Any] = {
            "bootstrap.servers": self.bootstrap_servers,
            "security.protocol": self.security_protocol,
            "logger": KAFKA_LOG,  # librdkafka's lines through Python logging, collapsed
        }
        if self.security_protocol.startswith("SASL"):
            conf["sasl.mechanism"] = self.sasl_mechanism
            if self.sasl_username is not None:
                conf["sasl.username"] = self.sasl_username
            if self.sasl_password is not None:
                conf["sasl.password"] = self.sasl_password.get_secret_value()
        if self.ssl_ca_location:
            conf["ssl.ca.location"] = str(self.ssl_ca_location)
        if self.ssl_cert_location:
            conf["ssl.certificate.location"] = str(self.ssl_cert_location)
        if self.ssl_key_location:
            conf["ssl.key.location"] = str(self.ssl_key_location)
        if self.ssl_key_password is not None:
            conf["ssl.key.password"] = self.ssl_key_password.get_secret_value()
        return conf

    def faust_broker(self) -> str:
        """The broker URL list in faust's ``kafka://host:port;host:port`` form."""
        return ";".join(f"kafka://{h.strip()}" for h in self.bootstrap_servers.split(","))


class RefinerySettings(BaseSettings):
    """Everything else a Refinery process needs from its environment."""

    model_config = SettingsConfigDict(env_prefix="REFINERY_", frozen=True, extra="ignore")

    lake: Path = Path("lake")
    home: Path = Path(".refinery")
    otlp_endpoint: str | None = None
    kafka_version: str = "4.2.2"

    def kafka(self) -> KafkaSettings:
        return KafkaSettings()


def load_settings() -> RefinerySettings:
    """The one place the environment is read (pydantic-settings does the reading). The Kafka
    settings are checked here too: a bad variable fails every command at once, not the first
    one that reaches for Kafka."""
    settings = RefinerySettings()
    settings.kafka()
    return settings
