"""Rank 0's link against the pods of a Freebase86m group, dense against sparse shared parameters (issue #45): the
paper model of bench/RESULTS.md, "Sparse shared parameters". Per bucket a pod moves 2 x 11.86 MB dense, or its
rows twice (out: the rows it changed; in: the rows its next bucket reads; 800 bytes a relation, parameters and
Adagrad sums, as ``lock_server_bench.py`` lays them out), the rows being those of the bucket's E / P² edges
drawn from a Zipf law over the 14,824 relations (an assumption, as in the bench). P = 2M; T_b = E / (P² r).

    .venv/bin/python bench/sparse_link_model.py --zipf 1.5
"""

from __future__ import annotations

import argparse

import numpy as np

EDGES, RELATIONS, ROW_BYTES = 338e6, 14_824, 200 * 4
RATES = {"CPU pod": 198.7e3, "H100 pod": 1.22e6}  # edges/s (bench/RESULTS.md: the Freebase-size stretch, the GPU runs)
LINKS = {"10 Gb/s": 1.25e9, "100 Gb/s": 12.5e9}  # bytes/s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--zipf", type=float, default=1.5)
    parser.add_argument("--pods", default="8,16,32,64,128")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    weights = 1.0 / np.arange(1, RELATIONS + 1) ** args.zipf
    weights /= weights.sum()
    dense = 2 * RELATIONS * ROW_BYTES
    for pods in (int(p) for p in args.pods.split(",")):
        parts = 2 * pods
        edges = EDGES / parts**2
        rows = RELATIONS if edges > 2e6 else np.unique(rng.choice(RELATIONS, size=int(edges), p=weights)).size
        sparse = dense if 2 * rows > RELATIONS else 2 * rows * ROW_BYTES  # past half the vector: dense (SPARSE_AT_MOST)
        for rate_name, rate in RATES.items():
            bucket_s = edges / rate
            loads = {link: (round(pods * dense / bucket_s / bw, 2), round(pods * sparse / bucket_s / bw, 2))
                     for link, bw in LINKS.items()}
            print(f"{pods} pods, P={parts}: {edges:,.0f} edges, {rows} rows a bucket, {rate_name}: T_b "
                  f"{bucket_s * 1e3:.1f} ms, {sparse / 1e3:.0f} KB a bucket; rank 0's link load dense -> sparse {loads}")


if __name__ == "__main__":
    main()
