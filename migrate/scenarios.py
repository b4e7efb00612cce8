"""The paper's six reconfigurations, old layout -> new layout, by the name `elastic bench --scenario`
takes. Apart from migrate.bench (which imports torch) so that `elastic bench --help` and a mistyped
`--scenario` answer without a torch import."""
from __future__ import annotations

PAPER_SCENARIOS: dict[str, tuple[str, str]] = {
    "pp8tp1-pp16tp1": ("pp8tp1", "pp16tp1"),
    "pp4tp2-pp4tp4": ("pp4tp2", "pp4tp4"),
    "pp4tp4-pp4tp2": ("pp4tp4", "pp4tp2"),
    "pp4tp2-pp6tp4": ("pp4tp2", "pp6tp4"),
    "pp6tp4-pp4tp2": ("pp6tp4", "pp4tp2"),
    "pp4tp2dp3-pp4tp8dp1": ("pp4tp2dp3", "pp4tp8dp1"),
}
