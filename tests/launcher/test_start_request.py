"""`--dry-run` prints exactly what a real start runs: the same command lines, environment included.

The real start here is `elastic-launch` with the local backend and a worker program that only
writes down its environment and arguments and exits once every worker has (so the launcher gives up
waiting for it to register, exit code 1). Each worker's record is compared with its dry-run line.
"""
from __future__ import annotations

import json
import shlex
import sys
from itertools import takewhile

from launcher.launch import main
from migrate.localrun import free_port

#: writes its record (whole: by rename), then waits until every worker's record is there (at most 15 s,
#: under --ready-timeout) before it exits: the launcher stops the others as soon as one exits without
#: registering, and on a loaded machine it once stopped a worker before that one had written anything
DUMP = ("import json, os, sys, time; d = sys.argv[1]; p = os.path.join(d, os.environ['ELASTIC_DEVICE'] + '.json'); "
        "f = open(p + '.tmp', 'w'); json.dump({'env': dict(os.environ), 'argv': sys.argv[1:]}, f); f.close(); "
        "os.replace(p + '.tmp', p); t = time.time(); "
        "[time.sleep(0.05) for _ in iter(lambda: sum(x.endswith('.json') for x in os.listdir(d)) < 4 "
        "and time.time() < t + 15, False)]")


def test_dry_run_prints_what_the_start_runs(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    out_dir = tmp_path / "seen"
    out_dir.mkdir()
    flags = ["--backend", "local", "--nnodes", "2", "--gpus-per-node", "2", "--layouts", "pp2tp2",
             "--master-port", str(free_port()), "--db", str(tmp_path / "e.db"), "--checkpoint-every", "3",
             "--ready-timeout", "20", "--mode", "live", "--", "python", "-c", DUMP, str(out_dir)]
    assert main(["--dry-run", *flags]) == 0
    lines = [shlex.split(x) for x in capsys.readouterr().out.splitlines() if x.startswith("env ")]
    assert len(lines) == 4
    assert main(flags) == 1, "the workers exit without registering"
    assert "exited before registering" in capsys.readouterr().err
    for line in lines:
        env = dict(x.split("=", 1) for x in takewhile(lambda x: "=" in x, line[1:]))
        argv = line[1 + len(env):]
        seen = json.loads((out_dir / f"{env['ELASTIC_DEVICE']}.json").read_text())
        assert argv[0] == sys.executable and argv[1:3] == ["-c", DUMP]
        assert seen["argv"] == argv[3:]
        assert {k: seen["env"].get(k) for k in env} == env
    assert env["ELASTIC_CHECKPOINT_EVERY"] == "3" and env["ELASTIC_CHECKPOINT_DIR"] == str(tmp_path / "checkpoints"
                                                                                              / "elastic")
