"""examples/mixer_live.py under `elastic-launch --backend local` in LIVE mode (launcher.runtime): an MLP-Mixer
with TP (parallelize_module) and DP on 2 nodes x 2 devices, shrunk to 1 node and grown back with
`elastic resize`. Oracle: the script saves the whole state (full tensors) after every step and before
every step; across each migration the state before step S+1 on the new layout equals the state
after step S on the old one bit for bit, and every step runs exactly once."""
from __future__ import annotations

from pathlib import Path

from db import Store
from tests.examples.harness import assert_state_carried, shrink_and_grow


def test_mixer_tp_dp_migrates_live_bit_exact_on_shrink_and_grow(tmp_path: Path) -> None:
    url, dump = f"sqlite:///{tmp_path}/e.db", tmp_path / "dump"
    dump.mkdir()
    rows = shrink_and_grow(tmp_path, "mixer", "tp2dp2,tp2dp1", "pp1tp2dp1", "mixer_live.py",
                           ["--steps", "40", "--dump-dir", str(dump), "--step-sleep", "0.25"])
    assert [r[0] for r in rows] == list(range(1, 41)), rows  # every step once, none lost or repeated
    assert [r[2] for r in rows] == [8 * s for s in range(1, 41)]  # the data position travelled
    layouts = [r[1] for r in rows]
    assert layouts[0] == "pp1tp2dp2" and "pp1tp2dp1" in layouts and layouts[-1] == "pp1tp2dp2"
    changed = [s for s in range(1, 40) if layouts[s] != layouts[s - 1]]
    assert len(changed) == 2
    assert_state_carried(dump, 40)  # the state carried into step s+1 is exactly the state step s left
    store = Store(url)
    job = store.find_job("mixer")
    assert (job.state, job.mode) == ("finished", "live")
    # registered from the first second in restart mode (auto), live once the workers joined through the runtime
    assert [m.layout for m in store.rank_maps(job.id)] == ["pp1tp2dp2", "pp1tp2dp1", "pp1tp2dp2"]  # only what trained
    migs = sorted(store.recent_migrations(job.id, limit=10), key=lambda m: m.id)
    assert [(m.kind, m.status, m.from_layout, m.to_layout) for m in migs] == [
        ("live", "succeeded", "pp1tp2dp2", "pp1tp2dp1"), ("live", "succeeded", "pp1tp2dp1", "pp1tp2dp2")]
    assert migs[1].bytes_moved > 0  # the grow fills the new node; the shrink kept node0 whole (local copies)
    # what `elastic jobs` and the job page say it survives, for a script's own model too (no dry-run model): back
    # on pp1tp2dp2, a TP group per node, each node a full replica; the local backend's batch node, nothing
    spec = store.launch_spec(job.id)
    assert spec["model"] is None and spec["survives"] == {"process": True, "node": True, "batch": False}


def test_the_plain_training_that_live_mode_is_timed_against_is_the_same_training(tmp_path: Path) -> None:
    """`elastic bench-control --steady` compares mixer_live's live step with its --plain one (torch.distributed
    alone, restart mode): that is only a comparison if both compute the same thing, step for step."""
    from tests.examples.harness import mixer_rows, run_local

    for name, launch, extra in (("live", ["--layouts", "tp2dp2"], []), ("plain", ["--mode", "restart"], ["--plain"])):
        (tmp_path / name).mkdir()
        run_local(tmp_path / name, ["--gpus-per-node", "2", "--nnodes", "2", "--job-name", name, *launch],
                  ["mixer_live.py", "--steps", "12", "--log", str(tmp_path / name / "steps.log"), *extra],
                  lambda alive: None)
    live, plain = mixer_rows(tmp_path / "live" / "steps.log"), mixer_rows(tmp_path / "plain" / "steps.log")
    assert [(s, n, loss) for s, _lay, n, loss in live] == [(s, n, loss) for s, _lay, n, loss in plain]
    assert len(live) == 12 and {r[1] for r in plain} == {"plain-tp2dp2"}
