"""``fullgraph report``: figures and an HTML page from a run's metrics file.

The two-worker run is the README's Python API example (shared fixture); a
one-worker run and hand-edited copies cover the other shapes of the file.
"""
from __future__ import annotations

import importlib.util
import json
import re
import shlex
import struct
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import fullgraph
from fullgraph.cli import main
from fullgraph.errors import DataError
from fullgraph.graph.synthetic import sbm
from fullgraph.plots import FIGURE_PX, FIGURES
from fullgraph.runlog import SLOWEST_MARGIN, read_run_log

pytest.importorskip("matplotlib")

REPO_ROOT = Path(__file__).resolve().parents[1]


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's signature and IHDR chunk."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", f"{path} is no PNG"
    return struct.unpack(">II", head[16:24])


def report(metrics: Path, out: Path, capsys, argv: list[str] | None = None) -> str:
    assert main(argv or ["report", str(metrics), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    for name in (*FIGURES, "index.html"):
        assert f"wrote {out / name}" in printed
        assert (out / name).stat().st_size > 0
    for name in FIGURES:
        assert png_size(out / name) == FIGURE_PX, name
    page = (out / "index.html").read_text(encoding="ascii")
    for name in FIGURES:
        assert f'<img src="{name}"' in page
    return page


def readme_report_command() -> list[str]:
    """The arguments of the ``fullgraph report`` command in README.md."""
    section = (REPO_ROOT / "README.md").read_text().split("## Plots and a report", 1)[1]
    line = next(ln for ln in section.splitlines() if ln.startswith("fullgraph report "))
    return shlex.split(line)[1:]


def epoch_record(epoch: int, **extra) -> dict:
    """An ``epoch`` record with every key the report reads."""
    return {"event": "epoch", "epoch": epoch, "loss": 1.0, "train_acc": 0.5, "val_acc": 0.5,
            "test_acc": 0.5, "epoch_s": 0.1, **extra}


def rank_record(epoch: int, rank: int, **extra) -> dict:
    """A ``rank_epoch`` record with every key the report reads."""
    return {"event": "rank_epoch", "epoch": epoch, "rank": rank, "compute_s": 0.08,
            "comm_s": 0.01, "wait_s": 0.01, "wall_s": 0.1, **extra}


EPOCH = json.dumps(epoch_record(1))


@pytest.mark.dist
def test_readme_report_of_a_two_worker_run_marks_the_slowest_rank(readme_api_run, capsys,
                                                                  monkeypatch) -> None:
    """The README's command, as written, on the metrics of its Python example."""
    argv = readme_report_command()
    monkeypatch.chdir(readme_api_run[1])
    metrics, out = Path(argv[1]), Path(argv[argv.index("--out") + 1])
    assert argv[0] == "report" and metrics.is_file()
    page = report(metrics, out, capsys, argv)
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    epochs: dict[int, list[dict]] = {}
    for rec in lines:
        if rec["event"] == "rank_epoch":
            epochs.setdefault(rec["rank"], []).append(rec)
    # each rank's epoch of median wall time, whose parts the report's table shows (medians
    # of compute and waiting taken apart disagreed with it where two ranks were close)
    median = {rank: sorted(v, key=lambda r: r["wall_s"])[len(v) // 2]
              for rank, v in epochs.items()}
    slowest = max(median, key=lambda rank: median[rank]["compute_s"])
    waited = {rank: rec["wait_s"] for rank, rec in median.items()}
    others = [w for rank, w in waited.items() if rank != slowest]
    if waited[slowest] >= SLOWEST_MARGIN * min(others) and min(others) > 0:
        # the rank with the most compute waited about as long as the other: no one rank held
        # the other up (two workers sharing the cores take turns), and none is named
        assert "(slowest)" not in page
    else:
        assert f"<td>{slowest} (slowest)</td>" in page and page.count("(slowest)") == 1
    summary = lines[-1]
    assert f"test accuracy {summary['test_acc']:.2%} at the best-validation epoch " \
           f"{summary['best_epoch']}" in page
    assert "dataset cora: 2708 vertices" in page and "strategy data, 2 worker(s)" in page
    # the traffic outside the epochs has its lines, and bytes are in MiB as memory is
    assert "<li>set-up traffic before the first epoch, all ranks: " in page
    assert "<li>between epochs (in no epoch&#x27;s figures), all ranks: " in page
    assert "<th>sent MiB</th>" in page and "MB<" not in page


@pytest.mark.dist
def test_report_of_an_unsplit_run_names_no_slowest_rank(readme_api_run, tmp_path,
                                                         capsys) -> None:
    """Ranks whose calls did not match (waiting_split false): no straggler is guessed."""
    metrics = tmp_path / "unsplit.jsonl"
    lines = readme_api_run[1].joinpath("cora-run.jsonl").read_text().splitlines()
    edited = [json.loads(line) for line in lines]
    for rec in edited:
        if rec["event"] == "rank_epoch":
            rec["waiting_split"] = False
    metrics.write_text("\n".join(json.dumps(rec) for rec in edited) + "\n")
    page = report(metrics, tmp_path / "report", capsys)
    assert "(slowest)" not in page


def test_report_of_a_one_worker_run(tmp_path, capsys) -> None:
    metrics = tmp_path / "r\u00e9sum\u00e9" / "one.jsonl"  # a path ascii cannot spell
    metrics.parent.mkdir()
    fullgraph.fit(sbm(67, 3, avg_degree=5.0, num_features=9, seed=11), epochs=4,
                  eval_every=2, metrics_out=str(metrics))
    assert len(read_run_log(metrics).epochs) == 4 and not read_run_log(metrics).ranks
    page = report(metrics, tmp_path / "report", capsys)
    assert "strategy single, 1 worker(s)" in page and "(slowest)" not in page
    assert "r&#233;sum&#233;" in page


def test_a_last_line_cut_off_by_a_stopped_run_is_left_out(tmp_path) -> None:
    metrics = tmp_path / "cut.jsonl"
    metrics.write_text(f'{{"event": "run"}}\n{EPOCH}\n{{"event": "ep')
    with pytest.warns(UserWarning, match="line 3 was cut off"):
        assert [e["epoch"] for e in read_run_log(metrics).epochs] == [1]
    metrics.write_text(f'{{"event": "run"}}\n{{"event": "ep\n{EPOCH}\n')
    with pytest.raises(DataError, match="not a JSON line"):  # not the last: damaged
        read_run_log(metrics)


def test_without_matplotlib_one_line_says_how_to_install_it(tmp_path, capsys,
                                                            monkeypatch) -> None:
    metrics = tmp_path / "run.jsonl"
    metrics.write_text('{"event": "run"}\n')
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    assert main(["report", str(metrics), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'fullgraph[plots]'" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("content, match", [
    (None, "metrics file not found"),
    ('{"event": "run"}\nnot json\n', r"bad\.jsonl:2: not a JSON line"),
    ('{"event": "run"}\n', "no epoch record: the run stopped before its first epoch ended"),
    ('{"event": "run", "config": {"runtime": {"strategy": "tensor"}}, '
     '"dataset": {"name": "cora"}}\n',
     r"no epoch record: the run \(strategy tensor, dataset cora\) stopped before"),
    (f'{EPOCH}\n', "no run record"),
    ('[1, 2]\n', r"bad\.jsonl:1: not a metrics record"),
    (f'{{"event": "run"}}\n{EPOCH}\n{{"event": "run"}}\n',
     r"bad\.jsonl:3: a second run starts here \(the first at line 1\): the file holds "
     r"several runs.*its own --metrics-out file"),
    # a record without a key the report reads (a traceback: KeyError)
    (f'{{"event": "run"}}\n{EPOCH}\n{{"event": "rank_epoch", "rank": 0, "epoch": 1}}\n',
     r"bad\.jsonl:3: a 'rank_epoch' record without 'compute_s', 'comm_s', 'wait_s', "
     r"'wall_s'"),
    (b"\x80\x02torch pickle", r"bad\.jsonl: not a metrics file: not text"),  # a checkpoint
])
def test_a_bad_metrics_file_is_one_clear_error(tmp_path, capsys, content, match) -> None:
    metrics = tmp_path / "bad.jsonl"
    if isinstance(content, bytes):
        metrics.write_bytes(content)
    elif content is not None:
        metrics.write_text(content)
    assert main(["report", str(metrics), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fullgraph report: error: ") and err.count("\n") == 1
    assert re.search(match, err), err


def test_the_page_and_the_epoch_figure_show_what_was_injected_and_switched(tmp_path):
    from fullgraph.plots import adapt_epochs, adapt_lines

    records = [{"event": "run"}]
    for epoch in (1, 2, 3):
        records.append(epoch_record(epoch))
        for rank in (0, 1):
            events = []
            if rank == 1 and epoch == 2:
                events.append({"kind": "inject", "what": "sleep"})
            if epoch == 2:
                events.append({"kind": "shares", "switched": True, "trial": "balance",
                               "rows": [40, 27]})
            records.append(rank_record(epoch, rank, events=events))
    metrics = tmp_path / "adapt.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    log = read_run_log(metrics)
    assert adapt_epochs(log) == ([2], [2])
    if importlib.util.find_spec("matplotlib") is not None:  # the switch: before epoch 2
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib.figure import Figure

        from fullgraph.plots import _epoch_time

        fig = Figure()
        _epoch_time(fig, log, [], None)
        lines = [line for line in fig.axes[0].get_lines()
                 if line.get_label() == "plan switched"]
        assert len(lines) == 1 and list(lines[0].get_xdata()) == [1.5, 1.5]
    assert adapt_lines(log) == [
        "adapt    rank 0: injected nothing; plan switched 1 time(s); the last for epoch 2: "
        "rows per worker 40/27",
        "adapt    rank 1: injected 1 epoch(s) of sleep; plan switched 1 time(s); the last for "
        "epoch 2: rows per worker 40/27"]


def test_the_page_says_a_run_was_approximate_and_marks_the_left_out_updates(tmp_path):
    """The page named --adapt adjust+partial only in its configuration dump, and the time
    figure did not show the epochs where a worker was left out of the update."""
    from fullgraph.plots import header_lines, left_out_epochs

    records = [{"event": "run", "config": {"adapt": {"mode": "adjust+partial",
                                                     "staleness": 3, "inject": "sleep"}}}]
    for epoch in (1, 2, 3):
        records.append(epoch_record(epoch))
        for rank in (0, 1):
            records.append(rank_record(epoch, rank, events=[
                {"kind": "partial", "sync": epoch == 1, "skipped": [1] if epoch == 3 else [],
                 "stale_peers": 0, "oldest": 0}]))
    metrics = tmp_path / "partial.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    log = read_run_log(metrics)
    assert header_lines(log)[-1] == \
        "adapt --adapt adjust+partial (approximate: partial reduce, K=3), --inject sleep"
    assert left_out_epochs(log) == [3]
    if importlib.util.find_spec("matplotlib") is not None:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib.figure import Figure

        from fullgraph.plots import _epoch_time

        fig = Figure()
        _epoch_time(fig, log, [], None)
        assert [list(line.get_xdata()) for line in fig.axes[0].get_lines()
                if line.get_label().startswith("a worker left out")] == [[3, 3]]


def test_figures_draw_what_decides_their_scale_and_mark_a_diverged_epoch(tmp_path):
    """A resumed multi-worker run's restored epochs have no rank records: they were not
    drawn, yet one of them set the log scale; a non-finite loss left the loss panel a
    single point on its own fractional epoch range."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from fullgraph.plots import _epoch_time, _training

    records = [{"event": "run"}, epoch_record(1, epoch_s=2.0, restored=True)]
    for epoch in (2, 3, 4):
        records.append(epoch_record(epoch, loss=float("nan") if epoch == 4 else 1.0))
        records += [rank_record(epoch, rank) for rank in (0, 1)]
    metrics = tmp_path / "m.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    log = read_run_log(metrics)
    fig = Figure()
    _epoch_time(fig, log, [], None)
    restored = [line for line in fig.axes[0].get_lines()
                if line.get_label().startswith("restored epochs")]
    assert len(restored) == 1 and list(restored[0].get_xdata()) == [1]
    assert fig.axes[0].get_yscale() == "log"  # (2.0 s against 0.1 s: drawn now)
    fig = Figure()
    _training(fig, log, [], None)
    loss_ax, acc_ax = fig.axes
    marks = [line for line in loss_ax.get_lines()
             if line.get_label() == "loss not finite: diverged"]
    assert len(marks) == 1 and list(marks[0].get_xdata()) == [4, 4]
    assert loss_ax.get_xlim() == acc_ax.get_xlim()


def test_a_resumed_run_counts_the_epochs_it_ran_against_its_time(tmp_path):
    from fullgraph.plots import final_lines

    records = [{"event": "run"}]
    records += [epoch_record(e, **({"restored": True} if e <= 3 else {}))
                for e in range(1, 6)]
    records.append({"event": "summary", "test_acc": 0.5, "best_epoch": 4, "best_val": 0.5,
                    "train_acc": 0.6, "total_s": 0.2, "median_epoch_s": 0.1})
    metrics = tmp_path / "resumed.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert "2 epochs in 0.20 s after 3 restored from a checkpoint" in \
        final_lines(read_run_log(metrics))[1]


def test_a_run_stopped_early_says_so(tmp_path):
    from fullgraph.plots import final_lines

    metrics = tmp_path / "early.jsonl"
    fullgraph.fit(sbm(90, 3, avg_degree=5.0, num_features=12, seed=5), epochs=60, lr=0.05,
                  hidden=8, patience=3, metrics_out=str(metrics))
    log = read_run_log(metrics)
    assert len(log.epochs) < 60 and log.summary["stopped_early"]
    assert f"{len(log.epochs)} epochs in" in final_lines(log)[1]
    assert "stopped early (patience 3)" in final_lines(log)[1]


def test_a_run_resumed_after_its_early_stop_ran_no_epoch(tmp_path, capsys):
    from fullgraph.plots import final_lines
    from fullgraph.runlog import rank_rows

    records = [{"event": "run", "workers": 2, "config": {"train": {"patience": 3}}}]
    records += [{"event": "epoch", "epoch": e, "loss": 1.0, "epoch_s": 0.1, "restored": True,
                 "train_acc": 0.6, "val_acc": 0.5, "test_acc": 0.5} for e in range(1, 8)]
    records.append({"event": "summary", "test_acc": 0.5, "best_epoch": 4, "best_val": 0.5,
                    "train_acc": 0.6, "total_s": 0.0, "median_epoch_s": float("nan"),
                    "stopped_early": True})
    metrics = tmp_path / "again.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    log = read_run_log(metrics)
    assert final_lines(log)[1] == ("final loss 1.0000; no epoch ran after the 7 restored "
                                   "from a checkpoint, stopped early (patience 3)")
    assert rank_rows(log) == []  # two workers, no per-rank records: not "one worker"
    pytest.importorskip("matplotlib")
    page = report(metrics, tmp_path / "report", capsys)
    assert "no per-rank records: no epoch ran" in page and "median epoch nan" not in page


def test_a_resumed_run_times_only_the_epochs_it_ran(tmp_path, capsys):
    """The checkpoint's epochs (maybe timed under another strategy) stay out of the
    per-rank row and the figure's median, as out of the summary's median epoch."""
    from fullgraph.runlog import rank_rows

    records = [{"event": "run", "workers": 1}]
    records += [{"event": "epoch", "epoch": e, "loss": 1.0, "epoch_s": 0.5 if e <= 3 else 0.1,
                 "train_acc": 0.6, "val_acc": 0.5, "test_acc": 0.5,
                 **({"restored": True} if e <= 3 else {})} for e in range(1, 6)]
    records.append({"event": "summary", "test_acc": 0.5, "best_epoch": 4, "best_val": 0.5,
                    "train_acc": 0.6, "total_s": 0.2, "median_epoch_s": 0.1})
    metrics = tmp_path / "resumed.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    log = read_run_log(metrics)
    assert [e["epoch"] for e in log.ran] == [4, 5]
    assert [row.wall_s for row in rank_rows(log)] == [0.1]  # not the 0.5 s of the restored
    from fullgraph.plots import header_lines  # (the heading's strategy is the resumed run's)

    assert "5 epochs (3 of them restored from a checkpoint, which another strategy or " \
        "worker count may have run)" in header_lines(log)[2]
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from fullgraph.plots import _epoch_time

    fig = Figure()
    _epoch_time(fig, log, rank_rows(log), None)
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert "median 100.0 ms" in labels and "restored from a checkpoint" in labels


def test_a_run_without_validation_vertices_is_reported_as_it_kept_its_model(tmp_path):
    from fullgraph.plots import final_lines

    d = SimpleNamespace(x=torch.randn(60, 4), y=torch.arange(60) % 3,
                        edge_index=torch.randint(0, 60, (2, 200)),
                        train_mask=torch.arange(60) < 40, test_mask=torch.arange(60) >= 40)
    metrics = tmp_path / "noval.jsonl"
    fullgraph.fit(d, epochs=3, hidden=4, metrics_out=str(metrics))
    first = final_lines(read_run_log(metrics))[0]
    assert first.startswith("no validation vertices: the model kept is the last epoch's "
                            "(epoch 3): test accuracy ") and "nan" not in first


def test_a_directory_given_as_the_metrics_file_is_named(tmp_path, capsys):
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert "is a directory, not a metrics file" in capsys.readouterr().err


def test_a_one_epoch_run_plots_its_point_at_that_epoch(tmp_path) -> None:
    """One epoch: the loss was a line of one point (drawn as nothing) and the epoch
    axis ran 0.95-1.05."""
    from fullgraph import plots
    from fullgraph.runlog import rank_rows

    metrics = tmp_path / "one.jsonl"
    fullgraph.fit(sbm(67, 3, avg_degree=5.0, num_features=9, seed=11), epochs=1,
                  metrics_out=str(metrics))
    log = read_run_log(metrics)
    for draw in (plots._training, plots._epoch_time):
        fig = plots._figure()
        draw(fig, log, rank_rows(log), None)
        ax = fig.axes[0]
        assert ax.lines[0].get_marker() == ".", draw
        assert list(ax.get_xticks()) == [1] and ax.get_xlim() == (0, 2), draw


def test_a_multi_worker_run_without_epochs_is_not_called_one_worker(tmp_path) -> None:
    """Resumed after its last epoch, a 3-worker run has no per-rank records: its bytes
    figure said "no communication (one worker)"."""
    from fullgraph import plots
    from fullgraph.runlog import RunLog

    epoch = {"epoch": 1, "loss": 1.0, "train_acc": 0.5, "val_acc": 0.5, "test_acc": 0.5,
             "epoch_s": 0.1, "restored": True}
    fig = plots._figure()
    plots._bytes(fig, RunLog(tmp_path / "m.jsonl", {"workers": 3}, [epoch]), [], None)
    assert [t.get_text() for t in fig.axes[0].texts] == ["no communication (no epoch ran)"]


def test_a_huge_loss_keeps_the_epoch_table_in_its_columns():
    """``--lr 1e6``: a loss of 34222809022464.0000 pushed every later column out."""
    from fullgraph.report import TABLE_COLUMNS, _fmt

    for name, width, fmt in TABLE_COLUMNS:  # the loss and the seconds
        for value in ((34222809022464.0, 1.5, 123456.7, 1e100, -1e100)
                      if fmt.endswith("f") else ()):
            assert len(_fmt(width, fmt, value)) == width, (name, value)
    assert _fmt(8, ".4f", 34222809022464.0) == "3.42e+13"


def test_a_requeued_run_keeps_its_first_attempts_rank_records(tmp_path):
    """A job requeued with the same command (``--resume auto``, the same
    ``--metrics-out``) replaced the file of its first attempt, and every per-rank
    record of the epochs the checkpoint brought went with it: their injected slowdowns
    and plan switches vanished from the report."""
    from fullgraph.plots import adapt_epochs, adapt_lines
    from fullgraph.report import EpochRecord, Reporter

    metrics = tmp_path / "m.jsonl"
    first = [{"event": "run"}]
    for epoch, loss in ((1, 1.5), (2, 1.25), (3, 1.0)):
        first.append(epoch_record(epoch, loss=loss))
        first += [rank_record(epoch, rank, events=[{"kind": "inject", "what": "sleep"}]
                              if (epoch, rank) == (2, 1) else []) for rank in (0, 1)]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in first))
    reporter = Reporter(5, metrics_out=str(metrics), verbose=False)
    reporter.resumed_after = 2  # the checkpoint of epoch 2 of that run
    reporter.header([], {})
    # its epochs, then epoch 3 again, and epoch 4
    reporter.restored([EpochRecord(e, loss, 0.5, 0.5, 0.5, 0.1, 0.0, 0.0, 0.0)
                       for e, loss in ((1, 1.5), (2, 1.25))])
    for epoch in (3, 4):
        reporter.epoch(EpochRecord(epoch, 0.9, 0.5, 0.5, 0.5, 0.1, 0.0, 0.0, 0.0))
        reporter.ranks([{k: v for k, v in rank_record(epoch, rank).items() if k != "event"}
                        for rank in (0, 1)])
    reporter.close()
    log = read_run_log(metrics)
    assert {r: [x["epoch"] for x in recs] for r, recs in log.restored_ranks.items()} == \
        {0: [1, 2], 1: [1, 2]}
    assert {r: [x["epoch"] for x in recs] for r, recs in log.ranks.items()} == \
        {0: [3, 4], 1: [3, 4]}  # the first attempt's epoch 3 is not this run's
    assert adapt_epochs(log)[0] == [2]
    assert any("rank 1: injected 1 epoch(s) of sleep" in line for line in adapt_lines(log))
    # another run's file (its losses differ) lends nothing
    reporter = Reporter(5, metrics_out=str(metrics), verbose=False)
    reporter.resumed_after = 1
    reporter.header([], {})
    reporter.restored([EpochRecord(1, 7.0, 0.5, 0.5, 0.5, 0.1, 0.0, 0.0, 0.0)])
    reporter.close()
    assert not any('"rank_epoch"' in line for line in metrics.read_text().splitlines())


def test_an_unfinished_run_says_how_far_it_got_and_its_best_so_far(tmp_path):
    """A killed run's page said "17 epochs" and nothing of the 400 asked for or of its
    best validation accuracy so far."""
    from fullgraph.plots import final_lines

    records = [{"event": "run", "config": {"train": {"epochs": 400}}}]
    records += [epoch_record(e, val_acc=v, test_acc=v - 0.1)
                for e, v in ((1, 0.5), (2, 0.75), (3, 0.75))]
    metrics = tmp_path / "m.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert final_lines(read_run_log(metrics)) == [
        "unfinished run: last epoch 3 of 400, loss 1.0000; best validation so far at epoch "
        "2: validation 75.00%, test 65.00%"]
