"""`elastic plan`: what does it cost to go from this layout to that one?"""
from __future__ import annotations

import argparse
import math

from db.units import human_bytes
from launcher.errors import UsageError
from launcher.options import parse_node_sizes


def add_model_arguments(p: argparse.ArgumentParser, layers: int | None = None, hidden: int | None = None) -> None:
    """Model flags shared by every command that needs a model spec."""
    p.add_argument("--layers", type=int, required=layers is None, default=layers, help="transformer layers")
    p.add_argument("--hidden", type=int, required=hidden is None, default=hidden, help="hidden size")
    p.add_argument("--heads", type=int, default=0, help="attention heads (default hidden/64)")
    p.add_argument("--ffn", type=int, default=0, help="MLP inner size (default 4*hidden)")
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary size (default 8192)")
    p.add_argument("--seq-len", type=int, default=128, help="sequence length (position embeddings)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="parameter dtype")
    p.add_argument("--optimizer", default="adam", choices=["adam", "none"],
                   help="adam: moments (+ fp32 master weights when dtype is not fp32); none: params only")


def model_from_args(args: argparse.Namespace):
    from migrate import LayoutError, ModelSpec

    try:
        return ModelSpec(layers=args.layers, hidden=args.hidden, heads=args.heads, ffn=args.ffn, vocab=args.vocab,
                         seq_len=args.seq_len, dtype=args.dtype, optimizer=args.optimizer)
    except LayoutError as exc:
        raise UsageError(str(exc)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--from", dest="prev", required=True, metavar="LAYOUT",
                   help="old layout, e.g. pp4tp2dp1, tp2fsdp4 (FSDP2 over 4 shards), tp2hsdp2x2 (HSDP: 2 replicas "
                        "of 2 shards)")
    p.add_argument("--to", dest="curr", required=True, metavar="LAYOUT", help="new layout, e.g. pp6tp4dp1")
    p.add_argument("--gpus-per-node", default="8", metavar="N[,N...]",
                   help="GPUs per node (default 8), or one count per node for uneven nodes, e.g. 4,4,2,2 "
                        "(then exactly those nodes); node 0 is pinned")
    p.add_argument("--tp-domain", type=int, default=None, metavar="K",
                   help="NVLink islands of K GPUs inside a node: a TP group that fits stays inside one island "
                        "(default: the whole node is one domain, any subset of its GPUs will do)")
    p.add_argument("--placement", choices=["resilient", "packed"], default="resilient",
                   help="resilient (default): with dp >= 2 the replicas of every PP stage sit on different nodes, "
                        "so losing one node leaves a full replica (gradient all-reduce then crosses nodes); "
                        "packed: fewest bytes and nodes only")
    p.add_argument("--failed", default="", metavar="IDS", help="comma-separated failed device ids, e.g. 3,5")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--instructions", action="store_true",
                   help="with --json: include every device's instructions (large at scale; each worker "
                        "derives its own from the placement)")


def _parse_failed(text: str) -> frozenset[int]:
    try:
        return frozenset(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UsageError(f"--failed takes comma-separated device ids like 3,5, got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    from migrate import LayoutError, ParallelConfig, Topology, plan

    model = model_from_args(args)
    sizes = parse_node_sizes(args.gpus_per_node)
    try:
        prev, curr = ParallelConfig.parse(args.prev), ParallelConfig.parse(args.curr)
        failed = _parse_failed(args.failed)
        if len(sizes) == 1:
            # enough nodes for both layouts, with spares standing in for failed devices
            sizes *= math.ceil((max(prev.world_size, curr.world_size) + len(failed)) / sizes[0])
        topo = Topology.of_nodes(sizes, tp_domain=args.tp_domain)
        result = plan(model, prev, curr, topo, failed, placement=args.placement)
    except LayoutError as exc:
        raise UsageError(str(exc)) from None
    print(result.to_json(instructions=args.instructions) if args.json else render(result))
    return 0


def render(p) -> str:
    """The plan as a person reads it: pairs and placement, per-device traffic, totals."""
    s = p.summary()
    send, recv = p._per_device("send", "src"), p._per_device("recv", "dst")
    fsdp = p.curr.layout.fsdp > 1  # a column for the FSDP rank
    lines = [f"Migration {s['from']} -> {s['to']}  ({len(p.curr.devices)} ranks, planned in {s['plan_ms']:.2f} ms)", "",
             f" rank  pp dp {'fs ' if fsdp else ''}tp  node:gpu      reuses      receives      sends"]
    for row, (rank, old) in zip(s["placement"], s["pairs"]):
        dev = row["device"]
        fs = f"{row['fsdp']:2d} " if fsdp else ""
        lines.append(f" {rank:4d}  {row['pp']:2d} {row['dp']:2d} {fs}{row['tp']:2d}  {row['node'] + ':' + str(row['gpu']):12s}"
                     f" {('dev ' + str(old)) if old is not None else 'new device':>10s}  {human_bytes(recv.get(dev, 0)):>10s}"
                     f"  {human_bytes(send.get(dev, 0)):>10s}")
    departing = sorted(set(send) - set(p.curr.devices))
    for dev in departing:
        lines.append(f"  (departing dev {dev} on {p.topology.devices[dev].node} sends {human_bytes(send[dev])})")
    pct = 100 * s["bytes_moved"] / s["bytes_checkpoint"] if s["bytes_checkpoint"] else 0
    lines += ["",
              f"bytes moved       {human_bytes(s['bytes_moved'])}  ({pct:.1f}% of a checkpoint round trip, "
              f"{human_bytes(s['bytes_checkpoint'])})",
              f"lower bound       {human_bytes(s['bytes_lower_bound'])} under the node rule"
              f"{' (this plan is optimal)' if s['optimal'] else ''}; {human_bytes(s['bytes_lower_bound_no_rule'])} "
              f"with TP groups anywhere",
              f"one full replica  {human_bytes(s['bytes_state_total'])}",
              f"busiest device    sends {human_bytes(s['max_device_send_bytes'])}, receives {human_bytes(s['max_device_recv_bytes'])}",
              f"{'pieces' if s.get('by_manifest') else 'instructions':18s}{s['instruction_counts']['send']} send / "
              f"{s['instruction_counts']['recv']} recv / {s['instruction_counts']['refer']} refer",
              f"nodes released    {', '.join(s['nodes_released']) or 'none'}",
              f"placement         {s['placement_rule']}"]
    lines += [f"note: {n}" for n in s["notes"]]
    return "\n".join(lines)
