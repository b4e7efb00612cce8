"""The job page and the jobs list say what the job's layout survives, from the launch spec the
launcher records (launcher.loop.launcher.launch_spec); a job without one, or with a spec that does not say
it plainly, shows no claim at all."""
from __future__ import annotations

import re
from typing import Any

import pytest

from db import Store

SPEC = {"model": {"layers": 4}, "min_nodes": 1, "max_nodes": 2, "gpus_per_node": 4, "layouts": {"8": "pp2tp2dp2"},
        "placement": "packed"}


def _row(html: str, job_id: int) -> str:
    match = re.search(rf'<tr data-job-id="{job_id}">(.*?)</tr>', html, re.S)
    assert match, f"no row for job {job_id}"
    return match.group(1)


def _said(html: str) -> str:
    """The survival note as a reader sees it (tags dropped, whitespace folded)."""
    match = re.search(r'<span class="survives"[^>]*>(?:[^<]|<span[^>]*>[^<]*</span>)*</span>', html)
    assert match, "no survival note"
    return " ".join(re.sub(r"<[^>]+>", " ", match.group(0)).split())


def test_job_page_and_row_show_what_the_layout_survives(viewer: Any, store: Store) -> None:
    llama, bert = store.find_job("llama"), store.find_job("bert")
    store.set_launch_spec(llama.id, {**SPEC, "checkpoint_every": 100, "survives": {"process": True, "node": False}})
    for page in (viewer.get(f"/jobs/{llama.id}").text, viewer.get(f"/jobs/{llama.id}", headers={"HX-Request": "true"}).text):
        assert 'data-survives="process:true node:false"' in page
        assert _said(page) == "survives: one process ✓ , one node ✗ (safety checkpoints every 100 steps)"
    jobs = viewer.get("/?show=all").text
    assert "one node ✗" in _row(jobs, llama.id) and "safety checkpoints every 100 steps" in _row(jobs, llama.id)
    # bert has no launch spec (started by an older launcher, or not yet recorded): no claim either way
    assert "survives" not in _row(jobs, bert.id)
    assert 'class="survives"' not in viewer.get(f"/jobs/{bert.id}").text


@pytest.mark.parametrize("extra, said", [
    ({"checkpoint_every": 0, "survives": {"process": True, "node": False}},
     "survives: one process ✓ , one node ✗ (no safety checkpoints)"),
    ({"checkpoint_every": 0, "survives": {"process": True, "node": True}}, "survives: one process ✓ , one node ✓"),
    ({"survives": {"process": False, "node": False}}, "survives: one process ✗ , one node ✗"),  # interval not said
    ({"checkpoint_every": 10, "survives": {"process": True, "node": True, "batch": True}},
     "survives: one process ✓ , one node ✓ , batch node ✓ (safety checkpoints every 10 steps)"),
    ({"checkpoint_every": 0, "survives": {"process": True, "node": True, "batch": False}},
     "survives: one process ✓ , one node ✓ , batch node ✗ (no safety checkpoints)"),
])
def test_checkpoint_remark_follows_the_spec(viewer: Any, store: Store, extra: dict, said: str) -> None:
    job = store.find_job("llama")
    store.set_launch_spec(job.id, {**SPEC, **extra})
    assert _said(viewer.get(f"/jobs/{job.id}").text) == said


@pytest.mark.parametrize("survives", [None, {}, {"process": True}, {"process": "yes", "node": "no"}, [True, False],
                                      {"process": 1, "node": 0}])
def test_a_spec_that_does_not_say_it_plainly_shows_nothing(viewer: Any, store: Store, survives: Any) -> None:
    job = store.find_job("llama")
    store.set_launch_spec(job.id, {**SPEC, "checkpoint_every": 100, "survives": survives})
    assert "survives" not in viewer.get(f"/jobs/{job.id}").text
    assert "survives" not in _row(viewer.get("/?show=all").text, job.id)


def test_a_node_loss_the_allocation_itself_would_not_survive_says_why(viewer: Any, store: Store) -> None:
    """A Slurm job submitted without --no-kill ends when any node fails, whatever its replicas: the launcher
    records node false with the reason (Holdings.survival), and the page says the reason where it says ✗."""
    job = store.find_job("llama")
    why = "on Slurm the whole job ends when one of its nodes fails: it was submitted without --no-kill"
    store.set_launch_spec(job.id, {**SPEC, "checkpoint_every": 0,
                                   "survives": {"process": True, "node": False, "node_note": why}})
    page = viewer.get(f"/jobs/{job.id}").text
    assert _said(page) == "survives: one process ✓ , one node ✗ (no safety checkpoints)"
    assert f'title="{why}"' in page
