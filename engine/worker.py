"""Model workers: one per GPU (tensor-parallel rank), each executing every step plan.

A `ModelWorker` owns its rank's model shard, KV buffers, request-to-token table, share of every LoRA
slot, attention backend and CUDA graphs. The front holds one handle on all of them:

    LocalWorkers     one rank, in the front's process (no process group)
    ProcessWorkers   rank 0 in the front's process, ranks 1..N-1 spawned processes, joined through
                     torch.distributed (NCCL on CUDA, gloo on the CPU) for the layers' all-reduces

Per step the front pickles (plan, packed adapters the plan loads) down one pipe per spawned rank, then
runs rank 0 itself: a pipe is ordered, needs no collective (so a dead rank is an error on send, not a
hang), and the packed tensors travel as handles to shared host memory (torch's multiprocessing
reductions), never as copies. Only rank 0 samples; the other ranks compute the same forward for its
collectives. A rank that dies is seen by a watcher thread (process sentinels) and reported once through
`on_failure`; spawned ranks ignore Ctrl-C (the front stops them) and exit when the front goes away.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from engine.attention import eager_backend
from engine.config import EngineConfig
from engine.forward_inputs import KVBuffers
from engine.kv_pool import num_slots_for_memory
from engine.lora_pool import LoraSlotPool, PackedAdapter, fused_targets
from engine.lora_tail import GemmTail
from engine.model_config import ModelConfig
from engine.model_runner import ModelRunner, SampledTokens
from engine.parallel import SINGLE, TensorParallel
from engine.step_plan import StepPlan
from engine.weights import load_model, random_model, store_linears_in_out
from lorakernels import tuned

log = logging.getLogger(__name__)
CPU_KV_SLOTS = 16384
START_TIMEOUT_S = 600.0  # loading a large shard and capturing graphs
COLLECTIVE_TIMEOUT_S = 600.0  # torch.distributed's own bound; the watcher reports a dead rank far sooner
STOP_TIMEOUT_S = 10.0  # leaving the process group at shutdown
DEATH_GRACE_S = 5.0  # after a failed step: how long a rank's death may take to show
JOINING = "joining"  # a spawned rank's first message: it is alive and about to join the process group


class WorkerDied(RuntimeError):
    """A model worker process exited; the engine cannot serve any more."""


@dataclass(frozen=True)
class WorkerSpec:
    """What a rank needs to build itself; plain data (it crosses the spawn boundary)."""

    config: EngineConfig
    max_context: int
    tp: TensorParallel = SINGLE
    store_port: int = 0  # rank 0's TCPStore (tensor parallelism only)
    random_config: ModelConfig | None = None  # benchmarks: random weights of this shape, not config.model_dir
    graph_buckets: tuple[int, ...] | None = None  # padded decode batch sizes to capture; None = the default

    @property
    def device(self) -> torch.device:
        device = torch.device(self.config.device)
        if device.type == "cuda" and (self.tp.size > 1 or device.index is None):
            return torch.device("cuda", self.tp.rank if self.tp.size > 1 else torch.cuda.current_device())
        return device


@dataclass(frozen=True)
class WorkerInfo:
    num_kv_slots: int
    attention_backend: str


class ModelWorker:
    def __init__(self, spec: WorkerSpec, runner: ModelRunner, num_kv_slots: int):
        self.spec = spec
        self.runner = runner
        self.info = WorkerInfo(num_kv_slots, runner.attention_backend)

    @classmethod
    def build(cls, spec: WorkerSpec) -> ModelWorker:
        config, device, tp = spec.config, spec.device, spec.tp
        if device.type == "cuda":
            torch.cuda.set_device(device)
            # cuBLASLt's heuristics pick faster kernels than cuBLAS's for the decode GEMMs of 32-64 rows
            # (benchmarks/gemm_layouts.py: the 70B q/k/v shard at 64 rows 23.5 vs 29.3 us a call, whose
            # cuBLAS choice is a split-K with a separate reduce); a process-wide choice.
            torch.backends.cuda.preferred_blas_library("cublaslt")
            from lorakernels import pdl  # Triton: CUDA only

            pdl.set_enabled(config.kernel_pdl)
            pdl.set_lora_enabled(config.lora_pdl)
            if not config.disable_custom_all_reduce:
                tp = tp.with_peer_all_reduce(device)
        # the LoRA kernels' tuned tiles (lorakernels/tuned.py): a file its parser refuses fails the start, not a step
        tuned.use_dir(config.kernel_configs or None)
        tuned.device_tiles(device)
        dtype = getattr(torch, config.dtype) if config.dtype else None
        if spec.random_config is not None:
            model_config = spec.random_config
            model = random_model(model_config, device=device, dtype=dtype, seed=tp.rank, tp=tp)
        else:
            model, model_config = load_model(config.model_dir, device=device, dtype=dtype, tp=tp)
        if config.linear_weight_layout == "in_out":
            store_linears_in_out(model)
            if device.type == "cuda":  # the old layout's blocks back to the device before the KV pool is sized
                torch.cuda.empty_cache()
        gemm_tail = None
        if (
            config.lora_gemm_tail_blocks and config.max_loras_per_batch > 0 and tp.size == 1
            and _lora_backend(config, device) in ("triton", "splitk")
        ):  # fmt: skip
            # before the KV pool is sized: the blocks' rows take device memory
            targets = {t.name: t for t in fused_targets(model.config, config.lora_target_modules)}
            gemm_tail = GemmTail(model, targets, config.max_lora_rank, config.max_loras_per_batch, config.lora_gemm_tail_blocks)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        dtype = next(model.parameters()).dtype
        local = model.config  # this rank's heads and features
        # each rank's pool must hold the same KV slots: the smallest any rank can afford
        num_slots = tp.agree_on_min(config.num_kv_slots or _auto_kv_slots(local, device, dtype, config), device)
        num_slots = max(2, num_slots // config.page_size) * config.page_size
        kv = KVBuffers.allocate(local, num_slots, dtype, device)
        req_to_token = torch.zeros(config.max_running_requests, spec.max_context, dtype=torch.int64, device=device)
        pool = None
        if config.max_loras_per_batch > 0:
            pool = LoraSlotPool(
                model_config, config.max_loras_per_batch, config.max_lora_rank, dtype, device, tp, config.lora_target_modules
            )
        runner = ModelRunner(
            model, kv, req_to_token, eager_backend(_attention_backend(config, device), req_to_token),
            pool, _lora_backend(config, device), samples=tp.rank == 0, lora_sm_carveout=config.lora_sm_carveout,
            lora_sm_carveout_targets=dict(config.lora_sm_carveout_targets), lora_decode_fused_expand=config.lora_decode_fused_expand,
            lora_decode_fused_delta=config.lora_decode_fused_delta, lora_prefill_fused_expand=config.lora_prefill_fused_expand,
            lora_gemm_tail=gemm_tail, lora_decode_norm_shrink=config.lora_decode_norm_shrink,
            tune_decode_gemms=config.tune_decode_gemms, lora_graph_segments=config.lora_graph_segments,
        )  # fmt: skip
        if device.type == "cuda" and (config.cuda_graph_max_batch > 0 or config.cuda_graph_max_tokens > 0):
            runner.enable_cuda_graphs(
                min(config.cuda_graph_max_batch, config.max_running_requests), spec.graph_buckets,
                max_tokens=min(config.cuda_graph_max_tokens, config.max_batch_tokens),
            )  # fmt: skip
        return cls(spec, runner, num_slots)

    def launch(self, plan: StepPlan, adapters: Mapping[str, PackedAdapter]) -> SampledTokens:
        return self.runner.launch(plan, adapters)

    def release(self) -> None:
        """Drop the CUDA graphs (they hold captured collectives) and let the device finish its work."""
        self.runner.graphs = self.runner.step_graphs = None
        if self.spec.device.type == "cuda":
            gc.collect()
            torch.cuda.synchronize(self.spec.device)


class LocalWorkers:
    """One rank, in this process."""

    def __init__(self, spec: WorkerSpec):
        self.local = ModelWorker.build(spec)
        self.info = self.local.info
        self.failure: str | None = None
        self.on_failure: Callable[[str], None] | None = None
        self.pids: list[int] = []

    def launch(self, plan: StepPlan, adapters: Mapping[str, PackedAdapter]) -> SampledTokens:
        return self.local.launch(plan, adapters)

    def execute(self, plan: StepPlan, adapters: Mapping[str, PackedAdapter]) -> list[int]:
        return self.launch(plan, adapters).result()

    def wait_for_failure(self, timeout: float) -> str | None:
        return None

    def close(self, abandon: bool = False) -> None:
        pass


class ProcessWorkers:
    """Rank 0 here, ranks 1..N-1 as spawned processes; see the module doc."""

    def __init__(self, spec: WorkerSpec):
        from torch.distributed import TCPStore

        size = spec.tp.size
        store = TCPStore("127.0.0.1", 0, size, is_master=True, timeout=datetime.timedelta(seconds=START_TIMEOUT_S), wait_for_workers=False)
        spec = replace(spec, store_port=store.port)
        ctx = multiprocessing.get_context("spawn")
        self._conns, self._procs = [], []
        for rank in range(1, size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(replace(spec, tp=TensorParallel(rank, size)), child), name=f"loramux-worker-{rank}", daemon=True)
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
            log.info("model worker rank %d started (pid %d)", rank, proc.pid)
        self.pids = [p.pid for p in self._procs]
        self.failure: str | None = None
        self.on_failure: Callable[[str], None] | None = None
        self._closing = threading.Event()
        self._dead_lock = threading.Lock()
        self._starting: threading.Thread | None = None  # rank 0's build, while the start is under way
        self.local: ModelWorker | None = None
        try:
            self.local = self._start(spec, store)
        except BaseException:
            self.close()
            raise
        self.info = self.local.info
        threading.Thread(target=self._watch, name="worker-watch", daemon=True).start()

    def execute(self, plan: StepPlan, adapters: Mapping[str, PackedAdapter]) -> list[int]:
        return self.launch(plan, adapters).result()

    def launch(self, plan: StepPlan, adapters: Mapping[str, PackedAdapter]) -> SampledTokens:
        if self.failure is not None:
            raise WorkerDied(self.failure)
        loaded = {load.digest: adapters[load.digest] for load in plan.loads}
        try:
            for conn in self._conns:
                conn.send((plan, loaded))
        except OSError as exc:  # a closed pipe: its rank is gone
            raise WorkerDied(self.wait_for_failure(DEATH_GRACE_S) or f"a model worker is unreachable: {exc}") from exc
        return self.local.launch(plan, adapters)

    def wait_for_failure(self, timeout: float) -> str | None:
        """The failure if a rank exits within `timeout` seconds (after a step failed), else None."""
        if self.failure is None:
            self._note_dead(multiprocessing.connection.wait([p.sentinel for p in self._procs], timeout))
        return self.failure

    def close(self, abandon: bool = False, timeout: float = 10.0) -> None:
        """Stop every spawned rank: ask, wait, then kill what is left. abandon: the loop thread is stuck
        in a collective with a dead rank, so the process group is left to the process's exit."""
        self._closing.set()
        for conn in self._conns:
            with contextlib.suppress(OSError):  # already gone
                conn.send(None)
        if self._starting is not None and self._starting.is_alive():  # a failed start: stop the ranks rank 0 waits on
            for proc in self._procs:
                proc.kill()
            self._starting.join(timeout)
        if not abandon:
            if self.local is not None:
                self.local.release()
            _leave_group(timeout)
        for proc in self._procs:
            proc.join(timeout)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout)

    def _start(self, spec: WorkerSpec, store) -> ModelWorker:
        """Build rank 0 while watching the other ranks. Joining the group and building wait on every rank
        (a rendezvous, then collectives), so a rank that fails first would hold rank 0 until torch's own
        timeout (minutes). So rank 0 joins only once every rank has said it is joining, and then builds
        in a thread while this one raises WorkerDied as soon as a rank reports a failure or exits (close()
        then gives that thread a bounded wait: a collective with a dead rank fails)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        self._await_all(lambda message: message == JOINING, deadline)
        built: dict[str, object] = {}
        done = threading.Event()

        def build() -> None:
            try:
                _init_group(spec, store)
                built["worker"] = ModelWorker.build(spec)
            except BaseException as exc:  # handed to the caller below
                built["error"] = exc
            finally:
                done.set()

        def raise_rank_0_failure() -> None:
            if "error" in built:
                raise built["error"]

        self._starting = threading.Thread(target=build, name="rank0-start", daemon=True)
        self._starting.start()
        self._await_all(lambda message: isinstance(message, WorkerInfo), deadline, raise_rank_0_failure)
        if not done.wait(max(0.0, deadline - time.monotonic())):
            raise WorkerDied(f"model worker rank 0 did not start within {START_TIMEOUT_S:.0f} s")
        raise_rank_0_failure()
        return built["worker"]

    def _await_all(self, accepts: Callable[[object], bool], deadline: float, check: Callable[[], None] = lambda: None) -> None:
        """Receive one message from every spawned rank, each one `accepts`, raising WorkerDied on a rank's
        failure, exit or lateness; `check` (which may raise) runs between waits."""
        waiting = dict(enumerate(self._conns, start=1))
        while waiting:
            self._receive_ready(waiting, accepts, 0.1)
            try:
                check()
            except BaseException:
                # Rank 0 failed, most likely because a rank it waited on failed first and exited: that
                # rank's own report names the cause, so it wins when it arrives within a second.
                self._receive_ready(waiting, accepts, 1.0)
                raise
            if waiting and time.monotonic() > deadline:
                late = ", ".join(str(r) for r in waiting)
                raise WorkerDied(f"model worker rank {late} did not start within {START_TIMEOUT_S:.0f} s")

    def _receive_ready(self, waiting: dict[int, multiprocessing.connection.Connection], accepts: Callable[[object], bool], timeout: float) -> None:
        ready = multiprocessing.connection.wait([*waiting.values(), *(p.sentinel for p in self._procs)], timeout)
        for rank, conn in list(waiting.items()):
            if conn in ready:
                message = self._receive(rank, conn)
                if not accepts(message):
                    raise WorkerDied(f"model worker rank {rank} sent {message!r} while starting")
                del waiting[rank]
        for rank, proc in enumerate(self._procs, start=1):
            if proc.sentinel in ready and rank not in waiting:
                raise WorkerDied(f"model worker rank {rank} exited while starting (code {proc.exitcode})")

    def _receive(self, rank: int, conn: multiprocessing.connection.Connection) -> object:
        try:
            message = conn.recv()
        except EOFError:
            proc = self._procs[rank - 1]
            proc.join(1.0)
            raise WorkerDied(f"model worker rank {rank} exited while starting (code {proc.exitcode})") from None
        if isinstance(message, BaseException):
            raise WorkerDied(f"model worker rank {rank} failed to start: {message}")
        return message

    def _watch(self) -> None:
        sentinels = [p.sentinel for p in self._procs]
        while not self._closing.is_set():
            ready = multiprocessing.connection.wait(sentinels, 0.5)
            if ready and not self._closing.is_set():
                self._note_dead(ready)
                if self.failure is not None and self.on_failure is not None:
                    self.on_failure(self.failure)
                return

    def _note_dead(self, ready: list) -> None:
        """Record the first rank whose sentinel is ready (it exited). Under a lock: the watcher and the
        loop thread may both get here, and only one of them can reap the process's exit code."""
        with self._dead_lock:
            for rank, proc in enumerate(self._procs, start=1):
                if self.failure is None and proc.sentinel in ready and not self._closing.is_set():
                    self.failure = f"model worker rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
                    log.error("%s", self.failure)


def start_workers(spec: WorkerSpec) -> LocalWorkers | ProcessWorkers:
    return LocalWorkers(spec) if spec.tp.size == 1 else ProcessWorkers(spec)


def worker_main(spec: WorkerSpec, conn: multiprocessing.connection.Connection) -> None:
    """A spawned rank: build, report, then execute plans until told to stop or the front is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the front stops us
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{spec.tp.rank} %(levelname)s %(name)s: %(message)s")
    if spec.device.type == "cpu":
        torch.set_num_threads(1)  # N ranks share the host's cores
    _exit_with_parent()
    from torch.distributed import TCPStore

    conn.send(JOINING)
    try:
        store = TCPStore("127.0.0.1", spec.store_port, spec.tp.size, is_master=False, timeout=datetime.timedelta(seconds=START_TIMEOUT_S))
        _init_group(spec, store)
        worker = ModelWorker.build(spec)
    except BaseException as exc:
        conn.send(RuntimeError(f"{type(exc).__name__}: {exc}"))
        raise
    conn.send(worker.info)
    gc.collect()
    gc.freeze()  # the rank's startup heap, out of the full collections that would stall its steps (engine/server.py)
    while True:
        try:
            message = conn.recv()
        except EOFError:
            break
        if message is None:
            worker.release()
            if not _leave_group(STOP_TIMEOUT_S):
                logging.shutdown()
                os._exit(0)  # a teardown still running in C++ threads would abort the interpreter's exit
            break
        plan, adapters = message
        worker.launch(plan, adapters)  # rank > 0 samples nothing: nothing to wait for


def _exit_with_parent() -> None:
    """A rank stuck in a collective would outlive a killed front; watch the parent and leave with it."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            threading.Event().wait(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _leave_group(timeout: float) -> bool:
    """Leave the process group, every rank on the same stop message (sent after the last plan, whose
    collectives every rank has joined); the caller has released its CUDA graphs, which hold the captured
    collectives. NCCL's teardown waits on its peers (rank 0 alone, after the others had exited, hung in
    destroy_process_group on two H200s; aborting the communicators instead hung as well), so a daemon
    thread bounds the wait. False when the group did not close in time: the process's exit is left to it."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return True
    start = time.monotonic()
    leaving = threading.Thread(target=dist.destroy_process_group, name="leave-group", daemon=True)
    leaving.start()
    leaving.join(timeout)
    if leaving.is_alive():
        log.warning("the process group did not close within %.0f s; leaving it to the process's exit", timeout)
        return False
    log.info("left the process group in %.2f s", time.monotonic() - start)
    return True


def _init_group(spec: WorkerSpec, store) -> None:
    import torch.distributed as dist

    backend = "nccl" if spec.device.type == "cuda" else "gloo"
    if spec.device.type == "cuda":
        torch.cuda.set_device(spec.device)
    dist.init_process_group(
        backend, store=store, rank=spec.tp.rank, world_size=spec.tp.size,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )  # fmt: skip


def read_model_config(model_dir: str) -> ModelConfig:
    return ModelConfig.from_hf(json.loads((Path(model_dir) / "config.json").read_text()))


def _auto_kv_slots(local: ModelConfig, device: torch.device, dtype: torch.dtype, config: EngineConfig) -> int:
    if device.type != "cuda":
        return CPU_KV_SLOTS
    free, _ = torch.cuda.mem_get_info(device)
    return num_slots_for_memory(free, config.kv_memory_fraction, local.num_layers, local.num_kv_heads, local.head_dim, dtype)


def _lora_backend(config: EngineConfig, device: torch.device) -> str:
    # splitk: the plain Triton SGMV for prefill, the split-K shrink for decode steps (faster in every
    # measured decode step; BENCHMARKS.md)
    return config.lora_backend or ("splitk" if device.type == "cuda" else "ref")


def _attention_backend(config: EngineConfig, device: torch.device) -> str:
    return config.attention_backend or ("triton" if device.type == "cuda" else "ref")
