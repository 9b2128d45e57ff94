"""Fair share between tenants (engine/fair_share.py) in the scheduler, stepped without a model: one
tenant flooding the queue delays another tenant's new request by at most one scheduling round, idle
tenants bank no credit, and a single tenant is plain FCFS. Asserted in scheduler steps, never seconds."""

from __future__ import annotations

import pytest

from engine.fair_share import FairShare
from engine.text import Tokenizer
from tests.engine.test_scheduler import Sim, prompt_of


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiny_llama_dir)


class TenantSim(Sim):
    def add_for(self, tenant: str, rid: str, prompt_len: int = 8, max_new_tokens: int = 16):
        real_add = self.sched.add

        def add_with_tenant(req) -> None:
            req.tenant = tenant
            real_add(req)

        self.sched.add = add_with_tenant
        try:
            return self.add(rid, prompt_of(prompt_len, len(self.events)), max_new_tokens)
        finally:
            self.sched.add = real_add

    def admitted_after(self, num_before: int) -> list[str]:
        return self.admission_order[num_before:]


class FcfsOnly(FairShare):
    """The policy the scheduler had before fair share: the queue's head, whoever sent it."""

    def pick(self, waiting) -> int:
        return 0


def flooded(tokenizer, policy: FairShare | None = None) -> TenantSim:
    """Tenant a has queued 40 requests and 4 run; returns the simulation mid-flood."""
    sim = TenantSim(tokenizer, page_size=1, num_pages=4096, max_running=4, max_batch_tokens=64)
    if policy is not None:
        sim.sched.fair_share = policy
    for i in range(40):
        sim.add_for("a", f"a{i}")
    for _ in range(5):
        sim.step()
    assert len(sim.sched.running) == 4 and len(sim.sched.waiting) > 30
    return sim


def steps_until_admitted(sim: TenantSim, rid: str, max_steps: int = 500) -> int:
    for n in range(1, max_steps + 1):
        sim.step()
        if rid in sim.admission_order:
            return n
    raise AssertionError(f"{rid} not admitted in {max_steps} steps")


def test_a_flood_delays_another_tenant_by_at_most_one_round(tokenizer):
    sim = flooded(tokenizer)
    before = len(sim.admission_order)
    sim.add_for("b", "b0")
    sim.add_for("b", "b1")
    steps_until_admitted(sim, "b0")
    # the first request admitted after b0 arrived is b0: no request of the flooding tenant went first
    assert sim.admitted_after(before)[0] == "b0"
    steps_until_admitted(sim, "b1")
    assert sim.admitted_after(before).index("b1") <= 2  # b's second waits for at most one of a's
    sim.run()
    assert all(sim.final(rid).reason.value == "LENGTH" for rid in sim.events)
    sim.assert_all_freed()


def test_without_fair_share_the_flood_goes_first(tokenizer):
    # the same scene under FCFS: b0 waits behind every request a queued before it (the test above would fail)
    sim = flooded(tokenizer, FcfsOnly())
    before = len(sim.admission_order)
    sim.add_for("b", "b0")
    steps = steps_until_admitted(sim, "b0")
    assert sim.admitted_after(before).index("b0") >= 30 and steps > 30


def test_idle_time_banks_no_credit(tokenizer):
    sim = flooded(tokenizer)
    for _ in range(20):
        sim.step()
    before = len(sim.admission_order)
    for i in range(12):  # c was idle while a was served: it arrives with a burst
        sim.add_for("c", f"c{i}")
    while len(sim.admission_order) < before + 8:
        sim.step()
    firsts = sim.admitted_after(before)[:8]
    # c's counter starts at a's, not at 0: the two share admissions instead of c taking all of them
    assert 2 <= sum(rid.startswith("a") for rid in firsts) <= 6


def test_a_tenant_that_went_idle_banks_no_credit(tokenizer):
    """Guards the scheduler's count of each tenant's queued and running requests: c ran one request and was
    idle (nothing queued or running) during a's flood, so its return lifts its counter to a's, as for a
    newcomer. A count that kept c busy after its request ended would leave c's small counter in place, and
    c's burst would take every admission."""
    sim = TenantSim(tokenizer, page_size=1, num_pages=4096, max_running=4, max_batch_tokens=64)
    sim.add_for("c", "c-early")
    sim.run()
    for i in range(40):
        sim.add_for("a", f"a{i}")
    for _ in range(25):
        sim.step()
    before = len(sim.admission_order)
    for i in range(12):
        sim.add_for("c", f"c{i}")
    while len(sim.admission_order) < before + 8:
        sim.step()
    assert 2 <= sum(rid.startswith("a") for rid in sim.admitted_after(before)[:8]) <= 6


def test_one_tenant_is_served_first_come_first_served(tokenizer):
    sim = TenantSim(tokenizer, page_size=1, num_pages=4096, max_running=2, max_batch_tokens=64)
    for i in range(8):
        sim.add_for("solo", f"s{i}")
    sim.run()
    assert sim.admission_order == [f"s{i}" for i in range(8)]


def test_the_scheduler_charges_prefill_at_the_prompt_weight_and_decodes_at_the_output_weight(tokenizer):
    """Guards the split of each step's tokens: a 40-token prompt in chunks of 16 costs 1 a token, each
    decode after it 2 (the defaults). Charging everything as output would double the prefill."""
    sim = TenantSim(tokenizer, page_size=1, num_pages=256, max_running=2, max_batch_tokens=16)
    sim.add_for("t", "long", prompt_len=40, max_new_tokens=3)
    counters = []
    while sim.sched.num_requests:
        sim.step()
        counters.append(sim.sched.fair_share.counters["t"])
    assert counters == [16.0, 32.0, 40.0, 42.0, 44.0]


@pytest.mark.parametrize("weights", [(1.0, 2.0), (1.0, 1.0)])
def test_counters_charge_prompt_and_output_tokens_by_weight(weights):
    share = FairShare(*weights)
    share.on_arrival("a", [])
    share.charge("a", num_prompt_tokens=10, num_output_tokens=3)
    assert share.counters["a"] == 10 * weights[0] + 3 * weights[1]
    share.on_arrival("b", ["a"])  # lifted to the busy tenants' smallest counter
    assert share.counters["b"] == share.counters["a"]
    share.on_arrival("a", ["a", "b"])  # already busy: unchanged
    assert share.counters["a"] == 10 * weights[0] + 3 * weights[1]
