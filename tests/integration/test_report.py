"""`refinery report` end to end: a synthetic lake with a PFC storm on a straggler's path, GPU
throttling, a clock step, dead letters, a gap and a counter reset; the report rendered in
headless Chromium (DevTools protocol) with no console error, every panel drawn, and the numbers
in the figures' data attributes equal to what DuckDB computes from the same lake."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from lab.lake import synth
from services.lake import sqlload
from services.lake.datasets import DATASETS
from services.lake.writer import LakeWriter
from services.report.cli import build_report

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
T0 = synth.T0_NS
NODES, SECONDS = 4, 120
STORM = ("node000", "eth5/prio3", range(4, 26))  # rail 5: the straggler's (rank 5) path
THROTTLE = ("node002", "gpu3", range(60, 80))
CLOCK_STEP = ("node003", 70, 300_000_000)  # from step 70 on, +300 ms


def _inject(t: pa.Table) -> pa.Table:
    """The synthetic cluster plus the faults the report must show."""
    per_step = NODES * 106
    step = np.arange(t.num_rows) // per_step
    node = t.column("node").to_numpy(zero_copy_only=False)
    dev = t.column("device").to_numpy(zero_copy_only=False)
    met = t.column("metric").to_numpy(zero_copy_only=False)
    cols = {n: t.column(n).to_numpy(zero_copy_only=False) for n in ("value", "delta", "rate")}
    delta = np.array([np.nan if v is None else v for v in cols["delta"]], dtype=float)
    value = cols["value"].astype(float)
    # PFC storm: 70 % of the time paused, 4000 pause frames/s; CNPs on the same NIC
    storm = (node == STORM[0]) & np.isin(step, list(STORM[2]))
    delta[storm & (dev == STORM[1]) & (met == "nic.rx_prio_pause_duration")] = 700_000.0
    delta[storm & (dev == STORM[1]) & (met == "nic.rx_prio_pause")] = 4_000.0
    delta[storm & (dev == "mlx5_5/1") & (met == "rdma.np_cnp_sent")] = 2_500.0
    # thermal throttling: SW_THERMAL | HW_THERMAL, SM clock down to 1100 MHz
    thr = (node == THROTTLE[0]) & (dev == THROTTLE[1]) & np.isin(step, list(THROTTLE[2]))
    value[thr & (met == "gpu.clock_event_reasons")] = 96.0
    value[thr & (met == "gpu.sm_clock")] = 1100.0
    off = t.column("clock_offset_ns").to_numpy().copy()
    err = t.column("clock_error_ns").to_numpy().copy()
    jump = (node == CLOCK_STEP[0]) & (step >= CLOCK_STEP[1])
    off[jump] += CLOCK_STEP[2]
    err[jump] = 5_000_000
    reset = t.column("reset").to_numpy(zero_copy_only=False).copy()
    reset[
        (node == "node001") & (dev == "mlx5_0/1") & (met == "ib.port_rcv_data") & (step == 90)
    ] = True
    gap = (node == "node002") & (met == "cpu.busy") & (step >= 40) & (step < 55)
    rate = delta / 1.0
    for name, arr in (
        ("value", pa.array(value)),
        ("delta", pa.array(delta, mask=np.isnan(delta))),
        ("rate", pa.array(rate, mask=np.isnan(rate))),
        ("clock_offset_ns", pa.array(off)),
        ("clock_error_ns", pa.array(err)),
        ("reset", pa.array(reset)),
    ):
        i = t.schema.get_field_index(name)
        t = t.set_column(i, t.schema.field(i), arr.cast(t.schema.field(i).type))
    return t.filter(pa.array(~gap))


def _dead_letters(writer: LakeWriter) -> None:
    schema = DATASETS["deadletter"].schema
    rows = [
        {
            "ts": T0 + i * 10**9,
            "reason": reason,
            "detail": "x",
            "topic": "telemetry.raw",
            "partition": 1,
            "offset": 100 + i,
            "node": "node001",
            "scope": "samples",
            "samples": 7,
            "ts_ns": T0 + i * 10**9,
            "kafka_partition": 0,
            "kafka_offset": 10 + i,
        }
        for i, reason in enumerate(["unknown_metric"] * 3 + ["bad_envelope"] * 2)
    ]
    t = pa.Table.from_pylist([{k: r.get(k) for k in schema.names} for r in rows], schema=schema)
    writer.land("deadletter", t, partition=0, first=10, last=14)


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lake")
    w = LakeWriter(root)
    w.ensure_seeds()
    synth.land_lake(w, _inject(synth.refined_samples(NODES, SECONDS)), chunk_rows=20_000)
    _dead_letters(w)
    return root


def test_report_html_references_nothing_outside_the_file(lake: Path) -> None:
    page = build_report(lake)
    assert not re.search(r"""(?:src|href|action)\s*=\s*["']?\s*(?:[a-z]+:|//)""", page, re.I)
    assert not re.search(r"https?://|@import|url\(\s*['\"]?(?!#)", page, re.I)
    assert page.count('class="panel"') == 5 and "<script src" not in page


# --- a minimal DevTools-protocol client ------------------------------------------------------


CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",  # this machine's closed network refuses them
    "--disable-component-update",
    "--disable-sync",
    "--remote-debugging-port=0",
    "--window-size=1280,2000",
)


class Browser:
    """One page of a headless Chromium, over a DevTools websocket (flattened session).
    Every event received is kept in ``events`` until the next :meth:`open`."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.events: list[dict[str, Any]] = []
        self._id = 0
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        attached = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})
        self.session = attached["sessionId"]
        for domain in ("Runtime", "Log", "Page"):
            self.call(f"{domain}.enable", session=True)

    def call(
        self,
        method: str,
        params: dict[str, Any] | None = None,
        *,
        session: bool = False,
        timeout: float = 30,
    ) -> dict[str, Any]:
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = self.session
        self.ws.send(json.dumps(msg))
        deadline = time.monotonic() + timeout
        while True:
            reply = json.loads(self.ws.recv(timeout=max(deadline - time.monotonic(), 0.01)))
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                result: dict[str, Any] = reply.get("result", {})
                return result
            self.events.append(reply)

    def open(self, url: str, timeout: float = 30) -> None:
        """Navigate, wait for the load event and two animation frames (layout done)."""
        self.events.clear()
        self.call("Page.navigate", {"url": url}, session=True)
        deadline = time.monotonic() + timeout
        while not any(e.get("method") == "Page.loadEventFired" for e in self.events):
            self.events.append(json.loads(self.ws.recv(timeout=deadline - time.monotonic())))
        self.eval("new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")

    def eval(self, expr: str) -> Any:
        params = {"expression": expr, "returnByValue": True, "awaitPromise": True}
        r = self.call("Runtime.evaluate", params, session=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expr}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def errors(self) -> list[dict[str, Any]]:
        """Uncaught exceptions, console.error/assert calls and error log entries so far."""
        out = []
        for e in self.events:
            m, p = e.get("method"), e.get("params", {})
            if (
                m == "Runtime.exceptionThrown"
                or (m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"))
                or (m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error")
            ):
                out.append(e)
        return out


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not CHROMIUM.exists():
        pytest.skip("/usr/bin/chromium is absent (install it: apt-get install -y chromium)")
    from websockets.sync.client import connect

    user_dir = Path(tempfile.mkdtemp(prefix="refinery-chromium-"))
    proc = subprocess.Popen(
        [str(CHROMIUM), *CHROMIUM_FLAGS, f"--user-data-dir={user_dir}", "about:blank"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        port_file = user_dir / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not (port_file.exists() and len(port_file.read_text().splitlines()) >= 2):
            assert proc.poll() is None, f"chromium exited with {proc.returncode}"
            assert time.monotonic() < deadline, "chromium did not open its DevTools port"
            time.sleep(0.05)
        port, path = port_file.read_text().splitlines()[:2]
        with connect(f"ws://127.0.0.1:{port}{path}", max_size=None, open_timeout=10) as ws:
            yield Browser(ws)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(user_dir, ignore_errors=True)


def _report(lake: Path, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "report",
            "--lake",
            str(lake),
            "--out",
            str(out),
            *args,
        ],
        cwd=REPO,
        env={**os.environ, "REFINERY_HOME": str(out.parent)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def _attrs(b: Browser, selector: str) -> list[dict[str, str]]:
    return list(
        b.eval(
            f"Array.from(document.querySelectorAll({json.dumps(selector)})).map(e => "
            "Object.fromEntries(Array.from(e.attributes).filter(a => a.name.startsWith('data-'))"
            ".map(a => [a.name.slice(5), a.value])))"
        )
    )


@pytest.mark.slow
def test_report_renders_in_chromium_with_the_lake_numbers(
    lake: Path, browser: Browser, tmp_path: Path
) -> None:
    out = tmp_path / "report.html"
    t = time.monotonic()
    r = _report(lake, out)
    took = time.monotonic() - t
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(out) and took < 30
    browser.open(out.as_uri())
    assert browser.errors() == []
    boxes = browser.eval(
        "Array.from(document.querySelectorAll('section.panel')).map(e => {"
        "const r = e.getBoundingClientRect(); return [e.id, e.dataset.state, r.width, r.height,"
        " e.querySelectorAll('svg').length]; })"
    )
    assert [b[0] for b in boxes] == [
        f"panel-{p}" for p in ("congestion", "stragglers", "gpu", "clocks", "quality")
    ]
    for pid, state, w, h, svgs in boxes:
        assert state == "data" and w > 600 and h > 150 and svgs >= 1, (pid, state, w, h, svgs)
    bucket = int(browser.eval("document.body.dataset.bucketNs"))
    con = sqlload.connect(lake)
    sqlload.refresh(con)

    # (1) the storm: paused % of its switch port per bucket, as DuckDB sums it
    rows = con.execute(
        "SELECT ts // $b * $b AS t, sum(delta) / ($b / 1e3) * 100 FROM rates WHERE node = $n"
        " AND device = $d AND metric = 'nic.rx_prio_pause_duration' GROUP BY ALL ORDER BY 2 DESC",
        {"b": bucket, "n": STORM[0], "d": STORM[1]},
    ).fetchall()
    cells = {
        (c["row"], int(c["t"])): float(c["value"])
        for c in _attrs(browser, "rect.cell[data-series=paused_pct]")
    }
    leaf = con.execute(
        "SELECT any_value(leaf) || ':' || any_value(leaf_port) FROM samples "
        "WHERE node = $n AND device = $d",
        {"n": STORM[0], "d": STORM[1]},
    ).fetchone()
    row = next(k for k in {k[0] for k in cells} if k.endswith(leaf[0]))
    for t, pct in rows[:5]:
        assert cells[(row, t)] == pytest.approx(pct, rel=1e-6)
    assert rows[0][1] > 60
    storms = _attrs(browser, "rect.storm")
    assert any(s["node"] == STORM[0] and s["device"] == STORM[1] for s in storms)
    assert len(storms) == len(sqlload.run_query(con, "pfc_storms").fetchall())

    # (2) stragglers: every late arrival, its skew, and the pauses on its path
    late = con.execute(
        "SELECT rank, op_seq, (ts_ns - min(ts_ns) OVER w) / 1e6 AS skew FROM collectives"
        " WHERE job = 'job-1001' WINDOW w AS (PARTITION BY comm, op, op_seq) QUALIFY skew > 5"
    ).fetchall()
    dots = {
        (int(d["rank"]), int(d["op-seq"])): float(d["value"])
        for d in _attrs(browser, "circle.straggler")
    }
    assert dots == pytest.approx({(r, s): k for r, s, k in late}, rel=1e-9) and len(dots) == 20
    path = {
        int(p["t"]): float(p["value"])
        for p in _attrs(browser, "circle.pt[data-series='PFC pause frames/s']")
    }
    in_storm = (T0 + 14_500_000_000) // bucket * bucket  # a bucket well inside the storm
    assert path[in_storm] == pytest.approx(4000.0)

    # (3) GPU: SM clock per bucket and seconds per cause
    sm = con.execute(
        "SELECT ts // $b * $b AS t, avg(value) FROM samples WHERE node = $n AND device = $g"
        " AND metric = 'gpu.sm_clock' GROUP BY ALL",
        {"b": bucket, "n": THROTTLE[0], "g": THROTTLE[1]},
    ).fetchall()
    pts = {
        int(p["t"]): float(p["value"])
        for p in _attrs(browser, f"circle.pt[data-series='{THROTTLE[0]} {THROTTLE[1]}']")
    }
    assert pts == pytest.approx(dict(sm), rel=1e-9) and min(pts.values()) == 1100.0
    by_cause: dict[str, float] = {}
    for r in sqlload.run_query(con, "gpu_throttling_by_cause").fetchall():
        by_cause[r[2]] = by_cause.get(r[2], 0.0) + r[4]
    shown = {c["cause"]: float(c["seconds"]) for c in _attrs(browser, "g.cause-total")}
    assert shown == pytest.approx(by_cause) and shown["HW_THERMAL"] > 15
    hot = [c for c in _attrs(browser, "rect.reason") if c["node"] == THROTTLE[0]]
    thermal = {int(c["t"]) for c in hot if c["gpu"] == "gpu3" and "HW_THERMAL" in c["causes"]}
    assert {(T0 + s * 10**9) // bucket * bucket for s in THROTTLE[2][1:-1]} <= thermal

    # (4) clock offsets: the stepped source, per bucket
    off = con.execute(
        "SELECT ts // $b * $b AS t, avg(clock_offset_ns) / 1e6 FROM samples WHERE node = $n"
        " AND exporter = 'node' GROUP BY ALL",
        {"b": bucket, "n": CLOCK_STEP[0]},
    ).fetchall()
    pts = {
        int(p["t"]): float(p["value"])
        for p in _attrs(browser, f"circle.pt[data-series='{CLOCK_STEP[0]}/node/0']")
    }
    assert pts == pytest.approx(dict(off), rel=1e-9) and max(pts.values()) > 250

    # (5) data quality: accounting, dead letters, gaps and resets
    acc = con.execute("SELECT raw_partition, input_samples FROM lake_accounting").fetchall()
    bars = {int(g["partition"]): int(g["input"]) for g in _attrs(browser, "g[data-partition]")}
    assert bars == {p: n for p, n in acc if p in bars} and 0 in bars
    dead = {d["label"]: float(d["value"]) for d in _attrs(browser, "rect[data-series=records]")}
    assert dead == {"unknown_metric": 3.0, "bad_envelope": 2.0, "non_finite": 1.0}
    checks = {c["label"]: float(c["value"]) for c in _attrs(browser, "rect[data-series=count]")}
    assert checks["reset"] == 1.0 and checks["gap"] >= 1.0 and checks["deadletter"] == 6.0


@pytest.mark.slow
def test_report_filters_and_empty_window(lake: Path, browser: Browser, tmp_path: Path) -> None:
    out = tmp_path / "empty.html"
    r = _report(lake, out, "--from", "2030-01-01T00:00:00", "--to", "2030-01-01T01:00:00")
    assert r.returncode == 0, r.stderr
    browser.open(out.as_uri())
    assert browser.errors() == []
    states = browser.eval(
        "Array.from(document.querySelectorAll('section.panel')).map(e => [e.dataset.state,"
        " e.textContent.includes('no data in this range'), e.getBoundingClientRect().height])"
    )
    assert len(states) == 5 and all(s == "empty" and msg and h > 40 for s, msg, h in states)

    out = tmp_path / "job.html"
    r = _report(
        lake,
        out,
        "--job",
        "job-1001",
        "--from",
        "2026-01-01T00:00:00",
        "--to",
        "2026-01-01T00:00:30",
    )
    assert r.returncode == 0, r.stderr
    browser.open(out.as_uri())
    assert browser.errors() == []
    assert browser.eval("document.body.dataset.job") == "job-1001"
    ts = [int(c["t"]) for c in _attrs(browser, "[data-t]")]
    end = T0 + 30 * 10**9
    assert ts and all(t < end for t in ts)
    con = sqlload.connect(lake)
    sqlload.refresh(con)
    late = con.execute(
        "SELECT rank, op_seq FROM collectives WHERE job = 'job-1001' AND ts_ns >= $s"
        " AND ts_ns < $e WINDOW w AS (PARTITION BY comm, op, op_seq)"
        " QUALIFY ts_ns - min(ts_ns) OVER w > 5e6",
        {"s": T0, "e": end},
    ).fetchall()
    dots = {(int(d["rank"]), int(d["op-seq"])) for d in _attrs(browser, "circle.straggler")}
    assert dots == set(late) and len(dots) >= 15


def test_report_on_missing_or_empty_lake_is_one_line_and_non_zero(tmp_path: Path) -> None:
    for lake in (tmp_path / "missing", tmp_path / "empty"):
        if lake.name == "empty":
            lake.mkdir()
        out = tmp_path / f"{lake.name}.html"
        r = _report(lake, out)
        assert r.returncode == 1 and r.stdout == ""
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
        assert not out.exists()
    r = _report(tmp_path / "empty", tmp_path / "x.html", "--from", "yesterday")
    assert r.returncode == 2 and "ISO 8601" in r.stderr
