"""The lander says why a dataset stays empty: a non-fatal consumer error (here, a topic that
does not exist) is logged in one line, not dropped."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytestmark = [pytest.mark.kafka]
REPO = Path(__file__).resolve().parents[2]


def test_a_consumer_error_is_logged_once(kafka_bootstrap: str, tmp_path: Path) -> None:
    topic = f"absent-{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("REFINERY_")}
    env |= {"REFINERY_BOOTSTRAP_SERVERS": kafka_bootstrap, "REFINERY_LAKE": str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "land", "--topics", f"{topic}=samples",
         "--group", f"land-errors-{uuid.uuid4().hex[:6]}", "--once-idle", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )  # fmt: skip
    try:
        _, err = proc.communicate(timeout=12)
    except subprocess.TimeoutExpired:  # never assigned a partition: it waits, as it should
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    lines = [ln for ln in err.splitlines() if ln.startswith(f"land: {topic}: ")]
    assert len(lines) == 1, err[-2000:]  # said once, not once per poll
    assert "nknown topic" in lines[0] or "not available" in lines[0], lines
