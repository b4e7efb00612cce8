"""Every command of the guide's Get-started and Guides pages runs, as written, so the guide cannot drift from
the product (issue 58, item 3); the README's marked blocks too.

Each page runs in a folder of its own standing in for the user's clone (`examples/` and `.venv` linked to this
checkout's; this checkout on PYTHONPATH; `elastic`/`elastic-launch` on PATH from the interpreter's bin), on
the local backend, with the small step counts the pages give. Which blocks run and what their output must
show is said by an HTML comment before each block (tests/docs/guide_blocks.py lists the words): the
expectations are facts the page states (the job finished on a layout, a migration was bit-exact, every
step ran once), so a product change that makes the page wrong fails here.

The Get-started page of a first Slurm job (ON_THE_TESTBED) runs as written on the real Slurm testbed. Blocks of
the other pages that need a Slurm cluster (sbatch scripts, `--backend slurm`) are not run: they are marked `parse`,
and every `elastic-launch` and `elastic` command line in them is parsed by the real argparse parsers (and
`elastic-launch`'s flags checked by launcher.options.options_from_args, which refuses a layout list the node
range cannot take); the Slurm testbed runs the same scripts in tests/examples/test_slurm_examples.py.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.policybench.replay import wait_until
from tests.docs.guide_blocks import NEEDS_MARK, Block, blocks, commands
from tests.paths import ROOT

DOCS = ROOT / "docs"
TESTED = sorted(str(p.relative_to(DOCS)) for p in [*DOCS.glob("get-started/*.md"), *DOCS.glob("guides/*.md")])
BIN = Path(sys.executable).parent
WAIT_S = 180  # a `wait=` condition, a background block's end
#: pages that submit sbatch jobs: run on the Slurm testbed (test_slurm_page_commands_run_on_the_testbed)
ON_THE_TESTBED = {"get-started/first-slurm-job.md"}


def page_blocks(name: str) -> list[Block]:
    path = ROOT / name if name == "README.md" else DOCS / name
    return blocks(path, name)


def test_the_tested_pages_are_there() -> None:
    """The guide's sections exist (a renamed folder would otherwise test nothing)."""
    assert "get-started/first-job.md" in TESTED and "guides/live-mode.md" in TESTED, TESTED
    assert len(TESTED) >= 8


@pytest.mark.parametrize("name", [*TESTED, "README.md"])
def test_every_command_block_is_marked(name: str) -> None:
    """A shell or python block without a marker would silently go untested."""
    unmarked = [b.where() for b in page_blocks(name) if b.lang in NEEDS_MARK and not b.kind]
    assert not unmarked, f"blocks without a <!-- guide: ... --> marker: {unmarked}"
    assert any(b.kind in ("run", "parse") for b in page_blocks(name)), f"{name}: nothing of it is checked"


# -- running a page ------------------------------------------------------------------------------------
class Page:
    """One page's folder and its background blocks."""

    def __init__(self, folder: Path) -> None:
        if not (BIN / "elastic-launch").exists():
            pytest.fail(f"{BIN}/elastic-launch is missing: install the project into this interpreter's environment "
                        "(scripts/bootstrap.sh)")
        self.folder = folder
        (folder / "tmp").mkdir(parents=True)
        (folder / "examples").symlink_to(ROOT / "examples")
        (folder / ".venv").symlink_to(Path(sys.prefix))
        self.env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
                    "PYTHONPATH": str(ROOT), "TMPDIR": str(folder / "tmp"), "PYTHONUNBUFFERED": "1"}
        for name in ("ELASTIC_DB_URL", "ELASTIC_SECRET_KEY", "SLURM_JOB_ID", "VIRTUAL_ENV"):
            self.env.pop(name, None)
        self.background: list[tuple[Block, subprocess.Popen, Path]] = []

    def argv(self, block: Block, code: str) -> list[str]:
        if block.lang in ("python", "py"):
            return [sys.executable, "-c", code]
        return ["bash", "-c", "set -euo pipefail\n" + code]

    def run(self, block: Block) -> None:
        if block.join:
            self.join()
        if block.wait:
            self.wait_for(block)
        if block.background:
            code = re.sub(r"&\s*$", "", block.code.rstrip())  # the page's `&`: here the test keeps the process
            out = self.folder / f".block-{block.line}.out"
            proc = subprocess.Popen(self.argv(block, code), cwd=self.folder, env=self.env, stdout=out.open("w"),
                                    stderr=subprocess.STDOUT, text=True, start_new_session=True)
            self.background.append((block, proc, out))
            return
        r = subprocess.run(self.argv(block, block.code), cwd=self.folder, env=self.env, capture_output=True,
                           text=True, timeout=600)
        output = r.stdout + r.stderr
        assert r.returncode == 0, f"{block.where()} exited {r.returncode}:\n{block.code}\n--- output:\n{output[-4000:]}"
        check_expect(block, output)

    def wait_for(self, block: Block) -> None:
        deadline = time.monotonic() + WAIT_S
        while True:
            running = any(p.poll() is None for _, p, _ in self.background)
            if subprocess.run(["bash", "-c", block.wait], cwd=self.folder, env=self.env).returncode == 0:
                return
            if self.background and not running:
                pytest.fail(f"{block.where()}: waiting for `{block.wait}`, but the background blocks ended:\n"
                            f"{self.outputs()}")
            assert time.monotonic() < deadline, f"{block.where()}: `{block.wait}` not true after {WAIT_S} s"
            time.sleep(0.2)

    def join(self) -> None:
        for block, proc, out in self.background:
            try:
                proc.wait(timeout=WAIT_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"{block.where()} still running after {WAIT_S} s:\n{out.read_text()[-4000:]}")
            output = out.read_text()
            assert proc.returncode == 0, f"{block.where()} exited {proc.returncode}:\n{output[-4000:]}"
            check_expect(block, output)
        self.background = []

    def outputs(self) -> str:
        return "\n".join(f"--- {b.where()}:\n{out.read_text()[-3000:]}" for b, _, out in self.background)

    def stop(self) -> None:
        for _, proc, _ in self.background:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # this test's own process group only
                proc.wait()


def check_expect(block: Block, output: str) -> None:
    for pattern in block.expect:
        assert re.search(pattern, output, re.M), \
            f"{block.where()}: output does not match {pattern!r}:\n{block.code}\n--- output:\n{output[-4000:]}"


def check_parse(block: Block, folder: Path) -> None:
    """A Slurm-only block: its elastic-launch and elastic lines through the real parsers."""
    from launcher.cli import build_parser as elastic_parser
    from launcher.options import build_parser as launch_parser, options_from_args

    checked = 0
    for argv in commands(block.code):
        tool = Path(argv[0]).name
        if tool not in ("elastic-launch", "elastic"):
            continue
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                if tool == "elastic":
                    elastic_parser().parse_args(argv[1:])
                else:
                    options_from_args(launch_parser().parse_args(argv[1:]))
                    check_program(argv[argv.index("--") + 1:], block)
        except SystemExit:
            pytest.fail(f"{block.where()}: `{' '.join(argv)}` does not parse: {err.getvalue().strip()}")
        except Exception as exc:  # UsageError from options_from_args
            pytest.fail(f"{block.where()}: `{' '.join(argv)}`: {exc}")
        checked += 1
    assert checked, f"{block.where()}: a parse block with no elastic-launch or elastic command line"


def check_program(program: list[str], block: Block) -> None:
    """The program after `--`: an example script of this checkout must exist; the reference worker's flags parse."""
    if program[:2] == ["python", "-m"] and program[2:3] == ["launcher.worker"]:
        from launcher.worker import build_parser

        build_parser().parse_args(program[3:])
    elif program[:1] == ["python"] and program[1].startswith("examples/"):
        assert (ROOT / program[1]).is_file(), f"{block.where()}: {program[1]} does not exist"


@pytest.mark.parametrize("name", [*(n for n in TESTED if n not in ON_THE_TESTBED), "README.md"])
def test_page_commands_run(name: str, tmp_path: Path) -> None:
    run_page(name, tmp_path)


@pytest.mark.slurm
@pytest.mark.slurm_host  # the page's `elastic testbed up` is the host's release, the one a newcomer gets
@pytest.mark.parametrize("name", sorted(ON_THE_TESTBED))
def test_slurm_page_commands_run_on_the_testbed(name: str, tmp_path: Path, slurm_testbed) -> None:
    """A page that submits to the Slurm testbed, on the real one: its blocks run in a shell pointed at it (the
    page's `eval "$(elastic testbed up)"`, which only lasts its own block here)."""
    before = set(slurm_jobs(slurm_testbed))
    try:
        run_page(name, tmp_path, {"SLURM_CONF": str(slurm_testbed.slurm_conf)})
    finally:  # the page's jobs (and their companions) end with it: the next Slurm test gets every node idle
        if left := set(slurm_jobs(slurm_testbed)) - before:
            subprocess.run(["scancel", *left], env=slurm_testbed.env(), check=False)
        wait_until("every testbed node idle", lambda: set(slurm_testbed.node_states().values()) == {"idle"}, 120)


def slurm_jobs(testbed) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%i"], env=testbed.env(), capture_output=True, text=True, check=True)
    return out.stdout.split()


def run_page(name: str, tmp_path: Path, env: dict[str, str] | None = None) -> None:
    todo = [b for b in page_blocks(name) if b.kind in ("run", "file", "parse")]
    if not any(b.kind == "run" for b in todo):
        for block in todo:
            if block.kind == "parse":
                check_parse(block, tmp_path)
        return
    page = Page(tmp_path / "clone")
    page.env.update(env or {})
    try:
        for block in todo:
            if block.kind == "file":
                target = page.folder / block.file
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(block.code)
            elif block.kind == "parse":
                check_parse(block, page.folder)
            else:
                page.run(block)
        page.join()
    finally:
        page.stop()
