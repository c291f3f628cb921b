"""What an idle data-parallel rank's dummy batch hands the attention builders.

Starts a real ``vllm.LLM`` (multiprocess), serves a request so the persistent batch
holds real history, leaves one stale row behind as a request aborted during chunked
prefill would, then runs ``Worker.execute_dummy_batch()`` inside the worker with
attention metadata forced on (an idle rank on FULL decode graphs builds it; the CPU
platform runs without cudagraphs). Prints ``RESULT {json}``: per captured
``CommonAttentionMetadata``, the query lengths, contexts, positions, how
``split_decodes_and_prefills`` classes the requests at the runner's uniform decode
query length, and whether the persistent rows were left as they were.

    python tools/inspect_dummy_batch.py MODEL_DIR [--ngram]
"""

from __future__ import annotations

import argparse
import json
import os

NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
STALE_ROW = 3  # a row beyond the live requests, as condense() leaves them
STALE_COMPUTED, STALE_PROMPT = 16, 64  # aborted half-way through a chunked prefill


def inspect_in_worker(worker) -> dict:  # noqa: ANN001
    """Runs in the worker process through ``LLM.collective_rpc``."""
    import functools

    from vllm.v1.attention.backends.utils import split_decodes_and_prefills

    runner = worker.model_runner
    batch = runner.input_batch
    batch.num_computed_tokens_cpu[: STALE_ROW + 1] = STALE_COMPUTED
    batch.num_prompt_tokens[: STALE_ROW + 1] = STALE_PROMPT
    captured: list = []
    restore_builders = _capture_builder_input(runner, captured)
    runner._dummy_run = functools.partial(runner._dummy_run, force_attention=True)
    try:
        worker.execute_dummy_batch()
    finally:
        del runner._dummy_run
        restore_builders()
    threshold = runner.uniform_decode_query_len
    facts = [_describe(cam, threshold, split_decodes_and_prefills) for cam in captured]
    rows_kept = bool(
        (batch.num_computed_tokens_cpu[: STALE_ROW + 1] == STALE_COMPUTED).all()
        and (batch.num_prompt_tokens[: STALE_ROW + 1] == STALE_PROMPT).all()
    )
    builders = sorted(
        {type(g.get_metadata_builder()).__name__ for gs in runner.attn_groups for g in gs}
    )
    return {
        "uniform_decode_query_len": threshold,
        "builds": facts,
        "rows_kept": rows_kept,
        "builders": builders,
    }


def _capture_builder_input(runner, captured: list):  # noqa: ANN001, ANN202
    builders = [group.get_metadata_builder() for groups in runner.attn_groups for group in groups]

    def capturing(build):  # noqa: ANN001, ANN202
        def build_and_capture(
            common_prefix_len, common_attn_metadata, *args, **kwargs
        ):  # noqa: ANN001, ANN202
            captured.append(_snapshot(common_attn_metadata))
            return build(common_prefix_len, common_attn_metadata, *args, **kwargs)

        return build_and_capture

    for builder in builders:
        builder.build = capturing(builder.build)

    def restore() -> None:
        for builder in builders:
            del builder.build

    return restore


def _snapshot(cam):  # noqa: ANN001, ANN202
    """A copy: the runner reuses these buffers for the next step."""
    import copy

    snap = copy.copy(cam)
    for name in ("query_start_loc_cpu", "seq_lens", "seq_lens_cpu_upper_bound", "positions"):
        setattr(snap, name, getattr(cam, name).clone())
    if cam.is_prefilling is not None:
        snap.is_prefilling = cam.is_prefilling.clone()
    return snap


def _describe(cam, threshold: int, split) -> dict:  # noqa: ANN001
    num_reqs = cam.num_reqs
    query_lens = (cam.query_start_loc_cpu[1:] - cam.query_start_loc_cpu[:-1]).tolist()
    seq_lens = cam.seq_lens.cpu().tolist()
    upper = cam.seq_lens_cpu_upper_bound.tolist()
    num_decodes, num_prefills, _, _ = split(
        cam, decode_threshold=threshold, treat_short_extends_as_decodes=False
    )
    return {
        "num_reqs": num_reqs,
        "query_lens": query_lens,
        "seq_lens": seq_lens,
        "seq_lens_cpu_upper_bound": upper,
        "contexts": [s - q for s, q in zip(seq_lens, query_lens, strict=True)],
        "positions": cam.positions[: cam.num_actual_tokens].tolist(),
        "max_seq_len": cam.max_seq_len,
        "is_prefilling": cam.is_prefilling.tolist() if cam.is_prefilling is not None else None,
        "num_decodes": num_decodes,
        "num_prefills": num_prefills,
    }


def regrouped_heads(model: str, head_dim: int) -> dict:
    """Config overrides giving a Llama-style model heads of ``head_dim`` with the
    same projection shapes (fewer, wider heads), so its checkpoint still loads."""
    with open(os.path.join(model, "config.json")) as handle:
        config = json.load(handle)
    hidden = config["hidden_size"]
    if config.get("head_dim"):
        raise SystemExit("--head-dim: this model's config sets head_dim; only derived ones regroup")
    if hidden % head_dim:
        raise SystemExit(f"--head-dim: {head_dim} must divide hidden_size {hidden}")
    heads = hidden // head_dim
    kv_heads = config.get("num_key_value_heads", config["num_attention_heads"])
    if kv_heads * heads % config["num_attention_heads"]:
        raise SystemExit(f"--head-dim: {head_dim} leaves no whole number of KV heads")
    # head_dim too: the loaded config derived it from the original head count
    return {
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads * heads // config["num_attention_heads"],
        "head_dim": head_dim,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--ngram", action="store_true", help="speculative decoding: q > 1")
    parser.add_argument("--dtype", default="float32", help="bfloat16 reaches FlashAttention")
    parser.add_argument("--kv-cache-gib", type=float, help="a fixed KV cache (GPU sharing)")
    parser.add_argument("--attention-backend", help="e.g. FLASHINFER (default: vLLM chooses)")
    parser.add_argument(
        "--head-dim",
        type=int,
        help="regroup the model's attention heads to this size (FlashInfer takes 64, 128, 256)",
    )
    options = parser.parse_args()
    backend = {"attention_backend": options.attention_backend} if options.attention_backend else {}
    if options.head_dim:
        backend["hf_overrides"] = regrouped_heads(options.model, options.head_dim)
    # collective_rpc ships the inspection function to the worker by value
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    from generate import tiny_llm
    from vllm import SamplingParams

    llm = tiny_llm(
        options.model,
        dtype=options.dtype,
        kv_cache_gib=options.kv_cache_gib,
        speculative_config=NGRAM if options.ngram else None,
        **backend,
    )
    llm.generate(["def main("], SamplingParams(max_tokens=8, temperature=0))
    (result,) = llm.collective_rpc(inspect_in_worker)
    result["head_size"] = llm.llm_engine.model_config.get_head_size()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
