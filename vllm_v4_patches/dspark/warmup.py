"""Speculative warm-up of a DSpark engine: internal requests before it serves.

vLLM's own warm-up runs the target and the draft forward on dummy batches but
never a speculative step, so everything reached only from one (the drafter's input
preparation and slot mapping, the Markov kernel, the rejection sampler, a draft
block's attention, and the target's attention where a Triton backend serves it)
compiles on the first user requests: seconds of latency on a GPU, and one warning
per kernel from vLLM's JIT monitor (an error in its ``error`` mode).

So an engine core whose V1 runner drafts with the overlay's DSpark drafter serves
internal requests once its own start-up is done, through its own scheduler and step
function (``rounds`` says which shapes and why). Their outputs never leave the
engine core, the prefix cache is reset after them, and the worker holds vLLM's JIT
monitor back until the engine core tells it the warm-up is over (or, failing that,
until the first step that carries no warm-up request); then it also clears the
drafter's counters. A CUDA error during the warm-up stops the engine: the context
is lost, and serving on would fail or hang at the first request.

``VLLM_V4_DSPARK_WARMUP``: ``auto`` (on CUDA-like platforms, where kernels are
JIT-compiled), ``on`` or ``off``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

SETTING = "VLLM_V4_DSPARK_WARMUP"
CHOICES = ("auto", "on", "off")
REQUEST_PREFIX = "vllm-v4-dspark-warmup-"
PROMPT_TOKENS = 8  # the batch rounds' prompts
MAX_PROMPT = 2048  # the longest prompt-length class warmed
MAX_BATCH = 256  # the largest batch warmed (vLLM's default max_num_seqs on GPUs)
MAX_STAGGER = 32  # the batch rounds' spread of output lengths
MAX_STEPS = 1000  # a bound on each round's step loop: a round needs a few dozen

logger = logging.getLogger("vllm_v4_patches")

# worker side: the JIT monitor activation vLLM asked for while a warm-up was pending
_held_activation: list[Callable[[], Any]] = []
_runner_warms: list[bool] = [False]  # this process built a V1 DSpark runner


def setting(env: dict[str, str] | None = None) -> str:
    from vllm_v4_patches.toggles import read_choice

    return read_choice(SETTING, CHOICES, "using auto", env)


def skip_reason(vllm_config: Any) -> str | None:
    """Why this engine core does not warm up, or None where it does."""
    choice = setting()
    if choice == "off":
        return f"{SETTING}=off"
    if choice == "auto" and not _jit_compiling_platform():
        return "the platform compiles no kernels at run time"
    if getattr(vllm_config, "use_v2_model_runner", False):
        return "vLLM's V2 runner drafts here"
    parallel = vllm_config.parallel_config
    if getattr(parallel, "data_parallel_size", 1) > 1:
        # ranks step in lockstep through collectives; warm-up steps are per rank
        return "data parallel ranks step together"
    return None


def _jit_compiling_platform() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cuda_alike())


# -- engine core --------------------------------------------------------------


def warm_engine_core(core: Any, vllm_config: Any) -> None:
    """Serve the warm-up rounds on a started engine core; never raises."""
    reason = skip_reason(vllm_config)
    if reason is not None:
        logger.info("vllm_v4_patches: DSpark warm-up skipped: %s", reason)
        return
    started = time.perf_counter()
    served = steps = rounds_served = 0
    try:
        for round_requests in rounds(vllm_config):
            rounds_served += 1
            for request in round_requests:
                core.add_request(*core.preprocess_add_request(request))
            served += len(round_requests)
            steps += _drain(core)
        if vllm_config.cache_config.enable_prefix_caching:
            core.reset_prefix_cache()
        core.model_executor.collective_rpc(close_worker_warmup)
    except Exception as exc:  # a warm-up must never stop the engine from serving
        if _device_fault(exc):
            # a CUDA error is sticky: the context is lost and every later step would
            # fail or hang, so the engine dies here, naming the fault
            raise
        _abandon(core)
        logger.warning(
            "vllm_v4_patches: DSpark warm-up stopped (%s: %s); kernels it did not reach "
            "compile on the first requests",
            type(exc).__name__,
            exc,
        )
        return
    logger.info(
        "vllm_v4_patches: DSpark warm-up: %d internal requests in %d rounds, %d steps, %.1f s",
        served,
        rounds_served,
        steps,
        time.perf_counter() - started,
    )


def rounds(vllm_config: Any) -> Iterator[list[Any]]:
    """The warm-up, round by round; a round is served to the end before the next.

    Kernels specialise on the step's shape: block sizes follow the longest prompt in
    a prefill step (one request per power-of-two prompt length, so each class is
    the longest once), kernel configurations and integer specialisations follow the
    batch size, and greedy and sampled requests take different paths. Triton
    specialises an integer argument on being 1 or a multiple of 16, and the drafter's
    kernel configurations change at powers of two, so a uniform batch of every power
    of two up to MAX_BATCH runs once (a batch that stays at 16 or 64, as a benchmark's
    does, otherwise meets a variant a shrinking batch can skip); then a batch of up
    to MAX_BATCH requests with staggered lengths shrinks through the sizes between.
    """
    from vllm.v1.engine import EngineCoreRequest

    model = vllm_config.model_config
    vocab = model.get_vocab_size()
    new_tokens = 4
    reserve = new_tokens + vllm_config.speculative_config.num_speculative_tokens + 2
    longest_prompt = min(model.max_model_len - reserve, MAX_PROMPT)
    lengths = [n for n in _powers_of_two(longest_prompt)] + [longest_prompt]
    batch = max(1, min(MAX_BATCH, vllm_config.scheduler_config.max_num_seqs))
    stagger = max(1, min(MAX_STAGGER, model.max_model_len - PROMPT_TOKENS - reserve))
    # (prompt length, new tokens, sampled) per request
    plan = [[(length, new_tokens, False)] for length in dict.fromkeys(lengths) if length > 0]
    uniform = [size for size in _powers_of_two(batch) if size > 1]  # 1: the rounds above
    plan += [[(PROMPT_TOKENS, new_tokens, False)] * size for size in uniform]
    staggered = [1 + i * stagger // batch for i in range(batch)]
    plan.append([(PROMPT_TOKENS, extra + new_tokens, False) for extra in staggered])
    plan.append(
        [(PROMPT_TOKENS, extra + new_tokens, i % 2 == 1) for i, extra in enumerate(staggered)]
    )
    plan.append([(PROMPT_TOKENS, stagger, True)])
    for number, shape in enumerate(plan):
        yield [
            engine_request(
                EngineCoreRequest,
                f"{REQUEST_PREFIX}{number}-{i}",
                _prompt(vocab, length, number * MAX_BATCH + i),
                _sampling_params(max_tokens, sampled),
            )
            for i, (length, max_tokens, sampled) in enumerate(shape)
        ]


def _powers_of_two(limit: int) -> Iterator[int]:
    length = 1
    while length <= limit:
        yield length
        length *= 2


def _prompt(vocab: int, length: int, seed: int) -> list[int]:
    return [(7 * seed + 13 * j + 1) % vocab for j in range(length)]


def _sampling_params(max_tokens: int, sampled: bool) -> Any:
    from vllm import SamplingParams

    return SamplingParams(
        temperature=1.0 if sampled else 0.0, max_tokens=max_tokens, ignore_eos=True
    )


def engine_request(request_class: type, request_id: str, prompt: list[int], params: Any) -> Any:
    """An engine-core request with the fields this release declares; raises
    TypeError naming a required field the warm-up cannot fill."""
    values = {
        "request_id": request_id,
        "external_req_id": request_id,
        "prompt_token_ids": prompt,
        "sampling_params": params,
        "arrival_time": time.time(),
    }
    empty = ("mm_features", "mm_kwargs", "mm_hashes", "mm_placeholders", "mm_inputs")
    empty += ("pooling_params", "lora_request", "cache_salt", "data_parallel_rank")
    empty += ("eos_token_id",)
    fields = request_class.__struct_fields__
    required = fields[: len(fields) - len(request_class.__struct_defaults__)]
    unknown = [name for name in required if name not in values and name not in empty]
    if unknown:
        raise TypeError(f"EngineCoreRequest needs {', '.join(unknown)}")
    chosen = {name: values.get(name) for name in fields if name in values or name in empty}
    return request_class(**chosen)


def _drain(core: Any) -> int:
    """Step until the scheduler holds nothing and no batch is in flight."""
    steps = 0
    post_step = getattr(core, "post_step", None)
    while core.scheduler.has_requests() or getattr(core, "batch_queue", None):
        if steps == MAX_STEPS:
            raise RuntimeError(f"warm-up requests unfinished after {MAX_STEPS} steps")
        _, model_executed = core.step_fn()
        if post_step is not None:
            post_step(model_executed)
        steps += 1
    return steps


def _device_fault(exc: BaseException) -> bool:
    name = type(exc).__name__
    return name == "AcceleratorError" or "CUDA error" in str(exc)


def _abandon(core: Any) -> None:
    try:
        requests = getattr(core.scheduler, "requests", {})
        core.abort_requests([r for r in requests if r.startswith(REQUEST_PREFIX)])
    except Exception:
        logger.exception("vllm_v4_patches: could not abort the DSpark warm-up requests")


# -- worker -------------------------------------------------------------------


def runner_built() -> None:
    """This process runs a V1 DSpark runner: hold the JIT monitor for its warm-up."""
    _runner_warms[0] = setting() != "off"


def hold_jit_monitor(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """vLLM activates its JIT monitor at the end of the worker's warm-up; a DSpark
    runner's warm-up goes on through the engine core's internal requests, so the
    activation waits for their end."""
    if not _runner_warms[0]:
        return wrapped(*args, **kwargs)
    _held_activation[:] = [lambda: wrapped(*args, **kwargs)]
    return None


def is_warmup_step(scheduler_output: Any) -> bool:
    scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
    return any(str(req_id).startswith(REQUEST_PREFIX) for req_id in scheduled)


def end_of_warmup(drafter: Any, scheduler_output: Any) -> None:
    """At the first step that carries requests and no warm-up request: release the
    held JIT monitor and clear what the warm-up steps counted."""
    if not getattr(scheduler_output, "num_scheduled_tokens", None):
        return
    if is_warmup_step(scheduler_output):
        drafter.warming_up = True
        return
    _close(drafter)


def close_worker_warmup(worker: Any) -> None:
    """Runs in each worker once the engine core has served the warm-up: the same
    as ``end_of_warmup`` at a first user step, done before that step, whose
    latency is what the warm-up is for."""
    _close(getattr(getattr(worker, "model_runner", None), "drafter", None))


def _close(drafter: Any) -> None:
    if _held_activation:
        _held_activation.pop()()
    if getattr(drafter, "warming_up", False):
        drafter.warming_up = False
        drafter.reset_counters()
