"""The trackers users look at, each writing its local store (no server), read back; the curves as a PNG."""

import json

import pytest
from conftest import BIN, causal_lm_args, launch, read_metrics, run, run_in_process


def test_report_to_mlflow_logs_the_runs_losses_into_output_dir(markov_data, tmp_path, monkeypatch):
    """--report_to mlflow, no MLFLOW_TRACKING_URI: the run's SQLite store output_dir/mlflow.db holds a run
    named after output_dir in the --run_name experiment, with metrics.jsonl's losses at their steps and the
    arguments as parameters."""
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "run"
    run_in_process(
        "recipes/causal_lm.py",
        causal_lm_args(
            markov_data, out, max_steps=6, report_to="mlflow", run_name="trackers", gradient_accumulation_steps=2
        ),
        monkeypatch,
    )
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    [recorded] = client.search_runs([client.get_experiment_by_name("trackers").experiment_id])
    assert recorded.info.run_name == "run" and recorded.data.params["gradient_accumulation_steps"] == "2"
    train, evaluations = read_metrics(out)
    history = client.get_metric_history(recorded.info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(row["step"], row["loss"]) for row in train]
    [final_eval] = client.get_metric_history(recorded.info.run_id, "eval_loss")
    assert final_eval.value == evaluations[-1]["eval_loss"]


@pytest.mark.slow
def test_report_to_trackio_logs_the_runs_losses_into_its_local_store(markov_data, tmp_path):
    """--report_to trackio on one launched process, its store in TRACKIO_DIR (a SQLite file per project,
    which `trackio show` serves): the project --run_name, a run named after output_dir, metrics.jsonl's
    losses at their steps."""
    out, store = tmp_path / "run", tmp_path / "trackio"
    env = {"TRACKIO_DIR": str(store)}
    launch(
        "single.yaml",
        "causal_lm.py",
        causal_lm_args(markov_data, out, max_steps=4, report_to="trackio", run_name="trackers"),
        env=env,
    )
    read = (
        "import json; from trackio.sqlite_storage import SQLiteStorage as s; "
        "print(json.dumps([s.get_runs('trackers'), s.get_logs('trackers', 'run')]))"
    )
    runs, logs = json.loads(run([BIN / "python", "-c", read], env=env).stdout.strip().splitlines()[-1])
    train, _ = read_metrics(out)
    assert runs == ["run"]
    assert [(row["step"], row["loss"]) for row in logs if "loss" in row] == [(r["step"], r["loss"]) for r in train]


@pytest.mark.slow
def test_make_plot_draws_the_runs_curves_into_a_png(markov_data, tmp_path, monkeypatch):
    from PIL import Image

    out = tmp_path / "run"
    run_in_process("recipes/causal_lm.py", causal_lm_args(markov_data, out, max_steps=4, eval_steps=2), monkeypatch)
    said = run(["make", "-s", "plot", f"RUN={out}"]).stdout
    assert "4 training and 2 evaluation rows" in said, said
    with Image.open(out / "curves.png") as image:
        assert image.format == "PNG" and image.size == (800, 600)
    refused = run(["make", "-s", "plot", f"RUN={tmp_path / 'nothing'}"], check=False)
    assert refused.returncode != 0 and "has no metrics.jsonl; pass the --output_dir of a run" in refused.stderr
