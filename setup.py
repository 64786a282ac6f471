"""Build hook: the wheel carries the product's data files under ``services/_data/``.

``deploy/``'s specs and ``sql/``'s scripts stay at the top of the repository, where users edit
them and run ``sql/init.sql`` with plain DuckDB. A regular install (the image's ``pip install
'.[gpu]'``) has no repository beside site-packages, so building the wheel copies them under the
package in the same relative layout (``sql/init.sql``'s ``.read sql/views/...`` lines still
resolve), and services/data_files.py reads them from there. An editable install copies nothing
and reads the repository's own files. Everything else about the build is in pyproject.toml;
MANIFEST.in puts the same files in the sdist.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
DATA = ["deploy/*.yaml", "deploy/rules/*.yaml", "sql/**/*.sql"]  # relative to ROOT
PACKAGED = Path("services", "_data")  # relative to the build's library directory


class BuildPyWithData(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        for pattern in DATA:
            for src in sorted(ROOT.glob(pattern)):
                dst = Path(self.build_lib, PACKAGED, src.relative_to(ROOT))
                self.mkpath(str(dst.parent))
                self.copy_file(str(src), str(dst))


setup(cmdclass={"build_py": BuildPyWithData})
