"""obstore (object_store-rs) against the storage layer (s3fs) for the three transfers training makes (issue 47).

- edge staging: one large object downloaded to a local file (stage mode's cache);
- partition swap: a partition file uploaded and read back into memory (out-of-core eviction and reload);
- checkpoint upload: a large local file uploaded (multipart).

On moto a third client, "previous", is the storage layer with s3fs' own get_file as the download (what the
resumable ranged download replaced): its edge-staging row is the before/after of that change.

Each transfer runs through ``storage_adapters`` (s3fs, the project's code: bounded-memory multipart, resumable
ranged downloads) and through obstore, on moto (a subprocess on 127.0.0.1) and on local files, side by side in one
run, alternating the two clients ``--repeats`` times. Figures: wall seconds and CPU seconds of this process (user +
system, every thread: obstore's Rust threads included; moto's own CPU is not counted) per GB moved. moto serves HTTP
from Python and copies the whole object on every ranged GET: its absolute figures are not S3's, the ratio between
the two clients in the same run is the figure to read.

    flock /work/bench.lock .venv/bin/python bench/obstore_bench.py --mib 128 --repeats 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import matmul_rate  # noqa: E402
from storage_bench import start_moto  # noqa: E402

import storage_adapters as storage  # noqa: E402


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(run: Callable[[], None], nbytes: int) -> dict[str, float]:
    wall, cpu = time.perf_counter(), _cpu()
    run()
    wall, cpu = time.perf_counter() - wall, _cpu() - cpu
    gb = nbytes / 1e9
    return {"wall_s": wall, "cpu_s": cpu, "cpu_s_per_gb": cpu / gb, "wall_s_per_gb": wall / gb}


class ObstoreClient:
    """The same three transfers through obstore (its defaults: 5 MiB parts, 12 in flight)."""

    def __init__(self, store: Any) -> None:
        import obstore

        self.obs = obstore
        self.store = store

    def download(self, key: str, local: Path) -> None:
        with open(local, "wb") as out:
            for piece in self.obs.get(self.store, key).stream(min_chunk_size=8 * 2**20):
                out.write(piece)

    def upload(self, local: Path, key: str) -> None:
        self.obs.put(self.store, key, local)

    def read(self, key: str) -> bytes:
        return bytes(self.obs.get(self.store, key).bytes())


class StorageClient:
    """The storage layer's own calls for the same transfers."""

    def __init__(self, root: str) -> None:
        self.root = root

    def download(self, key: str, local: Path) -> None:
        storage.get_file(storage.join(self.root, key), str(local))

    def upload(self, local: Path, key: str) -> None:
        storage.put_file(str(local), storage.join(self.root, key))

    def read(self, key: str) -> bytes:
        return storage.read_bytes(storage.join(self.root, key))


def one_round(client: Any, source: Path, work: Path, name: str, nbytes: int) -> dict[str, dict[str, float]]:
    """The three transfers once through ``client``: upload, staged download, swap (upload and read back)."""
    key, swap_key, target = f"bench/{name}.bin", f"bench/swap-{name}.bin", work / f"staged-{name}.bin"
    out = {"checkpoint upload": measure(lambda: client.upload(source, key), nbytes),
           "edge staging": measure(lambda: client.download(key, target), nbytes)}
    assert target.stat().st_size == nbytes
    target.unlink()
    out["partition swap"] = measure(lambda: (client.upload(source, swap_key), client.read(swap_key)), 2 * nbytes)
    return out


class PreviousDownload(StorageClient):
    """The storage layer with the download it had before issue 47: s3fs' get_file (16 MiB chunks, 2 in flight),
    which restarted from byte 0 after a dropped connection; for the edge-staging row only."""

    def download(self, key: str, local: Path) -> None:
        from storage_adapters.multipart import DOWNLOAD_CHUNKS, PART_BYTES

        fs, path = storage.get_filesystem(storage.join(self.root, key))
        fs.get_file(path, str(local), chunksize=PART_BYTES, max_concurrency=DOWNLOAD_CHUNKS)


def run_backend(name: str, clients: dict[str, Any], work: Path, nbytes: int, repeats: int) -> dict[str, Any]:
    source = work / "source.bin"
    with open(source, "wb") as out:
        for _ in range(nbytes // 2**20):
            out.write(os.urandom(2**20))
    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    for repeat in range(repeats):
        for client_name, client in clients.items():
            per = results.setdefault(client_name, {})
            for workload, figures in one_round(client, source, work, f"{client_name}-{repeat}", nbytes).items():
                per.setdefault(workload, []).append(figures)
    summary: dict[str, Any] = {}
    for client_name, per in results.items():
        for workload, runs in per.items():
            summary.setdefault(workload, {})[client_name] = {
                k: statistics.median(r[k] for r in runs) for k in ("wall_s", "cpu_s", "cpu_s_per_gb", "wall_s_per_gb")}
    print(f"\n{name}: {nbytes / 2**20:.0f} MiB, median of {repeats}")
    print(f"{'workload':18} {'client':9} {'wall s':>8} {'CPU s':>8} {'CPU s/GB':>9} {'wall s/GB':>10}")
    for workload, per_client in summary.items():
        for client_name, fig in per_client.items():
            print(f"{workload:18} {client_name:9} {fig['wall_s']:8.2f} {fig['cpu_s']:8.2f} {fig['cpu_s_per_gb']:9.2f} "
                  f"{fig['wall_s_per_gb']:10.2f}")
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=128, help="object size in MiB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    from obstore.store import LocalStore, S3Store

    rate = matmul_rate()
    print(f"machine: float32 matmul {rate:.1f} GFLOP/s; {os.cpu_count()} CPUs")
    nbytes = args.mib * 2**20
    out: dict[str, Any] = {"mib": args.mib, "repeats": args.repeats, "matmul_gflops": rate}
    with tempfile.TemporaryDirectory(prefix="obstore-bench-") as tmp:
        work = Path(tmp)
        local_root = work / "store"
        (local_root / "bench").mkdir(parents=True)
        out["local"] = run_backend("local files", {
            "storage": StorageClient(str(local_root)),
            "obstore": ObstoreClient(LocalStore(str(local_root), mkdir=True)),
        }, work, nbytes, args.repeats)
        shutil.rmtree(local_root)
        proc, endpoint = start_moto()
        try:
            import s3fs

            s3fs.S3FileSystem(endpoint_url=endpoint).mkdir("bench")
            with storage.using(storage.StorageSettings(options={"endpoint_url": endpoint})):
                s3 = S3Store("bench", endpoint=endpoint, region="us-east-1", access_key_id="bench",
                             secret_access_key="bench", virtual_hosted_style_request=False,
                             client_options={"allow_http": True})
                out["moto"] = run_backend("moto (S3)", {
                    "storage": StorageClient("s3://bench"), "obstore": ObstoreClient(s3),
                    "previous": PreviousDownload("s3://bench")}, work, nbytes, args.repeats)
        finally:
            proc.terminate()
            proc.wait(10)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
