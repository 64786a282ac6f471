"""The product image's files, installed alone, make a working `refinery`: the files that
deploy/Dockerfile copies (read from its COPY lines, so this follows the Dockerfile) installed
into a fresh virtual environment where the lab is not importable, then `refinery --help` and
every product command's and sub-command's `--help`: exit 0, no traceback, no lab command;
and the commands that read deploy/'s specs and sql/'s scripts find them in the installed
package (setup.py's services/_data/), the copied tree deleted, output the same as here.

Installing every dependency from the index would take minutes: the fresh environment sees the
development environment's site-packages through a .pth file instead. A directory named in a
.pth file is added to sys.path without its own .pth files being run, so the editable install's
finder (``__editable__.telemetry_refinery-*.pth``, which maps ``lab`` to this checkout) stays
out; the test checks that it did. pip builds the wheel with this environment's setuptools when
it satisfies pyproject's build-system requirements, else in isolation, from the index (as
`make install` does).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.metadata import EntryPoint, PackageNotFoundError, entry_points, version
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from pipelines.detect.rule_config import load_rules
from schemas.catalog import default_catalog
from services.cli import COMMAND_GROUP, COMMAND_MODULES, build_parser, command_modules
from services.detect.detector import DEFAULT_RULES

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "Dockerfile"


def image_copies(dockerfile: Path = DOCKERFILE) -> list[tuple[list[str], str, str]]:
    """(sources relative to the build context, destination, WORKDIR then) of each COPY line
    of ``dockerfile``, in order; continuation lines joined, ``--flag`` options dropped."""
    text = dockerfile.read_text().replace("\\\n", " ")
    workdir = "/"
    out = []
    for line in text.splitlines():
        words = line.strip().split(None, 1)
        if not words or words[0].startswith("#"):
            continue
        rest = words[1] if len(words) > 1 else ""
        if words[0].upper() == "WORKDIR":
            workdir = str(Path(workdir, rest.strip()))
        elif words[0].upper() == "COPY":
            args = json.loads(rest) if rest.lstrip().startswith("[") else shlex.split(rest)
            args = [a for a in args if not a.startswith("--")]
            out.append((args[:-1], args[-1], workdir))
    return out


def copy_image_files(dest: Path) -> Path:
    """Copy what the Dockerfile's COPY lines copy from this checkout (the build context) into
    ``dest``, standing for the root of the image; return the directory they were copied into
    (the WORKDIR its ``pip install .`` runs in)."""
    workdirs = set()
    for sources, target, workdir in image_copies():
        workdirs.add(workdir)
        into = dest / Path(workdir, target).relative_to("/")
        for src in sources:
            path = REPO / src
            assert path.exists(), f"deploy/Dockerfile copies {src}, which is not in the repo"
            if path.is_dir():  # Docker copies a directory's contents into the target
                shutil.copytree(path, into, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                file = into / path.name if target.endswith("/") else into
                file.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, file)
    assert len(workdirs) == 1, f"COPY lines in several WORKDIRs: {workdirs}"
    return dest / workdirs.pop().lstrip("/")


PROBE = """
import argparse, contextlib, importlib.metadata, io, json, sys
out = {"meta_path": [type(f).__name__ for f in sys.meta_path]}
try:
    import lab
    out["lab"] = getattr(lab, "__file__", None) or str(lab.__path__)
except ModuleNotFoundError as e:
    out["lab"] = None
    out["lab_error"] = str(e)
import services, services.cli as cli
out["services"] = services.__file__
out["dist"] = str(importlib.metadata.distribution("telemetry-refinery")._path)

def walk(parser, path):
    found = [path]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += walk(sub, [*path, name])
    return found

out["help"] = {}
for path in walk(cli.build_parser(), []):
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            rc = cli.main([*path, "--help"])
        except SystemExit as e:
            rc = e.code
    out["help"][" ".join(path)] = [rc, stdout.getvalue(), stderr.getvalue()]
print(json.dumps(out))
"""


def _build_in_this_environment(pyproject: Path) -> bool:
    """Whether this environment's packages satisfy the build system's requirements, so that
    pip can build without fetching them (else it builds in isolation, from the index)."""
    for req in map(Requirement, tomllib.loads(pyproject.read_text())["build-system"]["requires"]):
        try:
            if version(req.name) not in req.specifier:
                return False
        except PackageNotFoundError:
            return False
    return True


def _env() -> dict[str, str]:
    drop = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV")
    return {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("REFINERY_")}


def _run(argv: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout
    )


@dataclass(frozen=True)
class ImageInstall:
    python: Path  # the fresh environment's interpreter
    purelib: str  # its site-packages
    cwd: Path  # neither this checkout nor the copied tree

    @property
    def refinery(self) -> Path:
        return self.python.parent / "refinery"


@pytest.fixture(scope="module")
def image_install(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ImageInstall]:
    """The image's files installed (not editable) into a fresh environment, then deleted, so
    that nothing but the installed package can be read."""
    tmp_path = tmp_path_factory.mktemp("image-install")
    root = copy_image_files(tmp_path / "image")
    assert not (root / "lab").exists()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    python = venv / "bin" / "python"
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    purelib = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                   elsewhere).stdout.strip()  # fmt: skip
    dev_site = sysconfig.get_path("purelib")
    (Path(purelib) / "dev-site-packages.pth").write_text(dev_site + "\n")

    pip = [str(python), "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed"]
    if _build_in_this_environment(root / "pyproject.toml"):
        pip.append("--no-build-isolation")
    p = _run([*pip, str(root)], elsewhere, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    shutil.rmtree(tmp_path / "image")
    yield ImageInstall(python, purelib, elsewhere)


@pytest.mark.slow
def test_the_image_files_alone_install_a_refinery_whose_commands_all_answer_help(
    image_install: ImageInstall, tmp_path: Path
) -> None:
    python, purelib, elsewhere = image_install.python, image_install.purelib, image_install.cwd
    p = _run([str(image_install.refinery), "--help"], elsewhere)
    assert p.returncode == 0 and p.stderr == "", p.stderr[-3000:]
    assert p.stdout.startswith("usage: refinery")

    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    p = _run([str(python), "-I", str(probe)], elsewhere)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout)
    assert got["lab"] is None and "No module named 'lab'" in got["lab_error"], got["lab"]
    assert not any("Editable" in f for f in got["meta_path"]), got["meta_path"]
    assert got["services"].startswith(purelib), got["services"]
    assert got["dist"].startswith(purelib), got["dist"]

    for command, (rc, out, err) in got["help"].items():
        assert rc == 0 and "Traceback" not in err and err == "", (command, rc, err[-1500:])
        assert out.startswith("usage: refinery"), (command, out[:200])
    # every command but the lab's, and sub-commands too
    image = {c for c in got["help"] if c and " " not in c}
    lab = {ep.name for ep in entry_points(group=COMMAND_GROUP)}
    dev = set(_top_level_commands())
    assert lab and lab <= dev
    assert image == dev - lab
    assert any(" " in c for c in got["help"])


DATA_PROBE = """
import json
from pipelines.detect.rule_config import load_rules
from schemas.catalog import default_catalog
from services.data_files import data_root
from services.detect.detector import DEFAULT_RULES
from services.lake.sqlload import SQL_DIR
reads = [line.split(None, 1)[1].strip() for line in (SQL_DIR / "init.sql").read_text().splitlines()
         if line.startswith(".read ")]
print(json.dumps({
    "root": str(data_root()),
    "rules": [r.name for r in load_rules(DEFAULT_RULES, default_catalog())],
    "reads": reads,
    "unread": [r for r in reads if not (SQL_DIR.parent / r).is_file()],
}))
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["topics", "list"], ["telemetry.raw", "telemetry.alerts"]),
        (["acls", "list"], ["User:refinery-alerts", "topic:telemetry.raw"]),
        (["query", "--list"], ["stragglers(", "data_quality("]),
    ],
)
def test_the_installed_image_lists_its_specs_and_queries_as_the_checkout_does(
    image_install: ImageInstall, argv: list[str], expected: list[str]
) -> None:
    p = _run([str(image_install.refinery), *argv], image_install.cwd)
    assert p.returncode == 0 and p.stderr == "", (argv, p.returncode, p.stderr[-3000:])
    assert all(name in p.stdout for name in expected), (argv, p.stdout[:1000])
    here = _run([str(Path(sys.executable).parent / "refinery"), *argv], image_install.cwd)
    assert here.returncode == 0 and p.stdout == here.stdout, argv


@pytest.mark.slow
def test_the_installed_image_loads_the_default_rules_and_the_sql_views_from_the_package(
    image_install: ImageInstall, tmp_path: Path
) -> None:
    probe = tmp_path / "data_probe.py"
    probe.write_text(DATA_PROBE)
    p = _run([str(image_install.python), "-I", str(probe)], image_install.cwd)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout)
    assert got["root"] == str(Path(image_install.purelib, "services", "_data")), got["root"]
    rules = [r.name for r in load_rules(DEFAULT_RULES, default_catalog())]
    assert got["rules"] == rules and "gpu_thermal_throttle" in rules, got["rules"]
    assert "sql/views/samples.sql" in got["reads"] and got["unread"] == [], got["unread"]


def _top_level_commands() -> list[str]:
    parser = build_parser()
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return [name for a in subs for name in a.choices]


def _offer(*modules: str) -> list[EntryPoint]:
    return [EntryPoint(name=m, value=m, group=COMMAND_GROUP) for m in modules]


def test_an_entry_point_whose_module_is_not_installed_is_skipped_and_no_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # its package missing (the image: no lab/), or the module itself missing from its package
    mods = command_modules(_offer("no_such_package_here.cli", "services.no_such_cli"))
    assert [m.__name__ for m in mods] == list(COMMAND_MODULES)
    # there, but what it imports is missing, or it fails otherwise: that surfaces
    (tmp_path / "cmd_needs_missing.py").write_text("import no_such_dependency_here\n")
    (tmp_path / "cmd_broken.py").write_text("from services.cli import no_such_name\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency_here"):
        command_modules(_offer("cmd_needs_missing"))
    with pytest.raises(ImportError, match="no_such_name"):
        command_modules(_offer("cmd_broken"))
    # the development install offers the lab's commands
    offered = {ep.module for ep in entry_points(group=COMMAND_GROUP)}
    assert "lab.broker_cli" in offered
    assert offered <= {m.__name__ for m in command_modules()}
