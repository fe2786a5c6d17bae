"""Micro-benchmarks of the kernels (K1 decode, K2 prefill, K3 MoE experts, KV write) against their peers.

    python -m pallas_kernels.bench                 # the GPU shapes (needs a GPU)
    python -m pallas_kernels.bench --small         # tiny shapes, interpret mode: CPU, < 1 minute
    python -m pallas_kernels.bench --only k1 --json out.json

K1, decode: KV bytes read per second of `paged_decode_attention` (its default split
and the best of a small sweep), JAX's own Pallas `paged_attention` on the same arrays
(the same [kv_heads, pages, page_size, head_dim] layout), the XLA reference, and an HBM
copy of the same byte count (reported as bytes read + written per second). Then the same
kernel over an fp8 (float8_e4m3fn) copy of the cache: its bytes read per second (half
the bytes per token) and its effective tokens per second (sequences decoded per second)
against the bf16 cache's. K1 mixed: a decode batch of mixed context lengths (B1's
spread), over the bf16 and the fp8 cache, with the kernel's default order (longest
sequences first) against arrival order and shortest first (`seq_order`).
K2, prefill: causal TFLOP/s of `ragged_paged_attention` on a paged cache against
`jax.nn.dot_product_attention(implementation="cudnn")` and JAX's Pallas Triton flash
attention on unpaged data. KV write: XLA's scatter of a step's new K/V rows into the
donated cache (time, and copies of the cache in the compiled HLO). K3, MoE experts:
TFLOP/s of `grouped_matmul` against XLA's `ragged_dot` and a dense batched einsum over
balanced groups (see `bench_k3`). A whole model step
on each attention backend is jaxvllm's (`python -m jaxvllm.benchmarks.engine_step`):
this package imports nothing from jaxvllm.
Figures go to stdout and to JSON (`--json PATH`, default $OUT/bench.json when $OUT is
set). On CPU only ratios measured in one run mean anything (docs/design.md, "Benchmarks").
K1 and K1 mixed live in `pallas_kernels/bench_decode.py`; the timing, JSON and environment
helpers are `pallas_kernels.harness`'s.
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.bench_decode import DTYPE, bench_k1, bench_k1_mixed, paged_kv
from pallas_kernels.common import cdiv
from pallas_kernels.grouped_matmul import grouped_matmul
from pallas_kernels.harness import (
    attempt,
    environment,
    json_path,
    max_abs_err,
    summary,
    time_donated,
    time_fn,
    tuning_name,
    write_json,
)
from pallas_kernels.hlo import count_cache_copies
from pallas_kernels.kv_cache_write import write_kv_reference
from pallas_kernels.ragged_paged_attention import ragged_paged_attention, ragged_paged_attention_reference

FULL = dict(
    k1=dict(q_heads=16, kv_heads=8, head_dim=128, block_size=16, shapes=[(64, 2048), (256, 1024), (256, 4096)],
            # paged_decode_attention tunings tried beside the defaults (unset = default: a
            # 64-key tile, num_stages=3). block_kv=128 with num_stages=2 was the default before
            # the page ids were carried (no load in flight during a tile's dots).
            sweep=(dict(num_splits=1), dict(num_splits=2), dict(num_splits=4), dict(num_splits=8),
                   dict(block_kv=128, num_stages=2), dict(block_kv=128, num_stages=3),
                   dict(block_kv=32, num_stages=4), dict(num_stages=4), dict(num_warps=8)),
            # The same kernel over an fp8 cache: tunings tried beside its defaults (a 128-key
            # fp8 tile is as many bytes as the default 64-key bf16 one; with 2 stages it needs
            # less shared memory, so more programs fit on an SM).
            fp8_sweep=(dict(block_kv=128), dict(block_kv=128, num_stages=2), dict(block_kv=128, num_stages=4),
                       dict(block_kv=128, num_warps=8),
                       dict(num_stages=4), dict(num_warps=8), dict(block_kv=128, num_splits=2),
                       dict(block_kv=128, num_splits=4))),
    # 256 sequences of 100-2048 tokens (uniform), as mid-way through B1: the order in which
    # the decode kernel's programs take them.
    k1_mixed=dict(q_heads=16, kv_heads=8, head_dim=128, block_size=16, batch=256, contexts=(100, 2048)),
    k2=dict(batch=4, seq_len=4096, q_heads=16, kv_heads=16, head_dim=128, block_size=16,
            # ragged_paged_attention tunings (the first is the default: 128 query rows, 64 keys,
            # num_stages=3, 8 warps).
            tiles=(dict(), dict(block_kv=128), dict(block_q=64), dict(num_stages=2), dict(num_stages=4))),
    # K/V rows written per step: a decode batch, a prefill bucket; into one layer's cache
    # of Qwen3-0.6B's shape with 64k slots.
    kv=dict(kv_heads=8, head_dim=128, num_slots=65536, block_size=16, tokens=[256, 8192]),
    # K3, grouped matmul: Qwen3-30B-A3B's experts (128, top-8, hidden 2048, intermediate 768):
    # the (token, expert) rows of 256 and 1024 tokens, gate/up (k 2048, n 768) and down
    # (k 768, n 2048). grouped_matmul tunings (the first is the default: block_m by rows per
    # group, 16 at 2048 rows and 64 at 8192, block_n 128, block_k 64, 4 warps, 3 stages).
    k3=dict(experts=128, rows=[2048, 8192], projections=[(2048, 768), (768, 2048)],
            tiles=(dict(), dict(block_m=16), dict(block_m=32), dict(block_m=64), dict(block_m=128, num_warps=8),
                   dict(block_n=64), dict(block_k=128), dict(num_stages=4), dict(num_warps=8))),
    iters=20,
)
SMALL = dict(
    k1=dict(q_heads=4, kv_heads=2, head_dim=16, block_size=8, shapes=[(3, 40)],
            sweep=(dict(num_splits=1, block_kv=16), dict(num_splits=2, block_kv=16, num_warps=8)),
            fp8_sweep=(dict(num_splits=1, block_kv=16),)),
    k1_mixed=dict(q_heads=4, kv_heads=2, head_dim=16, block_size=8, batch=6, contexts=(4, 48)),
    k2=dict(batch=2, seq_len=64, q_heads=2, kv_heads=2, head_dim=16, block_size=8,
            tiles=(dict(block_q=16, block_kv=16),)),
    kv=dict(kv_heads=2, head_dim=16, num_slots=256, block_size=8, tokens=[16]),
    k3=dict(experts=4, rows=[40], projections=[(32, 16)], tiles=(dict(block_m=16, block_n=16, block_k=16),)),
    iters=2,
)


def bench_k2(cfg: dict, iters: int, interpret: bool) -> dict:
    b, n, hq, hkv, d, bs = (cfg[k] for k in ("batch", "seq_len", "q_heads", "kv_heads", "head_dim", "block_size"))
    key = jax.random.key(7)
    k_cache, v_cache, tables = paged_kv(key, hkv, [n] * b, bs, d, spare_blocks=0)
    q = jax.random.normal(jax.random.fold_in(key, 1), (b * n, hq, d), DTYPE)
    positions = jnp.tile(jnp.arange(n, dtype=jnp.int32), b)
    qsl = jnp.arange(b + 1, dtype=jnp.int32) * n
    lens = jnp.full((b,), n, jnp.int32)
    scale = d**-0.5
    flops = 4 * b * hq * d * (n * (n + 1) // 2)  # causal: QK^T and PV over the visible keys
    tflops = lambda t: flops / t / 1e12  # noqa: E731
    result: dict[str, Any] = {"batch": b, "seq_len": n, "q_heads": hq, "kv_heads": hkv, "head_dim": d, "flops": flops}

    # Unpaged copies of the same K/V: [b, n, kv_heads, d].
    def unpaged(cache):
        pages = cache[:, tables]  # [h, b, max_blocks, bs, d]
        return pages.reshape(hkv, b, -1, d)[:, :, :n].transpose(1, 2, 0, 3)

    k_dense, v_dense = unpaged(k_cache), unpaged(v_cache)
    q_dense = q.reshape(b, n, hq, d)

    def dense_xla():
        fn = jax.jit(partial(jax.nn.dot_product_attention, is_causal=True, scale=scale, implementation="xla"))
        return fn(q_dense, k_dense, v_dense).reshape(b * n, hq, d)

    want = None

    def cudnn():
        nonlocal want
        fn = jax.jit(partial(jax.nn.dot_product_attention, is_causal=True, scale=scale, implementation="cudnn"))
        out = fn(q_dense, k_dense, v_dense)
        want = out.reshape(b * n, hq, d)
        t = time_fn(fn, q_dense, k_dense, v_dense, iters=iters)
        return {"ms": t * 1e3, "tflop_s": tflops(t)}

    if jax.default_backend() == "cpu":
        result["cudnn"] = {"skipped": "no cuDNN on CPU"}
    else:
        attempt(result, "cudnn", cudnn)
    if want is None:  # no cuDNN (CPU): check against XLA's dense attention instead
        want = dense_xla()

    def ours():
        out: dict[str, Any] = {}
        sweep = {}
        for tuning in cfg["tiles"]:
            fn = jax.jit(partial(ragged_paged_attention, sm_scale=scale, interpret=interpret, **tuning))
            got = fn(q, k_cache, v_cache, positions, qsl, lens, tables)
            name = tuning_name(tuning)
            out.setdefault("max_abs_err", {})[name] = max_abs_err(got, want)
            sweep[name] = tflops(time_fn(fn, q, k_cache, v_cache, positions, qsl, lens, tables, iters=iters))
        best = max(sweep, key=sweep.get)
        out.update(sweep_tflop_s=sweep, best=best, best_tflop_s=sweep[best], default_tflop_s=next(iter(sweep.values())))
        return out

    def pallas_flash():
        from jax.experimental.pallas.ops.gpu.attention import mha

        kf = jnp.repeat(k_dense, hq // hkv, axis=2)
        vf = jnp.repeat(v_dense, hq // hkv, axis=2)
        fn = jax.jit(partial(mha, segment_ids=None, sm_scale=scale, causal=True, interpret=interpret))
        t = time_fn(fn, q_dense, kf, vf, iters=iters)
        return {"ms": t * 1e3, "tflop_s": tflops(t)}

    def reference():
        fn = jax.jit(partial(ragged_paged_attention_reference, sm_scale=scale))
        t = time_fn(fn, q, k_cache, v_cache, positions, qsl, lens, tables, iters=max(1, iters // 4))
        return {"ms": t * 1e3, "tflop_s": tflops(t)}

    attempt(result, "pallas_ragged", ours)
    attempt(result, "jax_pallas_flash_unpaged", pallas_flash)
    if interpret:  # the reference gathers [heads, T, context, D]: far too big at the full shape
        attempt(result, "xla_reference", reference)
    print(f"K2 {b}x{n}: {summary(result)}", flush=True)
    return result


# -- K3: grouped matmul (MoE experts) ------------------------------------------------------


def bench_k3(cfg: dict, iters: int, interpret: bool) -> list[dict]:
    """TFLOP/s (useful: 2 m k n) of `grouped_matmul` over rows routed uniformly at random to
    the experts, against XLA's `ragged_dot` (a masked product over every expert on GPU) and
    a dense batched einsum over perfectly balanced groups of cdiv(m, experts) rows (cuBLAS
    on the same useful work: the mark to reach). Also the bytes read per second (weights,
    rows and output once each)."""
    rows = []
    e = cfg["experts"]
    for m in cfg["rows"]:
        for k, n in cfg["projections"]:
            key = jax.random.key(m * 31 + k)
            lhs = jax.random.normal(key, (m, k), DTYPE)
            rhs = (jax.random.normal(jax.random.fold_in(key, 1), (e, k, n), jnp.float32) * k**-0.5).astype(DTYPE)
            chosen = jax.random.randint(jax.random.fold_in(key, 2), (m,), 0, e)
            sizes = jnp.bincount(chosen, length=e).astype(jnp.int32)
            flops = 2 * m * k * n
            nbytes = (e * k * n + m * k + m * n) * jnp.dtype(DTYPE).itemsize
            row: dict[str, Any] = {"rows": m, "k": k, "n": n, "experts": e, "flops": flops, "bytes": nbytes,
                                   "largest_group": int(sizes.max())}
            tflops = lambda t: flops / t / 1e12  # noqa: E731
            ragged_fn = jax.jit(jax.lax.ragged_dot)
            want = ragged_fn(lhs, rhs, sizes)

            def ours():
                out: dict[str, Any] = {}
                sweep = {}
                for tuning in cfg["tiles"]:
                    fn = jax.jit(partial(grouped_matmul, interpret=interpret, **tuning))
                    name = tuning_name(tuning)
                    out.setdefault("max_abs_err_vs_ragged_dot", {})[name] = max_abs_err(fn(lhs, rhs, sizes), want)
                    sweep[name] = time_fn(fn, lhs, rhs, sizes, iters=iters)
                best = min(sweep, key=sweep.get)
                first = next(iter(sweep.values()))
                out.update(default_ms=first * 1e3, default_tflop_s=tflops(first),
                           default_read_tb_s=nbytes / first / 1e12,
                           sweep_tflop_s={name: tflops(t) for name, t in sweep.items()}, best=best,
                           best_tflop_s=tflops(sweep[best]), best_read_tb_s=nbytes / sweep[best] / 1e12)
                return out

            def ragged():
                t = time_fn(ragged_fn, lhs, rhs, sizes, iters=iters)
                return {"ms": t * 1e3, "tflop_s": tflops(t)}

            def dense():
                c = cdiv(m, e)
                x = lhs[: e * c] if e * c <= m else jnp.pad(lhs, ((0, e * c - m), (0, 0)))
                x = x.reshape(e, c, k)
                fn = jax.jit(partial(jnp.einsum, "eck,ekn->ecn"))
                t = time_fn(fn, x, rhs, iters=iters)
                return {"ms": t * 1e3, "tflop_s": 2 * e * c * k * n / t / 1e12, "rows_per_expert": c}

            attempt(row, "pallas_grouped_matmul", ours)
            attempt(row, "xla_ragged_dot", ragged)
            attempt(row, "dense_batched_einsum_balanced", dense)
            rows.append(row)
            print(f"K3 rows={m} k={k} n={n} experts={e}: {summary(row)}", flush=True)
    return rows


# -- KV write ------------------------------------------------------------------------------


def bench_kv(cfg: dict, iters: int, interpret: bool) -> list[dict]:
    """XLA's scatter of T new K/V rows into donated caches (the engine's KV write): its time,
    the bytes it writes per second, and whether the compiled update copies the cache."""
    h, d, slots, bs = cfg["kv_heads"], cfg["head_dim"], cfg["num_slots"], cfg["block_size"]
    rows = []
    for tokens in cfg["tokens"]:
        key = jax.random.key(tokens)
        shape = (h, slots // bs, bs, d)
        new_k = jax.random.normal(key, (tokens, h, d), DTYPE)
        new_v = jax.random.normal(jax.random.fold_in(key, 1), (tokens, h, d), DTYPE)
        # Scattered slots, the last ones padding (-1), as the runner pads a bucket.
        slot_mapping = jax.random.permutation(jax.random.fold_in(key, 2), slots)[:tokens]
        slot_mapping = jnp.where(jnp.arange(tokens) < tokens - tokens // 8, slot_mapping, -1).astype(jnp.int32)
        written = 2 * (tokens - tokens // 8) * h * d * jnp.dtype(DTYPE).itemsize
        row: dict[str, Any] = {"tokens": tokens, "bytes_written": written}

        def run():
            fn = jax.jit(write_kv_reference, donate_argnums=(0, 1))
            caches = (jnp.zeros(shape, DTYPE), jnp.zeros(shape, DTYPE))
            compiled = fn.lower(*caches, new_k, new_v, slot_mapping).compile()
            copies = count_cache_copies(compiled.as_text(), shape)
            t, _ = time_donated(lambda c: fn(*c, new_k, new_v, slot_mapping), caches, iters=iters)
            return {"us": t * 1e6, "written_gb_s": written / t / 1e9, "cache_copies_in_hlo": copies}

        attempt(row, "xla_scatter", run)
        rows.append(row)
        print(f"KV write {tokens} tokens: {row['xla_scatter']}", flush=True)
    return rows


# -- driver --------------------------------------------------------------------------------


PARTS = {"k1": bench_k1, "k1_mixed": bench_k1_mixed, "k2": bench_k2, "kv": bench_kv, "k3": bench_k3}  # in the order they run: decode first


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny shapes in interpret mode (runs on CPU)")
    parser.add_argument("--only", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--iters", type=int, default=None, help="timed repetitions (median)")
    parser.add_argument("--json", default=None, help="write results here (default $OUT/bench.json if $OUT is set)")
    args = parser.parse_args(argv)

    cfg = SMALL if args.small else FULL
    iters = args.iters or cfg["iters"]
    if not args.small and jax.default_backend() == "cpu":
        parser.error("the full shapes need a GPU; use --small on CPU")
    interpret = args.small and jax.default_backend() == "cpu"
    wanted = {w.strip() for w in args.only.split(",") if w.strip()}
    unknown = wanted - set(PARTS)
    if unknown:
        parser.error(f"unknown --only parts {sorted(unknown)}")

    results: dict[str, Any] = {"small": args.small, "interpret": interpret, "iters": iters, "env": environment(),
                               "config": {k: v for k, v in cfg.items() if k in wanted}}
    path = json_path(args.json, "bench.json")
    start = time.perf_counter()
    # The file is rewritten after each part, so a run cut short by a time limit still
    # leaves what it measured.
    for part, fn in PARTS.items():
        if part in wanted:
            results[part] = fn(cfg[part], iters, interpret)
            results["seconds"] = time.perf_counter() - start
            write_json(path, results)
    if path:
        print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
