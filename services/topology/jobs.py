"""Job placement (:class:`~schemas.records.JobPlacement`) from a YAML/JSON file or from Slurm
``scontrol show job [-d]`` text.

YAML/JSON: one object, a list of them, or ``{"jobs": [...]}``; fields as JobPlacement, with
``start``/``end`` accepted as ISO-8601 times for ``start_ns``/``end_ns`` and ``nodes`` as a list
or a Slurm hostlist string::

    jobs:
      - job: "4242"
        start: 2025-02-23T16:00:00Z
        nodes: gpu[01-02]
        ranks: [{rank: 0, node: gpu01, gpu: gpu0}, ...]

``scontrol show job`` text: records separated by blank lines, ``Key=Value`` tokens. Used:
``JobId``, ``JobName``, ``UserId`` (``alice(1000)`` → ``alice``), ``StartTime``, ``EndTime``
(``Unknown``/``None`` → open), ``NodeList``, and from ``-d`` output the per-node
``Nodes=… GRES=gpu:8(IDX:0-7)`` lines. Ranks are then laid out node-major in NodeList order,
GPU index order within a node (the layout ``srun --ntasks-per-node=<gpus>`` gives); without
GRES detail no ranks are invented. Slurm prints local time without a zone: pass ``tz`` (default
UTC). Pending jobs (no StartTime) are skipped and named in the problems list.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import UTC, datetime, tzinfo
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from schemas.errors import ConfigError
from schemas.records import JobPlacement, RankPlacement
from services.topology.slurm import expand_hostlist
from services.topology.topofile import load_document, parse_time_ns

_OPEN_TIMES = frozenset({"", "unknown", "none", "n/a"})


def _job_from_mapping(raw: Mapping[str, Any], where: str) -> JobPlacement:
    d = dict(raw)
    if "start" in d:
        d["start_ns"] = parse_time_ns(d.pop("start"))
    elif isinstance(d.get("start_ns"), str):
        d["start_ns"] = parse_time_ns(d["start_ns"])
    if "end" in d:
        end = d.pop("end")
        d["end_ns"] = None if end is None else parse_time_ns(end)
    if isinstance(d.get("nodes"), str):
        d["nodes"] = expand_hostlist(d["nodes"])
    if "job" in d:
        d["job"] = str(d["job"])
    try:
        return JobPlacement.model_validate(d)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"]) or "job"
        raise ConfigError(f"{where}: {loc}: {err['msg']}") from e


def jobs_from_document(doc: object) -> list[JobPlacement]:
    """JobPlacements from a parsed YAML/JSON document; ConfigError naming the entry."""
    if isinstance(doc, Mapping) and "jobs" in doc:
        doc = doc["jobs"]
    items = doc if isinstance(doc, list) else [doc]
    out = []
    for i, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise ConfigError(f"jobs[{i}]: expected a mapping, got {type(item).__name__}")
        out.append(_job_from_mapping(item, f"jobs[{i}]"))
    return out


def _slurm_time(value: str, tz: tzinfo) -> int | None:
    if value.strip().lower() in _OPEN_TIMES:
        return None
    try:
        dt = datetime.fromisoformat(value)
    except ValueError as e:
        raise ConfigError(f"not a Slurm time: {value!r}") from e
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=tz)
    return int(dt.timestamp()) * 1_000_000_000 + dt.microsecond * 1000


_GRES_IDX = re.compile(r"gpu(?::[\w-]+)?:\d+\(IDX:([\d,\-]+)\)")


def _gpu_indices(idx: str) -> list[int]:
    out: list[int] = []
    for part in idx.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def parse_scontrol(text: str, tz: tzinfo = UTC) -> tuple[list[JobPlacement], list[str]]:
    """Parse ``scontrol show job [-d]`` output → (jobs, problems). ConfigError on a record
    that has a JobId but a malformed time or node list."""
    jobs: list[JobPlacement] = []
    problems: list[str] = []
    for record in re.split(r"\n\s*\n", text.strip()):
        if "JobId=" not in record:
            continue
        fields: dict[str, str] = {}
        gpus_by_node: dict[str, list[int]] = {}
        for line in record.splitlines():
            toks = line.split()
            kv = dict(t.partition("=")[::2] for t in toks if "=" in t)
            if toks and toks[0].startswith("Nodes=") and "GRES" in line:
                m = _GRES_IDX.search(line)
                if m:
                    for node in expand_hostlist(kv["Nodes"]):
                        gpus_by_node[node] = _gpu_indices(m.group(1))
                continue
            for k, v in kv.items():
                fields.setdefault(k, v)
        job = fields["JobId"]
        try:
            start = _slurm_time(fields.get("StartTime", ""), tz)
            end = _slurm_time(fields.get("EndTime", ""), tz)
            nodes = expand_hostlist(fields.get("NodeList", "")) if fields.get("NodeList") else []
        except ConfigError as e:
            raise ConfigError(f"job {job}: {e}") from e
        state = fields.get("JobState", "")
        if start is None or not nodes or state == "PENDING":
            problems.append(f"job {job}: not started ({state or 'no StartTime/NodeList'}), skipped")
            continue
        if state in ("RUNNING", "SUSPENDED", "CONFIGURING"):
            end = None  # EndTime of a running job is its time limit, not an end
        ranks: list[RankPlacement] = []
        if gpus_by_node:
            for node in nodes:
                for g in gpus_by_node.get(node, []):
                    ranks.append(RankPlacement(rank=len(ranks), node=node, gpu=f"gpu{g}"))
        user = fields.get("UserId", "").split("(", 1)[0] or None
        jobs.append(
            JobPlacement(
                job=job,
                start_ns=start,
                end_ns=end,
                user=user,
                name=fields.get("JobName") or None,
                nodes=nodes,
                ranks=ranks,
            )
        )
    return jobs, problems


def load_jobs(path: Path, tz: tzinfo = UTC) -> tuple[list[JobPlacement], list[str]]:
    """Read a jobs file in either form (``scontrol`` text is recognised by ``JobId=``)."""
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from e
    if re.search(r"^\s*JobId=\d", text, re.MULTILINE):
        return parse_scontrol(text, tz)
    return jobs_from_document(load_document(path)), []
