"""What the checksum manifests cost: CRC-32 of a multi-GB checkpoint partition against writing and reading it.

Writes one embeddings partition (``--rows`` x ``--dim`` float32 + row-wise Adagrad state) through
``CheckpointStorage`` and commits it, then reads it back with and without its manifest, and prints:

- the CRC-32 rate of this machine on that file (MB/s, page cache warm),
- write: ``save_entity_partition`` (HDF5 build + CRC-32 + rename) against the same without the CRC
  (the CRC's share of the write),
- read: ``load_entity_partition`` verified against the manifest, from a cold page cache when this
  process may drop it (root), against the same read with the manifest removed.

The alternation (A/B/A/B) and the ratios from one run follow bench/RESULTS.md's rules.

    .venv/bin/python bench/checksum_bench.py --rows 5000000 --dim 100 --repeats 2
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from job.formats import checkpoint as checkpoint_module
from job.formats.checkpoint import CheckpointStorage
from job.formats.checksums import checksum_file
from job.train.batch.optim import row_adagrad_state


def drop_page_cache() -> bool:
    """Cold reads need an empty page cache; only root can ask for one."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as handle:
            handle.write("3\n")
        return True
    except OSError:
        return False


def timed(func: Callable[[], Any]) -> float:
    started = time.perf_counter()
    func()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=5_000_000)
    parser.add_argument("--dim", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir on the root disk)")
    args = parser.parse_args()

    root = tempfile.mkdtemp(prefix="checksum-bench-", dir=args.dir)
    rng = np.random.default_rng(0)
    embeddings = rng.standard_normal((args.rows, args.dim), dtype=np.float32)
    state = row_adagrad_state(torch.from_numpy(rng.random(args.rows, dtype=np.float32)), 0.1, 5)
    real_checksum = checkpoint_module.checksum_file
    results: dict[str, list[float]] = {"write+crc": [], "write": [], "read verified": [], "read unverified": [],
                                       "crc warm": []}
    cold = False
    try:
        for repeat in range(args.repeats):
            for with_crc in (True, False):
                directory = os.path.join(root, f"r{repeat}-{int(with_crc)}")
                store = CheckpointStorage(directory)
                store.prepare()
                checkpoint_module.checksum_file = real_checksum if with_crc else (lambda path: (0, "00000000"))
                seconds = timed(lambda s=store: s.save_entity_partition(1, "node", 0, embeddings, state))
                checkpoint_module.checksum_file = real_checksum
                results["write+crc" if with_crc else "write"].append(seconds)
                if with_crc:
                    store.save_version(1)
                    path = store.partition_file(1, "node", 0)
                    results["crc warm"].append(timed(lambda p=path: checksum_file(p)))
                    for verified in (True, False):
                        if not verified:
                            os.rename(store.manifest_file(1), store.manifest_file(1) + ".off")
                        cold = drop_page_cache()
                        reader = CheckpointStorage(directory)
                        seconds = timed(lambda r=reader: r.load_entity_partition(1, "node", 0))
                        results["read verified" if verified else "read unverified"].append(seconds)
                shutil.rmtree(directory)
        size = args.rows * args.dim * 4 + args.rows * 4
        best = {k: min(v) for k, v in results.items()}
        cpu = torch.randn(2000, 2000)
        matmul = timed(lambda: [cpu @ cpu for _ in range(5)])
        print(f"partition {args.rows:,} x {args.dim} float32 + Adagrad state: {size / 1e9:.2f} GB; "
              f"best of {args.repeats}; matmul {5 * 2 * 2000**3 / matmul / 1e9:.0f} GFLOP/s; "
              f"reads from a {'cold' if cold else 'warm'} page cache")
        print(f"CRC-32 (page cache warm): {size / best['crc warm'] / 1e6:,.0f} MB/s")
        print(f"write: {best['write+crc']:.2f} s with the CRC vs {best['write']:.2f} s without "
              f"= {best['write+crc'] / best['write']:.3f}x ({size / best['write'] / 1e6:,.0f} MB/s written)")
        print(f"read:  {best['read verified']:.2f} s verified vs {best['read unverified']:.2f} s unverified "
              f"= {best['read verified'] / best['read unverified']:.3f}x")
        for key, values in results.items():
            print(f"  {key}: " + ", ".join(f"{v:.2f}" for v in values))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
