"""`elastic bench`'s sizing and ceiling: the model fits the memory it is given, every paper layout
splits it, and the loopback ceiling is a real throughput of real processes."""
from __future__ import annotations

import pytest

from launcher.cli import main as elastic
from migrate.bench import BenchConfig, estimated_peak_bytes, fit_hidden, loopback_ceiling
from migrate.layout import ParallelConfig
from migrate.scenarios import PAPER_SCENARIOS


def _closed_form_peak(hidden: int, workers: int, dp_old: int, dp_new: int) -> int:
    """48 layers of 12 h^2 + 13 h (qkv, out, 2 ffn, 2 layer norms: weights and biases), embeddings and head."""
    layer = 12 * hidden * hidden + 13 * hidden
    params = 48 * layer + 2 * 8192 * hidden + 32 * hidden + 2 * hidden
    return workers * (300 << 20) + 4 * params * (4 * dp_old + 3 * dp_new)


def test_fitted_model_stays_within_the_budget_and_splits_over_every_layout() -> None:
    names = list(PAPER_SCENARIOS)
    budget = 12 << 30
    cfg = fit_hidden(BenchConfig(), names, budget)
    assert cfg is not None
    model = cfg.model()
    for name in names:
        prev, curr = map(ParallelConfig.parse, PAPER_SCENARIOS[name])
        model.check_config(prev)
        model.check_config(curr)
        assert estimated_peak_bytes(model, prev, curr) <= budget
    bigger = fit_hidden(BenchConfig(), names, 10**15)
    assert bigger is not None and bigger.hidden >= cfg.hidden
    assert fit_hidden(BenchConfig(), names, 1 << 30) is None  # 32 worker processes alone need more


def test_estimate_matches_a_closed_form() -> None:
    cfg = BenchConfig(hidden=256)
    prev, curr = map(ParallelConfig.parse, PAPER_SCENARIOS["pp4tp2dp3-pp4tp8dp1"])
    expected = _closed_form_peak(256, 32, 3, 1)
    assert abs(estimated_peak_bytes(cfg.model(), prev, curr) - expected) <= 0.02 * expected


def test_loopback_ceiling_of_real_processes() -> None:
    gbps = loopback_ceiling(2, nbytes=4 << 20)
    assert 1e6 < gbps < 1e12  # bytes/s two processes really moved, not a constant


@pytest.mark.parametrize("args", [["--layers", "22"], ["--hidden", "100"]])
def test_bad_model_sizes_are_usage_errors_before_anything_starts(args, capsys) -> None:
    assert elastic(["bench", "--scenario", "pp4tp2-pp4tp4", *args]) == 2
    assert "error" in capsys.readouterr().err
