"""``entity_optimizer: adagrad``: per-coordinate Adagrad for the embeddings (issue #33).

The step is held to a float64 reference of Adagrad with one sum per coordinate (every entry point, native kernel
and torch form); a training run keeps per-coordinate sums, saves them in PBG's RowAdagrad layout (PBG 1.0.0 loads
the partition and steps it), resumes exactly; either kind of saved state loads into either optimizer; the memory
budget counts the larger state; a bad value is a one-line error.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import pytest
import torch

from job import native
from job.cli import main
from job.config import load_config, parse_config
from job.errors import ConfigError
from job.formats.checkpoint import CheckpointStorage
from job.model.scoring import Table
from job.native import kernels
from job.train import train
from job.train.batch import optim
from job.train.batch.rowops import scratch
from job.train.residency.budget import partition_bytes, unpartitioned_bytes

sys.path.insert(0, str(Path(__file__).parent))
from helpers_graphs import assert_same_run, write_cycle_graph  # noqa: E402

LR = 0.3


def reference(weight: torch.Tensor, state: torch.Tensor, lists: list[tuple[torch.Tensor, torch.Tensor]],
              lr: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Adagrad with a sum per coordinate on a merged sparse gradient, in float64, coordinate by coordinate (no
    shared code with the implementation: plain loops over the distinct rows)."""
    weight, state = weight.double().clone(), state.double().clone()
    summed: dict[int, torch.Tensor] = {}
    for ids, grad in lists:
        for row, g in zip(ids.tolist(), grad.double()):
            summed[row] = summed[row] + g if row in summed else g.clone()
    for row, g in summed.items():
        for j in range(weight.shape[1]):
            state[row, j] += float(g[j]) ** 2
            weight[row, j] -= lr * float(g[j]) / (float(state[row, j]) ** 0.5 + optim.ADAGRAD_EPS)
    return weight, state


def batch(dtype: torch.dtype, rows: int = 30, dim: int = 5, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, dim, generator=g, dtype=dtype)
    state = torch.rand(rows, dim, generator=g, dtype=dtype)  # per coordinate, and not all equal within a row
    # ids repeat within each list and across the two (rows < draws)
    lists = [(torch.randint(0, rows, (n,), generator=g), torch.randn(n, dim, generator=g, dtype=dtype))
             for n in (20, 25)]
    return weight, state, lists


def test_kernel_is_per_coordinate_adagrad_on_the_merged_gradient_float64(fresh_library: Path) -> None:
    weight, state, lists = batch(torch.float64)
    want_w, want_s = reference(weight, state, lists, LR)
    untouched = torch.ones(weight.shape[0], dtype=torch.bool)
    for ids, _ in lists:
        untouched[ids] = False
    assert untouched.any()
    before = weight[untouched].clone(), state[untouched].clone()
    assert kernels.row_adagrad(weight, state, lists, LR, optim.ADAGRAD_EPS, scratch(weight.shape[0], weight.device))
    torch.testing.assert_close(weight, want_w, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state, want_s, rtol=1e-12, atol=1e-12)
    assert torch.equal(weight[untouched], before[0]) and torch.equal(state[untouched], before[1])


def test_per_coordinate_step_differs_from_the_row_wise_one() -> None:
    """The two optimizers are not the same step by accident: with unequal gradient magnitudes across a row's
    coordinates, per-coordinate Adagrad moves each coordinate by ~lr (first step from zero sums), row-wise by
    lr times its share of the row's root mean square."""
    grad = torch.tensor([[4.0, 0.5, 0.0, -1.0]])
    full = Table(torch.zeros(1, 4), torch.zeros(1, 4))
    rowwise = Table(torch.zeros(1, 4), torch.zeros(1))
    optim.row_adagrad(full, torch.tensor([0]), grad.clone(), 0.1)
    optim.row_adagrad(rowwise, torch.tensor([0]), grad.clone(), 0.1)
    torch.testing.assert_close(full.weight, torch.tensor([[-0.1, -0.1, 0.0, 0.1]]))
    torch.testing.assert_close(full.optim_sum, grad.square())
    rms = float(grad.square().mean().sqrt())
    torch.testing.assert_close(rowwise.weight, -0.1 * grad / rms)


@pytest.mark.parametrize("function", ["occurrences", "row_adagrad", "repeated"])
@pytest.mark.parametrize("use_native", [True, False])
def test_every_entry_point_is_the_reference(fresh_library: Path, monkeypatch: pytest.MonkeyPatch, function: str,
                                            use_native: bool) -> None:
    """Each of job/train/batch/optim.py's steps (the unique-row, the repeated-row and the per-occurrence one) takes the
    per-coordinate step when the table's sums are per coordinate, with the kernel and in its torch form."""
    monkeypatch.setenv("BIGGRAPH_NATIVE", "1" if use_native else "0")
    weight, state, lists = batch(torch.float64, seed=5)
    if function == "row_adagrad":  # unique rows, as the unique-row path hands them
        ids = torch.randperm(weight.shape[0], generator=torch.Generator().manual_seed(1))[:12]
        lists = [(ids, lists[0][1][:12])]
    want_w, want_s = reference(weight, state, lists, LR)
    table = Table(weight, state)
    given = [(ids, grad.clone()) for ids, grad in lists]
    if function == "occurrences":
        optim.row_adagrad_occurrences(table, given, LR)
    elif function == "repeated":
        optim.row_adagrad_repeated(table, torch.cat([i for i, _ in given]), torch.cat([g for _, g in given]), LR)
    else:
        optim.row_adagrad(table, *given[0], LR)
    assert (native.library() is not None) == use_native
    torch.testing.assert_close(weight, want_w, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state, want_s, rtol=1e-12, atol=1e-12)


# the checkpoint ---------------------------------------------------------------------------------------------


def adagrad_graph(root: Path, **extra: object) -> dict:
    return write_cycle_graph(root, num_partitions=2, entity_optimizer="adagrad", **extra)


def test_training_saves_per_coordinate_sums_in_pbgs_layout_and_pbg_steps_them(tmp_path: Path) -> None:
    tbg_adagrad = pytest.importorskip("torchbiggraph.row_adagrad")
    tbg_cm = pytest.importorskip("torchbiggraph.checkpoint_manager")
    config = parse_config(adagrad_graph(tmp_path, num_epochs=2))
    train(config)
    store = CheckpointStorage(config.checkpoint_path)
    for part in range(2):
        emb, state = store.load_entity_partition(2, "node", part)
        assert state is not None
        entry = state["state"][0]
        full = entry[optim.PER_COORDINATE_KEY]
        assert full.shape == emb.shape  # a sum per coordinate
        assert bool((full.std(1) > 0).any())  # coordinates of a row differ: not a row-wise sum repeated
        torch.testing.assert_close(entry["sum"], full.mean(1))
    # PBG 1.0.0 reads the partition and its RowAdagrad takes the state (the per-coordinate key rides along unused)
    embs, optim_state = tbg_cm.CheckpointManager(config.checkpoint_path).read("node", 0)
    saved_row_sums = optim_state["state"][0]["sum"].clone()  # the optimizer takes the tensor itself
    param = torch.nn.Parameter(embs.clone())
    pbg_optimizer = tbg_adagrad.RowAdagrad([param], lr=0.1)
    pbg_optimizer.load_state_dict(optim_state)
    param.grad = torch.ones_like(param)
    pbg_optimizer.step()
    row_sums = next(iter(pbg_optimizer.state.values()))["sum"]
    torch.testing.assert_close(row_sums, saved_row_sums + 1.0)  # its row-wise step: + mean(g^2) per row


def test_resume_continues_exactly_as_an_uninterrupted_run(tmp_path: Path) -> None:
    straight = adagrad_graph(tmp_path / "a", num_epochs=4)
    train(parse_config(straight))
    resumed = parse_config(adagrad_graph(tmp_path / "b", num_epochs=4))
    train(resumed, stop_after_iterations=2)
    assert CheckpointStorage(resumed.checkpoint_path).load_version() == 2
    train(resumed)  # reads version 2's embeddings and per-coordinate sums and goes on
    a, b = CheckpointStorage(straight["checkpoint_path"]), CheckpointStorage(resumed.checkpoint_path)
    for part in range(2):
        emb_a, state_a = a.load_entity_partition(4, "node", part)
        emb_b, state_b = b.load_entity_partition(4, "node", part)
        assert_same_run(emb_a, emb_b)
        assert_same_run(state_a["state"][0][optim.PER_COORDINATE_KEY].numpy(),
                        state_b["state"][0][optim.PER_COORDINATE_KEY].numpy())


@pytest.mark.parametrize("saved_full", [True, False])
def test_either_saved_state_loads_into_either_optimizer(saved_full: bool) -> None:
    rows, dim = 6, 4
    full = torch.rand(rows, dim)
    state = optim.entity_adagrad_state(full if saved_full else full.mean(1), 0.1, step=3)
    row_sums, step = optim.sums_from_state(state, rows, dim, per_coordinate=False)
    assert step == 3
    torch.testing.assert_close(row_sums, full.mean(1))
    sums, _ = optim.sums_from_state(state, rows, dim, per_coordinate=True)
    assert sums is not None and sums.shape == (rows, dim)
    # a row-wise state starts every coordinate from its row's sum; a per-coordinate one is taken as saved
    torch.testing.assert_close(sums, full if saved_full else full.mean(1, keepdim=True).expand(rows, dim))


def test_per_coordinate_sums_that_pbg_trained_past_are_not_trusted() -> None:
    """PBG resumes a per-coordinate checkpoint row-wise and saves "sum" anew with the stale per-coordinate key
    beside it; the row sums no longer agree with it, so the row sums win (spread over the coordinates)."""
    rows, dim = 5, 3
    state = optim.entity_adagrad_state(torch.rand(rows, dim), 0.1)
    state["state"][0]["sum"] = state["state"][0]["sum"] + 2.0  # PBG's row-wise steps since
    sums, _ = optim.sums_from_state(state, rows, dim, per_coordinate=True)
    assert sums is not None
    torch.testing.assert_close(sums, state["state"][0]["sum"].unsqueeze(1).expand(rows, dim))


def test_unusable_state_starts_from_zero_sums() -> None:
    assert optim.sums_from_state(None, 4, 2, per_coordinate=True) == (None, 0)
    wrong_rows = optim.entity_adagrad_state(torch.rand(5, 2), 0.1)
    assert optim.sums_from_state(wrong_rows, 4, 2, per_coordinate=True) == (None, 0)


# memory and configuration -----------------------------------------------------------------------------------


def test_memory_budget_counts_a_sum_per_coordinate(tmp_path: Path) -> None:
    raw = write_cycle_graph(tmp_path, num_partitions=2)
    counts = {"node": [20, 20]}
    row_wise = parse_config(raw)
    full = parse_config({**raw, "entity_optimizer": "adagrad"})
    assert partition_bytes(row_wise, counts) == 20 * (16 + 1) * 4
    assert partition_bytes(full, counts) == 20 * (16 + 16) * 4
    one = parse_config({**raw, "entities": {"node": {"num_partitions": 1}}, "entity_optimizer": "adagrad"})
    assert unpartitioned_bytes(one, {"node": [40]}) == 40 * 32 * 4
    frozen = parse_config({**raw, "entities": {"node": {"num_partitions": 1, "frozen": True}},
                           "entity_optimizer": "adagrad"})
    assert unpartitioned_bytes(frozen, {"node": [40]}) == 40 * 17 * 4  # never stepped: PBG's one float per row


def test_default_is_pbgs_row_adagrad_and_the_key_stays_out_of_pbgs_config(tmp_path: Path) -> None:
    raw = write_cycle_graph(tmp_path)
    assert parse_config(raw).entity_optimizer == "row_adagrad"
    assert "entity_optimizer" not in parse_config({**raw, "entity_optimizer": "adagrad"}).to_pbg_dict()


@pytest.mark.parametrize("value", ["full", "Adagrad", "sgd"])
def test_an_unknown_optimizer_is_a_one_line_error(tmp_path: Path, value: str, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(write_cycle_graph(tmp_path)))
    with pytest.raises(ConfigError, match="'entity_optimizer'.*row_adagrad, adagrad"):
        load_config(str(path), [f"entity_optimizer={value}"])
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["train", str(path), "-p", f"entity_optimizer={value}"]) == 2
    err = capsys.readouterr().err
    assert "entity_optimizer" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
