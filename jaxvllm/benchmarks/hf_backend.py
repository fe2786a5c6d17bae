"""HF transformers on the same requests: the reference that `--backend hf|both` compares against.

Two ways to run a request list, as a transformers user would:

- "cb": transformers' continuous batching (the manager behind `generate_batch`), each
  request with its own output length;
- "padded": `generate` on batches of `batch_size` requests sorted by output length,
  left-padded, each batch generating its longest output (tokens past a request's
  own length are generated but not counted, as a padded batch must).

"auto" takes "cb" where this transformers has it. EOS never stops a request early,
so both engines do exactly the same number of tokens. torch is imported only here,
since it is a test extra and not a dependency of the engine.
"""

from __future__ import annotations

import gc
import inspect
import time
from typing import Any

from tqdm.auto import tqdm

from jaxvllm.benchmarks.common import RunTimings
from jaxvllm.benchmarks.datasets import BenchRequest
from jaxvllm.dummy import ModelSource

HF_MODES = ("auto", "cb", "padded")
CB, PADDED = "cb", "padded"


def import_torch():
    """torch, or an ImportError that says how to get it (the command line reports it in one line)."""
    try:
        import torch
    except ImportError as e:
        raise ImportError(
            "--backend hf/both needs torch (the `test` extra): pip install torch==2.13.0 (CPU wheel)"
        ) from e
    return torch


class _TokenClock:
    """A `generate` streamer that only notes when each step's tokens come out.

    `generate` calls put() once with the prompt, then once per step.
    """

    def __init__(self) -> None:
        self.times: list[float] = []
        self._seen_prompt = False

    def put(self, value: Any) -> None:
        if self._seen_prompt:
            self.times.append(time.perf_counter())
        self._seen_prompt = True

    def end(self) -> None:
        pass


def _accepted(fn, **kwargs: Any) -> dict[str, Any]:
    """The kwargs that `fn` takes and that are set: transformers' continuous batching API
    still moves between releases (5.17 on the GPU machine, 5.2x here)."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in kwargs.items() if v is not None and k in params}


def _hints(requests: list[BenchRequest]):
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints
    except ImportError:
        return None
    return WorkloadHints(max_prompt_length=max(r.prompt_len for r in requests),
                         max_generated_length=max(r.output_len for r in requests), num_requests=len(requests))


class HFBackend:
    """A transformers model on the best torch device here, loaded once for several runs."""

    name = "hf"

    def __init__(self, source: ModelSource, *, dtype: str = "auto", mode: str = "auto", batch_size: int = 64,
                 max_num_batched_tokens: int | None = None, max_num_seqs: int | None = None, seed: int = 0) -> None:
        torch = import_torch()
        from transformers import AutoConfig, AutoModelForCausalLM

        from jaxvllm.loader import load_config

        if mode not in HF_MODES:
            raise ValueError(f"hf mode must be one of {HF_MODES}, got {mode!r}")
        if batch_size < 1:
            raise ValueError(f"hf batch size must be >= 1, got {batch_size}")
        self.torch = torch
        self.batch_size = batch_size
        # The same step budget as jaxvllm's, for continuous batching (None: transformers' default).
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        dtype_name = load_config(source.path).dtype if dtype == "auto" else dtype
        self.dtype = getattr(torch, dtype_name)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        start = time.perf_counter()
        torch.manual_seed(seed)
        if source.dummy:  # random weights of the config, as jaxvllm's load_format="dummy"
            config = AutoConfig.from_pretrained(source.path, local_files_only=True)
            model = AutoModelForCausalLM.from_config(config, dtype=self.dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(source.path, dtype=self.dtype, local_files_only=True)
        self.model = model.to(self.device).eval()
        self._sync()
        self.load_seconds = time.perf_counter() - start
        self.warmup_seconds = 0.0
        self.mode = self._resolve_mode(mode)
        config = self.model.config
        self.pad_token_id = config.pad_token_id if config.pad_token_id is not None else 0
        eos = self.model.generation_config.eos_token_id  # (what a stop_at_eos request stops at)
        self.eos_token_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

    @property
    def device_name(self) -> str:
        if self.device == "cuda":
            return f"cuda ({self.torch.cuda.get_device_name()})"
        return self.device

    def _resolve_mode(self, mode: str) -> str:
        has_cb = hasattr(self.model, "init_continuous_batching")
        if mode == CB and not has_cb:
            raise ValueError("this transformers has no continuous batching (generate_batch); use --hf-mode padded")
        if mode == "auto":
            return CB if has_cb else PADDED
        return mode

    @property
    def mode_description(self) -> str:
        if self.mode == CB:
            return "continuous batching"
        return f"padded generate, batches of {self.batch_size}"

    def _sync(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def warmup(self, requests: list[BenchRequest]) -> float:
        """Run a couple of short requests once, so that first-call costs stay out of the timed run."""
        start = time.perf_counter()
        few = [BenchRequest(r.prompt_token_ids, min(r.output_len, 2)) for r in requests[:2]]
        self.run(few, use_tqdm=False)
        self.warmup_seconds = time.perf_counter() - start
        return self.warmup_seconds

    def run(self, requests: list[BenchRequest], *, temperature: float = 0.0, use_tqdm: bool = True) -> RunTimings:
        with self.torch.inference_mode():
            if self.mode == CB:
                return self._run_cb(requests, temperature, use_tqdm)
            return self._run_padded(requests, temperature, use_tqdm)

    def _generation_config(self, max_new_tokens: int, temperature: float, **extra):
        from transformers import GenerationConfig

        if temperature > 0:  # plain softmax(logits / T), as jaxvllm samples (transformers' top_k is 50 by default)
            sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        else:
            sampling = {"do_sample": False}
        return GenerationConfig(max_new_tokens=max_new_tokens, pad_token_id=self.pad_token_id, **sampling, **extra)

    # -- continuous batching ---------------------------------------------------------------

    def _run_cb(self, requests: list[BenchRequest], temperature: float, use_tqdm: bool) -> RunTimings:
        max_new = max(r.output_len for r in requests)
        gen_config = self._generation_config(max_new, temperature, eos_token_id=-1)  # -1: no EOS
        setup = time.perf_counter()
        manager = self.model.init_continuous_batching(
            **_accepted(self.model.init_continuous_batching, generation_config=gen_config,
                        continuous_batching_config=self._cb_config(requests), workload_hints=_hints(requests))
        )
        if hasattr(manager, "warmup"):  # allocates the paged cache (and captures CUDA graphs) before the clock
            manager.warmup()
        add_request = manager.add_request
        results: dict[str, Any] = {}
        bar = tqdm(total=len(requests), desc="HF processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        start = time.perf_counter()
        setup = start - setup
        manager.start()
        try:
            for i, r in enumerate(requests):
                eos = self.eos_token_ids if r.stop_at_eos and self.eos_token_ids else -1  # -1: no EOS
                options = _accepted(add_request, request_id=str(i), max_new_tokens=r.output_len, eos_token_id=eos,
                                    record_timestamps=True)
                add_request(r.prompt_token_ids, **options)
            while len(results) < len(requests):
                result = manager.get_result(timeout=1)
                if result is None:
                    if not manager.is_running():
                        raise RuntimeError("transformers' continuous batching thread stopped before finishing")
                    continue
                if result.is_finished():
                    if result.error is not None:
                        raise RuntimeError(f"transformers' continuous batching failed: {result.error}")
                    results[result.request_id] = result
                    bar.update(1)
            elapsed = time.perf_counter() - start
        finally:
            bar.close()
            manager.stop(block=True)
            if hasattr(manager, "destroy"):
                manager.destroy()
        outs = [results[str(i)] for i in range(len(requests))]
        stamps = [getattr(o, "timestamps", None) for o in outs]  # None where this transformers keeps none
        return RunTimings(
            elapsed=elapsed,
            output_token_ids=[list(o.generated_tokens) for o in outs],
            ttft=[t[0] - start for t in stamps] if all(stamps) else [],
            e2e=[t[-1] - start for t in stamps] if all(stamps) else [],
            setup_seconds=setup,
        )

    def _cb_config(self, requests: list[BenchRequest]):
        """jaxvllm's step budget, and on CPU a KV cache just large enough for the workload.

        Without a GPU, transformers sizes its paged cache from host memory and its
        attention (sdpa, no flash) fills a mask of batch tokens x cache tokens before
        every step: seconds per step for a cache of host-memory size.
        """
        try:
            from transformers.generation.configuration_utils import ContinuousBatchingConfig
        except ImportError:  # older transformers: its defaults
            return None
        default = ContinuousBatchingConfig()
        wanted = {"max_batch_tokens": self.max_num_batched_tokens, "max_requests_per_batch": self.max_num_seqs}
        if self.device == "cpu":
            page = getattr(default, "page_size", None) or getattr(default, "block_size", 256)  # renamed in 5.2x
            wanted["num_blocks"] = sum(-(-(r.prompt_len + r.output_len) // page) for r in requests) + 1
        return ContinuousBatchingConfig(**_accepted(ContinuousBatchingConfig, **wanted))

    # -- padded generate ---------------------------------------------------------------------

    def _run_padded(self, requests: list[BenchRequest], temperature: float, use_tqdm: bool) -> RunTimings:
        torch = self.torch
        # Batches of requests that all stop at EOS or all run to their length, shortest first.
        batches = []
        for stop in (False, True):
            order = sorted((i for i, r in enumerate(requests) if r.stop_at_eos == stop),
                           key=lambda i: requests[i].output_len)
            batches += [order[b : b + self.batch_size] for b in range(0, len(order), self.batch_size)]
        outputs: list[list[int]] = [[] for _ in requests]
        ttft, e2e = [0.0] * len(requests), [0.0] * len(requests)
        bar = tqdm(total=len(requests), desc="HF processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        start = time.perf_counter()
        try:
            for batch in batches:
                stop = requests[batch[0]].stop_at_eos
                width = max(requests[i].prompt_len for i in batch)
                ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
                mask = torch.zeros((len(batch), width), dtype=torch.long)
                for row, i in enumerate(batch):  # left padding: every prompt ends at the last column
                    p = requests[i].prompt_token_ids
                    ids[row, width - len(p) :] = torch.tensor(p)
                    mask[row, width - len(p) :] = 1
                max_new = max(requests[i].output_len for i in batch)
                clock = _TokenClock()
                # (min_new_tokens keeps EOS from being chosen)
                length = {"eos_token_id": self.eos_token_ids or None} if stop else {"min_new_tokens": max_new}
                out = self.model.generate(
                    input_ids=ids.to(self.device), attention_mask=mask.to(self.device), streamer=clock,
                    generation_config=self._generation_config(max_new, temperature, **length),
                )
                new = out[:, width:].tolist()
                for row, i in enumerate(batch):
                    tokens = new[row][: requests[i].output_len]
                    if stop:  # (through its first EOS; padding after it)
                        ends = [k for k, t in enumerate(tokens) if t in self.eos_token_ids]
                        tokens = tokens[: ends[0] + 1] if ends else tokens
                    outputs[i] = tokens
                    ttft[i], e2e[i] = clock.times[0] - start, clock.times[len(tokens) - 1] - start
                bar.update(len(batch))
            self._sync()
            elapsed = time.perf_counter() - start
        finally:
            bar.close()
        return RunTimings(elapsed=elapsed, output_token_ids=outputs, ttft=ttft, e2e=e2e)

    def close(self) -> None:
        """Give the device memory back before another engine (jaxvllm) takes it."""
        del self.model
        gc.collect()
        if self.device == "cuda":
            self.torch.cuda.empty_cache()
