"""Fuzzing elastic-launch's inputs: every command line is accepted (exit 0) or refused with a
one-line usage error (exit 2), never a traceback; every layout the policy returns fits.

The default suite runs a few hundred cases; `pytest -m fuzz` runs 10,000 (not in the default suite).
"""
from __future__ import annotations

import contextlib
import io

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from launcher.launch import main as launch_main
from launcher.policy.layouts import NoLayoutError, choose_layout, why_invalid
from migrate.layout import LayoutError, ModelSpec, ParallelConfig

junk = st.text(alphabet="ptd0123456789:,x- .", max_size=10)
small = st.integers(1, 4).map(str)
ints = st.one_of(small, small, small, st.integers(-3, 9).map(str), junk)  # mostly sensible, some not
nnodes = st.one_of(st.builds(lambda a, b: f"{a}:{b}", st.integers(1, 2), st.integers(2, 4)),
                   st.builds(lambda a, b: f"{a}:{b}", st.integers(-1, 5), st.integers(-1, 6)), ints)
layout = st.builds(lambda pp, tp, dp: f"pp{pp}tp{tp}dp{dp}", st.integers(0, 8), st.sampled_from([0, 1, 2, 3, 4]),
                   st.integers(0, 3))
good_layout = st.builds(lambda pp, tp, dp: f"pp{pp}tp{tp}dp{dp}", st.sampled_from([1, 2]), st.sampled_from([1, 2]),
                        st.sampled_from([1, 2]))
layouts = st.one_of(st.lists(good_layout, min_size=1, max_size=4).map(",".join),
                    st.lists(layout, min_size=1, max_size=4).map(",".join), junk)


def opt(flag, values):
    return st.one_of(st.just([]), st.just([]), values.map(lambda v: [flag, v]))


@st.composite
def command_lines(draw):
    argv = ["--backend", "local", "--dry-run"]
    for flag, values in [("--nnodes", nnodes), ("--gpus-per-node", ints), ("--layouts", layouts),
                         ("--local-nodes", ints), ("--on-signal", st.sampled_from(["shrink", "suspend", "ignore", "x"])),
                         ("--poll", ints), ("--master-port", ints)]:
        argv += draw(opt(flag, values))
    if draw(st.integers(0, 3)):
        worker = ["--", "python", "-m", "launcher.worker"]
        for flag, values in [("--layers", st.one_of(st.sampled_from(["2", "4", "8"]), ints)), ("--hidden", st.sampled_from(["64", "128", "96", "0", "x"])),
                             ("--heads", st.sampled_from(["0", "1", "2", "3", "4"])), ("--vocab", ints)]:
            worker += draw(opt(flag, values))
        argv += worker
    elif draw(st.booleans()):
        argv += ["--", "python", "train.py"]
    return argv


def _check_command_line(argv) -> None:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = launch_main(argv)
        except SystemExit as exc:  # argparse's own usage errors
            rc = exc.code
    assert rc in (0, 2), (argv, rc, err.getvalue()[-2000:])
    assert "Traceback" not in err.getvalue(), (argv, err.getvalue()[-2000:])
    if rc == 2:
        assert "error" in err.getvalue(), (argv, err.getvalue())
    else:
        assert out.getvalue().startswith("# local backend"), out.getvalue()
    event(f"exit {rc}")


@st.composite
def policy_inputs(draw):
    model = None
    if draw(st.booleans()):
        try:
            model = ModelSpec(layers=draw(st.integers(1, 12)), hidden=draw(st.sampled_from([64, 96, 128])),
                              heads=draw(st.sampled_from([0, 1, 2, 3, 4])), vocab=draw(st.sampled_from([64, 100])))
        except LayoutError:
            model = None
    cfgs = []
    for text in draw(st.lists(layout, max_size=4)):
        try:
            cfgs.append(ParallelConfig.parse(text))
        except LayoutError:
            pass
    return draw(st.integers(-1, 17)), draw(st.integers(1, 8)), cfgs, model


def _check_policy(devices, gpn, cfgs, model) -> None:
    try:
        cfg = choose_layout(devices, gpn, cfgs, model)
    except NoLayoutError:
        event("no layout")
        return
    assert why_invalid(cfg, devices, gpn, model) is None
    if cfgs:
        assert cfg in cfgs
    event("layout")


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(command_lines())
def test_launch_command_line_fuzz_quick(argv):
    _check_command_line(argv)


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(policy_inputs())
def test_policy_fuzz_quick(inputs):
    _check_policy(*inputs)


@pytest.mark.fuzz
@settings(max_examples=10_000, deadline=None, suppress_health_check=list(HealthCheck))
@given(command_lines())
def test_launch_command_line_fuzz_long(argv):
    _check_command_line(argv)


@pytest.mark.fuzz
@settings(max_examples=10_000, deadline=None, suppress_health_check=list(HealthCheck))
@given(policy_inputs())
def test_policy_fuzz_long(inputs):
    _check_policy(*inputs)
