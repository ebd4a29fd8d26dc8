"""``biggraph report``: figures from training_stats.json, then the page rendered in a real browser.

The browser tests use Debian's headless Chromium (``apt-get install chromium``; tests/run.sh installs it)
and skip, saying so, where /usr/bin/chromium is missing.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from storage_scope import use_storage

from job.cli import main
from job.cli.common import parse_storage_options
from job.errors import UserError
from job.report.collect import epoch_rows
from job.report.sampled import pca_2d
from job.report.svg import nice_ticks

sys.path.insert(0, str(Path(__file__).parent))
from helpers_graphs import make_graph  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


# a tiny PNG decoder (8-bit greyscale/RGB/RGBA, non-interlaced: what Chromium and matplotlib write) ---------


def decode_png(data: bytes) -> np.ndarray:
    """Pixels (height x width x channels); Pillow when installed (fast), else the decoder below."""
    try:
        import io

        from PIL import Image
    except ImportError:
        return decode_png_zlib(data)
    return np.asarray(Image.open(io.BytesIO(data))).astype(np.int32).reshape(*Image.open(io.BytesIO(data)).size[::-1], -1)


def decode_png_zlib(data: bytes) -> np.ndarray:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        length = int.from_bytes(data[pos:pos + 4], "big")
        kind = data[pos + 4:pos + 8]
        chunk = data[pos + 8:pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            header = chunk
        elif kind == b"IDAT":
            idat += chunk
    assert header is not None
    width, height = int.from_bytes(header[0:4], "big"), int.from_bytes(header[4:8], "big")
    depth, colour, interlace = header[8], header[9], header[12]
    assert depth == 8 and interlace == 0 and colour in (0, 2, 6), (depth, colour, interlace)
    channels = {0: 1, 2: 3, 6: 4}[colour]
    raw = zlib.decompress(idat)
    stride = width * channels
    out = np.zeros((height, stride), dtype=np.int32)
    prev = np.zeros(stride, dtype=np.int32)
    for y in range(height):
        line = raw[y * (stride + 1):(y + 1) * (stride + 1)]
        kind, row = line[0], np.frombuffer(line[1:], dtype=np.uint8).astype(np.int32)
        if kind == 0:
            cur = row
        elif kind == 2:
            cur = (row + prev) & 0xFF
        elif kind == 1:  # sub: a running sum per channel
            cur = (np.cumsum(row.reshape(width, channels), axis=0) & 0xFF).reshape(stride)
        else:  # 3 (average), 4 (Paeth) depend on the pixel to the left: pixel by pixel, channels at once
            cur = np.zeros(stride, dtype=np.int32)
            zero = np.zeros(channels, dtype=np.int32)
            for x in range(0, stride, channels):
                a = cur[x - channels:x] if x else zero
                b = prev[x:x + channels]
                if kind == 3:
                    pred = (a + b) // 2
                else:
                    c = prev[x - channels:x] if x else zero
                    p = a + b - c
                    pa, pb, pc = np.abs(p - a), np.abs(p - b), np.abs(p - c)
                    pred = np.where((pa <= pb) & (pa <= pc), a, np.where(pb <= pc, b, c))
                cur[x:x + channels] = (row[x:x + channels] + pred) & 0xFF
        out[y] = cur
        prev = cur
    return out.reshape(height, width, channels)


def test_png_decoder_round_trip() -> None:
    pixels = (np.arange(4 * 5 * 3) * 7 % 256).astype(np.uint8).reshape(4, 5, 3)
    raw = b"".join(b"\x00" + row.tobytes() for row in pixels)

    def chunk(kind: bytes, body: bytes) -> bytes:
        return len(body).to_bytes(4, "big") + kind + body + zlib.crc32(kind + body).to_bytes(4, "big")

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", (5).to_bytes(4, "big") + (4).to_bytes(4, "big") + bytes([8, 2, 0, 0, 0]))
           + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
    assert (decode_png_zlib(png) == pixels).all()
    assert (decode_png(png) == pixels).all()


# unit tests of the figures -------------------------------------------------------------------


def record(epoch: int, index: int, loss: float, count: int, mrr: float | None = None, **extra: Any) -> dict[str, Any]:
    r: dict[str, Any] = {"epoch_idx": epoch, "index": index, "lhs_partition": 0, "rhs_partition": index % 2,
                         "stats": {"count": count, "metrics": {"loss": loss}}, "time": 2.0, "io_time": 0.5,
                         "swap_time": 0.2, "edges_per_sec": count / 2.0}
    if mrr is not None:
        r["eval_stats_after"] = {"count": 10, "metrics": {"mrr": mrr, "hits@10": 0.5}}
    r.update(extra)
    return r


def test_epoch_rows_weight_dedupe_and_split_time() -> None:
    records = [
        record(0, 0, 1.0, 100, 0.1), record(0, 1, 0.5, 300, 0.3),
        {"pass_summary": True, "epoch_idx": 0, "index": 0, "time": 10.0, "stats": {"count": 400, "metrics": {"loss": 0.625}}},
        record(1, 2, 9.0, 100),  # a try of pass 2 that crashed before its commit ...
        record(1, 2, 0.2, 100), record(1, 3, 0.2, 100),  # ... redone after the resume
        {"pass_summary": True, "epoch_idx": 1, "index": 1, "time": 6.0, "stats": {"count": 200, "metrics": {"loss": 0.2}}},
    ]
    rows, buckets, passes = epoch_rows(records)
    assert (buckets, passes) == (4, 2)
    first, second = rows
    assert first.loss == pytest.approx((1.0 * 100 + 0.5 * 300) / 400)
    assert first.mrr == pytest.approx(0.2) and first.hits10 == pytest.approx(0.5)
    assert first.edges_per_sec == pytest.approx(400 / 4.0)
    assert (first.compute, first.swap, first.edge_io) == pytest.approx((4.0, 0.4, 0.6))
    assert first.other == pytest.approx(10.0 - 4.0 - 0.4 - 0.6)
    assert second.loss == pytest.approx(0.2) and second.edges == 200 and second.mrr is None


def test_nice_ticks_cover_the_range() -> None:
    assert nice_ticks(0.0, 1.0) == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    ticks = nice_ticks(1713.0, 3104.0)
    assert ticks[0] <= 1713 and ticks[-1] >= 3104 and len(ticks) <= 8
    assert nice_ticks(5.0, 5.0)[0] <= 5.0 <= nice_ticks(5.0, 5.0)[-1]


def test_pca_finds_the_spread_direction() -> None:
    rng = np.random.default_rng(0)
    along = rng.normal(size=(200, 1)) * 10
    a = np.hstack([along, rng.normal(size=(200, 3)) * 0.1])
    projected, explained = pca_2d({"a": a[:150], "b": a[150:]})
    assert explained[0] > 0.95 and explained[0] + explained[1] <= 1.0 + 1e-9
    assert projected["a"].shape == (150, 2) and projected["b"].shape == (50, 2)
    both = np.concatenate([projected["a"], projected["b"]])
    assert abs(np.corrcoef(both[:, 0], along[:, 0])[0, 1]) > 0.99


def test_no_committed_checkpoint_is_a_user_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "r.html")]) == 2
    assert "no committed checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "r.html").exists()


def test_storage_option_values_are_json_when_they_parse() -> None:
    options = parse_storage_options(["endpoint_url=http://127.0.0.1:9000", "anon=false", "max_concurrency=4",
                                     'client_kwargs={"region_name": "eu-west-1"}', "token=", "key=a=b"])
    assert options == {"endpoint_url": "http://127.0.0.1:9000", "anon": False, "max_concurrency": 4,
                       "client_kwargs": {"region_name": "eu-west-1"}, "token": "", "key": "a=b"}
    for bad in ("endpoint_url", "=x"):
        with pytest.raises(UserError, match="expected KEY=VALUE"):
            parse_storage_options([bad])


# a real run ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A 2-partition, 2-relation graph trained for 3 epochs with held-out edges, then reported on."""
    root = tmp_path_factory.mktemp("report")
    graph = make_graph(root, num_epochs=3, eval_fraction=0.25, edges_per_bucket=60, eval_num_uniform_negs=10,
                       eval_num_batch_negs=10, seed=0, dimension=8)
    graph.write_config()
    os.environ["BIGGRAPH_PROGRESS"] = "off"
    try:
        assert main(["train", str(graph.config_path)]) == 0
    finally:
        del os.environ["BIGGRAPH_PROGRESS"]
    checkpoint = root / "checkpoints"
    out = root / "report.html"
    png = root / "report.png"
    args = ["report", str(checkpoint), "--out", str(out), "--sample", "500"]
    if _has_matplotlib():
        args += ["--png", str(png)]
    assert main(args) == 0
    stats = [json.loads(line) for line in (checkpoint / "training_stats.json").read_text().splitlines()]
    return {"root": root, "graph": graph, "html": out, "png": png, "stats": stats}


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def expected_figures(stats: list[dict[str, Any]]) -> dict[str, str]:
    """The final epoch's loss and held-out MRR, computed here from training_stats.json independently."""
    last_epoch = max(r["epoch_idx"] for r in stats)
    buckets = [r for r in stats if not r.get("pass_summary") and r["epoch_idx"] == last_epoch]
    count = sum(r["stats"]["count"] for r in buckets)
    loss = sum(r["stats"]["metrics"]["loss"] * r["stats"]["count"] for r in buckets) / count
    n = sum(r["eval_stats_after"]["count"] for r in buckets)
    mrr = sum(r["eval_stats_after"]["metrics"]["mrr"] * r["eval_stats_after"]["count"] for r in buckets) / n
    return {"loss": f"{loss:.4f}", "mrr": f"{mrr:.4f}", "epochs": str(last_epoch + 1)}


@pytest.mark.slow
def test_report_html_holds_the_figures_of_the_run(trained: dict[str, Any]) -> None:
    page = trained["html"].read_text()
    figures = expected_figures(trained["stats"])
    headline = page[page.index('<table id="headline">'):page.index('<table id="facts">')]
    assert figures["loss"] in headline and figures["mrr"] in headline
    assert page.count("<svg") == 7
    assert "MRR per relation" in page and ">buys<" in page and ">follows<" in page
    assert "user (" in page and "item (" in page  # both entity types in the projection legend
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "")  # self-contained: nothing to fetch
    epochs_table = page[page.index('<table id="epochs">'):]
    assert len(re.findall(r"<tr><td>\d+</td>", epochs_table)) >= 3


@pytest.mark.slow
def test_report_png_is_a_real_image(trained: dict[str, Any]) -> None:
    if not _has_matplotlib():
        pytest.skip("matplotlib is not installed (pip install 'biggraph[report]'); --png was not exercised")
    pixels = decode_png(trained["png"].read_bytes())
    assert pixels.shape[0] > 500 and pixels.shape[1] > 500
    assert pixels[..., :3].std() > 20


def run_chromium(args: list[str], tmp: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={tmp / 'profile'}", *args],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_report_renders_in_a_real_browser(trained: dict[str, Any], tmp_path: Path) -> None:
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing: install Debian's chromium (apt-get install -y chromium; tests/run.sh "
                    "does) to render the report in a browser")
    url = trained["html"].resolve().as_uri()
    dom = run_chromium(["--dump-dom", url], tmp_path)
    assert dom.returncode == 0, dom.stderr[-2000:]
    figures = expected_figures(trained["stats"])
    text = dom.stdout
    assert "biggraph training report" in text
    assert figures["loss"] in text and figures["mrr"] in text
    assert text.count("<svg") == 7 and text.count("<circle") > 20  # the scatter and the line charts' points
    shot = tmp_path / "shot.png"
    result = run_chromium([f"--screenshot={shot}", "--window-size=1200,2000", url], tmp_path)
    assert result.returncode == 0 and shot.exists(), result.stderr[-2000:]
    pixels = decode_png(shot.read_bytes())[..., :3]
    assert pixels.shape[:2] == (2000, 1200)
    assert pixels.std() > 10, "the screenshot is blank"
    # coloured chart marks, not only black text on white: the loss line is red (#d62728)
    red = (np.abs(pixels[..., 0] - 0xD6) < 30) & (np.abs(pixels[..., 1] - 0x27) < 30) & (np.abs(pixels[..., 2] - 0x28) < 30)
    assert red.sum() > 50


def test_png_decoder_agrees_with_a_real_encoder(tmp_path: Path) -> None:
    """The zlib decoder against matplotlib's PNG writer (all filter types appear in a real image)."""
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install 'biggraph[report]')")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2, 1.5))
    ax.plot([0, 1, 2], [0, 1, 0.5], color="red")
    fig.savefig(tmp_path / "x.png", dpi=60)
    plt.close(fig)
    data = (tmp_path / "x.png").read_bytes()
    mine = decode_png_zlib(data)
    assert mine.shape[0] > 50 and mine[..., :3].std() > 5
    assert (mine == decode_png(data)).all()


# a checkpoint on S3 (moto) ---------------------------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens once the socket is closed


@pytest.fixture
def s3_checkpoint(trained: dict[str, Any], s3_bucket: str, s3_endpoint: str, tmp_path: Path) -> str:
    """The trained checkpoint copied to S3, its config.json naming a training directory that is gone."""
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=s3_endpoint, skip_instance_cache=True)
    local = trained["root"] / "checkpoints"
    remote = f"{s3_bucket}/copied/ckpt"
    for path in sorted(local.rglob("*")):
        if path.is_file() and path.name != "config.json":
            fs.put_file(str(path), f"{remote}/{path.relative_to(local).as_posix()}"[len("s3://"):])
    config = json.loads((local / "config.json").read_text())
    config["checkpoint_path"] = str(tmp_path / "trained-here-once")  # the per-relation MRR must read the copy
    fs.pipe_file(f"{remote}/config.json"[len("s3://"):], json.dumps(config).encode())
    return remote


@pytest.mark.slow
def test_report_of_an_s3_checkpoint_takes_storage_options_from_the_command_line(
        trained: dict[str, Any], s3_checkpoint: str, s3_endpoint: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    use_storage({})  # the fixture's endpoint is gone: only --storage-option / --config may supply it
    dead = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", dead)  # where the default endpoint would be: nothing listens
    out = tmp_path / "r.html"
    # without them: a clear error about the endpoint, and no page
    assert main(["report", s3_checkpoint, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"biggraph report: error: {s3_checkpoint}/" in err and f"the storage endpoint {dead} refused" in err, err
    assert "Traceback" not in err and not out.exists()
    # --storage-option: the endpoint, and every figure of the page read from S3
    assert main(["report", s3_checkpoint, "--out", str(out), "--sample", "300",
                 "--storage-option", f"endpoint_url={s3_endpoint}"]) == 0
    page = out.read_text()
    figures = expected_figures(trained["stats"])
    headline = page[page.index('<table id="headline">'):page.index('<table id="facts">')]
    assert figures["loss"] in headline and figures["mrr"] in headline
    assert '<table id="relations">' in page and ">buys<" in page and ">follows<" in page  # MRR from the S3 copy
    assert "user (" in page and "item (" in page  # embeddings sampled from S3
    # --config: its storage_options
    config_file = tmp_path / "cfg.json"
    config_file.write_text(json.dumps({**trained["graph"].config, "storage_options": {"endpoint_url": s3_endpoint}}))
    out.unlink()
    assert main(["report", s3_checkpoint, "--out", str(out), "--sample", "300", "--relation-edges", "0",
                 "--config", str(config_file)]) == 0
    page = out.read_text()
    assert figures["loss"] in page and "user (" in page and "not computed (--relation-edges 0)" in page
