"""The README's main command: `elastic demo` trains, shrinks and grows with real local workers."""
import json
import subprocess
import sys


def test_demo_shrinks_and_grows_and_records_it(tmp_path):
    db = tmp_path / "demo.db"
    out = subprocess.run([sys.executable, "-m", "launcher.cli", "demo", "--no-baseline", "--db", str(db),
                          "--steps-between", "3"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "shrink" in out.stdout and "grow" in out.stdout
    hist = subprocess.run([sys.executable, "-m", "launcher.cli", "history", "--db", str(db), "--json"],
                          capture_output=True, text=True, timeout=60)
    rows = json.loads(hist.stdout)
    assert len(rows) >= 2 and all(r["status"] == "succeeded" and r["bit_exact"] for r in rows)
    assert {r["from_layout"] != r["to_layout"] for r in rows} == {True}
    # the timeline's loss and step rate cover every layout the demo trained on, not only the first (the
    # launcher polls, and records a step's loss, between the demo's migrations)
    from db import Store

    store = Store(f"sqlite:///{db}", create=False)
    try:
        steps = store.steps(store.find_job("demo").id)
    finally:
        store.close()
    shrink, grow = sorted(rows, key=lambda r: r["id"])[:2]
    layouts = [s.layout for s in steps]
    assert shrink["to_layout"] in layouts and layouts[-1] == grow["to_layout"], layouts
    assert max(s.step for s in steps) > grow["at_step"], [s.step for s in steps]
