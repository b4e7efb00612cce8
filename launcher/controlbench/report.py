"""From the two halves' measurements to figures at N, and how they were made (pure: no processes).

The model: a step's control-plane time at N is the store's share measured at N (rank 0's store operations
under every other rank's heartbeats and the launcher's poll) plus 2 * ceil(log2 N) message hops (the
vote's ready all-reduce and its answer's tree). One hop is measured between two processes that each have a
core, as every rank has on a GPU node: the time the 2-process group's votes spent in their messages, halved.
Larger groups on this machine share 2 cores among their processes, so they measure the CPU's queue more
than the protocol; they are printed beside what the model says for them.
"""
from __future__ import annotations

from launcher.runtime.vote import HEARTBEAT_S, dissemination_rounds


def combine(store: dict, groups: list[dict]) -> dict:
    n = store["ranks"]
    pair = next(g for g in groups if g["processes"] == 2)
    hop = pair["hop_ms"]
    cascade = pair["failure_to_abort_ms"] or 0.0  # one survivor finds its peer gone and abandons: one hop of it
    rounds = dissemination_rounds(n)

    def model(ranks: int) -> dict:
        r = dissemination_rounds(ranks)
        return {"step_ms": store["store_step_ms"]["median"] + 2 * r * hop,
                "event_to_agreement_ms": (store["event_to_rank0_ms"]["median"] or 0.0) + r * hop,
                "failure_to_abort_ms": (store["failure_settled_ms"] or 0.0) + r * cascade}

    at_n = model(n)
    return {
        "ranks": n,
        "per_step_ms": {"median": at_n["step_ms"],
                        "p90": store["store_step_ms"]["p90"] + 2 * rounds * hop,
                        "max": store["store_step_ms"]["max"] + 2 * rounds * hop},
        "event_to_agreement_ms": at_n["event_to_agreement_ms"],
        "failure_to_abort_ms": at_n["failure_to_abort_ms"],
        "server_cpu_share": store["server_cpu_share"],
        "store_ops": {"rank0_per_step": store["rank0_store_ops_per_step"],
                      "other_rank_per_s": store["other_rank_store_ops_per_s"], "heartbeat_s": HEARTBEAT_S,
                      "launcher_per_poll": store["launcher_store_ops_per_poll"]},
        "model": {"rounds": rounds, "hop_ms": hop, "failure_hop_ms": cascade},
        "store_share": store,
        "groups": [{**g, "model": model(g["processes"])} for g in groups],
    }


def describe(out: dict) -> str:
    s, m = out["store_share"], out["model"]
    lines = [
        f"live mode's control plane at {out['ranks']} ranks (store measured at full N; the vote's messages "
        f"modelled as {2 * m['rounds']} hops of {m['hop_ms']:.3f} ms)",
        f"  per-step overhead   median {out['per_step_ms']['median']:.2f} ms, p90 {out['per_step_ms']['p90']:.2f}, "
        f"max {out['per_step_ms']['max']:.2f}",
        f"    of which store    median {s['store_step_ms']['median']:.3f} ms, p90 {s['store_step_ms']['p90']:.3f}, "
        f"max {s['store_step_ms']['max']:.2f} ({s['steps']} steps of rank 0)",
        f"  event -> agreement  {out['event_to_agreement_ms']:.1f} ms (rank 0 sees it at its next vote: "
        f"median {s['event_to_rank0_ms']['median'] or 0:.2f} ms over {s['event_to_rank0_ms']['events']} events)",
        f"  failure -> abort    {out['failure_to_abort_ms']:.0f} ms ({m['rounds']} hops of {m['failure_hop_ms']:.1f} ms; "
        f"every survivor settling its step at once: {s['failure_settled_ms'] or 0:.0f} ms, and all their failure "
        f"traffic: {s['failure_store_burst_ms'] or 0:.0f} ms)",
        f"  store server CPU    {100 * out['server_cpu_share']:.1f} % of one core",
        f"  store operations    rank 0 {out['store_ops']['rank0_per_step']:.1f} a step; every other rank "
        f"{out['store_ops']['other_rank_per_s']:.2f} a second (heartbeat every {out['store_ops']['heartbeat_s']:.0f} s, "
        f"none per step); the launcher {out['store_ops']['launcher_per_poll']:.0f} a poll",
        "  real gloo groups on this machine (2 cores: above 2 processes they queue for the CPU):",
        "    processes  vote median/p90 ms  event->agreement ms  failure->abort ms  | model: step, event, failure",
    ]
    for g in out["groups"]:
        ev, fail = g["event_to_agreement_ms"]["median"], g["failure_to_abort_ms"]
        lines.append(f"    {g['processes']:>9}  {g['vote_ms']['median']:>7.2f} / {g['vote_ms']['p90']:<7.2f}  "
                     f"{ev if ev is not None else float('nan'):>19.1f}  {fail if fail is not None else float('nan'):>17.0f}"
                     f"  | {g['model']['step_ms']:.2f}, {g['model']['event_to_agreement_ms']:.1f}, "
                     f"{g['model']['failure_to_abort_ms']:.0f}")
    for run in out.get("steady", []):
        if run["error"]:
            lines.append(f"  steady state, {run['job']}: {run['error']}")
        else:
            lines.append(f"  steady state, {run['job']}: a step {run['step_ms']:.1f} ms; the runtime's share "
                         f"{100 * run['runtime_share']:.2f} % (boundary {run['boundary_ms']:.2f} ms, vote "
                         f"{run['vote_ms']:.2f} ms, medians; {run['workers']} workers, {run['steps']} steps)")
    if out.get("live_over_plain") is not None:
        lines.append(f"  steady state, mixer_live's step in live mode vs the same step with no runtime (restart "
                     f"mode): {100 * out['live_over_plain']:+.1f} %")
    return "\n".join(lines)
