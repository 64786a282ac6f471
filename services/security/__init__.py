"""Secure transport, identity and least privilege for a Refinery cluster.

- :mod:`lab.broker_security`: a local CA, certificates, PKCS12 keystores, SCRAM users and
  broker properties for ``refinery broker start --secure``.
- :mod:`services.security.acls`: ``deploy/acls.yaml`` applied idempotently (``refinery acls``).
- :mod:`lab.bench.sasl`: SASL_SSL versus PLAINTEXT cost through the worker.
"""
