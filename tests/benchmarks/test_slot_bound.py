"""benchmarks/slot_bound.py: the idealised schedule it counts steps of."""

from benchmarks.serve import make_scenarios
from benchmarks.slot_bound import simulate


def test_an_adapter_without_a_slot_waits_for_an_idle_one():
    # one slot: b's request starts only once a's has finished and left the slot idle
    assert simulate(["a", "b"], slots=1, max_running=2, output_len=3) == {"steps": 6, "mean_batch": 1.0, "slot_loads": 2}
    # two slots: both run at once; a base-model request needs none
    assert simulate(["a", "b", ""], slots=2, max_running=3, output_len=3)["steps"] == 3
    # a waiting request's adapter is not the victim while an unwanted idle one exists
    run = simulate(["a", "b", "c", "a"], slots=2, max_running=1, output_len=1, prefill_per_step=1)
    assert run["steps"] == 4 and run["slot_loads"] == 3


def test_zipf_over_more_adapters_than_slots_is_slot_bound():
    base, zipf = (list(s.adapters) for s in make_scenarios(["base", "zipf"], 256, 1000, seed=0))
    base_steps = simulate(base, slots=1)["steps"]
    assert simulate(zipf, slots=1000)["steps"] == base_steps  # every adapter resident: the base schedule
    bound = simulate(zipf, slots=32)
    assert bound["steps"] > base_steps and bound["mean_batch"] < 64 and bound["slot_loads"] >= len(set(zipf))
