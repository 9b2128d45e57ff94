"""cuBLASLt through ctypes: a decode GEMM y = x @ W with the algorithm and SM-count target chosen by us.

PyTorch's `torch.mm` under its SM carve-out (engine/lora_inputs.py `sm_carveout`) asks cuBLASLt for one
algorithm, the first its heuristic returns for the device's SMs less the carve-out, and runs it. For the
decode projections beside the LoRA chain that pick is not the fastest: on an H100 gate/up's GEMM takes
95.5 us a layer under a 48-SM carve-out against 85.4 us on every SM (a 384x32 tile against 128x32;
BENCHMARKS.md, twenty-first session). `LtGemm` queries the heuristic for several candidates and runs any
of them, on the current stream and so inside CUDA graphs, so a tool can time them where they will run.

The library is the one PyTorch loaded (found in /proc/self/maps), so both share one cuBLASLt. Only the
engine's layout is covered: x [M, K] row-major, W stored [K, N] row-major (linear_weight_layout "in_out",
the logical [N, K] weight's transpose), y [M, N] row-major, in fp16 or bf16 with fp32 accumulation; in
cuBLASLt's column-major terms y^T = W^T x^T with no transposes. The heuristic assumes 256-byte aligned
pointers (its default), which `__call__` checks.
"""

from __future__ import annotations

import ctypes
import dataclasses
import glob
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import torch

_CUDA_DTYPE = {torch.float16: 2, torch.bfloat16: 14}  # cudaDataType_t: CUDA_R_16F, CUDA_R_16BF
_CUDA_R_32F = 0
_COMPUTE_32F = 68  # cublasComputeType_t CUBLAS_COMPUTE_32F
_DESC_TRANSA, _DESC_TRANSB, _DESC_SM_COUNT_TARGET = 3, 4, 15  # cublasLtMatmulDescAttributes_t
_PREF_MAX_WORKSPACE_BYTES = 1  # cublasLtMatmulPreferenceAttributes_t
_OP_N = 0
WORKSPACE_BYTES = 32 << 20  # what the heuristic may ask for: cuBLAS's own workspace on Hopper
ALIGNMENT = 256  # bytes: the heuristic's default minimum alignment of every matrix
# cublasLtMatmulAlgoConfigAttributes_t read back for the record (each a 32-bit integer)
_CONFIG_ATTRIBUTES = {"algo_id": 0, "tile": 1, "splitk": 2, "reduction": 3, "swizzle": 4, "custom": 5, "stages": 6, "inner_shape": 7, "cluster_shape": 8}


class _Algo(ctypes.Structure):  # cublasLtMatmulAlgo_t: opaque, 8 x uint64
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):  # cublasLtMatmulHeuristicResult_t
    _fields_ = [("algo", _Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int), ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


class CublasLtError(RuntimeError):
    """A cuBLASLt call that returned an error status, or no cuBLASLt to load."""


def _library_path() -> str:
    """The libcublasLt PyTorch's CUDA build loaded, else one beside it in site-packages."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if "libcublasLt.so" in os.path.basename(path):
                    return path
    except OSError:  # no /proc (not Linux): look beside PyTorch's wheels
        pass
    for base in sys.path:
        found = sorted(glob.glob(os.path.join(base, "nvidia", "*", "lib", "libcublasLt.so*")))
        if found:
            return found[-1]
    raise CublasLtError("no libcublasLt: this PyTorch has no CUDA build, or its cuBLAS is not installed")


@cache
def _lib() -> ctypes.CDLL:
    lib = ctypes.CDLL(_library_path())
    p, i, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    signatures = {
        "cublasLtCreate": [ctypes.POINTER(p)],
        "cublasLtMatmulDescCreate": [ctypes.POINTER(p), i, i],
        "cublasLtMatmulDescSetAttribute": [p, i, p, sz],
        "cublasLtMatmulDescDestroy": [p],
        "cublasLtMatrixLayoutCreate": [ctypes.POINTER(p), i, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64],
        "cublasLtMatrixLayoutDestroy": [p],
        "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(p)],
        "cublasLtMatmulPreferenceSetAttribute": [p, i, p, sz],
        "cublasLtMatmulPreferenceDestroy": [p],
        "cublasLtMatmulAlgoGetHeuristic": [p, p, p, p, p, p, p, i, ctypes.POINTER(_Heuristic), ctypes.POINTER(i)],
        "cublasLtMatmulAlgoCheck": [p, p, p, p, p, p, ctypes.POINTER(_Algo), ctypes.POINTER(_Heuristic)],
        "cublasLtMatmulAlgoConfigGetAttribute": [ctypes.POINTER(_Algo), i, p, sz, ctypes.POINTER(sz)],
        "cublasLtMatmul": [p, p, p, p, p, p, p, p, p, p, p, p, ctypes.POINTER(_Algo), p, sz, p],
    }  # fmt: skip
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = i
    return lib


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CublasLtError(f"{what} failed: cublasStatus_t {status}")


@cache
def _handle(device_index: int) -> ctypes.c_void_p:
    handle = ctypes.c_void_p()
    with torch.cuda.device(device_index):
        _check(_lib().cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    return handle


@cache
def _workspace(device_index: int, num_bytes: int) -> torch.Tensor:
    """One workspace a device for every LtGemm of that size: their calls are enqueued on one stream at a
    time (the main stream of a decode step), so none runs beside another."""
    return torch.empty(num_bytes, dtype=torch.uint8, device=torch.device("cuda", device_index))


@dataclass(frozen=True)
class Candidate:
    """One algorithm the heuristic returned: its place in the heuristic's order, the workspace it needs,
    its waves over the SM-count target, and its configuration (for the record; -1 where unreadable)."""

    index: int
    algo: bytes
    workspace: int
    waves: float
    config: dict[str, int]


class LtGemm:
    """y = x @ W for x [rows, in_dim] and W [in_dim, out_dim] (both row-major) in `dtype` on a CUDA
    device, with cuBLASLt's SM-count target `sm_count` (0: the device's SMs). `candidates(n)` lists the
    heuristic's first n algorithms; `__call__` runs one of them (or the first) on the current stream."""

    def __init__(self, rows: int, in_dim: int, out_dim: int, dtype: torch.dtype, device: torch.device, sm_count: int = 0, workspace_bytes: int = WORKSPACE_BYTES):
        if dtype not in _CUDA_DTYPE:
            raise ValueError(f"LtGemm takes float16 or bfloat16, got {dtype}")
        if min(rows, in_dim, out_dim) <= 0 or sm_count < 0:
            raise ValueError(f"LtGemm needs positive sizes and sm_count >= 0, got {rows}x{in_dim}x{out_dim}, sm_count {sm_count}")
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"LtGemm runs on CUDA devices, got {device}")
        self.rows, self.in_dim, self.out_dim, self.dtype, self.sm_count = rows, in_dim, out_dim, dtype, sm_count
        self.device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        lib, p = _lib(), ctypes.c_void_p
        self._handle = _handle(self.device.index)
        self._desc, self._w_layout, self._x_layout, self._y_layout = p(), p(), p(), p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self._desc), _COMPUTE_32F, _CUDA_R_32F), "cublasLtMatmulDescCreate")
        for attr, value in ((_DESC_TRANSA, _OP_N), (_DESC_TRANSB, _OP_N), (_DESC_SM_COUNT_TARGET, sm_count)):
            v = ctypes.c_int32(value)
            _check(lib.cublasLtMatmulDescSetAttribute(self._desc, attr, ctypes.byref(v), ctypes.sizeof(v)), "cublasLtMatmulDescSetAttribute")
        kind = _CUDA_DTYPE[dtype]
        # column-major: W^T is [out_dim, in_dim] with ld out_dim, x^T [in_dim, rows] with ld in_dim, y^T [out_dim, rows]
        for layout, r, c in ((self._w_layout, out_dim, in_dim), (self._x_layout, in_dim, rows), (self._y_layout, out_dim, rows)):
            _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), kind, r, c, r), "cublasLtMatrixLayoutCreate")
        self._workspace = _workspace(self.device.index, workspace_bytes)
        self._alpha, self._beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self._algos: dict[bytes, _Algo] = {}
        self._default: _Algo | None = None

    def __del__(self):
        try:
            lib = _lib()
            for layout in (self._w_layout, self._x_layout, self._y_layout):
                if layout:
                    lib.cublasLtMatrixLayoutDestroy(layout)
            if self._desc:
                lib.cublasLtMatmulDescDestroy(self._desc)
        except Exception:  # a half-built LtGemm, or the interpreter shutting down
            pass

    def candidates(self, count: int = 16, max_workspace: int | None = None) -> list[Candidate]:
        """The heuristic's first `count` algorithms for this shape and SM-count target that fit the
        workspace (or max_workspace bytes of it: 0 rules out split-K with a reduction in workspace), in
        its order."""
        lib = _lib()
        pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
        try:
            limit = ctypes.c_uint64(self._workspace.numel() if max_workspace is None else min(max_workspace, self._workspace.numel()))
            _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(limit), ctypes.sizeof(limit)), "cublasLtMatmulPreferenceSetAttribute")
            results, returned = (_Heuristic * count)(), ctypes.c_int(0)
            _check(
                lib.cublasLtMatmulAlgoGetHeuristic(
                    self._handle, self._desc, self._w_layout, self._x_layout, self._y_layout, self._y_layout, pref, count, results, ctypes.byref(returned)
                ),
                "cublasLtMatmulAlgoGetHeuristic",
            )  # fmt: skip
        finally:
            lib.cublasLtMatmulPreferenceDestroy(pref)
        out = []
        for index in range(returned.value):
            r = results[index]
            if r.state != 0:
                continue
            algo = bytes(r.algo)
            self._algos[algo] = _Algo.from_buffer_copy(algo)
            out.append(Candidate(index, algo, int(r.workspace_size), float(r.waves_count), _config(r.algo)))
        return out

    def adopt(self, algo: bytes) -> Candidate | None:
        """An algorithm from elsewhere (another SM-count target's heuristic, a cache written by an earlier
        run of the same cuBLASLt) as a Candidate of this GEMM, or None where cuBLASLt's check rejects it
        for this shape, target and workspace."""
        if len(algo) != ctypes.sizeof(_Algo):
            raise ValueError(f"a cuBLASLt algorithm is {ctypes.sizeof(_Algo)} bytes, got {len(algo)}")
        chosen, result = _Algo.from_buffer_copy(algo), _Heuristic()
        status = _lib().cublasLtMatmulAlgoCheck(
            self._handle, self._desc, self._w_layout, self._x_layout, self._y_layout, self._y_layout, ctypes.byref(chosen), ctypes.byref(result)
        )  # fmt: skip
        if status != 0 or result.state != 0 or result.workspace_size > self._workspace.numel():
            return None
        self._algos[algo] = chosen
        return Candidate(-1, algo, int(result.workspace_size), float(result.waves_count), _config(chosen))

    def refusal(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> str | None:
        """Why this GEMM cannot take these operands (shape, dtype, device, layout or alignment), or None
        where it can: `__call__` raises it, a caller with another way to compute falls back."""
        operands = [("x", x, (self.rows, self.in_dim)), ("w", w, (self.in_dim, self.out_dim))]
        if out is not None:
            operands.append(("out", out, (self.rows, self.out_dim)))
        for name, t, shape in operands:
            if tuple(t.shape) != shape or t.dtype != self.dtype or t.device != self.device or not t.is_contiguous():
                return f"LtGemm {name}: expected a contiguous {shape} {self.dtype} tensor on {self.device}, got {tuple(t.shape)} {t.dtype} on {t.device}"
            if t.data_ptr() % ALIGNMENT:
                return f"LtGemm {name}: its data must be {ALIGNMENT}-byte aligned"
        return None

    def __call__(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, algo: bytes | None = None) -> torch.Tensor:
        """out = x @ w with `algo` (bytes of a Candidate of this LtGemm; None: the heuristic's first),
        enqueued on the current stream (captured by a CUDA graph like any kernel)."""
        problem = self.refusal(x, w, out)
        if problem is not None:
            raise ValueError(problem)
        if out is None:
            out = torch.empty(self.rows, self.out_dim, dtype=self.dtype, device=self.device)
        if algo is None:
            if self._default is None:
                found = self.candidates(1)
                if not found:
                    raise CublasLtError(f"cuBLASLt has no algorithm for {self.rows}x{self.in_dim}x{self.out_dim} {self.dtype}")
                self._default = self._algos[found[0].algo]
            chosen = self._default
        else:
            chosen = self._algos.get(algo)
            if chosen is None:
                raise ValueError("LtGemm: that algorithm is not one of this GEMM's candidates (see candidates and adopt)")
        stream = torch.cuda.current_stream(self.device).cuda_stream
        _check(
            _lib().cublasLtMatmul(
                self._handle, self._desc, ctypes.byref(self._alpha), w.data_ptr(), self._w_layout, x.data_ptr(), self._x_layout,
                ctypes.byref(self._beta), out.data_ptr(), self._y_layout, out.data_ptr(), self._y_layout, ctypes.byref(chosen),
                self._workspace.data_ptr(), self._workspace.numel(), stream,
            ),
            "cublasLtMatmul",
        )  # fmt: skip
        return out


def pooled_candidates(
    runner: LtGemm, others: Sequence[LtGemm], count: int, max_workspaces: Sequence[int | None] = (None,)
) -> list[tuple[LtGemm, Candidate]]:
    """(the LtGemm whose heuristic returned it, the candidate as `runner` runs it): each algorithm once,
    runner's own heuristic first, then each of `others` (other SM-count targets of the same shape), each
    asked for `count` at each of max_workspaces (see `candidates`); another heuristic's algorithm only
    where runner's check adopts it, keeping its index in its own heuristic."""
    seen, out = set(), []
    for query in (runner, *others):
        for max_workspace in max_workspaces:
            for found in query.candidates(count, max_workspace):
                if found.algo in seen:
                    continue
                seen.add(found.algo)
                adopted = found if query is runner else runner.adopt(found.algo)
                if adopted is not None:
                    out.append((query, adopted if query is runner else dataclasses.replace(adopted, index=found.index)))
    return out


def _config(algo: _Algo) -> dict[str, int]:
    lib, out = _lib(), {}
    for name, attr in _CONFIG_ATTRIBUTES.items():
        value, written = ctypes.c_uint32(0), ctypes.c_size_t(0)
        status = lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(value), ctypes.sizeof(value), ctypes.byref(written))
        out[name] = int(value.value) if status == 0 else -1
    return out
