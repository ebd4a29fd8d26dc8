"""One build step on top of pyproject.toml: the Helm chart ships inside the wheel.

``charts/biggraph`` stays where it is (the source of truth, what helm and the image use); a regular build copies it
into the package as ``job/k8s/_bundled/charts/biggraph``, where ``job.k8s.render`` finds it in an installed package
(``biggraph submit`` renders it with helm). An editable install (and a checkout on PYTHONPATH) reads the checkout's
folder instead, so there is one copy to edit. ``k8s/base`` (for ``kubectl apply -k``) is not needed by the package.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
BUNDLED = ("charts/biggraph",)  # relative to the repository root, and to job/k8s/_bundled/
TARGET = Path("job", "k8s", "_bundled")


class BuildPyWithManifests(build_py):
    """build_py, then the chart copied into the built package (not for an editable install)."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        for relative in BUNDLED:
            source = ROOT / relative
            if not (source.is_dir() and any(source.iterdir())):
                raise SystemExit(f"{source}: missing; the wheel must ship it (biggraph submit renders it)")
            target = Path(self.build_lib) / TARGET / relative
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.py[cod]"))


setup(cmdclass={"build_py": BuildPyWithManifests})
