"""The deviceless sm_90a checks' own logic, kernels (pallas_kernels.aot_check) and engine
step (jaxvllm.benchmarks.aot_engine); the compiling itself runs in .ci/run, through
scripts/gpu_aot_check.sh, with the CUDA plugin outside this environment."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
from pathlib import Path

import jax.numpy as jnp

import pytest

from jaxvllm.benchmarks import aot_engine
from pallas_kernels import aot_check
from pallas_kernels.common import default_block_kv
from pallas_kernels.hlo import count_cache_copies, graphed_thunks, parameter_rewrites

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_aot_check.sh"

HLO = """HloModule jit_step, input_output_alias={ {1}: (3, {}, may-alias), {2}: (4, {}, may-alias) }, entry_computation_layout={...}

%branch {
  %copy.9 = f32[4,100]{1,0} copy(%get-tuple-element.1)
}

%body {
  %conditional.3 = (f32[4,100]{1,0}) conditional(%p0, %a, %b), true_computation=%branch, false_computation=%branch
}

ENTRY %main {
  %copy.1 = bf16[8,262144,128]{2,1,0} copy(%input_scatter_fusion.1), metadata={}
  %copy.2 = f32[128]{0} copy(%x), metadata={}
  %copy.3 = s32[4,100]{1,0} copy(%p2), metadata={}
  %fusion = bf16[8,16384,16,128]{3,2,1,0} fusion(%p), kind=kLoop
}
"""


def test_counts_copies_of_donated_buffers_in_the_entry_computation():
    assert count_cache_copies(HLO, (8, 16384, 16, 128)) == 1  # the flat view counts too
    assert count_cache_copies(HLO, (8, 16384, 16, 128), "bf16") == 1
    assert count_cache_copies(HLO, (8, 16384, 16, 128), "f32") == 0
    assert count_cache_copies(HLO, (8, 16384, 16, 64)) == 0
    assert count_cache_copies(HLO, (4, 100)) == 1  # the branch's copy is not a donated buffer


def test_counts_weights_rewritten_in_the_entry_computation():
    hlo = """ENTRY %main (w.1: f32[576,9,64], n.1: f32[576], x.1: f32[32,576]) -> f32[32,576] {
  %w.1 = f32[576,9,64]{2,1,0} parameter(0)
  %n.1 = f32[576]{0} parameter(1)
  %x.1 = f32[32,576]{1,0} parameter(2)
  %copy_bitcast_fusion = f32[576,576]{1,0} fusion(%w.1), kind=kLoop, calls=%fused_computation.728
  %transpose.3 = f32[9,64,576]{2,1,0} transpose(%w.1), dimensions={1,2,0}
  %slice_fusion = f32[576,9]{1,0} fusion(%w.1), kind=kLoop, calls=%fused_computation.9
  %ynn_fusion = f32[576,576]{1,0} fusion(%w.1), kind=kCustom, calls=%fused_computation.3
  %copy.2 = f32[576]{0} copy(%n.1)
  %dot_fusion = f32[32,576]{1,0} fusion(%x.1, %copy_bitcast_fusion), kind=kLoop, calls=%fused_computation.1
}
"""
    # the loop fusion and the transpose of the 3-axis weight; not a part of it, a dot
    # reading it, a 1-axis parameter, or a fusion of several operands
    assert parameter_rewrites(hlo) == {"%copy_bitcast_fusion = fusion(%w.1)": 331776,
                                       "%transpose.3 = transpose(%w.1)": 331776}
    assert parameter_rewrites(HLO) == {}


def test_counts_aliased_outputs_and_conditionals():
    assert aot_engine.aliased_outputs(HLO) == 2
    assert aot_engine.aliased_outputs("HloModule jit_f, entry_computation_layout={()->f32[]}\n") == 0
    assert aot_engine.conditionals(HLO) == 1  # in any computation, not only ENTRY
    assert aot_engine.conditionals(HLO.replace(" conditional(", " tuple(")) == 0


@pytest.mark.parametrize("head_dim,dtype,want", [
    (64, jnp.bfloat16, 128), (128, jnp.bfloat16, 64), (256, jnp.bfloat16, 32),
    (64, jnp.float32, 64), (128, jnp.float32, 32), (256, jnp.float32, 16), (512, jnp.float32, 16),
])
def test_default_kv_tile_fits_registers(head_dim, dtype, want):
    """The tiles that compiled without spills on sm_90a (see the aot_check sweep)."""
    assert default_block_kv(head_dim, dtype) == want


def test_problems_name_spills_and_errors():
    case = aot_check.Case("ragged", {"dtype": "bfloat16"}, None, [])
    case.result = {"ok": False, "error": "RESOURCE_EXHAUSTED: Shared memory size limit exceeded"}
    assert aot_check.problems(case) == ["RESOURCE_EXHAUSTED: Shared memory size limit exceeded"]
    spilled = {"ok": True, "kernels": [dict(name="k", registers=255, spill_bytes=8, cp_async=True, mma="")]}
    assert aot_check.problems(aot_check.Case("ragged", {"dtype": "bfloat16"}, None, [], dict(spilled))) == [
        "k spills 8 bytes"]
    assert not aot_check.problems(aot_check.Case("ragged", {"dtype": "float32"}, None, [], dict(spilled)))


def test_engine_problems_name_copies_rewrites_aliasing_and_conditionals():
    case = aot_check.Case("engine_step", {"donated": 8}, None, [])
    case.result = {"ok": True, "kernels": [dict(name="k", registers=255, spill_bytes=96, cp_async=True, mma="")],
                   "cache_copies": 3, "parameter_rewrites": 1, "aliased_outputs": 4, "conditionals": 2}
    assert aot_engine.problems(case) == [
        "k spills 96 bytes", "3 copies of a KV cache or sampler state in the compiled step",
        "1 weights or caches copied or converted whole in the compiled step",
        "only 4 of 8 donated buffers are updated in place", "2 conditionals in the compiled step (a host sync each)",
    ]
    case.result = {"ok": True, "cache_copies": 0, "aliased_outputs": 8, "conditionals": 0}
    assert aot_engine.problems(case) == []
    # Thunks outside CUDA graphs: a problem of the pallas backend's step, not the reference's.
    for backend, want in (("pallas", ["2 thunks outside CUDA graphs (host launches on every step)"]),
                          ("reference", [])):
        case = aot_check.Case("engine_step", {"donated": 8, "backend": backend}, None, [])
        case.result = {"ok": True, "cache_copies": 0, "aliased_outputs": 8, "conditionals": 0, "ungraphed_thunks": 2}
        assert aot_engine.problems(case) == want
    case.result = {"ok": True, "cache_copies": 0, "aliased_outputs": 8, "conditionals": 0, "rematerialized": 65}
    assert aot_engine.problems(case) == ["65 instructions recomputed by XLA's rematerialization pass"]
    case.result = {"ok": False, "error": "XlaRuntimeError: boom"}
    assert aot_engine.problems(case) == ["XlaRuntimeError: boom"]


def test_engine_inspect_reads_the_donated_shapes_off_the_case():
    case = aot_check.Case("engine_step", {"copy_shapes": [[8, 16384, 16, 128], [4, 100]]}, None, [])
    assert aot_engine.inspect(case, HLO) == {"cache_copies": 2, "parameter_rewrites": 0, "aliased_outputs": 2,
                                             "conditionals": 1, "unbounded_loops": 0, "rematerialized": 0,
                                             "launches": 4}


def test_launches_count_the_entry_computations_kernels():
    """Fusions, custom calls and other ops of the entry computation launch kernels; parameters,
    bitcasts, tuples and constants do not, nor do the ops of called computations."""
    hlo = """HloModule m
%fused {
  %a = f32[4]{0} add(%x, %y)
}

ENTRY %main {
  %p0 = f32[4]{0} parameter(0)
  %b = f32[2,2]{1,0} bitcast(%p0)
  %c = f32[] constant(1)
  %f = f32[4]{0} fusion(%p0, %c), kind=kLoop, calls=%fused
  %k = (bf16[8,2]{1,0}, f32[8]{0}) custom-call(%f), custom_call_target="__gpu$xla.gpu.triton"
  %g = bf16[8,2]{1,0} get-tuple-element(%k), index=0
  ROOT %t = (bf16[8,2]{1,0}) tuple(%g)
}
"""
    assert aot_engine.launches(hlo) == 2
    # The rematerialization pass's copies, named after the instruction they recompute.
    remat = "  %fusion.3.remat = f32[4]{0} fusion(%p0), kind=kLoop, calls=%fused\n" \
            "  ROOT %gte.7.remat2 = f32[] get-tuple-element(%k), index=1\n  %x = f32[] add(%fusion.3.remat, %c)\n"
    assert aot_engine.rematerialized(hlo) == 0 and aot_engine.rematerialized(remat) == 2
    loops = "%w = (s32[]) while(%t), condition=%c, body=%b\n%k = (s32[]) while(%t), condition=%c, body=%b, " \
            'backend_config={"known_trip_count":{"n":"32"}}\n'
    assert aot_engine.unbounded_loops(loops) == 1


def test_graphed_thunks_split_a_thunk_sequence_at_its_command_buffers():
    """XLA's thunk sequence dump: commands of a command buffer are indented under it; a
    thunk at the top level (here a while loop) is launched by the host."""
    dump = """000: kCommandBuffer [source       | next=023 (1)] 
    001: kCopy         [source        | next=002 (1)] kCopy
    002: kCustomKernel [prev=001 (1)  | next=003 (1)] loop_gather_fusion_1 grid: [2048, 1, 1]
    003: kCustomKernel [prev=002 (1)  | sink] gemm_fusion_dot_113 grid: [8192, 1, 1]
023: kWhile         [prev=000 (1) | next=000 (1)]   
condition:
000: kCommandBuffer [prev=023 (1) | sink        ] 
    000: kCustomKernel [source | sink] wrapped_compare
"""
    assert graphed_thunks(dump) == (4, 1)
    assert graphed_thunks("") == (0, 0)


def test_cases_cover_the_issue_matrix():
    cases = aot_check.kernel_cases(quick=False)
    decode = [c.params for c in cases if c.kind == "decode"]
    assert {p["group"] for p in decode} == {1, 2, 4, 8}
    assert {p["head_dim"] for p in decode} == {64, 128, 256}
    assert {p["dtype"] for p in decode} == {"bfloat16", "float32"}
    assert {p["block_size"] for p in decode} == {16, 32, 64, 128}
    assert any(p["window"] for p in decode)
    # The fp8 KV cache under bf16 queries: every head_dim and group, decode and ragged.
    fp8 = [(c.kind, c.params["head_dim"], c.params["group"]) for c in cases if c.params.get("kv_cache")]
    assert {(k, d, g) for k in ("decode", "ragged") for d in (64, 128, 256) for g in (1, 2, 4, 8)} <= set(fp8)
    assert all(c.params["dtype"] == "bfloat16" for c in cases if c.params.get("kv_cache"))  # spills fail them
    # W4A16 experts at Qwen3-30B-A3B's shapes: both projections, decode (with zero points or
    # not) and a 2048-token prefill; 8-bit GPTQ's int8 tiles; and the engine's step on them.
    int4 = {(p["rows"], p["k"], p["n"], p["asymmetric"], p["bits"]) for p in
            (c.params for c in cases if c.kind == "gmm_int4")}
    assert {(r, k, n, a, b) for k, n in ((2048, 768), (768, 2048))
            for r, a, b in ((2048, True, 4), (2048, False, 4), (16384, False, 4), (2048, True, 8))} == int4
    # Block-fp8 experts (blocks of 128), both projections, decode and prefill rows, and the engine's step on them.
    blocked = {(p["rows"], p["k"], p["n"]) for p in (c.params for c in cases if c.params.get("scale_size") == 128)}
    assert {(r, k, n) for k, n in ((2048, 768), (768, 2048)) for r in (2048, 16384)} == blocked
    engine = aot_engine.engine_cases()
    assert any(c.params.get("kv_cache") for c in engine)
    # A cache as large as the runner makes one on an H200 (56 GiB), at any depth.
    for quick in (False, True):
        big = [c for c in aot_engine.engine_cases(quick) if c.params["context"] > 1024]
        assert len(big) == 1 and math.prod(big[0].args[1][0].shape) * 2 * 2 == 56 * 2**30
    for quantization in ("gptq-dummy", "fp8-block"):
        assert any(c.params["model"] == "qwen3-30b-a3b" and c.params.get("quantization") == quantization
                   for c in engine)


@pytest.mark.parametrize("main", [aot_check.main, aot_engine.main])
def test_main_without_the_cuda_plugin_exits_2(main, monkeypatch, capsys):
    def no_device():
        raise RuntimeError("topology not implemented for cuda")

    monkeypatch.setattr(aot_check, "compile_only_device", no_device)
    assert main(["--quick"]) == 2
    assert "CUDA PJRT plugin" in capsys.readouterr().err


# Stands in for $PYTHON: `-c` snippets (jaxlib's version, "is the plugin installed") succeed,
# `-m MODULE ARGS` is logged and exits with $KERNELS_RC or $ENGINE_RC.
FAKE_PYTHON = """#!/usr/bin/env bash
[ "$1" = -c ] && { echo 0.0; exit 0; }
shift; echo "$*" >>"$LOG"
[ "$1" = pallas_kernels.aot_check ] && exit "$KERNELS_RC" || exit "$ENGINE_RC"
"""


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
@pytest.mark.parametrize("kernels,engine,want", [(0, 0, 0), (1, 0, 1), (0, 1, 1), (2, 0, 2), (0, 2, 2)])
def test_gpu_aot_check_script_runs_both_checks(tmp_path, kernels, engine, want):
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    log = tmp_path / "log"
    env = dict(os.environ, PYTHON=str(fake), LOG=str(log), KERNELS_RC=str(kernels), ENGINE_RC=str(engine))
    run = subprocess.run(["bash", str(SCRIPT), "--quick", "--json", "out.json"], env=env, capture_output=True)
    assert run.returncode == want
    expected = ["pallas_kernels.aot_check --quick --json out.json",
                "jaxvllm.benchmarks.aot_engine --quick --json out_engine.json"]
    assert log.read_text().splitlines() == expected[: 1 if kernels == 2 else 2]
