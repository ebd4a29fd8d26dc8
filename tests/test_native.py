"""The native kernels (job/native): the one-pass row-wise Adagrad held to a float64 reference and to the torch
path, the one-pass side loss held to its torch form, their refusals, and how the library is found, built, refused
and done without."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import job.native as native
from job.model.fused_losses import blockwise_loss
from job.model.scoring import MASKED_SCORE, Table
from job.native import kernels
from job.train.batch import optim
from job.train.batch.rowops import scratch

LR = 0.3


def reference(weight: torch.Tensor, state: torch.Tensor, lists: list[tuple[torch.Tensor, torch.Tensor]],
              lr: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PBG's RowAdagrad on a merged sparse gradient, written densely in float64."""
    weight, state = weight.double().clone(), state.double().clone()
    summed = torch.zeros_like(weight)
    touched = torch.zeros(weight.shape[0], dtype=torch.bool)
    for ids, grad in lists:
        summed.index_add_(0, ids, grad.double())
        touched[ids] = True
    rows = touched.nonzero().flatten()
    state[rows] += summed[rows].pow(2).mean(1)
    weight[rows] -= lr * summed[rows] / (state[rows].sqrt() + optim.ADAGRAD_EPS).unsqueeze(1)
    return weight, state


def batch(dtype: torch.dtype, rows: int = 60, dim: int = 7, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, dim, generator=g, dtype=dtype)
    state = torch.rand(rows, generator=g, dtype=dtype)
    # ids repeat within each list and across the two (rows < draws)
    lists = [(torch.randint(0, rows, (n,), generator=g), torch.randn(n, dim, generator=g, dtype=dtype))
             for n in (50, 80)]
    return weight, state, lists


def test_kernel_is_pbgs_row_adagrad_on_the_merged_gradient_float64(fresh_library: Path) -> None:
    weight, state, lists = batch(torch.float64)
    want_w, want_s = reference(weight, state, lists, LR)
    untouched = torch.ones(weight.shape[0], dtype=torch.bool)
    for ids, _ in lists:
        untouched[ids] = False
    before = weight[untouched].clone()
    assert kernels.row_adagrad(weight, state, lists, LR, optim.ADAGRAD_EPS, scratch(weight.shape[0], weight.device))
    torch.testing.assert_close(weight, want_w, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state, want_s, rtol=1e-12, atol=1e-12)
    assert torch.equal(weight[untouched], before)  # rows no list names stay as they were


def test_kernel_float32_within_rounding(fresh_library: Path) -> None:
    weight, state, lists = batch(torch.float32, rows=500, dim=200, seed=3)
    want_w, want_s = reference(weight, state, lists, LR)
    assert kernels.row_adagrad(weight, state, lists, LR, optim.ADAGRAD_EPS, scratch(500, weight.device))
    torch.testing.assert_close(weight.double(), want_w, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state.double(), want_s, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("function", ["occurrences", "row_adagrad", "repeated"])
def test_optimizer_entry_points_match_their_torch_form(fresh_library: Path, monkeypatch: pytest.MonkeyPatch,
                                                       function: str) -> None:
    """Every CPU entry point of job/train/batch/optim.py gives the same step with the kernel as without it."""
    results = []
    for use_native in (True, False):
        monkeypatch.setattr(native, "_loaded", {})
        monkeypatch.setenv("BIGGRAPH_NATIVE", "1" if use_native else "0")
        weight, state, lists = batch(torch.float64, seed=5)
        table = Table(weight, state)
        if function == "occurrences":
            optim.row_adagrad_occurrences(table, lists, LR)
        elif function == "repeated":
            optim.row_adagrad_repeated(table, torch.cat([i for i, _ in lists]), torch.cat([g for _, g in lists]), LR)
        else:  # unique rows, as the unique-row path hands them
            ids = torch.randperm(weight.shape[0], generator=torch.Generator().manual_seed(1))[:40]
            optim.row_adagrad(table, ids, lists[0][1][:40].clone(), LR)
        assert (native.library() is not None) == use_native
        results.append((weight, state))
    (w1, s1), (w2, s2) = results
    torch.testing.assert_close(w1, w2, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s1, s2, rtol=1e-12, atol=1e-12)


def test_an_id_outside_the_table_raises_and_writes_nothing(fresh_library: Path) -> None:
    weight, state, lists = batch(torch.float32)
    lists[1][0][17] = weight.shape[0]  # one past the end, in the second list
    w0, s0 = weight.clone(), state.clone()
    with pytest.raises(IndexError, match=f"row id {weight.shape[0]} is outside the table of {weight.shape[0]} rows"):
        kernels.row_adagrad(weight, state, lists, LR, optim.ADAGRAD_EPS, scratch(weight.shape[0], weight.device))
    assert torch.equal(weight, w0) and torch.equal(state, s0)


@pytest.mark.parametrize("case", ["bfloat16", "non_contiguous", "mixed_dtype", "int32_ids", "state_shape"])
def test_what_the_kernel_does_not_take_is_left_to_torch(fresh_library: Path, case: str) -> None:
    weight, state, lists = batch(torch.float32)
    if case == "bfloat16":
        weight, state = weight.bfloat16(), state.bfloat16()
        lists = [(ids, grad.bfloat16()) for ids, grad in lists]
    elif case == "non_contiguous":
        lists[0] = (lists[0][0], torch.randn(weight.shape[1], 50).t())
    elif case == "mixed_dtype":
        lists[0] = (lists[0][0], lists[0][1].double())
    elif case == "int32_ids":
        lists[0] = (lists[0][0].int(), lists[0][1])
    else:
        state = torch.zeros(weight.shape[0] + 1)
    w0 = weight.clone()
    assert not kernels.row_adagrad(weight, state, lists, LR, optim.ADAGRAD_EPS, scratch(weight.shape[0], weight.device))
    assert torch.equal(weight, w0)


def test_disabled_by_environment(fresh_library: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BIGGRAPH_NATIVE", "off")
    assert native.library() is None
    assert not (fresh_library / "cache").exists()  # nothing built either


def test_built_once_into_the_cache_then_loaded_from_it(fresh_library: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert native.library() is not None
    built = fresh_library / "cache" / native.library_name()
    assert built.is_file()
    assert oct((fresh_library / "cache").stat().st_mode & 0o777) == oct(0o700)
    stamp = built.stat().st_mtime_ns
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("PATH", "")  # no compiler at all: the cached build must do
    assert native.library() is not None
    assert built.stat().st_mtime_ns == stamp
    assert not [p for p in built.parent.iterdir() if p.name.startswith(".build-")]  # no partial file left


def test_the_file_name_follows_the_source(fresh_library: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An edited kernel is never served from an old build: the name hashes the source and the flags."""
    first = native.library_name()
    monkeypatch.setattr(native, "FLAGS", (*native.FLAGS, "-DCHANGED"))
    assert native.library_name() != first


def test_no_compiler_falls_back_with_one_warning(fresh_library: Path, monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("PATH", "")
    with caplog.at_level(logging.WARNING, logger="job.native"):
        assert native.library() is None
        assert native.library() is None  # decided once per process
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "no C compiler found" in warnings[0]
    weight, state, lists = batch(torch.float64)
    want_w, _ = reference(weight, state, lists, LR)
    optim.row_adagrad_occurrences(Table(weight, state), lists, LR)  # the torch path, same step
    torch.testing.assert_close(weight, want_w, rtol=1e-12, atol=1e-12)


def test_a_failing_compiler_falls_back(fresh_library: Path, monkeypatch: pytest.MonkeyPatch,
                                       caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("CC", "false")
    with caplog.at_level(logging.WARNING, logger="job.native"):
        assert native.library() is None
    assert "false failed on rowkernels.c" in caplog.text
    assert not list((fresh_library / "cache").glob("*.so"))


def test_a_cache_others_can_write_to_is_not_loaded_from(fresh_library: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    cache = fresh_library / "cache"
    cache.mkdir()
    cache.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="job.native"):
        assert native.library() is None
    assert "writable by others" in caplog.text


def test_prebuilt_library_needs_no_compiler(fresh_library: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    done = subprocess.run([sys.executable, "-m", "job", "build-native", "--into", str(fresh_library / "prebuilt")],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    path = Path(done.stdout.strip())
    assert path.parent == fresh_library / "prebuilt" and path.name == native.library_name()
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("PATH", "")
    assert native.library() is not None
    assert not (fresh_library / "cache").exists()


def test_build_command_reports_a_compiler_error() -> None:
    env = {**os.environ, "CC": "false"}
    done = subprocess.run([sys.executable, "-m", "job", "build-native", "--into", "/tmp/biggraph-native-unused"],
                          capture_output=True, text=True, env=env, check=False)
    assert done.returncode == 2
    assert "false failed on rowkernels.c" in done.stderr and "Traceback" not in done.stderr


def _as_package_build(fresh_library: Path, **build: object) -> Path:
    """A library built into the place of the package's own (``native.BUILT``, the fixture's), as setup.py would."""
    built = native.build(fresh_library / "ext", **build)  # type: ignore[arg-type]
    return built.rename(native.BUILT)


def test_the_packages_build_comes_first_and_needs_no_compiler(fresh_library: Path, monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    path = _as_package_build(fresh_library)
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("PATH", "")
    with caplog.at_level(logging.INFO, logger="job.native"):
        found = native.loaded()
    assert found is not None and (found.path, found.origin) == (path, "package")
    assert f"native kernels: built with the package, {native.CLONE_LEVELS[found.clone_level]} ({path})" in caplog.text
    assert not (fresh_library / "cache").exists()
    weight, state, lists = batch(torch.float64)
    want_w, _ = reference(weight, state, lists, LR)
    assert kernels.row_adagrad(weight, state, lists, LR, optim.ADAGRAD_EPS, scratch(weight.shape[0], weight.device))
    torch.testing.assert_close(weight, want_w, rtol=1e-12, atol=1e-12)


def test_a_library_built_from_other_sources_is_passed_over(fresh_library: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """An in-place build older than an edit of the C files is never run: the next place (here a run-time build)
    serves, with a warning naming the stale file."""
    stale = _as_package_build(fresh_library, digest="0" * 16)
    with caplog.at_level(logging.WARNING, logger="job.native"):
        found = native.loaded()
    assert found is not None and found.origin == "cache" and found.path.parent == fresh_library / "cache"
    assert f"passing over the package kernels {stale}: built from other sources" in caplog.text


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))


@pytest.mark.skipif(not (sys.platform == "linux" and os.uname().machine == "x86_64"), reason="clones are x86-64's")
@pytest.mark.parametrize("clones", [True, False])
def test_the_clones_follow_the_cpu(fresh_library: Path, monkeypatch: pytest.MonkeyPatch, clones: bool) -> None:
    """With clones the library runs the best code this CPU takes (AVX-512 ones on x86-64-v4, AVX2 on v3); built
    with -DBG_NO_CLONES (bench/ab_bench.py's baseline) only the baseline exists."""
    if not clones:
        monkeypatch.setattr(native, "FLAGS", (*native.FLAGS, "-DBG_NO_CLONES"))
    found = native.loaded()
    assert found is not None
    if not clones:
        assert found.clone_level == 0
        return
    if found.clone_level == -1:
        pytest.skip("this compiler's clones do not report their choice")
    flags = _cpu_flags()
    v3 = {"avx2", "fma", "bmi1", "bmi2", "movbe", "f16c", "abm"} <= flags
    v4 = v3 and {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"} <= flags
    assert found.clone_level == (4 if v4 else 3 if v3 else 0), sorted(flags)


def torch_side_loss(kind: str, batch: torch.Tensor | None, uniform: torch.Tensor | None, pos: torch.Tensor | None,
                    num_pos: int) -> tuple[float, float, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The torch form of a side's loss (job.model.fused: the batch block masked, then ``blockwise_loss``)."""
    blocks = []
    if batch is not None:
        chunks, chunk, _ = batch.shape
        pos = batch.diagonal(dim1=1, dim2=2).reshape(-1).clone()
        batch.diagonal(dim1=1, dim2=2).fill_(MASKED_SCORE)
        padding = chunks * chunk - num_pos
        if padding:
            batch[-1, :, chunk - padding:] = MASKED_SCORE
        blocks.append((batch.view(chunks * chunk, chunk), None))
    if uniform is not None:
        blocks.append((uniform, None))
    assert pos is not None
    num_neg = sum(block.shape[1] for block, _ in blocks)
    loss, d_pos, grads, violators = blockwise_loss(kind, MARGIN, pos, blocks, num_neg, num_pos)
    if batch is not None:
        grads[0].view_as(batch).diagonal(dim1=1, dim2=2).copy_(d_pos.view(batch.shape[0], -1))
    return float(loss), float(violators), pos, d_pos, grads


MARGIN = 0.1


def side_blocks(dtype: torch.dtype, layout: str, chunks: int = 4, chunk: int = 10, num_uniform: int = 23,
                seed: int = 0) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    padded = chunks * chunk
    batch = torch.randn(chunks, chunk, chunk, generator=g, dtype=dtype) * 3 if layout != "uniform" else None
    uniform = torch.randn(padded, num_uniform, generator=g, dtype=dtype) * 3 if layout != "batch" else None
    pos = torch.randn(padded, generator=g, dtype=dtype) * 3 if batch is None else None
    return batch, uniform, pos


@pytest.mark.parametrize("kind", ["softmax", "ranking"])
@pytest.mark.parametrize("layout", ["both", "batch", "uniform"])
@pytest.mark.parametrize("num_pos", [40, 33])  # 33: the last chunk padded
@pytest.mark.parametrize("dtype,tolerance", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_side_loss_is_the_torch_form(kind: str, layout: str, num_pos: int, dtype: torch.dtype,
                                     tolerance: float) -> None:
    """Loss, violators, positives' scores and gradients, and every entry of the blocks' gradients (masked and
    padded ones zero) as the torch form leaves them; float32 within a few ulp of its exponential."""
    batch, uniform, pos = side_blocks(dtype, layout)
    mine = [None if t is None else t.clone() for t in (batch, uniform, pos)]
    want_loss, want_violators, want_pos, want_d_pos, want_grads = torch_side_loss(kind, batch, uniform, pos, num_pos)
    done = kernels.side_loss(kind, MARGIN, *mine, num_pos)
    assert done is not None
    assert done.loss == pytest.approx(want_loss, rel=tolerance)
    assert done.violators == want_violators
    torch.testing.assert_close(done.pos[:num_pos], want_pos[:num_pos], rtol=0, atol=0)
    torch.testing.assert_close(done.d_pos, want_d_pos, rtol=tolerance, atol=tolerance)
    got_grads = [t.view(t.shape[0] * t.shape[1], -1) if t.dim() == 3 else t for t in mine[:2] if t is not None]
    for got, want in zip(got_grads, want_grads):
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
    for got in got_grads:
        assert not got[num_pos:].any()  # padding rows: no gradient, in every block
    assert not done.d_pos[num_pos:].any()


def test_side_loss_keeps_a_nan_score_visible() -> None:
    """A diverged model's NaN score gives a NaN loss, as the torch form does (not a finite one with the NaN
    dropped from the row's maximum or its exponential)."""
    for kind in ("softmax", "ranking"):
        batch, uniform, _ = side_blocks(torch.float32, "both")
        assert uniform is not None
        uniform[3, 5] = float("nan")
        done = kernels.side_loss(kind, MARGIN, batch, uniform, None, 40)
        assert done is not None and done.loss != done.loss, kind


def test_side_loss_float32_exponential_over_its_range() -> None:
    """The kernel's own float32 exponential against float64's, from 0 down to where it returns 0: each row holds
    one score at 0 (the row's top) and one at x, so the gradient of x's entry is exp(x) / (1 + exp(x) + exp(p))."""
    xs = torch.linspace(-100, 0, 4001, dtype=torch.float64)
    uniform = torch.stack((torch.zeros_like(xs), xs), 1).float()
    pos = torch.full((xs.shape[0],), -200.0)  # exp(-200): nothing in float32
    exact = uniform[:, 1].double()  # x as the kernel sees it, rounded to float32
    done = kernels.side_loss("softmax", 0.0, None, uniform, pos, xs.shape[0])
    assert done is not None
    want = exact.exp() / (1 + exact.exp())
    got = uniform[:, 1].double()
    normal = exact >= -87
    torch.testing.assert_close(got[normal], want[normal], rtol=3e-7, atol=0)
    assert not got[~normal].any()  # below -87: 0 where expf would be denormal


@pytest.mark.parametrize("case", ["logistic", "bfloat16", "non_contiguous", "mixed_dtype", "no_positives",
                                  "uniform_rows", "not_square", "disabled"])
def test_what_the_side_loss_does_not_take_is_left_to_torch(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    batch, uniform, pos = side_blocks(torch.float32, "both")
    assert batch is not None and uniform is not None
    kind, num_pos = "softmax", 40
    if case == "logistic":
        kind = "logistic"
    elif case == "bfloat16":
        batch, uniform = batch.bfloat16(), uniform.bfloat16()
    elif case == "non_contiguous":
        uniform = torch.randn(uniform.shape[1], uniform.shape[0]).t()
    elif case == "mixed_dtype":
        uniform = uniform.double()
    elif case == "no_positives":
        num_pos = 0
    elif case == "uniform_rows":
        uniform = uniform[:-1].contiguous()
    elif case == "not_square":
        batch = torch.randn(4, 10, 9)
    else:
        monkeypatch.setattr(native, "_loaded", {})
        monkeypatch.setenv("BIGGRAPH_NATIVE", "0")
    before = [batch.clone(), uniform.clone()]
    assert kernels.side_loss(kind, MARGIN, batch, uniform, None, num_pos) is None
    assert torch.equal(batch, before[0]) and torch.equal(uniform, before[1])
