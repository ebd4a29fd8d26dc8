"""The Python API (``import job``): what it exports, that it stays light, and that it works where users call it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import job

REPO = Path(__file__).resolve().parents[1]


def test_every_public_name_resolves() -> None:
    assert set(job.__all__) == {"__version__", *job._API}
    for name in job._API:
        assert callable(getattr(job, name)), name
    assert job.evaluate is __import__("job.evaluation", fromlist=["x"]).evaluate
    with pytest.raises(AttributeError, match="no attribute 'trian'"):
        job.trian  # noqa: B018


def test_subpackages_of_the_same_name_do_not_hide_the_functions() -> None:
    """``job.train``, ``job.validate``, ``job.archive``, ``job.report`` are packages too; loading them (every run
    does) must leave the API functions in place."""
    import job.archive.writer
    import job.formats.validate  # noqa: F401
    import job.report.collect
    import job.train.trainer
    from job.archive.writer import add_tag
    from job.formats.validate import run_validation
    from job.report import write_report
    from job.train import train

    assert (job.train, job.validate, job.archive, job.report) == (train, run_validation, add_tag, write_report)
    from job.train import trainer  # the subpackages stay importable

    assert trainer.Trainer is sys.modules["job.train"].Trainer and callable(job.train)


def test_import_job_does_not_load_torch() -> None:
    code = "import sys, job, job.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO).stdout
    assert out.strip() == "False"


def _pipeline_script(root: Path) -> str:
    """Import a small TSV graph, validate, train with two Hogwild workers, evaluate: the README's example."""
    return textwrap.dedent(f"""
        import json, job
        config = job.parse_config({{
            "entity_path": {str(root / "data")!r}, "edge_paths": [{str(root / "data" / "edges")!r}],
            "checkpoint_path": {str(root / "ckpt")!r}, "entities": {{"node": {{"num_partitions": 1}}}},
            "relations": [{{"name": "r", "lhs": "node", "rhs": "node", "operator": "translation"}}],
            "dynamic_relations": True, "global_emb": False, "dimension": 8, "num_epochs": 2, "eval_fraction": 0.0,
            "workers": 2, "batch_size": 50,  # >= 2 batches: the Hogwild pool starts
        }})
        job.import_edges(config, [{str(root / "edges.tsv")!r}], job.ImportOptions(lhs_col=0, rel_col=1, rhs_col=2))
        assert not job.validate(config).problems
        summary = job.train(config)
        metrics = job.evaluate(config, candidates="all")
        print(json.dumps({{"edges": summary["train_edges"], "mrr": metrics["mrr"]}}))
    """)


def _write_edges(root: Path) -> None:
    lines = [f"n{i}\\tr{i % 3}\\tn{(i * 7 + 1) % 50}" for i in range(400)]
    (root / "edges.tsv").write_text("\n".join(line.replace("\\t", "\t") for line in lines) + "\n")


def _check(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["edges"] == 2 * 400 and 0 < out["mrr"] <= 1


@pytest.mark.slow
def test_api_from_a_script_without_a_main_guard(tmp_path: Path) -> None:
    """Spawned Hogwild workers must not run the user's script again (multiprocessing would refuse to start)."""
    _write_edges(tmp_path)
    script = tmp_path / "pipeline.py"
    script.write_text(_pipeline_script(tmp_path))
    _check(subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=600))


@pytest.mark.slow
def test_api_from_standard_input(tmp_path: Path) -> None:
    """``python - <<EOF``: before the fix the workers died with FileNotFoundError: '<stdin>'."""
    _write_edges(tmp_path)
    _check(subprocess.run([sys.executable, "-"], input=_pipeline_script(tmp_path), capture_output=True, text=True,
                          cwd=tmp_path, timeout=600))


def test_every_api_function_taking_a_config_runs_with_its_storage_settings() -> None:
    """storage_options and edge_read_mode apply to import, validate, train, eval, export, archive and grow alike
    (before, only train applied edge_read_mode and each command set the options process-wide, or forgot to)."""
    import inspect

    import storage_adapters as storage
    from job.session import settings_of, storage_scoped

    scoped = [name for name in job._API if callable(getattr(job, name)) and not inspect.isclass(getattr(job, name))
              and "config" in inspect.signature(getattr(job, name)).parameters]
    assert set(scoped) >= {"import_edges", "validate", "train", "evaluate", "export", "archive", "grow"}
    # convert_legacy's config is the one it stores in the converted checkpoint, not where its files are: it runs in
    # the caller's settings (the command line's --storage-option, or storage.using(...) around the call)
    for name in set(scoped) - {"convert_legacy"}:
        assert hasattr(getattr(job, name), "__wrapped__"), f"job.{name} does not apply its config's storage settings"

    config = job.parse_config({"entities": {"n": {"num_partitions": 1}}, "relations": [{"name": "r", "lhs": "n", "rhs": "n"}],
                               "entity_path": "/tmp/x", "edge_paths": ["/tmp/y"], "checkpoint_path": "/tmp/z",
                               "dimension": 4, "edge_read_mode": "stream", "storage_options": {"endpoint_url": "http://minio:9000"}})
    seen = storage_scoped(lambda config: (storage.current().settings.edge_read_mode,
                                          storage.storage_options_for("s3://b/k").get("endpoint_url")))(config)
    assert seen == ("stream", "http://minio:9000") and settings_of(config).edge_read_mode == "stream"
    assert storage.current().settings.edge_read_mode == "stage"  # nothing left behind


def test_every_module_imports_first() -> None:
    """No import cycle hides behind import order: each module of job/ and storage_adapters/ imports on its own,
    as the first module of the package loaded (a cycle train -> growing -> train once passed every test that
    happened to import job.train first)."""
    code = textwrap.dedent("""
        import importlib, pkgutil, sys, job, storage_adapters
        names = [m.name for pkg in (job, storage_adapters)
                 for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".") if ".fb." not in m.name]
        failed = []
        for name in names:
            for loaded in [m for m in sys.modules if m.split(".")[0] in ("job", "storage_adapters")]:
                del sys.modules[loaded]
            try:
                importlib.import_module(name)
            except Exception as err:
                failed.append(f"{name}: {type(err).__name__}: {err}")
        print(len(names)); print("\\n".join(failed))
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    count, *failures = result.stdout.strip().splitlines()
    assert int(count) > 100 and not failures, "\n".join(failures)


def test_the_demo_leaves_a_config_that_trains_on_the_train_split(tmp_path: Path) -> None:
    """`biggraph train demo-output/config.yaml` must train on what the demo trained on (it used to list the
    valid and test splits too, so reusing it trained on the test split)."""
    from job.demo import demo_config

    config = job.parse_config(demo_config(str(tmp_path), epochs=1))
    assert config.edge_paths == [str(tmp_path / "data" / "train")]
