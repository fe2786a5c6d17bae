"""The deviceless sm_90a check's own logic (the compiling itself runs in .ci/run,
through scripts/gpu_aot_check.sh, with the CUDA plugin outside this environment)."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from pallas_kernels import aot_check
from pallas_kernels.common import default_block_kv

HLO = """HloModule jit_step, input_output_alias={ {1}: (3, {}, may-alias), {2}: (4, {}, may-alias) }, entry_computation_layout={...}

%branch {
  %copy.9 = f32[4,100]{1,0} copy(%get-tuple-element.1)
}

ENTRY %main {
  %copy.1 = bf16[8,262144,128]{2,1,0} copy(%input_scatter_fusion.1), metadata={}
  %copy.2 = f32[128]{0} copy(%x), metadata={}
  %copy.3 = s32[4,100]{1,0} copy(%p2), metadata={}
  %fusion = bf16[8,16384,16,128]{3,2,1,0} fusion(%p), kind=kLoop
}
"""


def test_counts_copies_of_donated_buffers_in_the_entry_computation():
    assert aot_check.count_cache_copies(HLO, (8, 16384, 16, 128)) == 1  # the flat view counts too
    assert aot_check.count_cache_copies(HLO, (8, 16384, 16, 128), "bf16") == 1
    assert aot_check.count_cache_copies(HLO, (8, 16384, 16, 128), "f32") == 0
    assert aot_check.count_cache_copies(HLO, (8, 16384, 16, 64)) == 0
    assert aot_check.count_cache_copies(HLO, (4, 100)) == 1  # the branch's copy is not a donated buffer


def test_counts_aliased_outputs():
    assert aot_check.aliased_outputs(HLO) == 2
    assert aot_check.aliased_outputs("HloModule jit_f, entry_computation_layout={()->f32[]}\n") == 0


@pytest.mark.parametrize("head_dim,dtype,want", [
    (64, jnp.bfloat16, 128), (128, jnp.bfloat16, 64), (256, jnp.bfloat16, 32),
    (64, jnp.float32, 64), (128, jnp.float32, 32), (256, jnp.float32, 16), (512, jnp.float32, 16),
])
def test_default_kv_tile_fits_registers(head_dim, dtype, want):
    """The tiles that compiled without spills on sm_90a (see the aot_check sweep)."""
    assert default_block_kv(head_dim, dtype) == want


def test_problems_name_spills_copies_and_errors():
    case = aot_check.Case("engine_step", {"num_layers": 2}, None, [])
    case.result = {"ok": True, "kernels": [dict(name="k", registers=255, spill_bytes=96, cp_async=True, mma="")],
                   "cache_copies": 3, "aliased_outputs": 4}
    assert aot_check.problems(case) == [
        "k spills 96 bytes", "3 copies of a KV cache or sampler state in the compiled step",
        "only 4 of 8 donated buffers are updated in place",
    ]
    case.result = {"ok": False, "error": "RESOURCE_EXHAUSTED: Shared memory size limit exceeded"}
    assert aot_check.problems(case) == ["RESOURCE_EXHAUSTED: Shared memory size limit exceeded"]
    spilled = {"ok": True, "kernels": [dict(name="k", registers=255, spill_bytes=8, cp_async=True, mma="")]}
    assert aot_check.problems(aot_check.Case("ragged", {"dtype": "bfloat16"}, None, [], dict(spilled)))
    assert not aot_check.problems(aot_check.Case("ragged", {"dtype": "float32"}, None, [], dict(spilled)))


def test_cases_cover_the_issue_matrix():
    cases = aot_check.kernel_cases(quick=False)
    decode = [c.params for c in cases if c.kind == "decode"]
    assert {p["group"] for p in decode} == {1, 2, 4, 8}
    assert {p["head_dim"] for p in decode} == {64, 128, 256}
    assert {p["dtype"] for p in decode} == {"bfloat16", "float32"}
    assert {p["block_size"] for p in decode} == {16, 32, 64, 128}
    assert any(p["window"] for p in decode)


def test_main_without_the_cuda_plugin_exits_2(monkeypatch, capsys):
    def no_device():
        raise RuntimeError("topology not implemented for cuda")

    monkeypatch.setattr(aot_check, "compile_only_device", no_device)
    assert aot_check.main([]) == 2
    assert "CUDA PJRT plugin" in capsys.readouterr().err
