"""Two build steps on top of pyproject.toml: the Helm chart ships inside the wheel, and so do the native kernels.

``charts/biggraph`` stays where it is (the source of truth, what helm and the image use); a regular build copies it
into the package as ``job/k8s/_bundled/charts/biggraph``, where ``job.k8s.render`` finds it in an installed package
(``biggraph submit`` renders it with helm). An editable install (and a checkout on PYTHONPATH) reads the checkout's
folder instead, so there is one copy to edit. ``k8s/base`` (for ``kubectl apply -k``) is not needed by the package.

The kernels (``job/native``'s C files) are an ``Extension`` built to ``job/native/_ext/kernels.so``: a plain shared
library loaded through ctypes (no Python C API, so one file serves every Python 3 and the wheel is tagged
``py3-none-<platform>``), with per-CPU clones of the hot loops (``bg_clones.h``). So a wheel installed where there
is no compiler runs them. The extension is optional: a source install without a compiler still installs, and
``job.native`` then builds the kernels at run time if it finds one, else uses torch ops.
``BIGGRAPH_NATIVE_CLONES=0`` builds them without clones (the baseline of bench/ab_bench.py's comparison).
"""

from __future__ import annotations

import os
import runpy
import shutil
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel

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


# job/native/sources.py by path: the package itself is not importable while it is being built
NATIVE = runpy.run_path(str(ROOT / "job" / "native" / "sources.py"))
KERNELS = "job.native._ext.kernels"


def kernels_extension() -> Extension:
    def relative(paths: tuple[Path, ...]) -> list[str]:
        return [str(path.relative_to(ROOT)) for path in paths]

    clones = os.environ.get("BIGGRAPH_NATIVE_CLONES", "1").strip().lower() not in ("0", "false", "no", "off")
    return Extension(KERNELS, sources=relative(NATIVE["SOURCES"]), depends=relative(NATIVE["HEADERS"]),
                     extra_compile_args=[*NATIVE["COMPILE_FLAGS"], NATIVE["digest_define"](NATIVE["source_digest"]())],
                     libraries=list(NATIVE["LIBRARIES"]), define_macros=[] if clones else [("BG_NO_CLONES", "1")],
                     optional=True)


class BuildKernels(build_ext):
    """build_ext, the kernels' library named ``job/native/_ext/kernels.so``: not a Python module (no EXT_SUFFIX),
    in a directory that is no package, so that nothing imports it by mistake; job.native loads it by path."""

    def get_ext_filename(self, fullname: str) -> str:
        # asked with the dotted name (in-place copies) and with its last part alone (distutils' get_ext_fullpath)
        *package, name = fullname.split(".")
        if name == KERNELS.rsplit(".", 1)[1] and package in ([], KERNELS.split(".")[:-1]):
            return str(Path(*package, NATIVE["BUILT_RELATIVE"].name))
        return super().get_ext_filename(fullname)

    def copy_extensions_to_source(self) -> None:
        # an in-place (editable) build: the library's directory is no package, so nothing has created it yet
        (ROOT / "job" / "native" / NATIVE["BUILT_RELATIVE"].parent).mkdir(exist_ok=True)
        super().copy_extensions_to_source()


class PlatformWheel(bdist_wheel):
    """The wheel runs on any Python 3 of its platform: the library uses libc only, not Python's ABI."""

    def get_tag(self) -> tuple[str, str, str]:
        _, _, platform = super().get_tag()
        return "py3", "none", platform


setup(ext_modules=[kernels_extension()],
      cmdclass={"build_py": BuildPyWithManifests, "build_ext": BuildKernels, "bdist_wheel": PlatformWheel})
