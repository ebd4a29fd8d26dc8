"""Quality (filtered MRR, all candidates, both sides) of a config on UMLS, Kinships and Nations.

The quality preset's experiments (docs/quality-preset.md): each run imports the dataset once (as
bench/train_bench.py does), trains biggraph with the base knowledge-graph config of train_bench plus
the given overrides, and scores the test split against every entity, filtering train, valid and test.
It prints one JSON line per run: dataset, overrides, epochs, training seconds (the sum of the
per-bucket training times of training_stats.json: I/O, start-up and evaluation excluded) and MRR.

    .venv/bin/python bench/quality_bench.py --datasets umls,nations,kinships -p preset=quality
    .venv/bin/python bench/quality_bench.py --datasets umls -p num_epochs=25  # PBG's recipe, as train_bench

Timing figures are only comparable on a quiet machine; quality figures are not affected by load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.train_bench import import_kg, kg_config, ours_compute_rate  # noqa: E402
from job.config import load_config  # noqa: E402
from job.evaluation import evaluate  # noqa: E402


def import_dataset(name: str, root: Path) -> None:
    """The dataset's three splits as PBG input (one entity type, dynamic relations), once per work dir."""
    from job.data.datasets import dataset_dir

    if (root / "data" / "test").exists():
        return
    root.mkdir(parents=True, exist_ok=True)
    import_kg(dataset_dir(name), root)


def run(name: str, root: Path, overrides: list[str], label: str, minimal: bool) -> dict[str, Any]:
    """Train with the base config plus ``overrides`` (key=value, as `biggraph train -p`); score the test split."""
    config = kg_config(root, 25, 1)
    if minimal:  # what a preset fills in is left out (keys a config sets win over its preset)
        for key in ("lr", "batch_size", "num_batch_negs", "num_uniform_negs", "loss_fn", "comparator", "global_emb"):
            config.pop(key)
    config["checkpoint_path"] = str(root / f"ckpt_{label}")
    path = root / f"config_{label}.json"
    path.write_text(json.dumps(config))
    args = [sys.executable, "-m", "job", "train", str(path)]
    for item in overrides:
        args += ["-p", item]
    subprocess.run(["rm", "-rf", config["checkpoint_path"]], check=True)
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))))
    _, seconds = ours_compute_rate(config["checkpoint_path"])
    epoch_times = bucket_times(config["checkpoint_path"])
    filters = [str(root / "data" / s) for s in ("train", "valid", "test")]
    loaded = load_config(str(path), [*overrides, f"edge_paths={root / 'data' / 'test'}"])
    mrr = float(evaluate(loaded, filter_paths=filters, candidates="all")["mrr"])
    epochs = loaded.num_epochs
    # one checkpoint version per epoch on these one-partition graphs: the snapshots give MRR along the way
    interval = loaded.checkpoint_preservation_interval
    along = {epoch: round(float(evaluate(loaded, filter_paths=filters, candidates="all", version=epoch)["mrr"]), 4)
             for epoch in range(interval, epochs, interval)} if interval else {}
    # on a loaded machine the fastest epoch times the epochs is the closer guess of a quiet machine's time
    return {"dataset": name, "overrides": overrides, "epochs": epochs, "train_s": round(seconds, 2),
            "min_epoch_x_epochs_s": round(min(epoch_times) * epochs, 2), "mrr": round(mrr, 4),
            **({"mrr_at_epoch": along} if along else {})}


def bucket_times(checkpoint_path: str) -> list[float]:
    """The training seconds of each bucket (one per epoch on these unpartitioned graphs)."""
    with open(os.path.join(checkpoint_path, "training_stats.json")) as handle:
        records = [json.loads(line) for line in handle]
    return [r["time"] for r in records if "lhs_partition" in r]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", default="umls,nations,kinships")
    parser.add_argument("-p", "--param", action="append", default=[], help="config override key=value")
    parser.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "biggraph-quality"))
    parser.add_argument("--label", default="run")
    parser.add_argument("--minimal", action="store_true",
                        help="leave the recipe keys (lr, batch size, negatives, loss) to the config's preset")
    args = parser.parse_args()
    for name in args.datasets.split(","):
        root = Path(args.work) / name
        import_dataset(name, root)
        print(json.dumps(run(name, root, args.param, args.label, args.minimal)), flush=True)


if __name__ == "__main__":
    main()
