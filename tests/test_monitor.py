"""Monitors (JSON lines, CSV, TensorBoard) written by rank 0, plots, and the progress bar."""
from __future__ import annotations

import csv
import fcntl
import importlib.util
import json
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
import torch

import shardtrain
from shardtrain import comm, monitor
from shardtrain.monitor import Progress, plot_main, read_metrics

from _dist import run_ranks

STEPS, MICRO, GAS, WORLD = 4, 3, 2, 2
PNG = b"\x89PNG\r\n\x1a\n"
HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None  # an optional extra


def train_with_monitors(rank: int, world_size: int, out: str) -> dict:
    """Each rank trains a small MLP with every monitor on; returns its own losses per step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    monitors = {"enabled": True, "output_path": out, "job_name": "job"}
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
              "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
              "jsonl_monitor": monitors, "csv_monitor": monitors,
              "tensorboard": monitors if HAS_TENSORBOARD else {"enabled": False}}
    engine, *_ = shardtrain.initialize(model=model, config=config)
    torch.manual_seed(100 + rank)
    losses = []
    for _ in range(STEPS):
        step_losses = []
        for _ in range(GAS):
            loss = engine(torch.randn(MICRO, 8)).pow(2).mean()
            engine.backward(loss)
            engine.step()
            step_losses.append(loss.item())
        losses.append(sum(step_losses) / GAS)
    engine.log_metrics(eval_loss=torch.tensor(0.25))
    engine.monitor.write_events([("Eval/Samples/accuracy", 0.5, 1000)])  # DeepSpeed's call
    writers = len(engine.monitor.monitors) if engine.monitor.enabled else -1
    engine.monitor.close()
    return {"losses": losses, "writers": writers, "states": engine.model_state_bytes()["total"]}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("monitors")
    results = run_ranks("test_monitor:train_with_monitors", WORLD, timeout=120, out=str(out))
    return out / "job", results


def test_only_rank_0_writes(run):
    job, results = run
    assert [r["writers"] for r in results] == [2 + HAS_TENSORBOARD, 0]
    assert len(list(job.glob("events.out.tfevents.*"))) == int(HAS_TENSORBOARD)


def test_jsonl_rows(run):
    job, results = run
    rows = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    steps, extra = rows[:STEPS], rows[STEPS:]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert [r["samples"] for r in steps] == [MICRO * GAS * WORLD * k for k in (1, 2, 3, 4)]
    for k, row in enumerate(steps):
        mean_over_ranks = sum(r["losses"][k] for r in results) / WORLD
        assert row["loss"] == pytest.approx(mean_over_ranks, rel=1e-5)
        assert row["lr"] == 0.05 and row["grad_norm"] > 0 and row["skipped"] is False
        assert row["samples_per_s"] > 0 and row["tokens_per_s"] is None  # float inputs: no tokens
        assert row["memory_allocated"] == [r["states"] for r in results]
        activations = MICRO * (8 + 16) * 4  # the input, and the tanh output (saved by both)
        assert row["memory_peak"] == [r["states"] + activations for r in results]
        assert "time_ms" not in row and "loss_scale" not in row
    assert extra == [{**extra[0], "step": STEPS, "eval_loss": 0.25},
                     {**extra[1], "step": STEPS, "samples": 1000, "Eval/Samples/accuracy": 0.5}]


def test_csv_rows_follow_deepspeed(run):
    job, _ = run
    with open(job / "Train_Samples_train_loss.csv") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "train_loss"]
    assert [int(r[0]) for r in rows[1:]] == [MICRO * GAS * WORLD * k for k in (1, 2, 3, 4)]
    for name in ("lr", "grad_norm", "samples_per_sec", "memory_peak_rank0", "memory_peak_rank1",
                 "memory_allocated_rank1"):
        with open(job / f"Train_Samples_{name}.csv") as f:
            assert len(list(csv.reader(f))) == 1 + STEPS, name
    with open(job / "Train_Samples_eval_loss.csv") as f:
        assert list(csv.reader(f)) == [["step", "eval_loss"], [str(MICRO * GAS * WORLD * STEPS), "0.25"]]


def test_tensorboard_scalars(run):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    job, results = run
    events = event_accumulator.EventAccumulator(str(job))
    events.Reload()
    losses = events.Scalars("Train/Samples/train_loss")
    assert [e.step for e in losses] == [MICRO * GAS * WORLD * k for k in (1, 2, 3, 4)]
    assert losses[0].value == pytest.approx(sum(r["losses"][0] for r in results) / WORLD, rel=1e-5)
    assert len(events.Scalars("Train/Samples/memory_peak_rank1")) == STEPS


def test_plot_writes_valid_pngs(run, tmp_path, capsys):
    matplotlib_image = pytest.importorskip("matplotlib.image")
    job, _ = run
    assert plot_main([str(job), "--out", str(tmp_path / "jsonl")]) == 0
    written = [Path(line) for line in capsys.readouterr().out.split()]
    assert sorted(p.name for p in written) == ["loss.png", "lr.png", "memory.png", "throughput.png"]
    for path in written:
        assert path.read_bytes().startswith(PNG)
        height, width, _ = matplotlib_image.imread(path).shape
        assert height > 100 and width > 100
    # With only the CSV monitor's files, the x-axis is global samples.
    csv_only = tmp_path / "csv_only"
    csv_only.mkdir()
    for file in job.glob("*.csv"):
        (csv_only / file.name).write_bytes(file.read_bytes())
    records, x_name = read_metrics(str(csv_only))
    assert x_name == "samples" and len(records) == STEPS and len(records[0]["memory_peak"]) == WORLD
    assert plot_main([str(csv_only)]) == 0
    assert len(list((csv_only / "plots").glob("*.png"))) == 4


def test_plot_through_the_shardtrain_command(run, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from shardtrain.cli import main
    job, _ = run
    assert main(["plot", str(job), "--out", str(tmp_path)]) == 0
    assert len(list(tmp_path.glob("*.png"))) == 4
    with pytest.raises(SystemExit) as exit_info:
        main(["plot", "--help"])
    assert exit_info.value.code == 0 and "shardtrain plot [-h] [--out DIR] RUN_DIR" in capsys.readouterr().out


def test_plot_errors(tmp_path, capsys, monkeypatch):
    assert plot_main([str(tmp_path / "missing")]) == 1
    assert "no run directory" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "samples": 2, "loss": 1.0}\n')
    assert plot_main([str(tmp_path)]) == 1
    assert "pip install 'shardtrain[plot]'" in capsys.readouterr().err


def test_tensorboard_missing_names_the_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r"pip install 'shardtrain\[tensorboard\]'"):
        monitor.TensorBoardMonitor(str(tmp_path))


# ---------------------------------------------------------------------------- trackers

TRACKER_ENV = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "MLFLOW_ALLOW_FILE_STORE": "true"}


def train_with_trackers(rank: int, world_size: int, out: str) -> dict:
    """2 ranks train with Weights & Biases (offline), MLflow (a file store) and the JSON-lines
    monitor on; rank 0 writes to all three."""
    os.environ["WANDB_DIR"] = out
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
              "optimizer": {"type": "SGD", "params": {"lr": 0.05}}, "zero_optimization": {"stage": 1},
              "jsonl_monitor": {"enabled": True, "output_path": out, "job_name": "job"},
              "wandb": {"enabled": True, "project": "shardtrain-test"},
              "mlflow": {"enabled": True, "tracking_uri": f"file://{out}/mlruns",
                         "experiment_name": "tiny", "run_name": "two-ranks"}}
    engine, *_ = shardtrain.initialize(model=model, config=config)
    torch.manual_seed(100 + rank)
    for _ in range(STEPS * GAS):
        engine.backward(engine(torch.randn(MICRO, 8)).pow(2).mean())
        engine.step()
    engine.log_metrics(eval_loss=torch.tensor(0.25))
    kinds = [type(m).__name__ for m in engine.monitor.monitors]
    run_id = next((m.run_id for m in engine.monitor.monitors if hasattr(m, "run_id")), None)
    engine.monitor.close()
    return {"monitors": kinds, "mlflow_run": run_id}


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    out = tmp_path_factory.mktemp("trackers")
    results = run_ranks("test_monitor:train_with_trackers", WORLD, timeout=180, out=str(out),
                        env=TRACKER_ENV)
    rows = [json.loads(line) for line in (out / "job" / "metrics.jsonl").read_text().splitlines()]
    return out, results, rows


def _wandb_records(path: Path):
    """The records of an offline run's ``.wandb`` file: W&B's log format (a 7-byte header,
    then 32 KiB blocks of records framed by CRC32, length and a full/first/middle/last kind),
    each a protobuf ``Record``."""
    import struct
    from wandb.proto import wandb_internal_pb2
    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (length == 0 and kind == 0):
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            yield record


def test_weights_and_biases_offline_holds_the_scalars_and_the_config(tracked):
    out, results, rows = tracked
    assert results[0]["monitors"] == ["JSONLinesMonitor", "WandbMonitor", "MLflowMonitor"]
    assert results[1]["monitors"] == []  # rank 0 alone writes
    runs = list(out.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(runs) == 1  # one run, rank 0's
    logged, config = [], {}
    for record in _wandb_records(runs[0]):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            logged.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                           for i in record.history.item})
        elif kind == "run":
            config.update({u.key: json.loads(u.value_json) for u in record.run.config.update})
    train = [h for h in logged if "Train/Samples/train_loss" in h]
    assert [h["Train/Samples"] for h in train] == [r["samples"] for r in rows[:STEPS]]
    for h, row in zip(train, rows):
        assert h["Train/Samples/train_loss"] == pytest.approx(row["loss"], rel=1e-6)
        assert h["Train/Samples/lr"] == row["lr"]
        assert h["Train/Samples/grad_norm"] == pytest.approx(row["grad_norm"], rel=1e-6)
    assert logged[-1]["Train/Samples/eval_loss"] == 0.25
    assert config["zero_optimization"]["stage"] == 1  # the resolved config, nested
    assert config["train_batch_size"] == MICRO * GAS * WORLD


def test_mlflow_file_store_holds_the_scalars_and_the_config(tracked, monkeypatch):
    from mlflow.tracking import MlflowClient
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    out, results, rows = tracked
    client = MlflowClient(tracking_uri=f"file://{out}/mlruns")
    run = client.get_run(results[0]["mlflow_run"])
    assert run.info.run_name == "two-ranks" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "tiny"
    params = run.data.params
    assert params["zero_optimization.stage"] == "1" and params["optimizer.type"] == "SGD"
    assert params["train_batch_size"] == str(MICRO * GAS * WORLD)
    losses = client.get_metric_history(run.info.run_id, "Train/Samples/train_loss")
    assert [m.step for m in losses] == [r["samples"] for r in rows[:STEPS]]
    for m, row in zip(losses, rows):
        assert m.value == pytest.approx(row["loss"], rel=1e-6)
    assert [m.value for m in client.get_metric_history(run.info.run_id,
                                                        "Train/Samples/eval_loss")] == [0.25]


def test_a_missing_tracker_names_the_install(monkeypatch):
    from shardtrain.telemetry.monitors import MLflowMonitor, WandbMonitor
    from shardtrain.config import load_config
    cfg = load_config({"train_batch_size": 1, "wandb": {"enabled": True},
                       "mlflow": {"enabled": True}}, world_size=1)
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match=r"pip install 'shardtrain\[wandb\]'"):
        WandbMonitor(cfg.wandb, {})
    monkeypatch.setitem(sys.modules, "mlflow", None)
    monkeypatch.setitem(sys.modules, "mlflow.entities", None)
    with pytest.raises(ImportError, match=r"pip install 'shardtrain\[mlflow\]'"):
        MLflowMonitor(cfg.mlflow, {})


# ---------------------------------------------------------------------------- progress bar


def test_progress_is_quiet_without_a_terminal_and_on_other_ranks(capsys, monkeypatch):
    with Progress(total=4) as bar:  # pytest's stderr is not a terminal
        for _ in range(4):
            bar.update(loss=1.0)
    assert capsys.readouterr().err == ""
    with Progress(total=4, every=2, desc="fit") as bar:
        for _ in range(4):
            bar.update(loss=1.5)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and lines[0].startswith("fit 2/4 loss=1.5") and "eta=" in lines[0]
    monkeypatch.setattr(comm, "get_rank", lambda: 1)
    with Progress(total=4, every=1, enabled=True) as bar:
        bar.update(loss=1.0)
    assert capsys.readouterr().err == "" and bar._bar is None


_BAR_SCRIPT = """
import torch, shardtrain
from shardtrain.telemetry import Progress
torch.manual_seed(0)
engine, *_ = shardtrain.initialize(model=torch.nn.Embedding(10, 4), config={
    "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
with Progress(total=3, engine=engine) as bar:
    for _ in range(3):
        engine.backward(engine(torch.randint(0, 10, (2, 5))).pow(2).mean())
        engine.step()
        bar.update()
"""


def test_progress_draws_a_bar_in_a_terminal_and_nothing_in_a_log(tmp_path):
    """The same script, by default: a tqdm bar when stderr is a terminal (a pseudo-terminal
    here), nothing when it goes to a file."""
    script = tmp_path / "bar.py"
    script.write_text(_BAR_SCRIPT)
    env = dict(os.environ)
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 100 columns
    proc = subprocess.Popen([sys.executable, str(script)], stdin=follower, stdout=follower,
                            stderr=follower, env=env, close_fds=True)
    os.close(follower)
    seen = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the terminal closed: the script ended
            break
        if not chunk:
            break
        seen += chunk
    assert proc.wait(timeout=120) == 0, seen.decode(errors="replace")[-2000:]
    os.close(leader)
    text = seen.decode(errors="replace")
    assert "train: 100%" in text and "3/3" in text and "loss=" in text, text[-2000:]
    logged = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                            text=True, timeout=120)
    assert logged.returncode == 0 and logged.stderr == "" and logged.stdout == "", logged.stderr


def test_progress_shows_the_engine_loss_and_throughput(capsys):
    torch.manual_seed(0)
    engine, *_ = shardtrain.initialize(model=torch.nn.Embedding(10, 4), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    with Progress(total=3, every=1, engine=engine) as bar:
        for _ in range(3):
            engine.backward(engine(torch.randint(0, 10, (2, 5))).pow(2).mean())
            engine.step()
            bar.update()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3 and all(" loss=" in line and " tok_s=" in line and " lr=0.1" in line
                                   for line in lines)
