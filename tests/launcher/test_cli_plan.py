"""`elastic plan` as a user calls it."""
import json
import subprocess
import sys

ARGS = ["--layers", "24", "--hidden", "512"]


def elastic(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher.cli", *args], capture_output=True, text=True)


def test_plan_json_has_the_documented_keys():
    out = elastic("plan", *ARGS, "--from", "pp4tp2dp1", "--to", "pp6tp4dp1", "--gpus-per-node", "4", "--json", "--instructions")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    for key in ("pairs", "placement", "instructions", "bytes_moved", "bytes_state_total", "bytes_checkpoint",
                "max_device_send_bytes", "max_device_recv_bytes", "nodes_released", "plan_ms",
                "bytes_lower_bound", "bytes_lower_bound_no_rule", "optimal", "placement_rule"):
        assert key in d
    assert len(d["pairs"]) == 24 and 0 < d["bytes_moved"] < d["bytes_checkpoint"]
    assert {i["op"] for i in d["instructions"]} == {"send", "recv", "refer"}
    assert d["bytes_lower_bound_no_rule"] <= d["bytes_lower_bound"] <= d["bytes_moved"]


def test_plan_on_uneven_nodes_with_resilient_placement():
    out = elastic("plan", *ARGS, "--from", "pp2tp2dp2", "--to", "pp2tp2dp2", "--gpus-per-node", "4,4,2,2",
                  "--failed", "4", "--placement", "resilient", "--json")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    nodes = {(r["pp"], r["tp"]): set() for r in d["placement"]}
    for r in d["placement"]:
        nodes[r["pp"], r["tp"]].add(r["node"])
    assert all(len(v) == 2 for v in nodes.values())  # every slice has a replica on two nodes
    for pp in range(2):
        for dp in range(2):
            assert len({r["node"] for r in d["placement"] if (r["pp"], r["dp"]) == (pp, dp)}) == 1
    assert d["placement_rule"] == "resilient"


def test_plan_text_is_readable():
    out = elastic("plan", *ARGS, "--from", "pp4tp2", "--to", "pp2tp2", "--gpus-per-node", "4")
    assert out.returncode == 0, out.stderr
    assert "bytes moved" in out.stdout and "nodes released    node1" in out.stdout
    assert "lower bound" in out.stdout and "optimal" in out.stdout


def test_bad_input_is_one_line_and_exit_2(capsys):
    # the first case as a user runs it (a process of its own: nothing but the one line, no traceback);
    # the others through the same entry point in this process (each process costs ~1.7 s of imports)
    from launcher.cli import main

    bad_inputs = (["--from", "pp4x", "--to", "pp2"], ["--from", "pp5", "--to", "pp2"],
                  ["--from", "pp4", "--to", "pp2", "--failed", "a,b"],
                  ["--from", "pp4", "--to", "pp2", "--failed", "0,1,2,3,4"],
                  ["--from", "pp4", "--to", "pp2", "--gpus-per-node", "4,0"],
                  ["--from", "pp4", "--to", "pp2", "--tp-domain", "0"])
    out = elastic("plan", *ARGS, *bad_inputs[0])
    assert out.returncode == 2, (bad_inputs[0], out.stderr)
    assert out.stdout == "" and len(out.stderr.strip().splitlines()) == 1 and "error" in out.stderr
    for bad in bad_inputs[1:]:
        capsys.readouterr()
        assert main(["plan", *ARGS, *bad]) == 2, bad
        got = capsys.readouterr()
        assert got.out == "" and len(got.err.strip().splitlines()) == 1 and "error" in got.err, (bad, got.err)
