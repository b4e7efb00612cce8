"""The two runs side by side, and the issue's goals checked against them (pure)."""
from __future__ import annotations

from collections.abc import Sequence

from launcher.policybench.replay import RunResult


def goals(manual: RunResult, opportunistic: RunResult) -> dict[str, bool]:
    """Utilisation >= 25 points higher; the plain jobs' median wait no longer than with manual beyond one
    migration (the longest yield's duration, decision to commit: what a plain job waiting for its nodes waits
    for; its training pause is shorter); every step once; every policy migration succeeded and bit-exact (or
    moved nothing)."""
    shrinks = [r for r in opportunistic.resizes if _devices(r["to_layout"]) < _devices(r["from_layout"])]
    allowance = max((r["duration_s"] or 0.0 for r in shrinks), default=0.0)
    m, o = manual.median_wait_s, opportunistic.median_wait_s
    return {
        "utilisation +25 points": opportunistic.utilisation - manual.utilisation >= 0.25,
        "plain median wait no longer": m is not None and o is not None and o <= m + allowance,
        "every step once": manual.every_step_once and opportunistic.every_step_once,
        "resizes succeeded, bit-exact": all(r["status"] == "succeeded" and r["bit_exact"] is not False
                                            for r in opportunistic.resizes),
    }


def describe(runs: Sequence[RunResult]) -> list[str]:
    lines = [f"{'policy':<14} {'util':>6} {'window':>7} {'plain wait median/max':>22} {'not started':>11} "
             f"{'steps':>6} {'replica-steps':>13} {'resizes':>7} {'yield -> plain running':>22}"]
    for r in runs:
        waits = "-" if r.median_wait_s is None else f"{r.median_wait_s:.1f} / {r.max_wait_s:.1f} s"
        ylds = [y["plain_wait_s"] for y in r.yields if y["plain_wait_s"] is not None]
        yld = f"{min(ylds):.1f}-{max(ylds):.1f} s ({len(ylds)})" if ylds else "-"
        lines.append(f"{r.policy:<14} {r.utilisation * 100:>5.1f}% {r.window_s:>6.0f}s {waits:>22} "
                     f"{r.never_started:>11} {r.steps:>6} {r.replica_steps:>13} {len(r.resizes):>7} {yld:>22}")
        if r.error:
            lines.append(f"  {r.policy}: {r.error}")
    return lines


def _devices(layout: str) -> int:
    from migrate.layout import ParallelConfig

    return ParallelConfig.parse(layout).world_size
