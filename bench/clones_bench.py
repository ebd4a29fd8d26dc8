"""The native kernels' own time, one checkout's build against another's: what do the per-CPU clones buy?

    BIGGRAPH_NATIVE_CLONES=0 python setup.py build_ext --inplace     # in the baseline checkout (a copy)
    .venv/bin/python bench/clones_bench.py --baseline /path/to/that/copy [--repeats 5]

bench/ab_bench.py gives the whole batch's answer; this one times the kernels alone, where the clones apply, so that
a gain too small to stand out of a batch's matrix products is still seen (or its absence shown). Each checkout's
kernels run in a child process with that checkout first on PYTHONPATH (the library ``job.native`` loads there is
that checkout's in-place build, reported with its clone level), the children alternated (A B B A ...) so that
machine load hurts both alike; per kernel the best of the runs' median call times, and baseline / candidate
ratios (above 1: the candidate is faster). The machine's float32 matmul rate is printed beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _median_seconds(call: Callable[[], object], prepare: Callable[[], None], calls: int) -> float:
    times = []
    for _ in range(calls):
        prepare()
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def worker(calls: int) -> None:
    """In the checkout on PYTHONPATH: time each kernel on a WordNet-sized batch (float32), print JSON."""
    import torch

    from job import native
    from job.native import kernels

    torch.manual_seed(0)
    loaded = native.loaded()
    assert loaded is not None, "no native kernels in this checkout"
    # row-wise Adagrad: ~42,000 gradient rows of 200 floats over a 100,000-row table (bench/RESULTS.md's batch)
    weight, state = torch.randn(100_000, 200), torch.rand(100_000)
    full_state = torch.rand(100_000, 200)
    ids = torch.randint(0, 100_000, (42_000,))
    grad_source, grad = torch.randn(42_000, 200), torch.empty(42_000, 200)
    slots = torch.empty(100_000, dtype=torch.int32)
    # a side's loss: 1,000 positives in chunks of 50 against their chunk and 50 uniform negatives
    batch_source, uniform_source = torch.randn(20, 50, 50), torch.randn(1000, 50)
    batch, uniform = torch.empty_like(batch_source), torch.empty_like(uniform_source)
    # ComplEx's operator on 2,000 rows of 200 (100 complex numbers), one relation
    rows, real, imag, out_grad = torch.randn(2000, 200), torch.randn(100), torch.randn(100), torch.randn(2000, 200)

    def fresh_grad() -> None:
        grad.copy_(grad_source)

    def fresh_blocks() -> None:
        batch.copy_(batch_source)
        uniform.copy_(uniform_source)

    def nothing() -> None:
        pass

    timings = {
        "row_adagrad": _median_seconds(lambda: kernels.row_adagrad(weight, state, [(ids, grad)], 0.1, 1e-10, slots),
                                       fresh_grad, calls),
        "full_adagrad": _median_seconds(
            lambda: kernels.row_adagrad(weight, full_state, [(ids, grad)], 0.1, 1e-10, slots), fresh_grad, calls),
        "side_loss_softmax": _median_seconds(lambda: kernels.side_loss("softmax", 0.0, batch, uniform, None, 1000),
                                             fresh_blocks, calls),
        "side_loss_ranking": _median_seconds(lambda: kernels.side_loss("ranking", 0.1, batch, uniform, None, 1000),
                                             fresh_blocks, calls),
        "complex_forward": _median_seconds(lambda: kernels.complex_diagonal(rows, real, imag, False), nothing, calls),
        "complex_backward": _median_seconds(
            lambda: kernels.complex_diagonal_backward(rows, real, imag, out_grad, False), nothing, calls),
    }
    print(json.dumps({"library": loaded.describe(), "seconds": timings}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", help="the other checkout, its kernels built in place")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=30, help="timed calls per kernel and run")
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.calls)
        return
    if not args.baseline:
        parser.error("--baseline is required")
    sys.path.insert(0, str(ROOT / "bench"))
    from machine import matmul_rate

    checkouts = {"baseline": Path(args.baseline).resolve(), "candidate": ROOT}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in checkouts}
    libraries = {}
    for repeat in range(args.repeats):
        for name in (list(checkouts) if repeat % 2 == 0 else list(reversed(checkouts))):
            env = dict(os.environ, PYTHONPATH=str(checkouts[name]))
            done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", "--calls", str(args.calls)],
                                  cwd=checkouts[name], env=env, check=True, capture_output=True, text=True)
            result = json.loads(done.stdout.strip().splitlines()[-1])
            libraries[name] = result["library"]
            runs[name].append(result["seconds"])
            print(f"{name:9s} run {repeat + 1}: " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in result["seconds"].items()),
                  flush=True)
    best = {name: {kernel: min(r[kernel] for r in rs) for kernel in rs[0]} for name, rs in runs.items()}
    summary = {"args": {k: v for k, v in vars(args).items() if k != "worker"}, "libraries": libraries,
               "matmul_gflops": matmul_rate(), "best_ms": {n: {k: v * 1e3 for k, v in b.items()} for n, b in best.items()},
               "speedup_baseline_over_candidate": {k: best["baseline"][k] / best["candidate"][k] for k in best["baseline"]}}
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps({**summary, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
