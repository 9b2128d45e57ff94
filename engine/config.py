"""The engine's settings, read once at the entry point (flags or LORAMUX_* variables)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from loramux.security import TlsFiles

DEFAULT_ENGINE_PORT = 50052
DEFAULT_HTTP_PORT = 8000  # the OpenAI-compatible front of `loramux up` (vLLM's port)


# On by default: without it one busy adapter can hold every slot while another adapter's requests wait
# forever. 2 s is long next to a slot's normal turnover (a request of a few hundred tokens at decode
# speed), so steady mixed traffic never drains, and short enough that a starved adapter waits seconds,
# not minutes (tests/engine/test_drain.py runs the default configuration through both cases).
DEFAULT_LORA_DRAIN_WAIT_S = 2.0

# Two a step: an 8B rank-16 adapter copies in ~1-2 ms, a decode step takes ~7-11 ms, so two copies hide
# behind one step's compute, and a burst of new adapters still loads a few steps ahead of admission.
DEFAULT_LORA_LOAD_AHEAD = 2

# Four, as many as the fetches that run at once (--max-concurrent-fetches). A cold Zipf pass over 1000
# q/v adapters, Llama-3-8B on an H200, ran at 0.09-0.11 of base with one packing thread, 0.60 with four
# and 0.50 with twenty (BENCHMARKS.md, 2026-12-02): one thread starves while the engine loop, short of
# adapters, runs steps of few rows back to back; twenty take the GIL from the loop's launches.
DEFAULT_ADAPTER_PREP_THREADS = 4

# One: on the H200 host a second fetch process took 8 fetches at once from 1.43 to 1.64 GB/s, and four
# did not beat two, but the cold Zipf pass of benchmarks/serve.py did not change with either
# (BENCHMARKS.md, 2026-12-03, eighteenth session); each process holds its own interpreter and connection.
DEFAULT_FETCH_PROCESSES = 1

# A bit over a third of an H200's 132 SMs. Llama-3-8B decode steps with rank-16 adapters on every
# projection, each GEMM enqueued before its side-stream LoRA kernels (BENCHMARKS.md, 2026-12-02), LoRA/base
# with 8 adapters at batch 32 and 64: 0.85, 0.88 for a carve-out of 40 SMs; 0.87-0.88, 0.87-0.88 for 48;
# 0.87, 0.82-0.85 for 56; 0.85, 0.86 for 64 (with 32 adapters 48 and 56 are level, 40 and 64 a little
# behind); the base GEMMs alone no slower. Prefill GEMMs are compute bound and never get one. At most half a
# device's SMs (usable_sm_carveout).
DEFAULT_LORA_SM_CARVEOUT = 48

LINEAR_WEIGHT_LAYOUTS = ("out_in", "in_out")  # linear_weight_layout's choices
DECODE_FUSED_TARGETS = ("qkv", "gate_up")  # lora_decode_fused_expand's and lora_decode_norm_shrink's choices
PREFILL_FUSED_TARGETS = ("gate_up", "o", "down")  # lora_prefill_fused_expand's choices
LORA_FUSED_TARGETS = ("qkv", "o", "gate_up", "down")  # engine/lora_pool.py FusedTarget.name: lora_sm_carveout_targets' keys


def parse_target_sms(text: str) -> tuple[str, int]:
    """TARGET=SMS (--lora-sm-carveout-target): one of LORA_FUSED_TARGETS and an SM count in 0..1024."""
    target, sep, num = text.partition("=")
    if not sep or target not in LORA_FUSED_TARGETS:
        raise ValueError(f"{text!r} is not TARGET=SMS with TARGET one of {', '.join(LORA_FUSED_TARGETS)}")
    if not num.isdigit() or not 0 <= int(num) <= 1024:
        raise ValueError(f"{text!r}: SMS must be an integer in 0..1024")
    return target, int(num)


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str
    base_model_name: str = ""  # "" = the model directory's name
    host: str = "127.0.0.1"
    port: int = DEFAULT_ENGINE_PORT
    device: str = "cpu"
    dtype: str = ""  # "" = float32 on CPU, bfloat16 on CUDA
    page_size: int = 1
    num_kv_slots: int = 0  # 0 = 16384 on CPU; on CUDA, kv_memory_fraction of free memory
    kv_memory_fraction: float = 0.85
    max_context: int = 0  # 0 = the model's max_position_embeddings
    max_running_requests: int = 64
    max_batch_tokens: int = 2048
    max_queued_requests: int = 1024
    max_prompt_bytes: int = 1 << 20
    attention_backend: str = ""  # "" = "triton" on CUDA (measured 3x SDPA at prefill), "ref" on CPU; or "ref" / "sdpa" / "triton"
    # LoRA: adapters served from local files (NAME, DIR), the GPU slot pool and the host cache.
    adapters: tuple[tuple[str, str], ...] = ()
    max_loras_per_batch: int = 8  # GPU adapter slots; 0 disables LoRA
    max_lora_rank: int = 64
    # Projections the slots hold LoRA for (q_proj keeps the whole q/k/v target); empty: all of them. A q/v
    # pool's slot is 23% of an all-target slot at Llama-3-8B's widths (engine/lora_pool.py).
    lora_target_modules: tuple[str, ...] = ()
    max_host_adapters: int = 64
    # On CUDA, pinned host memory (GiB) taken at startup for packed adapters (engine/pinned_arena.py): a
    # fresh pinned allocation while serving holds up the GPU launches; 0 = pin each adapter as it is
    # packed; None = auto (`auto_arena_bytes`: the host cache's adapters, those in slots and
    # max_host_adapters others, at the slots' capacity, at most 4 GiB and an eighth of the host's or
    # container's memory; one CUDA rank with LoRA on, else none)
    host_pinned_gb: float | None = None
    # On CUDA, SMs a decode step's base GEMMs leave to the LoRA kernels running beside them
    # (LoraInputs.sm_carveout): cuBLAS's decode GEMMs are weight-read bound, so they lose little, and the
    # LoRA kernels no longer wait for whole SMs; 0 = the GEMMs take every SM
    lora_sm_carveout: int = DEFAULT_LORA_SM_CARVEOUT
    # (fused target, SMs) pairs: those targets' GEMMs take their own carve-out in place of lora_sm_carveout.
    # With 48 SMs free cuBLASLt runs Llama-3-8B's gate/up GEMM at batch 32 in 95 us against 85 with every
    # SM, beside ~30 us of LoRA kernels; yet giving gate/up, q/k/v, o or down back their SMs (0, or 16 for
    # gate/up) made 8- and 32-adapter decode steps 0-8% slower, never faster beyond noise, and 32 or 64
    # SMs for all did no better than 48 (an H100, BENCHMARKS.md, 2026-12-05). None by default
    lora_sm_carveout_targets: tuple[tuple[str, int], ...] = ()
    # On CUDA with CUDA graphs, time cuBLASLt's candidate algorithms for each fused target's decode GEMM at
    # each captured batch size, under its carve-out beside LoRA kernels and on every SM without them, and
    # run the fastest where it beats torch.mm's own pick (engine/carved_gemms.py); False: torch.mm's pick.
    # On an H100 (Llama-3-8B, BENCHMARKS.md, 2026-12-07): under the carve-out alone, decode steps with
    # adapters 5.7% shorter at batch 1, 1.4% at batch 32 with 8 adapters, level at 64 (three rounds); with
    # every SM tuned too, base and 8-adapter steps at batch 1, 8 and 32 2.9-5.6% shorter (two rounds), for
    # about 0.1 s of timing a (target, batch size, carve-out) when the engine starts
    tune_decode_gemms: bool = True
    # On CUDA with the Triton SGMV ops, the fused targets ("qkv", "gate_up") whose LoRA expand a decode
    # step runs in the kernel that reads the projection next (RoPE with the KV write, lorakernels/rope_kv.py;
    # SiLU-mul, lorakernels/silu_mul.py) instead of beside the base GEMM on the side stream: that kernel
    # reads the slots' B as it loads the projection. None by default until measured (BENCHMARKS.md)
    lora_decode_fused_expand: tuple[str, ...] = ()
    # On CUDA with the Triton SGMV ops, the fused targets whose LoRA expand a prefill-sized step leaves to
    # the kernel that reads the projection next: gate/up's to SiLU-mul (lorakernels/silu_mul.py), o's and
    # down's to the residual add + RMSNorm (lorakernels/rmsnorm.py `add_rmsnorm_expand`; one GPU, since
    # under tensor parallelism their partial sums get the delta before the all-reduce), instead of the
    # expand reading and writing the projection's output first. o and down not by default until measured
    lora_prefill_fused_expand: tuple[str, ...] = ("gate_up",)
    # With the Triton SGMV ops on one GPU, prefill-sized steps (engine/lora_tail.py MIN_TOKENS+) of at most
    # this many adapters add their LoRA in the base GEMMs (the shrinks as extra input columns, the B
    # matrices as extra weight rows beside each layer's weights: engine/lora_tail.py), so no expand
    # reads and writes a projection's output; more adapters run in line. Prefill with 8 adapters 3-4%
    # faster at rank capacity 16, 2-11% at 64 (an H100, Llama-3-8B; BENCHMARKS.md, 2026-12-06), for
    # blocks x (A and B^T of one slot) of device memory (~2 GB at 4 blocks, rank 64, Llama-3-8B).
    # Unused under tensor parallelism (a row-parallel delta would be summed over the ranks). 0: off
    lora_gemm_tail_blocks: int = 4
    # CUDA decode graphs with LoRA are also captured for steps of at most these many LoRA segments (a
    # segment: one adapter's neighbouring rows, up to 16), and a step replays the graph of the fewest that
    # hold its own. A graph captured for one segment a row launches its LoRA kernels' programs for every
    # row, and with few adapters most are padding: up to 27 us a projection at 128 rows on an H100
    # (BENCHMARKS.md, 2026-12-07). Each count adds a LoRA graph per batch size and variant (capture time,
    # a logits buffer each). None by default: on an H100 the decode step was level with it (the chain runs
    # beside its GEMM, which hides the padding)
    lora_graph_segments: tuple[int, ...] = ()
    # On CUDA with the splitk LoRA backend and a max LoRA rank up to 64, the fused targets (LORA_FUSED_TARGETS) whose LoRA delta a decode
    # step computes beside the base GEMM in one pass from x (lorakernels/sgmv_decode.py
    # `sgmv_lora_delta_decode`: the expand sums the split shrink's partials itself, so no reduce kernel
    # and no v on the side stream) rather than shrink, reduce and expand. A target here may not also be in
    # lora_decode_fused_expand. None by default: level or slower beside each GEMM, and decode steps 1-6%
    # slower with it on all four targets (an H100, BENCHMARKS.md, 2026-12-06)
    lora_decode_fused_delta: tuple[str, ...] = ()
    # On CUDA with the Triton SGMV ops and a max LoRA rank up to 64, the fused targets ("qkv", "gate_up")
    # whose decode-step LoRA leaves the side stream: the residual add + RMSNorm kernel that writes the
    # projection's input also shrinks it (lorakernels/norm_shrink.py), the base GEMM runs on every SM with
    # nothing beside it, and the kernel that reads its output next expands (RoPE with the KV write, SiLU-mul).
    # A target here may not also be in lora_decode_fused_delta. None by default: on an H200 (Llama-3-8B,
    # rank 16) decode steps were 4-5% slower with gate/up's at 8 adapters, 8-11% at 32, and slower again with
    # q/k/v's too: the fused norm costs 5-8 us more than the plain one, more than the side stream's carve-out
    # and events cost (BENCHMARKS.md, 2026-12-06)
    lora_decode_norm_shrink: tuple[str, ...] = ()
    # a directory of tuned LoRA-kernel tile files (lorakernels/tuned.py; benchmarks/tune_lora_tiles.py writes
    # them); "" = the package's lorakernels/configs
    kernel_configs: str = ""
    lora_eviction_policy: str = "lru"  # or "fifo"
    lora_load_ahead: int = DEFAULT_LORA_LOAD_AHEAD  # queued requests' adapters loaded a step ahead; 0 = off
    lora_drain_wait_s: float = DEFAULT_LORA_DRAIN_WAIT_S  # starvation drain threshold (DESIGN 7); 0 = off
    lora_backend: str = ""  # "" = "splitk" on CUDA, "ref" on CPU; or "ref" / "triton" / "chunked" / "splitk"
    work_dir: str = ""  # compiled adapters; "" = a temporary directory
    registry: str = ""  # HOST:PORT of the registry service; "" = local adapters only
    # registry fetches in flight at most; the rest wait their turn in order, so a burst of new adapters
    # arrives one batch after another instead of all at the end of one shared transfer
    max_concurrent_fetches: int = 4
    # False: fetches run on the engine's event loop instead of a process of their own (engine/fetch_process.py,
    # Linux only), where every chunk waits for the GIL the engine's step thread holds
    disable_fetch_process: bool = False
    # fetch processes that split the fetches' turns (never more than max_concurrent_fetches): each one's
    # event loop handles every chunk of the fetches it runs
    fetch_processes: int = DEFAULT_FETCH_PROCESSES
    # threads that check and pack fetched adapters, at most this many at a time: the check and the packing
    # run Python and small tensor ops per layer and projection, and every thread doing them competes for
    # the GIL with the engine loop's launches
    adapter_prep_threads: int = DEFAULT_ADAPTER_PREP_THREADS
    # The process's GIL switch interval (sys.setswitchinterval), ms; 0 = Python's own (5 ms). A thread that
    # wants the GIL waits up to this long for a thread running Python: the registry link's event loop for
    # each 1 MiB chunk, the packing threads and the engine loop after each call that lets the GIL go.
    # Beside a thread that runs Python throughout, one link fetched 13.6 MB adapters, 4 at a time, at
    # 239 MB/s with 5 ms, 650 with 1 ms and 792 with 0.5 ms, against 930 alone, on the 2-core VM
    # (benchmarks/fetch_contention.py, BENCHMARKS.md); not yet measured in a serving run
    gil_switch_interval_ms: float = 0.0
    cuda_graph_max_batch: int = 64  # on CUDA, decode steps of up to this many requests replay graphs; 0 = off
    # on CUDA, prefill and mixed steps of up to this many tokens (at most max_batch_tokens) replay graphs
    # captured for padded token counts (engine/step_graphs.py); 0 = off
    cuda_graph_max_tokens: int = 2048
    # On CUDA (compute capability 9+), launch the decode path's Triton kernels (RMSNorm, RoPE with the KV
    # write, attention, SiLU-mul) with programmatic dependent launch (lorakernels/pdl.py): each kernel's
    # programs are scheduled while the kernel before it drains and wait for it on the device. Off by
    # default: decode steps with adapters 0.6-1.2% faster, base steps 0.6-1.0% slower (an H200 and an H100,
    # Llama-3-8B; BENCHMARKS.md, 2026-12-06); a process-wide setting each model worker makes when it builds
    kernel_pdl: bool = False
    # On CUDA (compute capability 9+), the decode LoRA chain on the side stream (the split shrink, its
    # reduce, the expand; lorakernels/sgmv_decode.py) with programmatic dependent launch: each kernel
    # releases the next at its start, whose programs read the step's metadata and the adapters' B, then
    # wait on the device (lorakernels/pdl.py). Base steps run none of these kernels. On by default: decode
    # steps with 8 or 32 adapters 0-2.5% shorter at batch 32 and 64, base steps level, the LoRA kernels
    # alone 1-2.7 us shorter a projection in most shapes (an H100, Llama-3-8B; BENCHMARKS.md, 2026-12-07);
    # a process-wide setting each model worker makes when it builds
    lora_pdl: bool = True
    # How the base model's linear weights lie in memory: "in_out" (the logical [out, in] tensors stored
    # transposed, so each GEMM reads W^T as a row-major [in, out] matrix) or "out_in" (nn.Linear's rows).
    # cuBLASLt reads the decode GEMMs' weights faster the first way: Llama-3-8B decode steps 3.5-3.9% shorter
    # at batch 32 and 64 with and without adapters, 1.6% at batch 1, prefill steps level (within 1%), and
    # served output 1.2% (base) to 2.5-3.6% (1-32 adapters) higher (an H100, BENCHMARKS.md, 2026-12-06).
    # The untied LM head is stored the same way; a tied one stays as the embedding lookup needs it
    linear_weight_layout: str = "in_out"
    tensor_parallel_size: int = 1  # model workers (GPUs), one per tensor-parallel rank
    disable_custom_all_reduce: bool = False  # True: every all-reduce through NCCL (no one-shot peer path)
    disable_overlap_schedule: bool = False  # True: on CUDA too, plan each step only after the last one's tokens
    # Security: with auth, clients' keys are checked through the registry (answers cached key_cache_s);
    # api_key is the engine's own key for the registry; tls serves TLS and links to the registry with it.
    auth: bool = False
    api_key: str = ""
    key_cache_s: float = 5.0
    allow_unauthenticated: bool = False
    tls: TlsFiles = field(default_factory=TlsFiles)

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.lora_load_ahead < 0:
            raise ValueError(f"lora_load_ahead must be >= 0, got {self.lora_load_ahead}")
        if not 0 <= self.lora_sm_carveout <= 1024:
            raise ValueError(f"lora_sm_carveout must be 0-1024 SMs, got {self.lora_sm_carveout}")
        names = [name for name, _ in self.lora_sm_carveout_targets]
        if not set(names) <= set(LORA_FUSED_TARGETS) or len(set(names)) != len(names):
            raise ValueError(f"lora_sm_carveout_targets takes each of {', '.join(LORA_FUSED_TARGETS)} once, got {names}")
        if any(not 0 <= num_sms <= 1024 for _, num_sms in self.lora_sm_carveout_targets):
            raise ValueError(f"lora_sm_carveout_targets must be 0-1024 SMs each, got {self.lora_sm_carveout_targets}")
        if not set(self.lora_decode_fused_expand) <= set(DECODE_FUSED_TARGETS):
            raise ValueError(f"lora_decode_fused_expand takes {', '.join(DECODE_FUSED_TARGETS)}, got {self.lora_decode_fused_expand}")
        if not set(self.lora_prefill_fused_expand) <= set(PREFILL_FUSED_TARGETS):
            raise ValueError(f"lora_prefill_fused_expand takes {', '.join(PREFILL_FUSED_TARGETS)}, got {self.lora_prefill_fused_expand}")
        if not set(self.lora_decode_fused_delta) <= set(LORA_FUSED_TARGETS):
            raise ValueError(f"lora_decode_fused_delta takes {', '.join(LORA_FUSED_TARGETS)}, got {self.lora_decode_fused_delta}")
        if both := sorted(set(self.lora_decode_fused_delta) & set(self.lora_decode_fused_expand)):
            raise ValueError(
                f"{', '.join(both)} cannot be in both lora_decode_fused_delta (the delta beside the GEMM) and"
                " lora_decode_fused_expand (the expand in the next kernel)"
            )
        if not set(self.lora_decode_norm_shrink) <= set(DECODE_FUSED_TARGETS):
            raise ValueError(f"lora_decode_norm_shrink takes {', '.join(DECODE_FUSED_TARGETS)}, got {self.lora_decode_norm_shrink}")
        if both := sorted(set(self.lora_decode_fused_delta) & set(self.lora_decode_norm_shrink)):
            raise ValueError(
                f"{', '.join(both)} cannot be in both lora_decode_fused_delta (the delta beside the GEMM) and"
                " lora_decode_norm_shrink (the shrink in the norm, the expand in the next kernel)"
            )
        if any(n < 1 for n in self.lora_graph_segments):
            raise ValueError(f"lora_graph_segments must be positive, got {self.lora_graph_segments}")
        if not 0 <= self.lora_gemm_tail_blocks <= 64:
            raise ValueError(f"lora_gemm_tail_blocks must be 0-64, got {self.lora_gemm_tail_blocks}")
        if self.linear_weight_layout not in LINEAR_WEIGHT_LAYOUTS:
            raise ValueError(f"linear_weight_layout must be one of {', '.join(LINEAR_WEIGHT_LAYOUTS)}, got {self.linear_weight_layout!r}")
        if self.kernel_configs and not Path(self.kernel_configs).is_dir():
            raise ValueError(f"kernel_configs {self.kernel_configs!r} is not a directory")
        if self.max_concurrent_fetches < 1:
            raise ValueError(f"max_concurrent_fetches must be >= 1, got {self.max_concurrent_fetches}")
        if not 1 <= self.fetch_processes <= 64:
            raise ValueError(f"fetch_processes must be 1-64, got {self.fetch_processes}")
        if not 0 <= self.gil_switch_interval_ms <= 100:
            raise ValueError(f"gil_switch_interval_ms must be 0-100 (0 = Python's own), got {self.gil_switch_interval_ms}")
        if not 1 <= self.adapter_prep_threads <= 64:
            raise ValueError(f"adapter_prep_threads must be 1-64, got {self.adapter_prep_threads}")
        if self.host_pinned_gb is not None and not 0 <= self.host_pinned_gb < float("inf"):
            raise ValueError(f"host_pinned_gb must be a finite number >= 0 (0 = off) or None (auto), got {self.host_pinned_gb}")
        if self.cuda_graph_max_batch < 0 or self.cuda_graph_max_tokens < 0:
            raise ValueError("cuda_graph_max_batch and cuda_graph_max_tokens must be >= 0 (0 = off)")

    @property
    def resolved_base_model_name(self) -> str:
        """The name the base model has in the registry: --base-model-name, else the model dir's name."""
        return self.base_model_name or Path(self.model_dir).resolve().name
