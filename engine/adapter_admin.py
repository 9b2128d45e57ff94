"""What the engine's adapter RPCs do: warm an adapter (and pin it), unload it once idle, and report
where every known adapter resides. Slot and scheduler state is read and changed on the loop thread."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from engine.adapter_slots import SlotsExhausted
from engine.adapters import AdapterRecord
from engine.core import EngineCore
from engine.errors import InvalidArgument, ResourceExhausted, Unavailable

UNLOAD_POLL_S = 0.05


@dataclass(frozen=True)
class AdapterResidency:
    ref: str
    digest: str
    on_gpu: bool
    in_slot: bool
    in_host_cache: bool
    pinned: bool
    running_requests: int
    waiting_requests: int


class AdapterAdmin:
    def __init__(self, core: EngineCore):
        self.core = core

    async def load(self, ref: str, pin: bool) -> AdapterResidency:
        record = await self._record(ref)
        packed = await self.core.prepare(record)
        if pin:
            try:
                await self._on_loop(lambda: self.core.lora.pin(record.digest, packed))
            except SlotsExhausted as exc:
                raise ResourceExhausted(f"adapter {ref!r} cannot be pinned: {exc}") from None
        return await self.state(record.digest)

    async def unload(self, ref: str, timeout: float) -> AdapterResidency:
        """Unpin and drop the adapter from GPU and host once its running requests have finished."""
        record = await self._record(ref)
        lora = self.core.lora
        await self._on_loop(lambda: lora.unpin(record.digest))
        deadline = asyncio.get_running_loop().time() + timeout
        while not await self._on_loop(lambda: lora.slots.evict(record.digest)):
            if asyncio.get_running_loop().time() > deadline:
                raise Unavailable(f"adapter {ref!r} still has running requests")
            await asyncio.sleep(UNLOAD_POLL_S)
        lora.host_cache.discard(record.digest)
        return await self.state(record.digest)

    async def available(self) -> list[AdapterRecord]:
        """Every adapter this engine can serve, latest versions: its local ones, then the registry's
        for its base model (UNAVAILABLE while the registry is down)."""
        if self.core.lora is None:
            return []
        records = self.core.adapters.records()
        if self.core.link is not None:
            local = {r.name for r in records}
            records += [r for r in await self.core.link.list_latest() if r.name not in local]
        return records

    async def states(self) -> list[AdapterResidency]:
        return await self._on_loop(self._snapshot)

    async def state(self, digest: str) -> AdapterResidency:
        return await self._on_loop(lambda: self._residency(digest))

    async def _record(self, ref: str) -> AdapterRecord:
        record = await self.core.resolve(ref)
        if record is None:
            raise InvalidArgument("adapter: name the adapter (the base model is always loaded)")
        self.core.check_base_model(record, ref)  # admins alone come here, and they see every adapter
        return record

    async def _on_loop(self, fn):
        return await asyncio.wrap_future(self.core.loop.call(fn))

    def _snapshot(self) -> list[AdapterResidency]:
        lora = self.core.lora
        digests = {s.digest for s in lora.slots.slots if s.digest} | {
            d for d in list(self.core.refs) if d in lora.host_cache
        } | {r.namespace for r in self.core.loop.scheduler.waiting if r.namespace}
        return sorted((self._residency(d) for d in digests), key=lambda r: r.ref)

    def _residency(self, digest: str) -> AdapterResidency:
        lora, scheduler = self.core.lora, self.core.loop.scheduler
        slot = lora.slots.slot_of(digest)
        state = lora.slots.slots[slot] if slot is not None else None
        return AdapterResidency(
            ref=self.core.refs.get(digest, ""),
            digest=digest,
            on_gpu=state is not None and self.core.config.device.startswith("cuda"),  # a CPU engine's slots are host memory
            in_slot=state is not None,
            in_host_cache=digest in lora.host_cache,
            pinned=bool(state and state.is_pinned),
            running_requests=state.num_users if state else 0,
            waiting_requests=sum(r.namespace == digest for r in scheduler.waiting),
        )
