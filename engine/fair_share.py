"""Fair share between tenants: a virtual token counter (VTC, Sheng et al., "Fairness in Serving Large
Language Models", OSDI 2024) that the scheduler consults for the order of admission.

Each tenant has a counter of the service it received: prompt tokens computed count `prompt_weight`
each, generated tokens `output_weight` each (a decode step costs more per token than a prefill chunk).
Admission takes the oldest waiting request of the tenant with the smallest counter, so requests of one
tenant stay first-come-first-served (the starvation drain's view of them is unchanged), and between
tenants the least served goes first.

A tenant that had nothing queued or running and sends a request has its counter lifted to the smallest
counter of the tenants that are busy: idle time earns no credit to burst with later, and a newcomer is
never behind a tenant that has been flooding. Hence the bound the engine promises: however many
requests one tenant queues, another tenant's new request is the next one admitted (one scheduling
round) once admission has room.

Choices: counters live as long as the engine (a tenant's counter is only ever compared with busy
tenants' after the lift, so old values do no harm); with a single tenant the order is plain FCFS.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

DEFAULT_PROMPT_WEIGHT = 1.0
DEFAULT_OUTPUT_WEIGHT = 2.0


class _Queued(Protocol):
    tenant: str


class FairShare:
    def __init__(self, prompt_weight: float = DEFAULT_PROMPT_WEIGHT, output_weight: float = DEFAULT_OUTPUT_WEIGHT):
        self.prompt_weight = prompt_weight
        self.output_weight = output_weight
        self.counters: dict[str, float] = {}

    def on_arrival(self, tenant: str, busy_tenants: Iterable[str]) -> None:
        """`tenant` sent a request; `busy_tenants` are those with requests queued or running before it."""
        busy = set(busy_tenants)
        if tenant in busy:
            return
        floor = min((self.counters.get(t, 0.0) for t in busy), default=None)
        own = self.counters.get(tenant, 0.0)
        self.counters[tenant] = own if floor is None else max(own, floor)

    def pick(self, waiting: Sequence[_Queued]) -> int:
        """Index in `waiting` (FCFS order) of the request to admit next."""
        first: dict[str, int] = {}
        for i, req in enumerate(waiting):
            first.setdefault(req.tenant, i)
        if len(first) <= 1:
            return 0
        return min(first.items(), key=lambda item: (self.counters.get(item[0], 0.0), item[1]))[1]

    def charge(self, tenant: str, num_prompt_tokens: int, num_output_tokens: int) -> None:
        """Service given to `tenant` in one step."""
        cost = self.prompt_weight * num_prompt_tokens + self.output_weight * num_output_tokens
        self.counters[tenant] = self.counters.get(tenant, 0.0) + cost
