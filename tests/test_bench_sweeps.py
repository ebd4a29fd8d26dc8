"""The GPU sweep files (bench/sweeps/*.txt, bench/device_check.sh's SWEEP_FILE) hold configs the trainer accepts.

Device time is short (minutes per task): a variant whose overrides the config refuses would fail in its first
second on the GPU and waste the slot. Each line's overrides are applied to the config bench/wn18rr_bench.py writes
and parsed here, as ``biggraph train -p ...`` would.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from job.config import load_config

ROOT = Path(__file__).resolve().parent.parent
SWEEPS = sorted((ROOT / "bench" / "sweeps").glob("*.txt"))


def _variants(path: Path) -> list[tuple[str, list[str]]]:
    lines = [line.split() for line in path.read_text().splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(words[0], words[1:]) for words in lines]


@pytest.mark.parametrize("sweep", SWEEPS, ids=[p.name for p in SWEEPS])
def test_every_variant_parses(sweep: Path, tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from wn18rr_bench import base_config
    finally:
        sys.path.remove(str(ROOT / "bench"))
    variants = _variants(sweep)
    assert variants, f"{sweep.name}: no variants"
    labels = [label for label, _ in variants]
    assert len(set(labels)) == len(labels), f"{sweep.name}: a label repeats (each writes its own log)"
    for label, overrides in variants:
        path = tmp_path / f"{label}.json"
        path.write_text(json.dumps(base_config(tmp_path, label, 35)))
        config = load_config(str(path), ["device=cuda", *overrides])
        assert config.preset == "quality", label
