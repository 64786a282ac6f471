"""Where the product's data files are: ``deploy/``'s topic, ACL and rule specs and ``sql/``'s
DuckDB scripts, in the layout the repository has them.

They live at the top of the repository, where users edit them (and run ``sql/init.sql`` with
plain DuckDB from there). A checkout or an editable install reads them there, so an edit takes
effect without reinstalling. A regular install (the image's ``pip install '.[gpu]'``) has no
repository beside site-packages: building the wheel copies them (setup.py) into
``services/_data/``, and they are read from there, wherever the package is installed.

Both are plain directories beside this module, so the paths are real files: the specs' loaders
take a :class:`~pathlib.Path`, and ``sql/init.sql``'s ``.read sql/...`` lines resolve against
the root. (A zipped install would need importlib.resources' ``as_file``; we ship none.)
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def data_root() -> Path:
    """The directory that holds ``deploy/`` and ``sql/``: the copy installed with the package
    when there is one, else the repository around this package. Never raises; the files
    themselves are not checked."""
    packaged = _PACKAGE / "_data"
    return packaged if packaged.is_dir() else _PACKAGE.parent


def data_path(*parts: str) -> Path:
    """``parts`` under :func:`data_root`, e.g. ``data_path("deploy", "topics.yaml")``."""
    return data_root().joinpath(*parts)
