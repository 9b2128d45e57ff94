"""How far GPU adapter slots alone bound a serving run: decode steps of an idealised schedule.

    python benchmarks/slot_bound.py --slots 32 128 --num-adapters 1000 --num-requests 256

The same requests as `serve.py`'s scenarios (its Zipf draw and seed), all arriving at once, scheduled the
way the engine's scheduler admits them: first come first served, at most --max-running at a time and
--prefill-per-step new ones a step; a request whose adapter has no slot (every slot held by an adapter
with running requests) waits without blocking later ones; a new adapter takes a free slot or evicts an
idle one, preferring one no waiting request wants, then the least recently used. Each request then runs
--output-len decode steps. Every step costs the same here, so the step counts compare schedules only:
no kernel, fetch or load cost. Prints steps, the mean running batch, slot loads and base steps / steps,
the throughput ratio the slots alone allow.
"""

from __future__ import annotations

import argparse
import collections
import json


def simulate(
    adapters: list[str], slots: int, max_running: int = 64, output_len: int = 128, prefill_per_step: int = 8
) -> dict[str, float]:
    """Decode steps until every request (adapters[i]: its adapter, "" = base model) has finished."""
    waiting = collections.deque(range(len(adapters)))
    running: dict[int, int] = {}  # request -> tokens left
    resident: collections.OrderedDict[str, None] = collections.OrderedDict()  # LRU order
    steps = batch_sum = loads = 0
    while waiting or running:
        users = collections.Counter(adapters[r] for r in running)
        wanted = collections.Counter(adapters[r] for r in waiting)
        blocked, admitted = [], 0
        while waiting and len(running) < max_running and admitted < prefill_per_step:
            r = waiting.popleft()
            name = adapters[r]
            if name and name not in resident:
                if len(resident) >= slots:
                    idle = [a for a in resident if users[a] == 0]
                    if not idle:
                        blocked.append(r)
                        continue
                    del resident[next((a for a in idle if wanted[a] == 0), idle[0])]
                resident[name] = None
                loads += 1
            if name:
                resident.move_to_end(name)
            running[r] = output_len
            users[name] += 1
            wanted[name] -= 1
            admitted += 1
        waiting.extendleft(reversed(blocked))
        steps += 1
        batch_sum += len(running)
        for r in list(running):
            running[r] -= 1
            if not running[r]:
                del running[r]
    return {"steps": steps, "mean_batch": batch_sum / steps, "slot_loads": loads}


def main() -> None:
    from benchmarks.serve import make_scenarios

    p = argparse.ArgumentParser()
    p.add_argument("--slots", type=int, nargs="+", default=[32, 128])
    p.add_argument("--num-adapters", type=int, default=1000)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--prefill-per-step", type=int, default=8, help="new requests a step (--max-batch-tokens / prompt length)")
    p.add_argument("--scenarios", nargs="+", default=["zipf", "32"])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    kw = {"max_running": args.max_running, "output_len": args.output_len, "prefill_per_step": args.prefill_per_step}
    scenarios = make_scenarios(["base", *args.scenarios], args.num_requests, args.num_adapters, args.seed)
    base = simulate(list(scenarios[0].adapters), 1, **kw)
    for scenario in scenarios[1:]:
        for slots in args.slots:
            row = simulate(list(scenario.adapters), slots, **kw)
            row.update(scenario=scenario.name, slots=slots, distinct=len(set(scenario.adapters)), vs_base=base["steps"] / row["steps"])
            print(json.dumps(row))


if __name__ == "__main__":
    main()
