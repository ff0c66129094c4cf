"""``python -m fullgraph.bench.outofcore`` on a small graph: both modes train and
report the same losses."""
from __future__ import annotations

import re

from fullgraph.bench import outofcore
from fullgraph.graph import store
from fullgraph.graph.synthetic import sbm


def test_outofcore_reports_both_modes_with_the_same_losses(tmp_path, capsys):
    data = tmp_path / "data"
    store.save_dataset(sbm(300, 3, avg_degree=6.0, num_features=8, seed=3), data)
    code = outofcore.main(["--dataset", str(data), "--spill-dir", str(tmp_path / "spill"),
                           "--spill-memory", "4KB", "--epochs", "2", "--hidden", "8",
                           "--row-block", "64", "--logs", str(tmp_path / "logs")])
    assert code == 0
    rows = [line for line in capsys.readouterr().out.splitlines()
            if re.match(r"\| (memory|spill) \|", line)]
    assert len(rows) == 2, rows
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    assert [c[1] for c in cells] == ["0", "0"], rows  # both exited cleanly
    assert cells[0][5] == cells[1][5] and cells[0][5].count("/") == 1, rows  # same losses
    assert not list((tmp_path / "spill").iterdir())  # nothing left behind
