"""The GPU suite: stock against patched vLLM on the same machine, one vLLM release.

Runs on the GPU machine after ``tools/gpu/run.sh`` installed the release, from the
repository root, with the tiny models of ``make model`` under ``.cache/models``:

    python tools/gpu/suite.py OUT_DIR [--jobs 6] [--only NAME ...]

Each job is one real engine (``tools/generate.py``, ``tools/inspect_dummy_batch.py``)
or one layer-level script in its own process, with or without the overlay on
PYTHONPATH; several run at once on the one GPU, each with a fixed 2 GiB KV cache.
Each check then compares jobs (patched against stock, speculation against none) and
yields pass or fail with its figure. Writes ``OUT_DIR/gpu-results-<version>.json``
(the record ``tools/gpu/record.py`` merges into the committed results file) and
``OUT_DIR/logs-<version>.tar.gz``; prints a table last.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
MODELS = REPO / ".cache" / "models"
LLAMA, QWEN3, DRAFT = (MODELS / n for n in ("tiny-llama", "tiny-qwen3", "tiny-qwen3-dspark"))
MIXTRAL = MODELS / "tiny-mixtral"  # tools/build_tiny_model.py: experts for data parallelism
GATED_DRAFT = MODELS / "tiny-qwen3-dspark-gated"  # the draft with a gated Markov head, made here
DFLASH_DRAFT = MODELS / "tiny-qwen3-dflash"  # the DSpark draft as a DFlash draft, made here
# the tiny Llama served by an out-of-tree class with nothing compiled, made here
PLAIN_LLAMA = MODELS / "tiny-llama-plain"
# the shrunken DeepSeek-V4-Flash with its three DSpark stages, built here
# (tools/build_tiny_v4.py; 1.5 GiB, more than a call carries)
TINY_V4 = MODELS / "tiny-v4"
# V4 engines starting at once: each builds its kernels on the machine's CPUs at
# start, and more at once start none in a call's time (docs/testing.md, GPU harness)
V4_AT_ONCE = 3
# what --part all runs; the V4 parts and the two-GPU parts run only when named
ALL_PARTS = ("core", "extra", "perf")
# the staged environment's fixes for DeepSeek-V4 jobs (its sitecustomize says which)
SITE_FIXES = REPO / "tools" / "gpu" / "site_fixes"
V4_LAYERS, V4_DRAFT_STAGES = 3, 3  # tools/build_tiny_v4.py's default depth, its stages
STEP_BATCHES = ("1", "64")  # the batch sizes of the V4 step-time figures
PLAIN_PLUGIN = REPO / "tools" / "plain_model_plugin"
STAGING_PLUGIN = REPO / "tools" / "staging_probe_plugin"
# the GPU sleep the staging probe enqueues before each drafter copy: a target step
# this long on the device gives the host time to run ahead on a tiny model
PROBE_DELAY = {"STAGING_PROBE_DELAY_US": "2000"}
HEAVY_PLUGIN = REPO / "tools" / "heavy_target_plugin"
# device time added to every target forward: a target bound by its weights' reads
HEAVY_TARGET = {"HEAVY_TARGET_US": "4000"}
GENERATE = str(REPO / "tools" / "generate.py")
# does the routing kernel route a token alone as in a batch (the matrix's premise)
HASH_ROUTING = str(REPO / "tools" / "gpu" / "hash_routing_probe.py")
RECORD_DRAFTS = str(REPO / "tools" / "record_dspark_drafts.py")
# its attention layout (fp8_ds_mla) takes an fp8 KV cache only
V4_ENGINE = ["--dtype", "bfloat16", "--kv-cache-dtype", "fp8"]
INSPECT = str(REPO / "tools" / "inspect_dummy_batch.py")
EMBEDDING = str(REPO / "tools" / "gpu" / "embedding_fault.py")
SERVE = str(REPO / "tools" / "serve_check.py")
KV = ["--kv-cache-gib", "2"]
TOKENS = ["--max-tokens", "32"]
BENCH = ["--max-tokens", "64", "--bench-batches", "1", "16", "64"]
PIECEWISE = ["--cudagraph-mode", "PIECEWISE"]
FULL_DECODE_ONLY = ["--cudagraph-mode", "FULL_DECODE_ONLY"]
BF16 = ["--dtype", "bfloat16"]
V1, V2 = {"VLLM_USE_V2_MODEL_RUNNER": "0"}, {"VLLM_USE_V2_MODEL_RUNNER": "1"}
# with one GPU vLLM runs the worker inside the EngineCore process (no worker process)
ROLES = {"front-end", "engine-core"}
ERROR_LINE = re.compile(r"\w(Error|Exception): |\.Unsupported: |TIMEOUT|Dynamo recompile limit")
# the first fault, not the engine's death after it
RECOMPILE_LIMIT = "Dynamo recompile limit exceeded"
STARTUP_DEATH = "Engine core initialization failed"
ROOT_ERROR = re.compile(rf"CUDA error: |AcceleratorError|{RECOMPILE_LIMIT}")
JIT_LINE = re.compile(r"during inference: ([\w.<>]+)")
# T = 1 losslessness: one prompt sampled this many times (a seed per request), and
# the tokens after the first (the first is the target's own prefill sample) compared
SAMPLES = 4000
SAMPLED_POSITIONS = (1, 2)
SIGNIFICANCE = 0.001
CONTROL_TEMPERATURE = "0.8"


@dataclass
class Job:
    name: str
    args: list[str]
    overlay: bool
    env: dict[str, str] = field(default_factory=dict)
    min_version: str = "0"
    below_version: str = "99"  # diagnostics for one release line
    # "extra": run by a second call (one call is at most 10 minutes); "v4" (eager),
    # "v4-compiled" (CUDA graphs: a call of their own, their capture is long) and
    # "v4-matrix" (the lossless matrix): only when asked for, on a release staged
    # with DeepSeek-V4's kernels (--v4)
    part: str = "core"
    timeout: float = 480
    alone: bool = False  # a timing job: runs after the others, with the GPU to itself
    plugins: tuple[str, ...] = ()  # folders put on the job's PYTHONPATH (vLLM plugins)
    gpus: int = 1  # devices the job needs; a machine with fewer does not run it


@dataclass
class Outcome:
    result: dict | None
    statuses: list[dict] | None  # None: a recorded run that did not save them
    log: str
    seconds: float
    returncode: int


def jobs() -> list[Job]:
    dspark = ["--dspark", str(DRAFT), "--spec-tokens", "4"]
    compiled_qwen3 = [GENERATE, str(QWEN3), "--no-eager"]
    qwen3 = [*compiled_qwen3, *TOKENS, *KV]
    return [
        *v4_jobs(),
        *dense_jobs(dspark, qwen3, compiled_qwen3),
        *data_parallel_jobs(),
        *tensor_parallel_jobs(dspark, qwen3),
    ]


# NVLink multicast stays off on the lent multi-GPU machines
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0"}


def tensor_parallel_jobs(dspark: list[str], qwen3: list[str]) -> list[Job]:
    """DSpark at tensor parallel size 2 on two GPUs (``--part tp2``): the tiny Qwen3
    pair through the overlay's V1 route, compiled, against the same at size 1.
    The vanilla Markov head is vLLM's own draft class where the release has one
    (its head whole on each rank); the gated head is the overlay's class, its bias
    weight split over the vocabulary. Sampled requests: T = 1, a seed per request,
    probabilistic drafts."""
    two = ["--tensor-parallel-size", "2"]
    gated = ["--dspark", str(GATED_DRAFT), "--spec-tokens", "4"]
    sampled = ["--temperature", "1.0", "--draft-sample-method", "probabilistic", "--repeat", "4"]
    env = {**V1, **NCCL_ENV}
    runs = {
        "tp1-nospec": ([*qwen3], False),
        "tp1-dspark": ([*qwen3, *dspark], True),
        "tp1-dspark-gated": ([*qwen3, *gated], True),
        "tp1-dspark-sampled": ([*qwen3, *dspark, *sampled], True),
    }
    jobs = [Job(name, args, overlay, V1, part="tp2") for name, (args, overlay) in runs.items()]
    timed = ["--step-times", *STEP_BATCHES]
    for name, (args, overlay) in list(runs.items())[1:]:
        two_name = name.replace("tp1", "tp2")
        extra = timed if two_name == SHARD_WALK_JOB else []
        jobs.append(Job(two_name, [*args, *two, *extra], overlay, env, part="tp2", gpus=2))
    # the gated head's split bias drafted by the loop, which gathers it: the shard
    # walk's tokens and draft-step time are judged against it
    loop = {**env, "VLLM_V4_DSPARK_MARKOV_KERNEL": "torch"}
    args = [*qwen3, *gated, *two, *timed]
    jobs.append(Job(SHARD_LOOP_JOB, args, True, loop, part="tp2", gpus=2))
    return jobs


SHARD_WALK_JOB, SHARD_LOOP_JOB = "tp2-dspark-gated", "tp2-dspark-gated-loop"


def data_parallel_jobs() -> list[Job]:
    """``dp_dummy`` at data parallel size 2 on two GPUs (a call of its own, ``--part
    dp2``): the tiny Mixtral's eight prompts one at a time through the OpenAI server,
    so one rank idles on dummy batches while its peer decodes, each dummy batch
    recorded in the worker (``tools/data_parallel_plugin``). With CUDA graphs the
    idle rank's FULL decode graph builds attention metadata itself; eagerly it builds
    none, so the eager runs ask for it (``--force-attention``)."""
    serve = [SERVE, str(MIXTRAL), "--one-at-a-time", "--max-tokens", "24", *KV]
    two = ["--data-parallel-size", "2", "--probe-dummy-batches"]
    forced = ["--eager", "--force-attention"]
    env = {**V1, **NCCL_ENV}
    # the shrunken DeepSeek-V4, whose builders tell decodes by context (a call of its
    # own, --part v4-dp2): eager, experts split over the ranks as V4 deployments run
    v4 = [SERVE, str(TINY_V4), "--dtype", "bfloat16", "--kv-cache-dtype", "fp8", "--eager"]
    v4 += ["--one-at-a-time", "--max-tokens", "24", *KV]
    v4_two = [*v4, *two, "--expert-parallel", "--force-attention"]
    v4_env = {**env, "VLLM_DEEP_GEMM_WARMUP": "skip"}
    return [
        Job("dp1-mixtral", serve, False, V1, part="dp2"),
        Job("dp1-mixtral-eager", [*serve, "--eager"], False, V1, part="dp2"),
        Job("dp2-stock", [*serve, *two], False, env, part="dp2", gpus=2),
        Job("dp2-overlay", [*serve, *two], True, env, part="dp2", gpus=2),
        Job("dp2-stock-eager", [*serve, *two, *forced], False, env, part="dp2", gpus=2),
        Job("dp2-overlay-eager", [*serve, *two, *forced], True, env, part="dp2", gpus=2),
        Job("dp1-v4", v4, False, v4_env, part="v4-dp2"),
        Job("dp2-v4-stock", v4_two, False, v4_env, part="v4-dp2", gpus=2),
        Job("dp2-v4-overlay", v4_two, True, v4_env, part="v4-dp2", gpus=2),
    ]


# the tiny V4's LM head has this many non-zero rows: wider greedy margins
V4_LIVE_TOKENS = 16
# eight prompts of the tiny V4's trained tokenizer's kind (plain English and code)
V4_PROMPTS = (
    "def main(",
    "import os\nimport",
    "class Parser:",
    "The quick brown fox",
    "for i in range(",
    "Once upon a time",
    "SELECT name FROM",
    "# a comment about",
)


# The lossless matrix on DeepSeek-V4 (a call of its own): 16 prompts, each engine
# serving them as one batch, the first two alone and all behind a shared prefix
# twice (generate.py --phases), with chunked prefill and a small KV cache. V4's blocks
# are 256 tokens (vLLM 0.26.0's sparse SWA backend picks them in the engine core; the
# front end's config says 4 even with block_size=256 given), so the shared prefix is
# given as 800 tokens, over three blocks, hence a 1,024-token context. 0.08 GiB
# held 23.6 such contexts and sixteen 280-token answers without a preemption (2 GiB
# held 397 of 256 tokens beside the draft's cache); 0.02 GiB holds about six, under
# the sixteen answers' two blocks each. vLLM keeps max_num_seqs times the draft's new
# slots (up to N) of each step's tokens for drafting, so 256 tokens leave at least
# 144 (N = 7) for the batch: prefill is chunked. DSpark engines against one reference.
V4_MATRIX_PROMPTS = V4_PROMPTS + (
    "while True:",
    "return the",
    "In the beginning",
    "if __name__ ==",
    "A list of",
    "try:\n    import",
    "The weather today",
    "x = [",
)
V4_MATRIX = ["--phases", "--alone", "2", "--max-num-batched-tokens", "256", "--max-num-seqs", "16"]
V4_MATRIX += ["--kv-cache-gib", "0.02", "--prefix-tokens", "800"]
V4_MATRIX += ["--max-tokens", "280", "--max-model-len", "1024"]
# stock vLLM 0.26 refuses DSpark below the draft's block size (5) in its config
# check, and the overlay's V1 route takes the block size only: N = 7 was served here
# and failed, its verdict stays checked (recorded runs keep it), and no job serves it
V4_MATRIX_SPEC_TOKENS = ("5",)
V4_MATRIX_CHECKED_TOKENS = ("5", "7")
# the matrix again with vLLM's default compilation and CUDA graphs: job-name prefix,
# engine flags, part
V4_MATRIX_COMPILED = (("v4-matrix-compiled", ["--no-eager"], "v4-compiled"),)
# vLLM captures V4 in breakable CUDA graphs from 0.23; the setting that keeps their
# piecewise half for the overlay's V4 route
V4_BREAKABLE_FROM = "0.23"
V4_PIECEWISE_SETTING = "VLLM_V4_DSPARK_V4_PIECEWISE"
V4_PIECEWISE_KEPT = {"on": "-piecewise", "target": "-piecewise-target"}  # job-name suffixes
# the mode the route serves V4 in where vLLM captures it breakably
V4_ROUTE_GRAPHS = ["--cudagraph-mode", "FULL_DECODE_ONLY"]
# N the V1 route refuses for the tiny V4 (block 5): below and above it
V4_REFUSED_SPEC_TOKENS = ("3", "7")


# vLLM 0.20's hash-routing kernel divides a token's routed weights by a sum over its
# whole warp, which holds several tokens below 128 routed experts (docs/dspark.md,
# section 13): the 8-expert model's outputs there depend on the tokens packed beside
# them, so its engine's answers served alone stray up to 4.5 nats from its own
# prefill's picks, and that gap, as the matrix's bound, admits the controls. Below
# 0.21 the matrix (and the compiled part) serves 128 experts, one token a warp, as
# the real 256 are.
TINY_V4_WIDE = MODELS / "tiny-v4-e128"
V4_WIDE_EXPERTS = 128
V4_EXPERTS = 8  # tools/build_tiny_v4.py's default, the matrix's model from 0.21
V4_WARP_NORM_BELOW = "0.21"
# a token's float32 routed weights (order one) alone and in a batch: the same
# arithmetic gives the same bits, so anything past rounding is another token's share
ROUTING_TOLERANCE = 1e-6


def narrowed(job: Job, min_version: str = "0", below_version: str = "99", **changes) -> Job:
    """``job`` changed, on the releases both its range and the one given hold."""
    from packaging.version import Version

    return replace(
        job,
        min_version=max(job.min_version, min_version, key=Version),
        below_version=min(job.below_version, below_version, key=Version),
        **changes,
    )


def wide_below_warp_norm(jobs: list[Job]) -> list[Job]:
    """Each job twice: from 0.21 as written (the 8-expert model), below it serving the
    128-expert model, whose tokens 0.20's hash routing keeps apart."""
    split = []
    for job in jobs:
        args = [str(TINY_V4_WIDE) if arg == str(TINY_V4) else arg for arg in job.args]
        split.append(narrowed(job, min_version=V4_WARP_NORM_BELOW))
        split.append(narrowed(job, args=args, below_version=V4_WARP_NORM_BELOW))
    return split


def v4_matrix_jobs(v4: list[str], v1_env: dict, overlay_env: dict) -> list[Job]:
    """The lossless matrix eager (``v4-matrix``) and with CUDA graphs (in
    ``v4-compiled``, whose 256 tokens alone are too few to judge against stock's
    compiled engine: its own answers stray up to 6.3 nats from its picks)."""
    # the --prompts and --max-tokens given later win (argparse keeps the last)
    matrix = [*v4, "--prompts", *V4_MATRIX_PROMPTS, *V4_MATRIX]
    jobs = []
    for prefix, mode, part in (("v4-matrix", [], "v4-matrix"), *V4_MATRIX_COMPILED):
        reference = [*matrix, *mode, "--margins"]
        jobs.append(Job(f"{prefix}-reference", reference, False, v1_env, part=part))
        for n in V4_MATRIX_SPEC_TOKENS:
            spec = [*matrix, *mode, "--dspark", str(TINY_V4), "--spec-tokens", n]
            jobs.append(Job(f"{prefix}-n{n}", spec, True, overlay_env, part=part))
    routing = Job("v4-hash-routing", [HASH_ROUTING], False, v1_env, part="v4-matrix", timeout=180)
    return [*wide_below_warp_norm(breakable_split(jobs, overlay_env)), routing]


def breakable_split(jobs: list[Job], overlay_env: dict) -> list[Job]:
    """From 0.23 the route drops breakable piecewise graphs (dspark.v4_cudagraphs), so
    the compiled reference there runs in the mode the route serves, decode-only full
    graphs: stock's own breakable piecewise engine strays up to 6.3 nats from its
    picks, a calibration too loose to judge by. Stock's default mode stays as the
    ``-piecewise`` reference, beside the engines that keep those graphs, for the
    drafter too or the target alone, to follow the fault that made the route drop
    them. Those engines come first: their capture is the long one, and the engines
    start in list order, a few at once."""
    split = []
    for job in jobs:
        if job.part != "v4-compiled":
            split.append(job)
        elif not job.overlay:
            decode_only = [*job.args, *V4_ROUTE_GRAPHS]
            split.append(narrowed(job, name=f"{job.name}-piecewise", min_version=V4_BREAKABLE_FROM))
            split.append(narrowed(job, below_version=V4_BREAKABLE_FROM))
            split.append(narrowed(job, args=decode_only, min_version=V4_BREAKABLE_FROM))
        else:
            split.extend(
                narrowed(
                    job,
                    name=f"{job.name}{suffix}",
                    env={**overlay_env, V4_PIECEWISE_SETTING: choice},
                    min_version=V4_BREAKABLE_FROM,
                )
                for choice, suffix in V4_PIECEWISE_KEPT.items()
            )
            split.append(job)
    return split


# V4 engines not eager, one CUDA-graph mode each. vLLM 0.26.0 turns torch.compile off
# for DeepSeek-V4 (its breakable CUDA graphs instead), so there NONE runs eager's code
# and PIECEWISE graphs with the attention left eager; where a release compiles V4,
# NONE is torch.compile alone
V4_GRAPH_MODES = {
    "compile-only": ["--cudagraph-mode", "NONE"],
    "piecewise": ["--cudagraph-mode", "PIECEWISE"],
}


def v4_jobs() -> list[Job]:
    """The shrunken DeepSeek-V4 (real widths, real checkpoint format), bfloat16 with
    its fp8 attention and fp4 experts, eager and compiled, on the V1 runner; and with
    its own DSpark draft where stock vLLM has one (0.26.0: the V2 runner's)."""
    v4 = [GENERATE, str(TINY_V4), *V4_ENGINE, *TOKENS, *KV]
    # every V4 engine scores its own answers (teacher_forced_lossless)
    v4 += ["--prompts", *V4_PROMPTS, "--teacher-forced"]
    # the references record each greedy pick's top-two gap (NEAR_TIE)
    reference = [*v4, "--margins"]
    in_checkpoint = ["--dspark", str(TINY_V4), "--spec-tokens", "5"]
    # vLLM's start-up JIT-builds every DeepGEMM shape it may meet (2,541 here,
    # about 30 minutes on the H200); the tiny model's few shapes build on first use
    v1_env, v2_env = ({**env, "VLLM_DEEP_GEMM_WARMUP": "skip"} for env in (V1, V2))
    # the overlay's V1 route for the in-checkpoint draft is opt-in while unproven;
    # its speculative warm-up would meet every batch shape, each a DeepGEMM build
    overlay_env = {**v1_env, "VLLM_V4_DSPARK_V4_ON_V1": "on", "VLLM_V4_DSPARK_WARMUP": "off"}
    jobs = [
        Job("v4-nospec-eager", reference, False, v1_env, part="v4"),
        # the same engine again: what numeric noise alone does to greedy picks
        Job("v4-nospec-eager-again", [*v4, "--count-syncs"], False, v1_env, part="v4"),
        Job("v4-nospec", [*reference, "--no-eager"], False, v1_env, part="v4-compiled"),
        # which graph mode moves stock's answers off its own picks (FULL_AND_PIECEWISE:
        # up to 6.3 nats, eager 1.1), beside the eager reference, in its call
        *(
            Job(f"v4-nospec-{name}", [*reference, "--no-eager", *mode], False, v1_env, part="v4")
            for name, mode in V4_GRAPH_MODES.items()
        ),
        # the V2 runner's own numbers, which stock DSpark on V2 must equal
        Job("v4-nospec-v2", reference, False, v2_env, min_version="0.26", part="v4"),
        Job("v4-dspark-stock", [*v4, *in_checkpoint], False, v2_env, min_version="0.26", part="v4"),
        Job(
            "v4-dspark-overlay-v1",
            [*v4, *in_checkpoint, "--count-syncs"],
            True,
            overlay_env,
            part="v4",
        ),
        # every served block against its recompute on the committed prefix
        Job(
            EXACT_JOBS[0],
            [RECORD_DRAFTS, str(TINY_V4), str(TINY_V4), *V4_ENGINE, *KV, "--spec-tokens", "5"]
            + [
                "--max-tokens",
                "24",
                "--prompts",
                *V4_PROMPTS[:4],
                "--recompute",
                "--served-context",
                "--sparse-logits",
            ],
            True,
            overlay_env,
            part="v4",
        ),
        # its own engine: the batch-64 round meets many new token counts (a TileLang
        # build each), which must not cost the checked run its record
        Job(
            "v4-dspark-overlay-v1-steps",
            [*v4, *in_checkpoint, "--prompts", V4_PROMPTS[0], "--step-times", *STEP_BATCHES],
            True,
            overlay_env,
            part="v4",
        ),
        # refused at configuration, before the model loads
        *(
            Job(
                f"v4-dspark-overlay-v1-n{n}",
                [*v4, "--dspark", str(TINY_V4), "--spec-tokens", n],
                True,
                overlay_env,
                part="v4",
                timeout=120,
            )
            for n in V4_REFUSED_SPEC_TOKENS
        ),
        Job(
            "v4-dspark-overlay-v1-compiled",
            [*v4, *in_checkpoint, "--no-eager"],
            True,
            overlay_env,
            part="v4-compiled",
        ),
    ]
    compiled = [job for job in jobs if job.part == "v4-compiled"]
    jobs = [job for job in jobs if job.part != "v4-compiled"] + wide_below_warp_norm(compiled)
    return jobs + v4_matrix_jobs(v4, v1_env, overlay_env)


def dense_jobs(dspark: list[str], qwen3: list[str], compiled_qwen3: list[str]) -> list[Job]:
    compiled_llama = [GENERATE, str(LLAMA), "--no-eager", "--dtype", "bfloat16", *TOKENS, *KV]
    # a drafting method vLLM runs under async scheduling on the GPU (ngram is refused)
    eagle = [GENERATE, str(LLAMA), "--eagle", str(MODELS / "tiny-llama-eagle"), *TOKENS, *KV]
    inspect = [INSPECT, str(LLAMA), "--dtype", "bfloat16", *KV]
    # FlashInfer takes head sizes 64, 128 and 256; the tiny Llama's are 32
    flashinfer = [*inspect, "--attention-backend", "FLASHINFER", "--head-dim", "64"]
    sampled = [*compiled_qwen3, "--max-tokens", "3", "--prompts", "def main(", *KV]
    sampled += ["--repeat", str(SAMPLES), "--temperature"]
    serve = [SERVE, str(QWEN3), *KV]
    plain = [GENERATE, str(PLAIN_LLAMA), "--no-eager", "--dtype", "bfloat16", *TOKENS, *KV]
    # six requests of 32, 27, ... 7 tokens: the batch shrinks as they finish
    shrinking = [*qwen3, "--repeat", "2", "--stagger", "5"]
    return [
        Job("llama-v1-stock", compiled_llama, False, V1),
        Job("llama-v1-overlay", compiled_llama, True, V1),
        Job("llama-v2-stock", compiled_llama, False, V2),
        Job("llama-v2-overlay", compiled_llama, True, V2),
        Job("qwen3-nospec", qwen3, False, V1),
        Job("dspark-v1", [*qwen3, *dspark], True, V1),
        Job(
            "dspark-v1-loop",
            [*qwen3, *dspark],
            True,
            {**V1, "VLLM_V4_DSPARK_MARKOV_KERNEL": "torch"},
        ),
        Job(
            "dspark-v1-eager-kernel",
            [*qwen3, *dspark],
            True,
            {**V1, "VLLM_V4_DSPARK_MARKOV_KERNEL": "eager"},
        ),
        Job("dspark-default-runner", [*qwen3, *dspark], True, min_version="0.25"),
        Job(
            "dspark-v1-async-confidence",
            [*qwen3, *dspark, "--async-scheduling"],
            True,
            {**V1, "VLLM_V4_DSPARK_VERIFY": "confidence"},
        ),
        # VLLM_COMPILE with FULL_AND_PIECEWISE (the default) on a model with
        # nothing compiled: what the runner settles on, stock and patched
        Job("plain-llama-stock", plain, False, V1, plugins=(str(PLAIN_PLUGIN),)),
        Job("plain-llama-overlay", plain, True, V1, plugins=(str(PLAIN_PLUGIN),)),
        Job("llama-fp32", [GENERATE, str(LLAMA), *TOKENS, *KV], False, V1),
        Job("eagle-sync-overlay", [*eagle, "--sync-scheduling"], True, V1),
        Job("eagle-async-stock", [*eagle, "--async-scheduling"], False, V1),
        Job("eagle-async-overlay", [*eagle, "--async-scheduling"], True, V1),
        Job(
            "eagle-async-probe-stock",
            [*eagle, "--async-scheduling"],
            False,
            {**V1, **PROBE_DELAY},
            plugins=(str(STAGING_PLUGIN),),
        ),
        Job(
            "eagle-async-probe-overlay",
            [*eagle, "--async-scheduling"],
            True,
            {**V1, **PROBE_DELAY},
            plugins=(str(STAGING_PLUGIN),),
        ),
        Job("dp-dummy-stock", inspect, False, V1),
        Job("dp-dummy-overlay", inspect, True, V1),
        Job("dp-dummy-flashinfer-stock", flashinfer, False, V1, part="extra"),
        Job("dp-dummy-flashinfer-overlay", flashinfer, True, V1, part="extra"),
        Job("t1-nospec", [*sampled, "1.0"], False, V1, part="extra"),
        Job("t1-dspark", [*sampled, "1.0", *dspark], True, V1, part="extra"),
        Job(
            "t1-dspark-probabilistic",
            [*sampled, "1.0", *dspark, "--draft-sample-method", "probabilistic"],
            True,
            V1,
            min_version="0.24",
            part="extra",
        ),
        Job("control-nospec", [*sampled, CONTROL_TEMPERATURE], False, V1, part="extra"),
        Job("serve-plain", serve, False, part="extra"),
        Job("serve-dspark", [*serve, "--dspark", str(DRAFT)], True, V1, part="extra"),
        Job(
            "bench-dspark-loop",
            [*compiled_qwen3, *BENCH, *KV, *dspark],
            True,
            {**V1, "VLLM_V4_DSPARK_MARKOV_KERNEL": "torch"},
            below_version="0.21",
            part="extra",
        ),
        # 0.20.2's DSpark engines die in the warm-up's shrinking batch (async
        # scheduling, compiled, CUDA graphs): the same without async, and eagerly
        Job(
            "dspark-v1-sync",
            [*qwen3, *dspark, "--sync-scheduling"],
            True,
            V1,
            below_version="0.21",
        ),
        Job(
            "dspark-v1-eager",
            [GENERATE, str(QWEN3), *TOKENS, *KV, *dspark],
            True,
            V1,
            below_version="0.21",
        ),
        # which side of the overlay the shrinking-batch fault is on: vLLM's own
        # DFlash on the same batch, and DSpark on it outside the warm-up, with
        # every launch synchronous so the trace names the faulting kernel
        Job("qwen3-nospec-stagger", [*shrinking], False, V1, below_version="0.21"),
        Job(
            "dflash-stock-stagger",
            [*shrinking, "--dflash", str(DFLASH_DRAFT), "--spec-tokens", "4"],
            False,
            V1,
            below_version="0.21",
        ),
        Job(
            "dspark-v1-stagger",
            [*shrinking, *dspark],
            True,
            {**V1, "VLLM_V4_DSPARK_WARMUP": "off"},
            below_version="0.21",
        ),
        # whether the fault needs the target's full CUDA graphs: piecewise ones only
        Job(
            "dflash-stock-stagger-piecewise",
            [*shrinking, *PIECEWISE, "--dflash", str(DFLASH_DRAFT), "--spec-tokens", "4"],
            False,
            V1,
            below_version="0.21",
        ),
        # flex_graphs: the same DFlash through the overlay, whose patch keeps the
        # float32 target's FlexAttention out of multi-token full graphs
        Job(
            "dflash-overlay-stagger",
            [*shrinking, "--dflash", str(DFLASH_DRAFT), "--spec-tokens", "4"],
            True,
            V1,
            below_version="0.21",
        ),
        # in bfloat16 the target takes FlashAttention, not FlexAttention
        Job("qwen3-nospec-stagger-bf16", [*shrinking, *BF16], False, V1, below_version="0.21"),
        Job(
            "dflash-stock-stagger-bf16",
            [*shrinking, *BF16, "--dflash", str(DFLASH_DRAFT), "--spec-tokens", "4"],
            False,
            V1,
            below_version="0.21",
        ),
        # with flex_graphs the float32 timing run on 0.20.x stops at Dynamo's recompile
        # limit in FlexAttention's compiled kernel: whether vLLM's DFlash does the same
        # with piecewise graphs and no overlay, and whether DSpark in bfloat16
        # (FlashAttention) runs and times
        Job(
            "bench-dflash-stock-piecewise",
            [*compiled_qwen3, *BENCH, *KV, *PIECEWISE, "--dflash", str(DFLASH_DRAFT)]
            + ["--spec-tokens", "4"],
            False,
            {**V1, "TORCH_LOGS": "recompiles"},  # the guard each recompile failed
            below_version="0.21",
            alone=True,
        ),
        Job("qwen3-nospec-bf16", [*qwen3, *BF16], False, V1, below_version="0.21"),
        Job("dspark-v1-bf16", [*qwen3, *BF16, *dspark], True, V1, below_version="0.21"),
        Job(
            "bench-dspark-bf16",
            [*compiled_qwen3, *BENCH, *KV, *BF16, *dspark],
            True,
            V1,
            below_version="0.21",
            alone=True,
        ),
        # and whether it needs the full graph of mixed batches, or the decode one is enough
        Job(
            "dflash-stock-stagger-full-decode",
            [*shrinking, *FULL_DECODE_ONLY, "--dflash", str(DFLASH_DRAFT), "--spec-tokens", "4"],
            False,
            V1,
            below_version="0.21",
        ),
        Job(
            "dspark-v1-stagger-piecewise",
            [*shrinking, *PIECEWISE, *dspark],
            True,
            V1,
            below_version="0.21",
        ),
        Job(
            "dspark-v1-stagger-blocking",
            [*shrinking, *dspark],
            True,
            {**V1, "VLLM_V4_DSPARK_WARMUP": "off", "CUDA_LAUNCH_BLOCKING": "1"},
            below_version="0.21",
        ),
        Job(
            "bench-dspark-blocking",
            [*compiled_qwen3, "--max-tokens", "64", "--bench-batches", "16", *KV, *dspark],
            True,
            {**V1, "CUDA_LAUNCH_BLOCKING": "1"},
            below_version="0.21",
            part="extra",
        ),
        Job("embedding-stock", [EMBEDDING], False),
        Job("embedding-overlay", [EMBEDDING], True),
        Job("embedding-stock-compiled", [EMBEDDING, "--compiled"], False),
        Job("embedding-overlay-compiled", [EMBEDDING, "--compiled"], True),
        Job(
            "bench-dflash-stock",
            [*compiled_qwen3, *BENCH, *KV, "--dflash", str(DFLASH_DRAFT), "--spec-tokens", "4"],
            False,
            V1,
            min_version="0.24",
            part="extra",
            alone=True,
        ),
        Job(
            "bench-nospec-heavy",
            [*compiled_qwen3, *BENCH, *KV],
            False,
            {**V1, **HEAVY_TARGET},
            part="perf",
            alone=True,
            plugins=(str(HEAVY_PLUGIN),),
        ),
        Job(
            "bench-dspark-heavy",
            [*compiled_qwen3, *BENCH, *KV, *dspark],
            True,
            {**V1, **HEAVY_TARGET},
            part="perf",
            alone=True,
            plugins=(str(HEAVY_PLUGIN),),
        ),
        Job("bench-nospec", [*compiled_qwen3, *BENCH, *KV], False, V1, alone=True),
        Job("bench-dspark", [*compiled_qwen3, *BENCH, *KV, *dspark], True, V1, alone=True),
    ]


STOCK_FIGURE = "stock vLLM, no overlay: "  # opens the figures of checks of stock alone
FIRST_REQUEST_STOCK = (
    "no speculation (stock vLLM, no overlay): first request within 1.2x of the steady state"
    " (batch 1)"
)

# failures of stock vLLM: the check that shows one without the overlay, the text
# its failing checks' figures share, and what it is; record.py marks those checks
UPSTREAM_FAULTS = {
    FIRST_REQUEST_STOCK: (
        STOCK_FIGURE,
        "vLLM alone, without speculation: its own first request is slower than its " "steady state",
    ),
    "stock dflash (no overlay): shrinking batch equals no speculation": (
        "illegal memory access",
        "vLLM's own DFlash dies the same way without the overlay: an illegal memory "
        "access in the target's CUDA-graph replay once a speculative batch shrinks "
        "(compiled with CUDA graphs; eager runs pass)",
    ),
    "stock dflash (diagnostic, no overlay): timing run with piecewise CUDA graphs": (
        RECOMPILE_LIMIT,
        "vLLM's own DFlash stops the same way without the overlay: a float32 target on "
        "0.20.x runs FlexAttention, whose compiled kernel meets Dynamo's recompile limit "
        "(16) as speculative batches change shape",
    ),
}


# JIT-built kernels, kept across calls and sessions: the V4 jobs spend minutes building
# TileLang's mHC kernels, DeepGEMM's GEMMs, Triton's kernels and FlashInfer's sparse MLA
# (about 100 s per engine start on a fresh machine). The folder lives in the checkout
# (ignored); the suite hands it back packed, as $OUT/kernel-cache.tar.gz or, when that
# is larger than a file that comes back, in parts (kernel-cache.tar.gz.part0, ...).
# A session carries the parts to a fresh machine in .cache/gpu-kernels-packed, where
# tools/gpu/run.sh unpacks them (packed, they are a seventh of the folder's size, and a
# call carries at most 64 MiB). Keyed by content, so stock and overlay engines share
# nothing but identical kernels.
KERNEL_CACHE = REPO / ".cache" / "gpu-kernels"
KERNEL_CACHE_LIMIT = 15 * 2**20  # a file back from the machine is at most 16 MiB
KERNEL_CACHE_PARTS = 3  # with the results and logs, under the 64 MiB that come back


def kernel_cache_env() -> dict[str, str]:
    return {
        "TILELANG_CACHE_DIR": str(KERNEL_CACHE / "tilelang"),
        "DG_JIT_CACHE_DIR": str(KERNEL_CACHE / "deep_gemm"),
        "TRITON_CACHE_DIR": str(KERNEL_CACHE / "triton"),
        # FlashInfer keeps its builds under $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer
        "FLASHINFER_WORKSPACE_BASE": str(KERNEL_CACHE / "flashinfer"),
    }


def vllm_cache_root(job: Job, scratch: Path) -> Path:
    """Where a job's vLLM keeps its model-class inspections and autotune results.

    Eager V4 engines keep theirs in the kernel cache, so later calls of a hold skip
    the front end's class inspections (about 25 s each, one subprocess per class);
    the overlay's apart from stock's, because the overlay's processes inspect patched
    classes. Every other job keeps a folder of this call, where the timing jobs reuse
    the compiled graphs of the jobs before them."""
    if job.part in ("v4", "v4-matrix", "v4-dp2"):
        return KERNEL_CACHE / ("vllm-overlay" if job.overlay else "vllm-stock")
    return scratch / "vllm-cache"


def hand_back_kernel_cache(out: Path) -> str:
    """The kernel cache as one archive under ``out``, split into parts where it is
    larger than a file that comes back; nothing where even the parts are too many."""
    if not KERNEL_CACHE.is_dir():
        return "no kernel cache"
    archive = out / "kernel-cache.tar.gz"
    try:
        with tarfile.open(archive, "w:gz") as packed:
            packed.add(KERNEL_CACHE, arcname="gpu-kernels")
    except OSError as error:
        # another release's suite in the same hold may be building into the folder
        # (a temporary file gone between listing and reading); its own hand-back,
        # later, carries the whole cache
        archive.unlink(missing_ok=True)
        return f"kernel cache not handed back: {error}"
    size = archive.stat().st_size
    if size <= KERNEL_CACHE_LIMIT:
        return f"kernel cache handed back: {size / 2**20:.1f} MiB packed"
    parts = -(-size // KERNEL_CACHE_LIMIT)
    if parts > KERNEL_CACHE_PARTS:
        archive.unlink()
        return f"kernel cache {size / 2**20:.1f} MiB packed: too large to hand back"
    with open(archive, "rb") as whole:
        for index in range(parts):
            part = out / f"kernel-cache.tar.gz.part{index}"
            part.write_bytes(whole.read(KERNEL_CACHE_LIMIT))
    archive.unlink()
    return f"kernel cache handed back: {size / 2**20:.1f} MiB packed, in {parts} parts"


def run_job(job: Job, scratch: Path, deadline: float) -> Outcome:
    status_dir = scratch / "status" / job.name
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_V4_")}
    env.update(job.env, VLLM_ENABLE_V1_MULTIPROCESSING="1", HF_HUB_OFFLINE="1")
    env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with local functions
    site = env.get("VLLM_GPU_SITE", "")
    fixes = str(SITE_FIXES) if job.part.startswith("v4") else ""
    paths = (str(REPO) if job.overlay else "", *job.plugins, fixes, site)
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    if job.overlay:
        env["VLLM_V4_PATCHES_STATUS_DIR"] = str(status_dir)
    env["VLLM_CACHE_ROOT"] = str(vllm_cache_root(job, scratch))
    env.update(kernel_cache_env())
    env["PYTHONFAULTHANDLER"] = "1"  # a timed-out job's processes print their stacks
    started = time.perf_counter()
    budget = min(job.timeout, deadline - started)
    if budget < 30:
        return Outcome(None, [], "TIMEOUT: the suite's deadline came first", 0.0, -9)
    # its own session, so a timeout kills the engine processes it started too: an
    # orphaned engine core keeps its GPU context and competes with the jobs after it
    process = subprocess.Popen(
        [sys.executable, *job.args],
        env=env,
        cwd=scratch,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=budget)
        log, code = stdout + stderr, process.returncode
    except subprocess.TimeoutExpired:
        stdout, stderr = stop_with_stacks(process)
        log, code = "\n".join([stdout, stderr, f"TIMEOUT after {budget:.0f}s"]), -9
    found = [line for line in log.splitlines() if line.startswith("RESULT ")]
    result = json.loads(found[-1].removeprefix("RESULT ")) if found else None
    statuses = [json.loads(p.read_text()) for p in sorted(status_dir.glob("*.json"))]
    return Outcome(result, statuses, log, time.perf_counter() - started, code)


def stop_with_stacks(process: subprocess.Popen) -> tuple[str, str]:
    """Abort a job's processes so that each prints every thread's Python stack
    (faulthandler) where it hung, then kill whatever is left; returns its output."""
    os.killpg(process.pid, signal.SIGABRT)
    try:
        return process.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        return process.communicate()


# -- checks -------------------------------------------------------------------
# each takes the outcomes by job name and returns (passed, figure); a job that did
# not run or failed fails every check that reads it, with its last error line

Check = Callable[[dict[str, Outcome]], tuple[bool, str]]


class Missing(Exception):
    pass


class NotRun(Exception):
    pass


class NotApplicable(Exception):
    """The release cannot answer this check: a verdict recorded earlier is void."""


class NotSaved(Exception):
    """A recorded run lacks what this check reads; its recorded verdict stands."""


# A result larger than this is left out of the results file, which must come back
# from the machine (16 MiB a file): the exact job's draft logits (94 blocks and their
# recomputes over a 4,096-token vocabulary) took 29 MB. Its log keeps the RESULT line,
# and the checks that read it were answered on the machine.
RESULT_LIMIT = 2 * 2**20
OMITTED = "omitted"


def saved_results(outcomes: dict[str, Outcome]) -> dict[str, dict | None]:
    saved = {}
    for name, outcome in outcomes.items():
        size = len(json.dumps(outcome.result))
        saved[name] = (
            {OMITTED: f"{size} bytes, over the results file's limit: its log has it"}
            if size > RESULT_LIMIT
            else outcome.result
        )
    return saved


def statuses_of(outcomes: dict[str, Outcome], job: str) -> list[dict]:
    result_of(outcomes, job)
    if outcomes[job].statuses is None:
        raise NotSaved(job)
    return outcomes[job].statuses


def all_ran(outcomes: dict[str, Outcome], *names: str) -> None:
    """A check comparing jobs is unanswered, not failed, when one of them did not
    run, even if another of them failed."""
    for name in names:
        if name not in outcomes:
            raise NotRun(f"{name} not run on this release")


def result_of(outcomes: dict[str, Outcome], name: str) -> dict:
    outcome = outcomes.get(name)
    if outcome is None:
        raise NotRun(f"{name} not run on this release")
    if outcome.result is not None and OMITTED in outcome.result:
        raise NotSaved(f"{name}: {outcome.result[OMITTED]}")
    if outcome.result is None:
        errors = [line for line in outcome.log.splitlines() if ERROR_LINE.search(line)]
        # the device fault itself, where there is one, not the engine's death after it
        root = [line for line in errors if ROOT_ERROR.search(line)]
        # else the engine core's own first error, not the front end's word on its death
        core = [
            line
            for line in errors
            if "EngineCore" in line and " ERROR " in line and STARTUP_DEATH not in line
        ]
        first = root or core
        line = (first[0] if first else (errors or ["no RESULT"])[-1])[-300:]
        raise Missing(f"{name} exited {outcome.returncode}: {line}")
    return outcome.result


def same_tokens(reference: str, other: str) -> Check:
    def check(outcomes: dict[str, Outcome]) -> tuple[bool, str]:
        all_ran(outcomes, reference, other)
        ref, got = result_of(outcomes, reference), result_of(outcomes, other)
        equal = sum(a == b for a, b in zip(ref["token_ids"], got["token_ids"], strict=True))
        return equal == len(ref["token_ids"]), f"{equal}/{len(ref['token_ids'])} sequences equal"

    return check


def roles_and_summaries(job: str) -> Check:
    def check(outcomes: dict[str, Outcome]) -> tuple[bool, str]:
        roles = {doc["role"] for doc in statuses_of(outcomes, job)}
        lines = re.findall(r"vllm_v4_patches \[([\w-]+) pid \d+, vLLM", outcomes[job].log)
        ok = ROLES <= roles and ROLES <= set(lines)
        return ok, f"status roles {sorted(roles)}; summary lines from {sorted(set(lines))}"

    return check


# a greedy pick whose top-two logprob gap (nats) in the reference is below this is a
# near-tie: numeric noise between engines that run the target in other batch shapes
# can flip such picks (random weights, MXFP4 experts and fp8 attention), so a
# comparison stops there
NEAR_TIE = 0.1


def divergences(reference: dict, other: dict) -> list[tuple[int, float | None]]:
    """Per sequence that differs: the first differing position and the reference's
    top-two gap there (None where the reference recorded no gaps)."""
    found = []
    margins = reference.get("margins") or [None] * len(reference["token_ids"])
    for ref, got, gaps in zip(reference["token_ids"], other["token_ids"], margins, strict=True):
        pairs = enumerate(zip(ref, got, strict=True))
        position = next((i for i, (a, b) in pairs if a != b), None)
        if position is not None:
            found.append((position, None if gaps is None else gaps[position]))
    return found


def same_until_near_tie(reference: str, other: str) -> Check:
    """Greedy tokens equal, except that a sequence may part from the reference at a
    pick the reference made by less than NEAR_TIE nats (and is not compared after)."""

    def check(outcomes: dict[str, Outcome]) -> tuple[bool, str]:
        all_ran(outcomes, reference, other)
        return near_tie_verdict(result_of(outcomes, reference), result_of(outcomes, other))

    return check


def near_tie_verdict(ref: dict, got: dict) -> tuple[bool, str]:
    """``same_until_near_tie`` on two records of ``token_ids`` (and the reference's
    ``margins``)."""
    parted = divergences(ref, got)
    total = sum(len(tokens) for tokens in ref["token_ids"])
    compared = total - sum(
        len(ref["token_ids"][0]) - position for position, _ in parted
    )  # equal lengths: ignore_eos with one max_tokens
    ok = all(gap is not None and gap < NEAR_TIE for _, gap in parted)
    where = [(p, None if gap is None else round(gap, 4)) for p, gap in parted]
    return ok, (
        f"{len(ref['token_ids']) - len(parted)}/{len(ref['token_ids'])} sequences equal; "
        f"parted at (position, reference gap in nats) {where}; "
        f"{compared}/{total} tokens compared"
    )


def teacher_forced(record: dict, name: str) -> dict:
    if "teacher_forced" not in record:
        raise NotSaved(f"{name}: a run from before generate.py scored answers")
    scored = record["teacher_forced"]
    if not scored:
        raise Missing(f"{name} scored no answers (run with --teacher-forced)")
    if "error" in scored:
        raise Missing(f"{name}: scoring failed: {scored['error']}")
    return scored


def flat_gaps(gaps: list[list[float]]) -> list[float]:
    return [gap for answer in gaps for gap in answer]


def largest_gap(gaps: list[list[float]]) -> float:
    return max(flat_gaps(gaps), default=0.0)


# a gap past one of these shares of the calibrating engines' own gaps is a stray (the
# one where the measure sees best); the largest gap alone is no bound: two runs of one
# engine differ there by more than a let-through token (0.20.2's five reference runs
# of 2026-12-07 ranged 1.535-2.219 nats)
STRAY_QUANTILES = (0.99, 0.995, 0.999)
# the one-sided chance below which a rate of strays differs from stock's
STRAY_ALPHA = 1e-3
# the rate test must fail, with at least LOSSY_POWER, a decoder that lets another
# answer's token (the control's) through at LOSSY_SHARE of positions: one that could
# not is no evidence of losslessness. Answers swapped behind an 815-token shared
# prefix stay near each other's picks, so that phase's control is the weakest
LOSSY_SHARE = 0.5
LOSSY_POWER = 0.9


def stray_threshold(calibration: list[float], quantile: float) -> float:
    """The calibrating engines' gap at ``quantile``, never below NEAR_TIE."""
    if not calibration:
        return NEAR_TIE
    ordered = sorted(calibration)
    return max(NEAR_TIE, ordered[int(quantile * (len(ordered) - 1))])


def excess_chance(strays: int, tokens: int, stock_strays: int, stock_tokens: int) -> float:
    """The chance that ``tokens`` hold at least ``strays`` of the strays of both
    samples when every token strays at one rate: given the total, each stray falls in
    ``tokens`` by its share of the tokens (the exact conditional test of two Poisson
    counts). With no stock tokens to compare, any stray is an excess."""
    if stock_tokens == 0:
        return 0.0 if strays else 1.0
    return binomial_tail(strays, strays + stock_strays, tokens / (tokens + stock_tokens))


def binomial_tail(count: int, tokens: int, rate: float) -> float:
    """The chance of at least ``count`` of ``tokens`` when each is one at ``rate``."""
    if count <= 0:
        return 1.0
    if rate <= 0.0 or count > tokens:
        return 0.0
    if rate >= 1.0:
        return 1.0

    def term(k: int) -> float:
        ways = math.lgamma(tokens + 1) - math.lgamma(k + 1) - math.lgamma(tokens - k + 1)
        return math.exp(ways + k * math.log(rate) + (tokens - k) * math.log1p(-rate))

    return min(1.0, sum(term(k) for k in range(count, tokens + 1)))


def fewest_failing(tokens: int, stock: int, stock_tokens: int) -> int:
    """The fewest strays among ``tokens`` the rate test fails (``tokens + 1``: none)."""
    low, high = 0, tokens + 1
    while low < high:  # excess_chance falls as the strays grow
        middle = (low + high) // 2
        if excess_chance(middle, tokens, stock, stock_tokens) < STRAY_ALPHA:
            high = middle
        else:
            low = middle + 1
    return low


def lossy_power(threshold: float, calibration: list, control: list, tokens: int) -> float:
    """The chance that the rate test at ``threshold`` fails ``tokens`` answer tokens
    of a decoder as noisy as stock that lets another answer's token (``control``)
    through at LOSSY_SHARE of positions."""
    stock = sum(gap > threshold for gap in calibration)
    stock_rate = stock / len(calibration) if calibration else 0.0
    control_rate = sum(gap > threshold for gap in control) / len(control) if control else 0.0
    lossy_rate = (1 - LOSSY_SHARE) * stock_rate + LOSSY_SHARE * control_rate
    return binomial_tail(fewest_failing(tokens, stock, len(calibration)), tokens, lossy_rate)


def teacher_verdict(scored: dict, calibration: list[float]) -> tuple[bool, str]:
    """Lossless under teacher forcing (``generate.py --teacher-forced``): the answers
    stray past a high quantile of stock's gaps no more often than stock's own answers
    do (``calibration``: their gaps; none: no stray past NEAR_TIE at all), and the
    measure can see wrong tokens: the test fails answers with LOSSY_SHARE of their
    tokens taken from another prompt's answers (the control) with LOSSY_POWER. The
    quantile is the one of STRAY_QUANTILES where the test sees best, chosen from
    stock's gaps and the control's alone (a rate test at STRAY_ALPHA)."""
    gaps, control = flat_gaps(scored["gaps"]), flat_gaps(scored["control_gaps"])
    power, threshold = max(
        (lossy_power(threshold, calibration, control, len(gaps)), threshold)
        for threshold in {stray_threshold(calibration, q) for q in STRAY_QUANTILES}
    )
    stock = sum(gap > threshold for gap in calibration)
    strays = sum(gap > threshold for gap in gaps)
    caught = sum(gap > threshold for gap in control)
    excess = excess_chance(strays, len(gaps), stock, len(calibration))
    ok = excess >= STRAY_ALPHA and power >= LOSSY_POWER
    not_own = sum(gap > 0 for gap in gaps)
    return ok, (
        f"{not_own}/{len(gaps)} tokens not the target's own pick, {strays} past "
        f"{threshold:.3f} nats against stock's {stock}/{len(calibration)} (chance "
        f"{excess:.2g}); control: {caught}/{len(control)} past, a {LOSSY_SHARE:.0%} "
        f"lossy mix failed with chance {power:.2f}; largest gap "
        f"{max(gaps, default=0.0):.3f}, stock's {max(calibration, default=0.0):.3f}"
    )


def teacher_forced_lossless(
    job: str, calibrators: tuple[str, ...], where_run: tuple[str, ...] = ()
) -> Check:
    """Lossless where token-for-token equality cannot show it: each answer of ``job``
    scored by its own engine's target in one prefill of prompt and answer. A draft
    token let through against the target shows the target's preference as a gap; a
    near-tie flipped by a verification forward's shapes shows a small one. Stock
    vLLM's own engines on the same measure calibrate it (``teacher_verdict``), their
    answers pooled (``calibrators``: no speculation; ``where_run``: those counted on
    the releases that run them, such as stock's own DSpark)."""

    def check(outcomes: dict[str, Outcome]) -> tuple[bool, str]:
        names = [*calibrators, *(name for name in where_run if name in outcomes)]
        all_ran(outcomes, job, *names)
        stock_gaps = {
            name: teacher_forced(result_of(outcomes, name), name)["gaps"] for name in names
        }
        calibration = [gap for gaps in stock_gaps.values() for gap in flat_gaps(gaps)]
        scored = teacher_forced(result_of(outcomes, job), job)
        ok, figure = teacher_verdict(scored, calibration)
        stock = ", ".join(f"{name} {largest_gap(gaps):.3f}" for name, gaps in stock_gaps.items())
        return ok, f"{figure}; stock's largest gaps: {stock}"

    return check


# a served block's logits may differ from its recompute's by at most this share of
# what a wrong context (another committed prefix) moves them
EXACT_SHARE = 0.1
# the exact-drafting job, then its name in runs before it recomputed from served context
EXACT_JOBS = ("v4-dspark-overlay-v1-exact-served", "v4-dspark-overlay-v1-exact")


def slot_entries(slot: list[float] | dict) -> dict[int, float]:
    """A slot's logits by token id: a dense list, or ``--sparse-logits``' non-zero
    entries (the rest are zero)."""
    if isinstance(slot, dict):
        return dict(zip(slot["ids"], slot["values"], strict=True))
    return dict(enumerate(slot))


def slot_differences(record: dict, twin: dict) -> list[float]:
    """Each slot's largest logit difference between two blocks."""
    differences = []
    for slot, other in zip(record["base_logits"], twin["base_logits"], strict=True):
        mine, theirs = slot_entries(slot), slot_entries(other)
        keys = mine.keys() | theirs.keys()
        differences.append(max(abs(mine.get(k, 0.0) - theirs.get(k, 0.0)) for k in keys))
    return differences


def block_differences(record: dict, twin: dict) -> float:
    """The largest difference between two blocks' draft logits."""
    return max(slot_differences(record, twin))


def first_blocks(records: list[dict]) -> dict[tuple, dict]:
    """Each recompute prompt's first block (the one drafted right after its prefill)."""
    first: dict[tuple, dict] = {}
    for record in records:
        first.setdefault(tuple(record["prompt"]), record)
    return first


def is_first(record: dict) -> bool:
    """A request's first drafted block: anchored right after its prompt."""
    return record["anchor_position"] == len(record["prompt"])


def spread(values: list[float]) -> str:
    if not values:
        return "none"
    return f"{min(values):.3g}-{max(values):.3g} ({len(values)})"


def served_context_effect(result: dict) -> str:
    """How far the served context rows moved the recompute's first blocks from the
    ones drafted on the recompute's own target rows (the same prompts, the same
    batch): zero would mean the substitution changed nothing the draft reads."""
    own, served = (first_blocks(result[k]["records"]) for k in ("fresh", "fresh_served"))
    differences = [
        block_differences(own[prompt], record)
        for prompt, record in served.items()
        if prompt in own and own[prompt]["anchor"] == record["anchor"]
    ]
    if not differences:
        return "no recompute block to set against its own-row twin"
    return (
        f"served rows against the recompute's own ({len(differences)} first blocks): "
        f"largest {max(differences):.4g}, median {statistics.median(differences):.4g}"
    )


def drafts_within_noise(job: str) -> Check:
    """Exact drafting judged against the draft's own numeric noise
    (``record_dspark_drafts.py --served-context``). Each served block has two
    recomputes of its committed prefix in one batch: on the recompute's own target
    rows, and on the served rows. The served block and its served-row twin read the
    same context; the two twins differ only by the target's numerics in those rows.
    A serving loop that reads a wrong row, slot or position puts its blocks further
    from their served-row twins than the target's noise puts the twins apart, so the
    median slot difference (served block, served-row twin) must not exceed the median
    (own-row twin, served-row twin). The control, each block against another
    prefix's served-row twin, must exceed that noise, or the measure tells nothing.
    Medians, not maxima: a random-weight draft has heavy tails (with identical inputs
    at another batch shape, a request's first block differed by up to 1.7)."""

    def check(outcomes: dict[str, Outcome]) -> tuple[bool, str]:
        result = result_of(outcomes, job)
        if "fresh_served" not in result:
            raise Missing(f"{job}: no 'fresh_served' recompute in the result")
        own, served = (first_blocks(result[k]["records"]) for k in ("fresh", "fresh_served"))
        triples = [
            (record, own.get(tuple(prefix)), served.get(tuple(prefix)))
            for record, prefix in zip(result["records"], result["prefixes"], strict=True)
        ]
        kept = [
            (r, o, t)
            for r, o, t in triples
            if o is not None and t is not None and r["anchor"] == o["anchor"] == t["anchor"]
        ]
        if len(kept) < 2:
            raise Missing(f"{job}: {len(kept)} blocks with both recomputes to compare")
        loop = [d for r, _, t in kept for d in slot_differences(r, t)]
        noise = [d for _, o, t in kept for d in slot_differences(o, t)]
        shifted = [t for _, _, t in kept[1:]] + [kept[0][2]]
        control = [
            d for (r, _, _), t in zip(kept, shifted, strict=True) for d in slot_differences(r, t)
        ]
        medians = [statistics.median(v) for v in (loop, noise, control)]
        counts = result["fresh_served"].get("substituted") or {"replaced": 0, "missing": 0}
        ok = (
            medians[0] <= medians[1] < medians[2]
            and len(kept) * 5 >= 4 * len(triples)
            and counts["replaced"] > 0
            and counts["missing"] == 0
        )
        return ok, (
            f"{len(kept)}/{len(triples)} served blocks with both recomputes; median slot "
            f"difference served against served-row twin {medians[0]:.3g} (largest "
            f"{max(loop):.3g}), own-row twin against served-row twin {medians[1]:.3g} "
            f"(largest {max(noise):.3g}), control (another prefix) {medians[2]:.3g}; "
            f"rows replaced {counts['replaced']}, without a served row {counts['missing']}"
        )

    return check


def drafts_equal_recompute(jobs: tuple[str, ...], twins: str = "fresh") -> Check:
    """Exact drafting (``record_dspark_drafts.py --recompute``): every block the
    serving loop drafted, against the first block the same engine drafts for its
    committed prefix served as a new prompt with prefix caching off (only pristine
    context: no rejected rows, no stale slots, no other group's block table). Blocks
    whose recompute anchored on another token (a greedy near-tie of the target) are
    counted, not compared. The tolerance is a share (EXACT_SHARE) of the control: the
    same blocks against the recompute of another committed prefix, what a context
    off by a token or a request does to these logits.

    ``twins="fresh_served"`` (``--served-context``) judges the recompute that read the
    served requests' own context rows: the draft's inputs are then the same in both,
    and every row of every recompute must have been replaced. ``jobs``: the first of
    them a run ran (the job was renamed when it gained the served-context pass)."""

    def check(outcomes: dict[str, Outcome]) -> tuple[bool, str]:
        job = next((name for name in jobs if name in outcomes), jobs[0])
        result = result_of(outcomes, job)
        if twins not in result:
            raise Missing(f"{job}: no {twins!r} recompute in the result")
        fresh = first_blocks(result[twins]["records"])
        pairs = [
            (record, fresh.get(tuple(prefix)))
            for record, prefix in zip(result["records"], result["prefixes"], strict=True)
        ]
        compared = [(r, t) for r, t in pairs if t is not None and t["anchor"] == r["anchor"]]
        if len(compared) < 2:
            raise Missing(f"{job}: {len(compared)} blocks with a recompute to compare")
        differences = [block_differences(r, t) for r, t in compared]
        worst = max(differences)
        shifted = [t for _, t in compared[1:]] + [compared[0][1]]
        control = statistics.median(
            block_differences(r, t) for (r, _), t in zip(compared, shifted, strict=True)
        )
        equal_drafts = sum(r["drafts"] == t["drafts"] for r, t in compared)
        ok = worst <= EXACT_SHARE * control and len(compared) * 5 >= 4 * len(pairs)
        # a request's first block follows its prefill, with no draft step before it
        firsts = [is_first(r) for r, _ in compared]
        first = [d for d, f in zip(differences, firsts, strict=True) if f]
        later = [d for d, f in zip(differences, firsts, strict=True) if not f]
        figure = (
            f"{len(compared)}/{len(pairs)} served blocks compared with their recompute "
            f"(others anchored elsewhere or not recomputed); largest logit difference "
            f"{worst:.4g} (median {statistics.median(differences):.4g}) against "
            f"{control:.4g} for another prefix's block (median); "
            f"{equal_drafts}/{len(compared)} blocks drafted the same tokens; first blocks "
            f"{spread(first)}, later blocks {spread(later)}"
        )
        counts = result[twins].get("substituted")
        if counts is not None:
            ok = ok and counts["replaced"] > 0 and counts["missing"] == 0
            figure += (
                f"; context rows replaced by the served ones {counts['replaced']}, "
                f"without a served row {counts['missing']}; {served_context_effect(result)}"
            )
        return ok, figure

    return check


def routes_alone_as_in_batch(job: str) -> Check:
    """The matrix's premise: with float32 router logits, as V4's gate gives them, the
    routing kernel gives each token of the matrix's model (128 experts below
    ``V4_WARP_NORM_BELOW``, else 8) the same experts and weights alone as in a batch,
    in hash and in learned layers. The figure gives every expert count the probe
    routed, so a kernel that mixes tokens at another count shows too."""

    def check(outcomes: dict[str, Outcome]) -> tuple[bool, str]:
        from packaging.version import Version

        got = result_of(outcomes, job)
        wide = Version(got["vllm"]) < Version(V4_WARP_NORM_BELOW)
        experts = V4_WIDE_EXPERTS if wide else V4_EXPERTS
        float32 = [c for c in got["cases"] if c["logits"] == "float32"]
        ours = [c for c in float32 if c["experts"] == experts]
        if len(ours) != 2:
            raise Missing(f"{job}: no float32 cases for {experts} experts (hash and learned)")
        errors = [c for c in ours if "error" in c]
        if errors:
            return False, f"{experts} experts: {errors[0]['error'][:200]}"
        ok = all(c["experts_agree"] and c["batch_vs_alone"] <= ROUTING_TOLERANCE for c in ours)

        def describe(case: dict) -> str:
            kind = "hash" if case["hash_layer"] else "learned"
            if "error" in case:
                return f"{case['experts']} {kind}: {case['error'][:80]}"
            agree = "" if case["experts_agree"] else ", experts differ"
            return (
                f"{case['experts']} {kind}: alone-vs-batch {case['batch_vs_alone']:.3g}, "
                f"batch-vs-reference {case['batch_vs_reference']:.3g}{agree}"
            )

        cases = "; ".join(describe(c) for c in float32)
        return ok, f"matrix model {experts} experts ({got['vllm']}): {cases}"

    return check


def lossless_in_every_phase(reference: str, job: str) -> Check:
    """The lossless matrix of one engine (``generate.py --phases``): in the batch
    (chunked prefill, and the preemptions a small KV cache forces), for prompts served
    alone, and behind a shared prefix served the second time, the answers under
    teacher forcing no further from the target's own picks than the reference
    engine's answers of that phase (``teacher_verdict``; runs that scored nothing:
    greedy tokens equal up to near-ties); and those shapes really happened in
    ``job``: preemptions, and prefix-cache hits with speculation on."""

    def check(outcomes: dict[str, Outcome]) -> tuple[bool, str]:
        all_ran(outcomes, reference, job)
        ref, got = result_of(outcomes, reference), result_of(outcomes, job)
        if not got.get("phases") or not ref.get("phases"):
            raise Missing(f"{reference} or {job} served no phases (run with --phases)")
        records = {
            name: (ref, got) if name == "batch" else (ref["phases"][name], got["phases"][name])
            for name in ("batch", "alone", "shared_prefix")
        }
        scored = all(r.get("teacher_forced") for pair in records.values() for r in pair)
        if scored:
            for name, pair in records.items():
                for record in pair:
                    if "error" in record["teacher_forced"]:
                        error = record["teacher_forced"]["error"]
                        raise Missing(f"scoring failed: {name}: {error}")
        parts, ok = [], True
        for name, (ref_record, got_record) in records.items():
            if scored:
                calibration = flat_gaps(ref_record["teacher_forced"]["gaps"])
                good, figure = teacher_verdict(got_record["teacher_forced"], calibration)
            else:
                good, figure = near_tie_verdict(ref_record, got_record)
            ok = ok and good
            parts.append(f"{name}: {figure}")
        shared = got["phases"]["shared_prefix"]
        preemptions = got.get("preemptions") or 0
        ok = ok and preemptions > 0 and shared["prefix_hits"] > 0
        parts.append(
            f"{preemptions} preemptions; prefix cache {shared['prefix_hits']:.0f} of "
            f"{shared['prefix_queries']:.0f} tokens hit (prefix {shared['prefix_tokens']} tokens)"
        )
        return ok, "; ".join(parts)

    return check


def sync_counts(outcomes: dict[str, Outcome], job: str) -> dict:
    counts = result_of(outcomes, job).get("host_syncs")
    if not counts:
        raise Missing(f"{job} recorded no host_syncs (run with --count-syncs)")
    if "error" in counts:
        raise Missing(f"{job}: the sync counter did not install: {counts['error']}")
    return counts


def no_metadata_syncs(job: str) -> Check:
    """The seed's request-id change removed a device-to-host copy that a plugin's V4
    metadata build made each step; stock vLLM's own V4 builders are read to make
    none. Counted with CUDA's sync debug mode over every build of the run."""

    def check(outcomes: dict[str, Outcome]) -> tuple[bool, str]:
        counted = sync_counts(outcomes, job)["runner._build_attention_metadata"]
        return counted["calls"] > 0 and counted["syncs"] == 0, f"{counted}"

    return check


def sync_figures(job: str) -> Check:
    def check(outcomes: dict[str, Outcome]) -> tuple[bool, str]:
        counts = sync_counts(outcomes, job)
        per_call = {
            key: round(value["syncs"] / value["calls"], 2) if value["calls"] else None
            for key, value in counts.items()
        }
        return bool(counts), f"syncs per call {per_call}; {counts}"

    return check


def step_figures(job: str, earlier_job: str | None = None) -> Check:
    """The draft step against the target's forward of the same engine step
    (``generate.py --step-times``), per batch size, and per layer: the tiny V4 has
    few target layers where the real one has 43, so the per-layer figures are the
    ones that carry over (the issue's aim: a draft step at most 15% of a target step
    at batch 1)."""

    def check(outcomes: dict[str, Outcome]) -> tuple[bool, str]:
        # runs before the timer had its own job timed inside the checked one; a run
        # that ran that one without the timer did not time
        timed = earlier_job if earlier_job in outcomes and job not in outcomes else job
        earlier = outcomes[timed].result if timed == earlier_job else None
        if earlier is not None and OMITTED not in earlier and not earlier.get("step_times"):
            raise NotRun(f"{job} not run, and {earlier_job} was not timed")
        figures = result_of(outcomes, timed).get("step_times")
        if not figures:
            raise Missing(f"{timed} recorded no step_times (run with --step-times)")
        # runs before the engine reported its depths: the model this suite builds
        depths = figures.get("depths") or {}
        layers = depths.get("target_layers") or V4_LAYERS
        # the stages of the checkpoint this suite builds, which the overlay's loader
        # checks against its mtp.* weights; an engine's report may be vLLM's loaded
        # config's num_nextn_predict_layers (1), which is not the stage count
        stages = V4_DRAFT_STAGES
        parts, ok = [], True
        for batch in STEP_BATCHES:
            share = figures.get(batch, {"steps": 0})
            ok = ok and share["steps"] > 0
            if not share["steps"]:
                parts.append(f"batch {batch}: no step")
                continue
            unit = "device" if share["ratio_basis"] == "device_ms" else "host"
            target, draft = share[f"target_{unit}_ms"], share[f"draft_{unit}_ms"]
            parts.append(
                f"batch {batch}: draft/target {share['draft_over_target']:.3f} ({unit}, "
                f"{share['steps']} steps); target {target:.3f} ms ({target / layers:.3f} per "
                f"layer of {layers}), draft {draft:.3f} ms ({draft / stages:.3f} per stage of "
                f"{stages}); host: target {share['target_host_ms']:.3f} ms, draft "
                f"{share['draft_host_ms']:.3f} ms"
            )
        return ok, "; ".join(parts)

    return check


def acceptance_like(reference: str, job: str) -> Check:
    """Same weights, same prompts, greedy: drafts equal to the reference drafter's
    are accepted as often (scheduling may differ a little between runners)."""

    def check(outcomes: dict[str, Outcome]) -> tuple[bool, str]:
        lengths = []
        for name in (reference, job):
            counters = result_of(outcomes, name)["spec_decode"]
            drafts = counters.get("num_drafts", 0)
            accepted = counters.get("num_accepted_tokens", 0)
            lengths.append((drafts, accepted, 1 + accepted / drafts if drafts else 0.0))
        (_, _, ref_length), (drafts, _, length) = lengths
        ok = drafts > 0 and abs(length - ref_length) <= 0.1 * ref_length
        return ok, f"acceptance length {length:.2f} against {ref_length:.2f}; {lengths}"

    return check


def dspark_accepts(job: str, kernel: bool | None) -> Check:
    def check(outcomes: dict[str, Outcome]) -> tuple[bool, str]:
        result = result_of(outcomes, job)
        counters, drafter = result["spec_decode"], result.get("dspark_drafter") or {}
        drafts = counters.get("num_drafts", 0)
        length = 1 + counters.get("num_accepted_tokens", 0) / drafts if drafts else 0.0
        fused, steps = drafter.get("fused_draft_steps"), drafter.get("draft_steps")
        ok = drafts > 0 and length >= 1.5
        if kernel is not None:
            ok = ok and bool(fused) == kernel and bool(steps)
        return ok, f"acceptance length {length:.2f} over {drafts} drafts; fused {fused}/{steps}"

    return check


def stage_from_graphs(job: str, wanted: bool) -> Check:
    """Whether the drafter's greedy stage was replayed from its CUDA graphs."""

    def check(outcomes: dict[str, Outcome]) -> tuple[bool, str]:
        drafter = result_of(outcomes, job).get("dspark_drafter") or {}
        if "graph_draft_steps" not in drafter:
            raise NotSaved(job)  # a drafter without the graphs
        replayed, steps = drafter["graph_draft_steps"], drafter.get("draft_steps")
        ok = bool(steps) and bool(replayed) == wanted
        return ok, f"{replayed} of {steps} draft steps replayed from CUDA graphs"

    return check


def status_outcome(job: str, patch: str, wanted: str, detail_has: str = "") -> Check:
    def check(outcomes: dict[str, Outcome]) -> tuple[bool, str]:
        statuses = statuses_of(outcomes, job)
        engine = [d for d in statuses if d["role"] in ("engine-core", "worker")]
        cells = {d["patches"][patch]["outcome"] for d in engine}
        details = " | ".join(sorted({d["patches"][patch]["detail"][:160] for d in engine}))
        ok = cells == {wanted} and all(detail_has in d["patches"][patch]["detail"] for d in engine)
        return ok, f"{patch} in engine processes: {sorted(cells)} ({details})"

    return check


def ranks_drafted(job: str, split: bool | None) -> Check:
    """Both tensor-parallel ranks drafted; their Markov bias weight split over the
    vocabulary (``split``), whole on each rank (not ``split``), or either (None)."""

    def check(outcomes: dict[str, Outcome]) -> tuple[bool, str]:
        ranks = result_of(outcomes, job).get("dspark_drafter_ranks") or []
        sizes = [rank.get("markov_bias_tp_size") or 1 for rank in ranks]
        steps = [rank.get("draft_steps") for rank in ranks]
        ok = len(ranks) == 2 and all(steps)
        if split is not None:
            ok = ok and all((size == 2) == split for size in sizes)
        fused = [rank.get("fused_draft_steps") for rank in ranks]
        return ok, f"draft steps by rank {steps}, bias split {sizes}, fused steps {fused}"

    return check


def shard_walk_like_loop(walk: str, loop: str) -> Check:
    """The split Markov head walked over each rank's vocabulary shard drafts what
    the loop drafts: the same tokens and the same drafts accepted, every draft
    step of both ranks a shard walk in ``walk`` and none in ``loop``."""

    def check(outcomes: dict[str, Outcome]) -> tuple[bool, str]:
        all_ran(outcomes, walk, loop)
        walked, looped = result_of(outcomes, walk), result_of(outcomes, loop)
        names = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
        counters = [[run["spec_decode"].get(name) for name in names] for run in (walked, looped)]
        shard_steps = [
            [(rank.get("sharded_draft_steps"), rank.get("draft_steps")) for rank in ranks]
            for ranks in (walked.get("dspark_drafter_ranks") or [], looped["dspark_drafter_ranks"])
        ]
        ok = walked["token_ids"] == looped["token_ids"] and counters[0] == counters[1]
        ok = ok and len(shard_steps[0]) == 2 and all(s == d and d for s, d in shard_steps[0])
        ok = ok and all(not s for s, _ in shard_steps[1])
        return ok, (
            f"tokens {'equal' if walked['token_ids'] == looped['token_ids'] else 'differ'}; "
            f"drafts, draft tokens, accepted: {counters[0]} against {counters[1]}; "
            f"(shard steps, draft steps) by rank {shard_steps[0]} against {shard_steps[1]}"
        )

    return check


def draft_step_against(job: str, reference: str) -> Check:
    """Rank 0's median draft step (``generate.py --step-times``) in ``job`` against
    ``reference``'s, per batch size, on the device where it was timed there."""

    def check(outcomes: dict[str, Outcome]) -> tuple[bool, str]:
        figures = [result_of(outcomes, name).get("step_times") for name in (job, reference)]
        if not all(figures):
            raise Missing(f"{job} or {reference} recorded no step_times")
        parts, ok = [], True
        for batch in STEP_BATCHES:
            shares = [figure.get(batch, {"steps": 0}) for figure in figures]
            if not all(share["steps"] for share in shares):
                ok = False
                parts.append(f"batch {batch}: no step")
                continue
            unit = "device" if shares[0]["ratio_basis"] == "device_ms" else "host"
            mine, theirs = (share[f"draft_{unit}_ms"] for share in shares)
            parts.append(
                f"batch {batch}: {mine:.3f} ms against {theirs:.3f} ms ({unit}, ratio "
                f"{mine / theirs:.3f})"
            )
        return ok, "; ".join(parts)

    return check


def same_answers(reference: str, other: str, near_tie: bool = False) -> Check:
    """``serve_check.py --one-at-a-time``'s greedy answers, token for token; with
    ``near_tie``, an answer may part from the reference where the reference's
    top-two gap was below ``NEAR_TIE`` (``same_until_near_tie``)."""

    def check(outcomes: dict[str, Outcome]) -> tuple[bool, str]:
        all_ran(outcomes, reference, other)
        ref, got = result_of(outcomes, reference)["answers"], result_of(outcomes, other)["answers"]
        if near_tie:
            return near_tie_verdict(as_sequences(ref), as_sequences(got))
        equal = sum(a["tokens"] == b["tokens"] for a, b in zip(ref, got, strict=True))
        return equal == len(ref), f"{equal}/{len(ref)} answers equal"

    return check


def as_sequences(answers: list[dict]) -> dict:
    """serve_check's answers as ``near_tie_verdict`` reads generate.py's records."""
    return {"token_ids": [a["tokens"] for a in answers], "margins": [a["gaps"] for a in answers]}


def idle_rank_dummies(job: str, context: int) -> Check:
    """Both ranks idled on dummy batches, and every attention build of those had
    ``context`` tokens before each dummy request's query."""

    def check(outcomes: dict[str, Outcome]) -> tuple[bool, str]:
        probe = result_of(outcomes, job)["dummy_batches"]
        calls, builds, contexts = probe["calls_by_rank"], probe["builds"], probe["contexts_seen"]
        ok = len(calls) == 2 and builds > 0 and contexts == [str([context])]
        decodes = probe["builds_as_decode"]
        return (
            ok,
            f"dummies by rank {calls}; {builds} builds, {decodes} decodes, contexts {contexts}",
        )

    return check


def dummy_batch_class(job: str, want_decode: bool) -> Check:
    def check(outcomes: dict[str, Outcome]) -> tuple[bool, str]:
        builds = result_of(outcomes, job)["builds"]
        prefills = sum(b["num_prefills"] for b in builds)
        decodes = sum(b["num_decodes"] for b in builds)
        ok = bool(builds) and (prefills == 0 if want_decode else prefills > 0)
        return ok, f"{len(builds)} builds: {decodes} decode, {prefills} prefill requests"

    return check


def embedding_case(job: str, patched: bool) -> Check:
    def check(outcomes: dict[str, Outcome]) -> tuple[bool, str]:
        result = result_of(outcomes, job)
        if patched:
            ok = result["completed"] and result["valid_rows_equal"] and result["invalid_row_zero"]
            return ok, json.dumps(result)
        if result.get("compiled") and result["completed"]:
            zero = result["invalid_row_zero"]
            return not zero, "completed; the -1 row " + ("is zero" if zero else "is not zero")
        return not result["completed"], result.get("error", "completed without a fault")

    return check


def async_on(job: str) -> Check:
    def check(outcomes: dict[str, Outcome]) -> tuple[bool, str]:
        result = result_of(outcomes, job)
        return bool(result["async_scheduling"]), f"async_scheduling={result['async_scheduling']}"

    return check


def refused_in_one_line(job: str, refusals: tuple[str, ...]) -> Check:
    """An engine that must not start: it exited with an error, and a line of its log
    holds one of ``refusals`` (the overlay's refusal or stock's own)."""

    def check(outcomes: dict[str, Outcome]) -> tuple[bool, str]:
        outcome = outcomes.get(job)
        if outcome is None:
            raise NotRun(f"{job} not run on this release")
        lines = [line for line in outcome.log.splitlines() if any(r in line for r in refusals)]
        if outcome.returncode == 0 or not lines:
            return False, f"{job} exited {outcome.returncode}; no line says {refusals[0]!r}"
        return True, f"exited {outcome.returncode}: {lines[-1][-300:]}"

    return check


def completes(job: str) -> Check:
    def check(outcomes: dict[str, Outcome]) -> tuple[bool, str]:
        result = result_of(outcomes, job)
        return True, f"{len(result.get('tokens_per_s') or {})} batch sizes timed"

    return check


def cudagraph_mode(job: str, piecewise: bool) -> Check:
    """The cudagraph mode an engine's runner settled on, and whether its dispatcher
    holds piecewise shapes (``piecewise``: the stock symptom expected)."""

    def check(outcomes: dict[str, Outcome]) -> tuple[bool, str]:
        has_piecewise, figure = piecewise_graphs(outcomes, job)
        return has_piecewise == piecewise, figure

    return check


def piecewise_graphs(outcomes: dict[str, Outcome], job: str) -> tuple[bool, str]:
    """Whether an engine's runner kept piecewise graphs (its mode or its dispatcher's
    keys), and its mode and keys as a figure."""
    facts = result_of(outcomes, job).get("cudagraphs") or {}
    if not facts.get("mode"):
        raise Missing(f"{job} saved no cudagraph mode")
    has_piecewise = "PIECEWISE" in facts["mode"] or facts["keys"].get("PIECEWISE", 0) > 0
    return has_piecewise, f"mode {facts['mode']}, dispatcher keys {facts['keys']}"


# vLLM's own warning where an engine runs breakable CUDA graphs (0.22+)
BREAKABLE_LINE = "VLLM_USE_BREAKABLE_CUDAGRAPH is set"


def route_graph_mode(job: str) -> Check:
    """The V4 route's engine: piecewise graphs where the model is compiled (0.20-0.22),
    none where vLLM captures it in breakable graphs, which the route drops."""

    def check(outcomes: dict[str, Outcome]) -> tuple[bool, str]:
        has_piecewise, figure = piecewise_graphs(outcomes, job)
        breakable = BREAKABLE_LINE in outcomes[job].log
        capture = "breakable" if breakable else "compiled-model"
        return has_piecewise != breakable, f"{capture} capture: {figure}"

    return check


def staging_tears(stock: str, patched: str) -> Check:
    """The staging probe's counts, stock and patched: copies whose pinned buffer the
    host rewrote while they were pending, and steps whose delivered values differ
    from those written. Patched must show none of either; stock's are the figure
    (whether this release's step loop lets the host run ahead that far)."""

    def counted(outcomes: dict[str, Outcome], job: str) -> dict:
        probe = result_of(outcomes, job).get("staging_probe")
        if not probe or not probe["calls"]:
            raise Missing(f"{job}: the staging probe counted no drafter copies")
        return probe

    def describe(name: str, probe: dict) -> str:
        return (
            f"{name}: {probe['pending_at_reuse']} of {probe['calls']} copies rewritten "
            f"while pending, {probe['torn']} torn"
        )

    def check(outcomes: dict[str, Outcome]) -> tuple[bool, str]:
        base, fixed = counted(outcomes, stock), counted(outcomes, patched)
        ok = fixed["pending_at_reuse"] == 0 and fixed["torn"] == 0
        figure = f"{describe('stock', base)}; {describe('patched', fixed)}"
        return ok, f"{figure} (GPU sleep {fixed['delay_us']:.0f} us before each copy)"

    return check


def no_jit_after_start(*jobs: str) -> Check:
    def check(outcomes: dict[str, Outcome]) -> tuple[bool, str]:
        names: set[str] = set()
        for job in jobs:
            result_of(outcomes, job)
            if "JIT monitor activated" not in outcomes[job].log:
                raise NotApplicable("this vLLM has no JIT monitor to ask")
            names |= set(JIT_LINE.findall(outcomes[job].log))
        return not names, f"JIT compilations during inference: {sorted(names) or 'none'}"

    return check


def first_request_latency(
    job: str, stock: bool = False, batch: str = "1", limit: float = 1.2
) -> Check:
    """The engine's first request against its steady state, timed inside the engine
    core (``generate.engine_window``): the front end's one-time work on a first
    request (stock vLLM scans every installed distribution's entry points for
    logits-processor plugins then) is the same with or without a drafter, so the
    end-to-end figure is reported beside it, not judged."""

    def check(outcomes: dict[str, Outcome]) -> tuple[bool, str]:
        result = result_of(outcomes, job)
        if not result.get("bench_ran_first"):
            raise NotSaved(job)  # timed after the checked run: not the first request
        timing = result["tokens_per_s"][batch]
        if "first_engine_s" not in timing:
            raise NotSaved(job)  # a run from before the engine's own timestamps were kept
        ratio = timing["first_engine_s"] / timing["steady_engine_s"]
        figure = (
            f"{STOCK_FIGURE if stock else ''}engine core: first "
            f"{timing['first_engine_s']:.3f} s, steady {timing['steady_engine_s']:.3f} s "
            f"({ratio:.2f}x) at batch {batch}; end to end: first {timing['first_s']:.3f} s, "
            f"steady {timing['steady_s']:.3f} s ({timing['first_s'] / timing['steady_s']:.2f}x)"
        )
        return ratio <= limit, figure

    return check


def permutation_p(first: list[int], second: list[int], rounds: int = 2000) -> float:
    """Two-sample test of equal distributions over tokens: the chi-square statistic
    of the 2 x K table, its p-value by relabelling (no distribution assumed)."""
    import numpy as np

    values, codes = np.unique(np.array(first + second), return_inverse=True)
    labels = np.array([0] * len(first) + [1] * len(second))
    rng = np.random.default_rng(0)

    def statistic(groups: np.ndarray) -> float:
        table = np.stack([np.bincount(codes[groups == g], minlength=len(values)) for g in (0, 1)])
        expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
        return float(((table - expected) ** 2 / np.maximum(expected, 1e-12)).sum())

    observed = statistic(labels)
    exceed = sum(statistic(rng.permutation(labels)) >= observed for _ in range(rounds))
    return (exceed + 1) / (rounds + 1)


def tokens_at(result: dict, position: int) -> list[int]:
    return [tokens[position] for tokens in result["token_ids"]]


def sampled_like(reference: str, speculated: str, control: str) -> Check:
    """Speculation at T = 1 must not be told apart from plain sampling, while the
    same test tells plain sampling at another temperature apart (the control)."""

    def check(outcomes: dict[str, Outcome]) -> tuple[bool, str]:
        plain, spec = result_of(outcomes, reference), result_of(outcomes, speculated)
        other = result_of(outcomes, control)
        p_spec = [permutation_p(tokens_at(plain, i), tokens_at(spec, i)) for i in SAMPLED_POSITIONS]
        p_ctrl = [
            permutation_p(tokens_at(plain, i), tokens_at(other, i)) for i in SAMPLED_POSITIONS
        ]
        drafts = spec["spec_decode"].get("num_drafts", 0)
        ok = drafts > 0 and min(p_spec) > SIGNIFICANCE and min(p_ctrl) <= SIGNIFICANCE
        return ok, (
            f"{len(plain['token_ids'])} samples per run, {drafts} drafts; p speculated "
            f"{[round(p, 4) for p in p_spec]}, p control (T={CONTROL_TEMPERATURE}) "
            f"{[round(p, 4) for p in p_ctrl]}, threshold {SIGNIFICANCE}"
        )

    return check


def served_like_plain(plain: str, speculated: str) -> Check:
    def check(outcomes: dict[str, Outcome]) -> tuple[bool, str]:
        ref, got = result_of(outcomes, plain), result_of(outcomes, speculated)
        equal = sum(a == b for a, b in zip(ref["greedy"], got["greedy"], strict=True))
        drafts = got["spec_decode"].get("num_drafts", 0)
        ok = equal == len(ref["greedy"]) and drafts > 0
        return ok, f"{equal}/{len(ref['greedy'])} concurrent completions equal; {drafts} drafts"

    return check


def stream_and_abort(plain: str, speculated: str) -> Check:
    def check(outcomes: dict[str, Outcome]) -> tuple[bool, str]:
        ref, got = result_of(outcomes, plain), result_of(outcomes, speculated)
        streamed = got["streamed"] == ref["greedy"][: len(got["streamed"])]
        after = got["after_abort"] == ref["greedy"][2]
        ok = streamed and after and got["aborted_chunks"] == 2
        return ok, (
            f"streamed equal {streamed}; stream closed after {got['aborted_chunks']} chunks, "
            f"next request equal {after}"
        )

    return check


def dummy_batch_builder(job: str, builder: str) -> Check:
    def check(outcomes: dict[str, Outcome]) -> tuple[bool, str]:
        result = result_of(outcomes, job)
        passed, figure = dummy_batch_class(job, job.endswith("overlay"))(outcomes)
        builders = result.get("builders", [])
        return passed and builder in builders, f"{figure}; builders {builders}"

    return check


CHECKS: dict[str, Check] = {
    "every-process/v1: roles and summary lines": roles_and_summaries("llama-v1-overlay"),
    "every-process/v1: greedy equal to stock (compile + cudagraphs)": same_tokens(
        "llama-v1-stock", "llama-v1-overlay"
    ),
    "every-process/v2: roles and summary lines": roles_and_summaries("llama-v2-overlay"),
    "every-process/v2: greedy equal to stock (compile + cudagraphs)": same_tokens(
        "llama-v2-stock", "llama-v2-overlay"
    ),
    "embedding: stock faults on a -1 id at tp 1": embedding_case("embedding-stock", False),
    "embedding: patched zeroes it, valid rows exact": embedding_case("embedding-overlay", True),
    # Inductor may wrap -1 to the last row rather than fault: either way not a zero row
    "embedding (compiled model): stock faults or returns a row for a -1 id": embedding_case(
        "embedding-stock-compiled", False
    ),
    "embedding (compiled model): patched zeroes it, valid rows exact": embedding_case(
        "embedding-overlay-compiled", True
    ),
    "async_sync: EAGLE sync patched equals no speculation": same_tokens(
        "llama-fp32", "eagle-sync-overlay"
    ),
    "async_sync: EAGLE async stock equals no speculation": same_tokens(
        "llama-fp32", "eagle-async-stock"
    ),
    "async_sync: EAGLE async patched equals no speculation": same_tokens(
        "llama-fp32", "eagle-async-overlay"
    ),
    "async_sync: async scheduling really on": async_on("eagle-async-overlay"),
    "dp_dummy: stock dummy batch classed as prefill": dummy_batch_class("dp-dummy-stock", False),
    "dp_dummy: patched dummy batch classed as decode": dummy_batch_class("dp-dummy-overlay", True),
    "dspark/2 GPUs: TP 2 greedy equals TP 1 without speculation": same_tokens(
        "tp1-nospec", "tp2-dspark"
    ),
    "dspark/2 GPUs: TP 2 gated head greedy equals TP 1 without speculation": same_tokens(
        "tp1-nospec", "tp2-dspark-gated"
    ),
    "dspark/2 GPUs: TP 2 accepts as TP 1 does": acceptance_like("tp1-dspark", "tp2-dspark"),
    "dspark/2 GPUs: TP 2 gated head accepts as TP 1 does": acceptance_like(
        "tp1-dspark-gated", "tp2-dspark-gated"
    ),
    "dspark/2 GPUs: TP 2 probabilistic drafts accept as TP 1's": acceptance_like(
        "tp1-dspark-sampled", "tp2-dspark-sampled"
    ),
    "dspark/2 GPUs: both ranks draft": ranks_drafted("tp2-dspark", None),
    "dspark/2 GPUs: the gated head's bias is split over both ranks": ranks_drafted(
        "tp2-dspark-gated", True
    ),
    "dspark/2 GPUs: the gated head's shard walk drafts what the loop drafts": (
        shard_walk_like_loop(SHARD_WALK_JOB, SHARD_LOOP_JOB)
    ),
    "dspark/2 GPUs (diagnostic): shard walk against the loop, draft step": draft_step_against(
        SHARD_WALK_JOB, SHARD_LOOP_JOB
    ),
    "dp_dummy/2 GPUs: stock V4 idle-rank dummies have no context": idle_rank_dummies(
        "dp2-v4-stock", 0
    ),
    "dp_dummy/2 GPUs: patched V4 idle-rank dummies have a context": idle_rank_dummies(
        "dp2-v4-overlay", 1
    ),
    "dp_dummy/2 GPUs: stock V4 DP 2 greedy equals DP 1 up to near-ties": same_answers(
        "dp1-v4", "dp2-v4-stock", near_tie=True
    ),
    "dp_dummy/2 GPUs: patched V4 DP 2 greedy equals DP 1 up to near-ties": same_answers(
        "dp1-v4", "dp2-v4-overlay", near_tie=True
    ),
    "dp_dummy/2 GPUs: stock idle-rank dummies have no context (graphs)": idle_rank_dummies(
        "dp2-stock", 0
    ),
    "dp_dummy/2 GPUs: patched idle-rank dummies have a context (graphs)": idle_rank_dummies(
        "dp2-overlay", 1
    ),
    "dp_dummy/2 GPUs: stock idle-rank dummies have no context (eager)": idle_rank_dummies(
        "dp2-stock-eager", 0
    ),
    "dp_dummy/2 GPUs: patched idle-rank dummies have a context (eager)": idle_rank_dummies(
        "dp2-overlay-eager", 1
    ),
    "dp_dummy/2 GPUs: stock DP 2 greedy equals DP 1 (graphs)": same_answers(
        "dp1-mixtral", "dp2-stock"
    ),
    "dp_dummy/2 GPUs: patched DP 2 greedy equals DP 1 (graphs)": same_answers(
        "dp1-mixtral", "dp2-overlay"
    ),
    "dp_dummy/2 GPUs: stock DP 2 greedy equals DP 1 (eager)": same_answers(
        "dp1-mixtral-eager", "dp2-stock-eager"
    ),
    "dp_dummy/2 GPUs: patched DP 2 greedy equals DP 1 (eager)": same_answers(
        "dp1-mixtral-eager", "dp2-overlay-eager"
    ),
    "cudagraph (stock): a piecewise mode kept with nothing compiled": cudagraph_mode(
        "plain-llama-stock", True
    ),
    "cudagraph (patched): piecewise demoted with nothing compiled": cudagraph_mode(
        "plain-llama-overlay", False
    ),
    "cudagraph: greedy equal to the compiled Llama, stock": same_tokens(
        "llama-v1-stock", "plain-llama-stock"
    ),
    "cudagraph: greedy equal to the compiled Llama, patched": same_tokens(
        "llama-v1-stock", "plain-llama-overlay"
    ),
    "async_sync: drafter staging probe, none rewritten while pending when patched": (
        staging_tears("eagle-async-probe-stock", "eagle-async-probe-overlay")
    ),
    "async_sync: greedy with the probe equal to stock async": same_tokens(
        "eagle-async-stock", "eagle-async-probe-overlay"
    ),
    "dspark/v1: greedy equal to no speculation": same_tokens("qwen3-nospec", "dspark-v1"),
    "dspark/v1: acceptance, fused kernel in the drafter": dspark_accepts("dspark-v1", True),
    "dspark/v1: greedy stage replayed from CUDA graphs": stage_from_graphs("dspark-v1", True),
    "dspark/v1: fused kernel launched eagerly equals no speculation": same_tokens(
        "qwen3-nospec", "dspark-v1-eager-kernel"
    ),
    "dspark/v1: eager kernel accepts, fused kernel in the drafter": dspark_accepts(
        "dspark-v1-eager-kernel", True
    ),
    "dspark/v1: eager kernel, no CUDA graphs": stage_from_graphs("dspark-v1-eager-kernel", False),
    "dspark/v1: PyTorch loop equals no speculation": same_tokens("qwen3-nospec", "dspark-v1-loop"),
    "dspark/v1: loop accepts, kernel off": dspark_accepts("dspark-v1-loop", False),
    "dspark/v1: status applied in engine processes": status_outcome(
        "dspark-v1", "dspark", "applied"
    ),
    "dspark/v1: no JIT compilation after start": no_jit_after_start("dspark-v1", "bench-dspark"),
    "dspark/v1: first request within 1.2x of the steady state (batch 1)": first_request_latency(
        "bench-dspark"
    ),
    "dspark/v1: T = 1 sampling indistinguishable from no speculation": sampled_like(
        "t1-nospec", "t1-dspark", "control-nospec"
    ),
    "dspark/v1: T = 1 with probabilistic drafts indistinguishable": sampled_like(
        "t1-nospec", "t1-dspark-probabilistic", "control-nospec"
    ),
    "serve: vllm serve + openai, concurrent greedy equal to a plain server": served_like_plain(
        "serve-plain", "serve-dspark"
    ),
    "serve: streamed equal, an aborted stream leaves the server serving": stream_and_abort(
        "serve-plain", "serve-dspark"
    ),
    "serve: roles and summary lines": roles_and_summaries("serve-dspark"),
    "v4: no speculation, eager, completes": completes("v4-nospec-eager"),
    "v4 (diagnostic): no speculation, eager, run twice, parts only at near-ties": (
        same_until_near_tie("v4-nospec-eager", "v4-nospec-eager-again")
    ),
    "v4: no speculation, compiled with CUDA graphs, equals eager up to near-ties": (
        same_until_near_tie("v4-nospec-eager", "v4-nospec")
    ),
    "v4 (diagnostic): stock DSpark (V2) against V2 without speculation, token for token": (
        same_until_near_tie("v4-nospec-v2", "v4-dspark-stock")
    ),
    "v4 (diagnostic): V2 without speculation equals V1 eager up to near-ties": (
        same_until_near_tie("v4-nospec-eager", "v4-nospec-v2")
    ),
    "v4 (diagnostic): overlay DSpark on V1, eager, against no speculation, token for token": (
        same_until_near_tie("v4-nospec-eager", "v4-dspark-overlay-v1")
    ),
    "v4 (diagnostic): overlay DSpark on V1, compiled, against no speculation, token for token": (
        same_until_near_tie("v4-nospec", "v4-dspark-overlay-v1-compiled")
    ),
    "v4 (diagnostic): overlay DSpark on V1 against stock DSpark on V2, token for token": (
        same_until_near_tie("v4-dspark-stock", "v4-dspark-overlay-v1")
    ),
    "v4: stock DSpark (V2): answers as near the target's picks as V2's own (teacher-forced)": (
        teacher_forced_lossless("v4-dspark-stock", ("v4-nospec-v2",))
    ),
    "v4: overlay DSpark on V1, eager: answers as near the target's picks as stock's "
    "(teacher-forced)": (
        teacher_forced_lossless("v4-dspark-overlay-v1", ("v4-nospec-eager",), ("v4-dspark-stock",))
    ),
    "v4: overlay DSpark on V1, compiled: answers as near the target's picks as stock's "
    "(teacher-forced)": (teacher_forced_lossless("v4-dspark-overlay-v1-compiled", ("v4-nospec",))),
    **{
        f"v4 (diagnostic): no speculation, not eager, CUDA graphs {mode[-1]}, equals eager "
        "up to near-ties": same_until_near_tie("v4-nospec-eager", f"v4-nospec-{name}")
        for name, mode in V4_GRAPH_MODES.items()
    },
    **{
        f"v4 (diagnostic): no speculation, not eager, CUDA graphs {mode[-1]}: answers as "
        "near the target's picks as eager's (teacher-forced)": teacher_forced_lossless(
            f"v4-nospec-{name}", ("v4-nospec-eager",)
        )
        for name, mode in V4_GRAPH_MODES.items()
    },
    "v4: no host sync in the target's attention metadata (stock, V1)": no_metadata_syncs(
        "v4-nospec-eager-again"
    ),
    # the largest difference within a tenth of the control's: identical inputs at
    # another batch shape already differ more on this model (docs/dspark.md 13)
    "v4 (diagnostic): every served draft block equals its recompute on the committed "
    "prefix (V1, eager)": drafts_equal_recompute(EXACT_JOBS),
    "v4 (diagnostic): every served draft block equals its recompute from the served "
    "context rows (V1, eager)": drafts_equal_recompute(EXACT_JOBS[:1], "fresh_served"),
    "v4: served draft blocks no further from their served-context recompute than the "
    "target's noise moves it (V1, eager)": drafts_within_noise(EXACT_JOBS[0]),
    "v4 (diagnostic): host syncs per step of the overlay's V4 drafter": sync_figures(
        "v4-dspark-overlay-v1"
    ),
    "v4 (diagnostic): draft step against target forward, batch 1 and 64": step_figures(
        "v4-dspark-overlay-v1-steps", "v4-dspark-overlay-v1"
    ),
    "v4 matrix: the matrix's model routes a token alone as in a batch (float32 "
    "router logits)": routes_alone_as_in_batch("v4-hash-routing"),
    **{
        f"v4 matrix: DSpark N={n} through the overlay on V1, lossless in every phase": (
            lossless_in_every_phase("v4-matrix-reference", f"v4-matrix-n{n}")
        )
        for n in V4_MATRIX_CHECKED_TOKENS
    },
    **{
        f"v4 matrix: DSpark N={n} through the overlay on V1, compiled with CUDA graphs, "
        "lossless in every phase": lossless_in_every_phase(
            "v4-matrix-compiled-reference", f"v4-matrix-compiled-n{n}"
        )
        for n in V4_MATRIX_SPEC_TOKENS
    },
    **{
        f"v4 matrix: DSpark N={n} through the overlay on V1, CUDA graphs without "
        "breakable piecewise capture where vLLM would use it": route_graph_mode(
            f"v4-matrix-compiled-n{n}"
        )
        for n in V4_MATRIX_SPEC_TOKENS
    },
    **{
        f"v4 matrix (diagnostic): DSpark N={n} through the overlay on V1, breakable "
        f"piecewise graphs kept ({V4_PIECEWISE_SETTING}={choice}), lossless in every "
        "phase": lossless_in_every_phase(
            "v4-matrix-compiled-reference-piecewise", f"v4-matrix-compiled-n{n}{suffix}"
        )
        for n in V4_MATRIX_SPEC_TOKENS
        for choice, suffix in V4_PIECEWISE_KEPT.items()
    },
    **{
        f"v4: the overlay's V1 route refuses N={n} in one line": refused_in_one_line(
            f"v4-dspark-overlay-v1-n{n}",
            # the overlay's line, or stock 0.26's own below the block
            (f"num_speculative_tokens={n}: ", f"dspark_block_size (5); got {n}."),
        )
        for n in V4_REFUSED_SPEC_TOKENS
    },
    "v4: the overlay's V1 drafts accept as stock V2's do": acceptance_like(
        "v4-dspark-stock", "v4-dspark-overlay-v1"
    ),
    "dp_dummy/flashinfer: stock classed as prefill": dummy_batch_builder(
        "dp-dummy-flashinfer-stock", "FlashInferMetadataBuilder"
    ),
    "dp_dummy/flashinfer: patched classed as decode": dummy_batch_builder(
        "dp-dummy-flashinfer-overlay", "FlashInferMetadataBuilder"
    ),
    "dspark/v1 (diagnostic): timing run with the PyTorch Markov loop": completes(
        "bench-dspark-loop"
    ),
    "dspark/v1 (diagnostic): timing run with CUDA_LAUNCH_BLOCKING": completes(
        "bench-dspark-blocking"
    ),
    "dspark/v1: timing run (batch 1, 16, 64; 64 tokens) completes": completes("bench-dspark"),
    "dspark/v1: timing run, emulated heavy target, completes": completes("bench-dspark-heavy"),
    "dspark/v1: emulated heavy target accepts": dspark_accepts("bench-dspark-heavy", True),
    "dspark/v1: shrinking batch, no warm-up, equals no speculation": same_tokens(
        "qwen3-nospec-stagger", "dspark-v1-stagger"
    ),
    "dspark/v1: shrinking batch, synchronous launches, equals no speculation": same_tokens(
        "qwen3-nospec-stagger", "dspark-v1-stagger-blocking"
    ),
    "stock dflash (no overlay): shrinking batch equals no speculation": same_tokens(
        "qwen3-nospec-stagger", "dflash-stock-stagger"
    ),
    "stock dflash (diagnostic, no overlay): shrinking batch, piecewise CUDA graphs only": (
        same_tokens("qwen3-nospec-stagger", "dflash-stock-stagger-piecewise")
    ),
    "flex_graphs: vLLM's DFlash through the overlay, shrinking batch equals no speculation": (
        same_tokens("qwen3-nospec-stagger", "dflash-overlay-stagger")
    ),
    "flex_graphs: status applied in engine processes": status_outcome(
        "dflash-overlay-stagger", "flex_graphs", "applied", "FlexAttentionMetadataBuilder"
    ),
    "stock dflash (diagnostic, no overlay): shrinking batch in bfloat16 (FlashAttention)": (
        same_tokens("qwen3-nospec-stagger-bf16", "dflash-stock-stagger-bf16")
    ),
    "stock dflash (diagnostic, no overlay): timing run with piecewise CUDA graphs": completes(
        "bench-dflash-stock-piecewise"
    ),
    "dspark/v1 (bfloat16): greedy equal to no speculation": same_tokens(
        "qwen3-nospec-bf16", "dspark-v1-bf16"
    ),
    "dspark/v1 (bfloat16): timing run completes": completes("bench-dspark-bf16"),
    "stock dflash (diagnostic, no overlay): shrinking batch, decode-only full CUDA graphs": (
        same_tokens("qwen3-nospec-stagger", "dflash-stock-stagger-full-decode")
    ),
    "dspark/v1 (diagnostic): shrinking batch, piecewise CUDA graphs only": same_tokens(
        "qwen3-nospec-stagger", "dspark-v1-stagger-piecewise"
    ),
    FIRST_REQUEST_STOCK: first_request_latency("bench-nospec", stock=True),
    "dspark/v1 (diagnostic): synchronous scheduling, greedy equal": same_tokens(
        "qwen3-nospec", "dspark-v1-sync"
    ),
    "dspark/v1 (diagnostic): eager (no compile, no CUDA graphs), greedy equal": same_tokens(
        "qwen3-nospec", "dspark-v1-eager"
    ),
    "dflash (diagnostic): vLLM's own DFlash drafter, no overlay, timing run completes": completes(
        "bench-dflash-stock"
    ),
    "dspark/default runner: greedy equal to no speculation": same_tokens(
        "qwen3-nospec", "dspark-default-runner"
    ),
    "dspark/default runner: status true to the runner": status_outcome(
        "dspark-default-runner", "dspark", "applied", "V2 model runner"
    ),
    "dspark/v1 async + confidence: greedy equal": same_tokens(
        "qwen3-nospec", "dspark-v1-async-confidence"
    ),
    "dspark/v1 async + confidence: async on": async_on("dspark-v1-async-confidence"),
}


def evaluate(outcomes: dict[str, Outcome]) -> list[dict]:
    """One row per check; a check a recorded run cannot answer again is left out."""
    rows = []
    for name, check in CHECKS.items():
        try:
            passed, figure = check(outcomes)
        except NotSaved:
            continue
        except NotRun as exc:
            passed, figure = None, str(exc)
        except NotApplicable as exc:
            rows.append({"check": name, "passed": None, "figure": str(exc), "applies": False})
            continue
        except Missing as exc:
            passed, figure = False, str(exc)
        except Exception as exc:
            passed, figure = False, f"check crashed: {type(exc).__name__}: {exc}"
        rows.append(
            {"check": name, "passed": passed if passed is None else bool(passed), "figure": figure}
        )
    return rows


def environment() -> dict:
    from importlib.metadata import version as dist_version

    import torch

    return {
        "vllm": dist_version("vllm"),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "gpus": torch.cuda.device_count(),
        "driver_cuda": torch.version.cuda,
    }


def run_jobs(chosen: list[Job], at_once: int, deadline: float, scratch: Path) -> dict:
    """Outcomes by job name: the shared jobs ``at_once`` at a time, then the timing
    jobs one by one."""
    with ThreadPoolExecutor(at_once) as pool:
        shared = [j for j in chosen if not j.alone]
        futures = {j.name: pool.submit(run_job, j, scratch, deadline) for j in shared}
        outcomes = {name: future.result() for name, future in futures.items()}
    for job in (j for j in chosen if j.alone):
        outcomes[job.name] = run_job(job, scratch, deadline)
    return outcomes


def write_plain_variant(source: Path, out: Path) -> None:
    """The tiny Llama's files, its config naming the plugin's uncompiled class."""
    if (out / "config.json").exists():
        return
    out.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.is_file() and path.name != "config.json":
            shutil.copyfile(path, out / path.name)
    config = json.loads((source / "config.json").read_text())
    config["architectures"] = ["PlainLlamaForCausalLM"]
    (out / "config.json").write_text(json.dumps(config, indent=1))


@contextlib.contextmanager
def models_lock(models: Path, model: str) -> Iterator[None]:
    """Hold one model's build alone: two releases' suites detached in one hold share the
    folder, and a build that sees another's half-written checkpoint would remove it.
    One lock per model, so a suite whose model is built does not wait behind another
    model's build (the 128-expert one takes minutes)."""
    import fcntl

    models.mkdir(parents=True, exist_ok=True)
    with open(models / f".build-{model}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def v4_build(model: Path) -> list[str]:
    """The builder's command for one of the suite's shrunken V4 checkpoints."""
    command = [sys.executable, str(REPO / "tools" / "build_tiny_v4.py"), str(model)]
    command += ["--live-tokens", str(V4_LIVE_TOKENS), "--layers", str(V4_LAYERS)]
    return command + (["--experts", str(V4_WIDE_EXPERTS)] if model == TINY_V4_WIDE else [])


def prebuild(name: str) -> None:
    """Build one shrunken V4 checkpoint of the suite under the models lock
    (``run.sh prebuild``): a suite started later waits for it, then finds it built."""
    model = {model.name: model for model in (TINY_V4, TINY_V4_WIDE)}.get(name)
    if model is None:
        sys.exit(
            f"prebuild: {name!r} is not a model the suite builds ({TINY_V4.name}, "
            f"{TINY_V4_WIDE.name})"
        )
    build_v4(model)
    print(f"prebuild: {model.name} ready")


def build_v4(model: Path) -> None:
    """One shrunken V4 checkpoint, built once under its own lock."""
    with models_lock(MODELS, model.name):
        if not (model / "config.json").exists():
            subprocess.run(v4_build(model), check=True)


def build_models(chosen: list[Job]) -> None:
    """The models the chosen jobs name that the machine builds itself (each once)."""
    sys.path.insert(0, str(REPO / "tools"))
    for model in (TINY_V4, TINY_V4_WIDE):
        if any(str(model) in job.args for job in chosen):
            build_v4(model)
    with models_lock(MODELS, "small"):
        build_small_models(chosen)


def build_small_models(chosen: list[Job]) -> None:
    """The variants of the tiny Llama and DSpark draft that the chosen jobs name."""
    if any(str(PLAIN_LLAMA) in job.args for job in chosen):
        write_plain_variant(LLAMA, PLAIN_LLAMA)
    if any(str(MIXTRAL) in job.args for job in chosen):
        from build_tiny_model import build_mixtral

        build_mixtral(str(LLAMA), str(MIXTRAL))
    if any(str(DFLASH_DRAFT) in job.args for job in chosen):
        from dspark_model import write_dflash_variant

        write_dflash_variant(DRAFT, DFLASH_DRAFT)
    if any(str(GATED_DRAFT) in job.args for job in chosen):
        from dspark_model import write_markov_variant

        write_markov_variant(DRAFT, GATED_DRAFT, "gated")


def jobs_for(version: str, gpus: int = 1) -> list[Job]:
    from packaging.version import Version

    return [
        j
        for j in jobs()
        if Version(j.min_version) <= Version(version) < Version(j.below_version) and j.gpus <= gpus
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--jobs", type=int, default=6, help="engines at once on the GPU")
    parser.add_argument("--only", nargs="*", help="run only these jobs")
    parser.add_argument(
        "--part",
        choices=[
            *("core", "extra", "perf", "v4", "v4-compiled", "v4-matrix"),
            *("dp2", "v4-dp2", "tp2", "all"),
        ],
        default="all",
    )
    parser.add_argument(
        "--deadline",
        type=float,
        default=540,
        help="seconds for the suite, model builds included (the call's limit also "
        "covers the install before it: leave it about 60 s)",
    )
    parser.add_argument(
        "--job-timeout",
        type=float,
        help="raise each engine job's own limit to this (a fresh machine's V4 start-up "
        "compiles its kernels: over 480 s for three engines at once)",
    )
    args = parser.parse_args()
    started = time.perf_counter()  # the deadline counts the model build too
    facts = environment()
    version = facts["vllm"]
    chosen = [
        j
        for j in jobs_for(version, facts["gpus"])
        if (not args.only or j.name in args.only)
        and (args.part == j.part or (args.part == "all" and j.part in ALL_PARTS))
    ]
    if args.job_timeout:
        chosen = [replace(j, timeout=max(j.timeout, args.job_timeout)) for j in chosen]
    build_models(chosen)
    scratch = Path(tempfile.mkdtemp(prefix="gpu-suite-"))
    at_once = min(args.jobs, V4_AT_ONCE) if args.part.startswith("v4") else args.jobs
    outcomes = run_jobs(chosen, at_once, started + args.deadline, scratch)
    rows = evaluate(outcomes)
    args.out.mkdir(parents=True, exist_ok=True)
    record = {
        **facts,
        "date": datetime.date.today().isoformat(),
        "wall_s": round(time.perf_counter() - started, 1),
        "jobs": {
            name: {"seconds": round(o.seconds, 1), "returncode": o.returncode}
            for name, o in outcomes.items()
        },
        "results": saved_results(outcomes),
        "statuses": {name: o.statuses for name, o in outcomes.items()},
        "checks": rows,
    }
    (args.out / f"gpu-results-{version}.json").write_text(json.dumps(record, indent=1) + "\n")
    with tarfile.open(args.out / f"logs-{version}.tar.gz", "w:gz") as logs:
        for name, outcome in outcomes.items():
            path = scratch / f"{name}.log"
            path.write_text(outcome.log)
            logs.add(path, arcname=f"{name}.log")
    print(hand_back_kernel_cache(args.out))
    for name, o in outcomes.items():
        print(f"job {name:32} rc {o.returncode:>3} {o.seconds:6.1f}s")
    for row in rows:
        mark = {True: "PASS", False: "FAIL", None: "SKIP"}[row["passed"]]
        print(f"{mark}  {row['check']}: {row['figure'][:200]}")
    for name in (n for n in outcomes if n.startswith("bench-")):
        result = outcomes.get(name) and outcomes[name].result
        if result:
            print(
                name,
                {b: round(v["tok_s"]) for b, v in result["tokens_per_s"].items()},
                "first round s",
                {b: round(v["first_s"], 2) for b, v in result["tokens_per_s"].items()},
            )
    ran = [r for r in rows if r["passed"] is not None]
    print(f"vLLM {version}: {sum(r['passed'] for r in ran)}/{len(ran)} checks passed")


if __name__ == "__main__":
    main()
