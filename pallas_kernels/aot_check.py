"""Compile the kernels for an H100/H200 on a machine without a GPU (deviceless AOT).

    scripts/gpu_aot_check.sh                      # installs the plugin below, runs this and the engine's check
    JAX_PLATFORMS=cpu python -m pallas_kernels.aot_check [--quick] [--kind decode,ragged,gmm] [--json PATH]

Needs the CUDA PJRT plugin of the installed jaxlib and ptxas, but no GPU, driver or
CUDA runtime: `pip install --no-deps jax-cuda12-plugin==V jax-cuda12-pjrt==V
nvidia-cuda-nvcc-cu12` (V = jaxlib's version). XLA compiles each jitted kernel for a
compile-only sm_90a device described by `TARGET_CONFIG`, Triton included, so this
catches what interpret mode cannot: Triton compile errors, shared memory over the
227 KiB per-block limit, and register spills in 16-bit kernels (`ptxas -v` on the PTX
XLA dumps). It measures no speed: that needs the GPU (`scripts/gpu_check.sh`).
The driver (`check`) is generic: jaxvllm's `python -m jaxvllm.benchmarks.aot_engine`
runs it on the engine step, for copies of donated buffers; this package imports nothing
from jaxvllm.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp

from pallas_kernels.bench import FULL
from pallas_kernels.common import INTERPRET_ENV
from pallas_kernels.grouped_int4_matmul import grouped_int4_matmul, pack_int4
from pallas_kernels.grouped_matmul import grouped_matmul
from pallas_kernels.int4_matmul import int4_matmul
from pallas_kernels.harness import json_path, write_json
from pallas_kernels.hlo import graphed_thunks
from pallas_kernels.paged_decode_attention import paged_decode_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention

# stream_executor.GpuTargetConfigProto of an H200 (an H100's SM: 132 SMs, 227 KiB of
# shared memory per block, 64 K registers); what XLA and Triton need to compile.
TARGET_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024  threads_per_warp: 32  shared_memory_per_block: 49152
  shared_memory_per_core: 233472  threads_per_core_limit: 2048  core_count: 132
  fpus_per_core: 128  block_dim_limit_x: 2147483647  block_dim_limit_y: 65535
  block_dim_limit_z: 65535  memory_bandwidth: 4800000000000  l2_cache_size: 52428800
  clock_rate_ghz: 1.98  device_memory_size: 150323855360
  shared_memory_per_block_optin: 232448  cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
runtime_version { major: 12 minor: 8 }
device_description_str: "NVIDIA H200"
"""

KERNEL_PREFIX = "jaxvllm_"


def compile_only_device() -> jax.Device:
    """A device to compile for, backed by no hardware (needs the CUDA PJRT plugin)."""
    from jax.experimental import topologies

    topology = topologies.get_topology_desc("cuda", "cuda", topology="1x1x1", target_config=TARGET_CONFIG)
    return topology.devices[0]


def target_mesh(device: jax.Device) -> jax.sharding.AbstractMesh:
    """Names the GPU to Pallas' Triton lowering, which jax >= 0.11 otherwise looks for
    among the attached devices (the CPU here)."""
    abstract = jax.sharding.AbstractDevice(device_kind=device.device_kind, num_cores=None, platform="cuda")
    return jax.sharding.AbstractMesh((1,), ("x",), abstract_device=abstract)


def ptxas_path() -> str | None:
    """ptxas from the nvidia-cuda-nvcc wheel, else from PATH."""
    try:
        import nvidia.cuda_nvcc

        for root in nvidia.cuda_nvcc.__path__:
            candidate = os.path.join(root, "bin", "ptxas")
            if os.path.exists(candidate):
                return candidate
    except ImportError:
        pass
    return shutil.which("ptxas")


@dataclass
class KernelStats:
    """What ptxas reports for one compiled Pallas kernel."""

    name: str
    registers: int
    spill_bytes: int  # spill stores + loads; anything above 0 costs bandwidth
    cp_async: bool  # loads pipelined through shared memory
    mma: str  # tensor-core instruction used ("mma.sync", "wgmma" or "")
    shared_memory: int | None = None  # bytes per program, when XLA's thunk dump tells


def kernel_stats(ptx_file: str, ptxas: str) -> KernelStats:
    text = open(ptx_file).read()
    name = re.search(r"\.entry\s+(\w+)", text).group(1)
    out = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx_file, "-o", os.devnull],
                         capture_output=True, text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", out).group(1))
    spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", out))
    mma = "wgmma" if "wgmma" in text else "mma.sync" if "mma.sync" in text else ""
    return KernelStats(name, registers, spills, "cp.async" in text, mma)


def shared_memory_of_kernels(dump: str) -> dict[str, int]:
    """Kernel name -> shared memory bytes, from XLA's thunk sequence dump (absent before jax 0.11)."""
    found = {}
    for path in glob.glob(os.path.join(dump, "*thunk_sequence.txt")):
        for m in re.finditer(rf"({KERNEL_PREFIX}\w+) grid: .*? shared_memory: (\d+) bytes", open(path).read()):
            found[m.group(1)] = max(found.get(m.group(1), 0), int(m.group(2)))
    return found


@dataclass
class Case:
    """One configuration to compile: a jitted function and the shapes of its arguments."""

    kind: str
    params: dict
    fn: Callable
    args: list  # one pytree of ShapeDtypeStructs per argument
    result: dict = field(default_factory=dict)


def compile_case(case: Case, device: jax.Device, ptxas: str | None) -> dict:
    """Compile one case for `device`; kernel figures from the PTX XLA dumps on the way."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), case.args)
    with tempfile.TemporaryDirectory() as dump:
        start = time.perf_counter()
        try:
            with jax.sharding.use_abstract_mesh(target_mesh(device)):
                lowered = case.fn.trace(*specs).lower()
            compiled = lowered.compile(compiler_options={"xla_dump_to": dump})
            if ptxas and not kernel_ptx(dump):
                # XLA of jax >= 0.11 dumps PTX only with every emitter's IR (slow: ~10 s a case).
                compiled = lowered.compile(compiler_options={"xla_dump_to": dump, "xla_dump_emitter_re": ".*"})
        except Exception as e:  # Triton or XLA refused it: the message says why
            return {"ok": False, "error": f"{type(e).__name__}: {e}".splitlines()[0][:400]}
        result: dict[str, Any] = {"ok": True, "compile_s": round(time.perf_counter() - start, 2)}
        if ptxas:
            shared = shared_memory_of_kernels(dump)
            kernels = []
            for ptx in kernel_ptx(dump):
                stats = kernel_stats(ptx, ptxas)
                stats.shared_memory = shared.get(stats.name)
                kernels.append(asdict(stats))
            result["kernels"] = kernels
        result["hlo"] = compiled.as_text()
        memory = compiled.memory_analysis()
        if memory is not None:  # (temporaries: what a step writes besides its outputs, e.g. a copied weight)
            result["temp_mib"] = round(memory.temp_size_in_bytes / 2**20, 1)
        thunks = [open(p).read() for p in glob.glob(os.path.join(dump, "*thunk_sequence_after_thunk_passes.txt"))]
        if thunks:  # XLA of jax >= 0.10 dumps it
            graphed = [graphed_thunks(t) for t in thunks]
            result["graphed_thunks"], result["ungraphed_thunks"] = (sum(g[i] for g in graphed) for i in (0, 1))
    return result


def kernel_ptx(dump: str) -> list[str]:
    """The dumped PTX files that hold one of our kernels."""
    return [p for p in sorted(glob.glob(os.path.join(dump, "*.ptx"))) if KERNEL_PREFIX in open(p).read()]


# -- what to compile -------------------------------------------------------------------------


def spec(shape: tuple[int, ...], dtype=jnp.int32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


def _fp8_args(fn: Callable, cache_dtype, kv_heads: int) -> tuple[Callable, list, dict]:
    """An fp8 cache's kernel takes k_scale / v_scale as traced float32 [kv_heads] (one per KV
    head, as the engine passes them): extra arguments, and `kv_cache` in the case's params."""
    if cache_dtype is None:
        return fn, [], {}
    scaled = jax.jit(lambda *a: fn(*a[:-2], k_scale=a[-2], v_scale=a[-1]))
    return scaled, [spec((kv_heads,), jnp.float32)] * 2, {"kv_cache": jnp.dtype(cache_dtype).name}


def decode_case(group: int, head_dim: int, dtype, block_size: int = 16, window: int | None = None,
                num_seqs: int = 64, context: int = 2048, kv_heads: int = 8, cache_dtype=None, **tuning) -> Case:
    blocks = num_seqs * context // block_size
    fn = jax.jit(partial(paged_decode_attention, sm_scale=head_dim**-0.5, sliding_window=window,
                         interpret=False, **tuning))
    fn, scales, fp8 = _fp8_args(fn, cache_dtype, kv_heads)
    cache = spec((kv_heads, blocks, block_size, head_dim), cache_dtype or dtype)
    args = [spec((num_seqs, kv_heads * group, head_dim), dtype), cache, cache, spec((num_seqs,)),
            spec((num_seqs, context // block_size)), *scales]
    params = dict(group=group, head_dim=head_dim, dtype=jnp.dtype(dtype).name, **fp8, block_size=block_size,
                  window=window, num_seqs=num_seqs, context=context, **tuning)
    return Case("decode", params, fn, args)


def ragged_case(group: int, head_dim: int, dtype, block_size: int = 16, window: int | None = None,
                num_tokens: int = 2048, num_seqs: int = 8, context: int = 4096, kv_heads: int = 8,
                cache_dtype=None, **tuning) -> Case:
    blocks = num_seqs * context // block_size
    fn = jax.jit(partial(ragged_paged_attention, sm_scale=head_dim**-0.5, sliding_window=window,
                         interpret=False, **tuning))
    fn, scales, fp8 = _fp8_args(fn, cache_dtype, kv_heads)
    cache = spec((kv_heads, blocks, block_size, head_dim), cache_dtype or dtype)
    args = [spec((num_tokens, kv_heads * group, head_dim), dtype), cache, cache, spec((num_tokens,)),
            spec((num_seqs + 1,)), spec((num_seqs,)), spec((num_seqs, context // block_size)), *scales]
    params = dict(group=group, head_dim=head_dim, dtype=jnp.dtype(dtype).name, **fp8, block_size=block_size,
                  window=window, num_tokens=num_tokens, **tuning)
    return Case("ragged", params, fn, args)


def gmm_case(rows: int, k: int, n: int, dtype=jnp.bfloat16, experts: int = 128, scale_size: int = 0,
             **tuning) -> Case:
    """grouped_matmul over `rows` (token, expert) rows; the routing is data (traced).
    `scale_size`: 8-bit operands with block scales over that many inputs."""
    args = [spec((rows, k), dtype), spec((experts, k, n), dtype), spec((experts,))]
    params = dict(rows=rows, k=k, n=n, experts=experts, dtype=jnp.dtype(dtype).name, **tuning)
    if scale_size:
        blocks = -(-k // scale_size)
        args += [spec((rows, blocks), jnp.float32), spec((experts, blocks, n), jnp.float32)]
        params["scale_size"] = scale_size
    fn = jax.jit(lambda lhs, rhs, group_sizes, lhs_scale=None, rhs_scale=None: grouped_matmul(
        lhs, rhs, group_sizes, lhs_scale=lhs_scale, rhs_scale=rhs_scale, scale_size=scale_size,
        interpret=False, **tuning))
    return Case("gmm", params, fn, args)


def int4_case(m: int, k: int, n: int, asymmetric: bool, group_size: int = 128, **tuning) -> Case:
    """int4_matmul (W4A16) of m bf16 rows over an int4 [n, k] weight, scales per group."""
    fn = jax.jit(partial(int4_matmul, group_size=group_size, interpret=False, **tuning))
    groups = k // group_size
    args = [spec((m, k), jnp.bfloat16), spec((n, k // 2), jnp.uint8), spec((n, groups), jnp.float32)]
    args += [spec((n, groups), jnp.float32)] if asymmetric else []
    params = dict(m=m, k=k, n=n, group_size=group_size, asymmetric=asymmetric, **tuning)
    return Case("int4", params, fn, args)


def grouped_int4_case(rows: int, k: int, n: int, asymmetric: bool, group_size: int = 128, bits: int = 4,
                      experts: int = 128, **tuning) -> Case:
    """grouped_int4_matmul (W4A16 experts; bits 8: W8A16) of `rows` bf16 rows, bf16 out, over
    the stack as the engine holds it (int4 [experts, k, n], packed inside: the bitcast must
    cost no copy, which temp_mib shows), scales per group; the routing is data (traced)."""
    def fn(lhs, values, group_sizes, scale, zero=None):
        rhs = pack_int4(values) if bits == 4 else values
        return grouped_int4_matmul(lhs, rhs, group_sizes, scale, zero, group_size=group_size, interpret=False,
                                   out_dtype=jnp.bfloat16, **tuning)

    groups = k // group_size
    args = [spec((rows, k), jnp.bfloat16), spec((experts, k, n), jnp.int4 if bits == 4 else jnp.int8),
            spec((experts,)), spec((experts, groups, n), jnp.float32)]
    args += [spec((experts, groups, n), jnp.float32)] if asymmetric else []
    params = dict(rows=rows, k=k, n=n, experts=experts, bits=bits, group_size=group_size, asymmetric=asymmetric,
                  **tuning)
    return Case("gmm_int4", params, jax.jit(fn), args)


def kernel_cases(quick: bool) -> list[Case]:
    """The issue's kernel matrix: GQA groups 1-8, head_dim 64/128/256, both dtypes,
    block_size 16-128, a sliding window, the K1/K2 benchmark shapes, and an fp8
    (float8_e4m3fn, and float8_e5m2) cache under bf16 queries."""
    dtypes = (jnp.bfloat16, jnp.float32)
    groups = (1, 2, 8) if quick else (1, 2, 4, 8)
    cases = []
    for dtype in dtypes:
        for head_dim in (64, 128, 256):
            for group in groups:
                cases.append(decode_case(group, head_dim, dtype))
                cases.append(ragged_case(group, head_dim, dtype))
    for block_size in (32, 64, 128):
        cases.append(decode_case(2, 128, jnp.bfloat16, block_size=block_size))
        cases.append(ragged_case(2, 128, jnp.bfloat16, block_size=block_size))
    cases.append(decode_case(4, 128, jnp.bfloat16, window=1000))
    cases.append(ragged_case(4, 128, jnp.bfloat16, window=1000))
    # K1 (q heads 16, kv heads 8) at its largest shape and K2 (4 x 4096, 16 heads, MHA),
    # with every tuning the benchmark tries, so that a GPU session spends no time on one
    # that does not compile.
    cases.append(decode_case(2, 128, jnp.bfloat16, num_seqs=256, context=4096))
    for tuning in FULL["k1"]["sweep"]:
        cases.append(decode_case(2, 128, jnp.bfloat16, **tuning))
    for tuning in FULL["k2"]["tiles"]:
        cases.append(ragged_case(1, 128, jnp.bfloat16, num_tokens=4 * 4096, num_seqs=4, context=4096, kv_heads=16,
                                 **tuning))
    # fp8 KV cache (bf16 queries, tiles converted after each load): the head dims and groups,
    # a larger block and a window, K1's largest shape, and a 128-key tile (an fp8 tile of 128
    # keys is as many bytes as the default bf16 one).
    fp8 = jnp.float8_e4m3fn
    for head_dim in (64, 128, 256):
        for group in (1, 8) if quick else (1, 2, 4, 8):
            cases.append(decode_case(group, head_dim, jnp.bfloat16, cache_dtype=fp8))
            cases.append(ragged_case(group, head_dim, jnp.bfloat16, cache_dtype=fp8))
    cases.append(decode_case(4, 128, jnp.bfloat16, block_size=64, window=1000, cache_dtype=fp8))
    cases.append(ragged_case(4, 128, jnp.bfloat16, block_size=64, window=1000, cache_dtype=fp8))
    cases.append(decode_case(2, 128, jnp.bfloat16, num_seqs=256, context=4096, cache_dtype=fp8))
    for tuning in FULL["k1"]["fp8_sweep"]:
        cases.append(decode_case(2, 128, jnp.bfloat16, cache_dtype=fp8, **tuning))
    # kv_cache_dtype="fp8_e5m2": the same kernels over float8_e5m2 tiles.
    cases.append(decode_case(2, 128, jnp.bfloat16, num_seqs=256, context=4096, cache_dtype=jnp.float8_e5m2))
    cases.append(ragged_case(2, 128, jnp.bfloat16, cache_dtype=jnp.float8_e5m2))
    # Grouped matmul (MoE experts), Qwen3-30B-A3B's shapes: 128 experts, gate/up (k 2048,
    # n 768) and down (k 768, n 2048), 2048 and 8192 rows (256 and 1024 tokens x top-8), with
    # every tuning K3 tries (the defaults: block_m 16 at 2048 rows, 64 at 8192), and float32.
    k3 = FULL["k3"]
    for rows in k3["rows"]:
        for k, n in k3["projections"]:
            for tuning in k3["tiles"][:1] if quick else k3["tiles"]:
                cases.append(gmm_case(rows, k, n, experts=k3["experts"], **tuning))
    cases.append(gmm_case(2048, 2048, 768, jnp.float32))
    # fp8 expert stacks (W8A8): 8-bit tiles converted in registers, both projections
    cases += [gmm_case(2048, k, n, jnp.float8_e4m3fn, experts=k3["experts"]) for k, n in k3["projections"]]
    # block-fp8 expert stacks (Qwen3-30B-A3B-FP8: blocks of 128), each block's product scaled in the kernel
    cases += [gmm_case(rows, k, n, jnp.float8_e4m3fn, experts=k3["experts"], scale_size=128)
              for k, n in k3["projections"] for rows in (2048, 16384)]
    # W4A16 (Llama-3-8B's MLP): batch-1 and 256-row decode, a 2048-row prefill
    cases += [int4_case(1, 4096, 14336, True), int4_case(256, 4096, 14336, False), int4_case(2048, 14336, 4096, True)]
    # W4A16 experts (Qwen3-30B-A3B-GPTQ-Int4: groups of 128), both projections: 256 decode
    # rows x top-8 with zero points and without, a 2048-token prefill; 8-bit GPTQ's int8 tiles.
    for k, n in k3["projections"]:
        cases += [grouped_int4_case(2048, k, n, True), grouped_int4_case(16384, k, n, False)]
        cases += [] if quick else [grouped_int4_case(2048, k, n, False), grouped_int4_case(2048, k, n, True, bits=8)]
    return cases


# -- driver ----------------------------------------------------------------------------------


def problems(case: Case) -> list[str]:
    """Why a compiled case is not good enough (empty: fine)."""
    r = case.result
    if not r.get("ok"):
        return [r.get("error", "failed")]
    # Spills fail the 16-bit kernels only: float32 ones (exact dots, for parity tests) are
    # not a speed path, and ptxas spills a few bytes there in some Triton versions.
    if case.params.get("dtype") == "float32":
        return []
    return [f"{k['name']} spills {k['spill_bytes']} bytes" for k in r.get("kernels", []) if k["spill_bytes"]]


def describe(kernel: dict) -> str:
    text = f"{kernel['name']}: {kernel['registers']} regs, {kernel['spill_bytes']} B spilled, {kernel['mma'] or 'no mma'}"
    if kernel["cp_async"]:
        text += ", cp.async"
    if kernel["shared_memory"] is not None:
        text += f", {kernel['shared_memory'] // 1024} KiB smem"
    return text


Inspect = Callable[[Case, str], dict]  # (case, optimized HLO text) -> figures for its result


def run(cases: list[Case], device: jax.Device, ptxas: str | None, inspect: Inspect | None = None,
        judge: Callable[[Case], list[str]] = problems) -> None:
    """Compile each case into `case.result` and print a line for it: `inspect` adds
    figures read off its HLO (the HLO itself is too big to keep), `judge` its problems."""
    for case in cases:
        case.result = compile_case(case, device, ptxas)
        hlo = case.result.pop("hlo", "")
        figures = inspect(case, hlo) if inspect and case.result["ok"] else {}
        case.result.update(figures)
        case.result["problems"] = judge(case)
        kernels = "; ".join(describe(k) for k in case.result.get("kernels", []))
        graphs = {k: case.result[k] for k in ("graphed_thunks", "ungraphed_thunks", "temp_mib", "compile_s")
                  if k in case.result}
        extra = "".join(f" {k}={v}" for k, v in {**figures, **graphs}.items())
        status = "ok  " if not case.result["problems"] else "FAIL"
        print(f"{status} {case.kind} {case.params}{extra} {kernels} {'; '.join(case.result['problems'])}", flush=True)


def check(argv: list[str] | None, doc: str, name: str, make_cases: Callable[[bool], list[Case]], *,
          use_ptxas: bool = True, inspect: Inspect | None = None,
          judge: Callable[[Case], list[str]] = problems) -> int:
    """The command line of a deviceless check: `make_cases(quick)` compiled for sm_90a,
    results to $OUT/`name`.json. Exit 0 all clean, 1 a case failed, 2 no CUDA plugin."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="less to compile (kernels: fewer GQA groups, about half; the engine: models cut "
                        "to 2 layers)")
    parser.add_argument("--kind", default=None, help="only cases of these kinds, comma-separated (kernels: "
                        "decode, ragged, gmm, int4, gmm_int4)")
    parser.add_argument("--json", default=None, help=f"write results here (default $OUT/{name}.json if $OUT is set)")
    args = parser.parse_args(argv)
    try:
        device = compile_only_device()
    except Exception as e:
        print(f"no compile-only CUDA device ({type(e).__name__}: {e}); install the CUDA PJRT plugin "
              "as pallas_kernels/aot_check.py's docstring says", file=sys.stderr)
        return 2
    os.environ[INTERPRET_ENV] = "0"  # for a GPU: kernels that pick by backend are compiled, not interpreted
    ptxas = ptxas_path() if use_ptxas else None
    if use_ptxas and ptxas is None:
        print("ptxas not found (pip install nvidia-cuda-nvcc-cu12): no register or spill figures", file=sys.stderr)
    cases = make_cases(args.quick)
    if args.kind:
        cases = [c for c in cases if c.kind in args.kind.split(",")]
    start = time.perf_counter()
    run(cases, device, ptxas, inspect, judge)
    failed = [c for c in cases if c.result["problems"]]
    print(f"{len(cases) - len(failed)}/{len(cases)} cases compiled cleanly for sm_90a "
          f"in {time.perf_counter() - start:.0f} s")
    path = json_path(args.json, f"{name}.json")
    if path:
        write_json(path, {"jax": jax.__version__,
                          "cases": [dict(kind=c.kind, params=c.params, **c.result) for c in cases]})
        print(f"wrote {path}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    return check(argv, __doc__, "aot_check", kernel_cases)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
