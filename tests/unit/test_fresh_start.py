"""Every service starts from an empty directory with its defaults: state directories are
created with their parents."""

from __future__ import annotations

from pathlib import Path

from services.settings import KafkaSettings
from services.telemetry import ServiceTelemetry
from services.worker.app import WorkerConfig, build_app


def test_the_worker_creates_its_data_dir_with_its_parents(tmp_path: Path) -> None:
    data_dir = tmp_path / ".refinery" / "worker"  # the default, relative to an empty cwd
    worker = build_app(
        KafkaSettings(bootstrap_servers="127.0.0.1:1"),
        WorkerConfig(data_dir=data_dir, web_port=None),
        ServiceTelemetry("test"),
    )
    app = worker.app
    assert data_dir.is_dir()
    app._create_directories()  # what Faust does on first start: the last level only
    assert Path(app.conf.datadir).is_dir()
    worker.outputs.close()  # stop dialling 127.0.0.1:1
