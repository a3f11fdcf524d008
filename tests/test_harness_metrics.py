"""bench's timed metrics are named once (harness/metrics.py): its rules, the agents' compact
results and the table read that table (issue #53: three hand-kept lists before)."""
from __future__ import annotations

from fastelbo.harness import metrics, table
from fastelbo.harness.agents import summary
from fastelbo.harness.bench import bench_rows


def test_every_reader_takes_the_metrics_from_one_table():
    assert bench_rows.METRICS is metrics.KEYS and summary.METRICS is metrics.NAMES
    assert [f"{name}_ms" for name in metrics.NAMES] == list(metrics.KEYS)
    assert set(table.COLUMNS) == set(metrics.NAMES)
    assert [table.HEADERS.index(metrics.METRICS[m].column) for m in table.COLUMNS] == [3, 4, 5]


def test_each_metric_has_its_speedups():
    """A row's speedups come from each metric's row key: timed in each, one per metric."""
    import torch
    out = (torch.arange(4.0),)
    eager = {bench_rows.EAGER: {4: {"outputs": out, **{key: 2.0 for key in metrics.KEYS}}}}
    row = bench_rows.finish_row({"batch_size": 4, "device": "cpu", "candidate": "c",
                                 "outputs": out, **{key: 1.0 for key in metrics.KEYS}},
                                eager, 1e-4, 1e-4)
    assert all(row[f"speedup_eager_{name}"] == 2.0 for name in metrics.NAMES), row
