"""Record what the overlay's V1 DSpark drafter computes inside a real engine.

Runs ``vllm.LLM`` (through the overlay, which must be on PYTHONPATH) with a DSpark
draft, and in the worker records, at every drafting step and for every request,
the request's prompt, the anchor token and its position, the draft's base
logits for the N slots and the N tokens drafted. Prints ``RESULT {json}`` with the
records, so a test can recompute each block from scratch on the committed prefix.

With ``--served-context`` (a DeepSeek-V4 draft), the recompute is run a second time
with the context the served requests gave the draft: every committed position's
combined target hidden state, as served, replaces the one the recompute's prefill
computed. The draft then sees the same inputs in both runs, so what is left of a
difference is the serving loop's (slots, context rows, positions), not the target's
numerics at another batch shape.

    python tools/record_dspark_drafts.py TARGET DRAFT [--max-tokens N] [--prompts ...]
"""

from __future__ import annotations

import argparse
import json
import os

DEFAULT_PROMPTS = ["def main(", "class Parser:"]


def sparse(logits) -> dict:  # noqa: ANN001
    """A slot's logits as its non-zero entries: exact, and small where most of the
    vocabulary's rows are zero (the tiny V4's LM head keeps 16)."""
    import torch

    ids = torch.nonzero(logits).flatten()
    return {"size": logits.shape[0], "ids": ids.tolist(), "values": logits[ids].tolist()}


def install_recorder(worker, sparse_logits: bool = False) -> None:  # noqa: ANN001
    """Runs in the worker: wrap this drafter instance's sampling stage."""
    runner = worker.model_runner
    drafter = runner.drafter
    sample = drafter._sample_draft_tokens
    records: list[dict] = []

    def recording(hidden_states, sampling_metadata):  # noqa: ANN001, ANN202
        slots = drafter.num_speculative_tokens
        base = drafter.model.compute_draft_logits(hidden_states).float().cpu()
        rows = [sparse(slot) for slot in base] if sparse_logits else base.tolist()
        drafts, probs = sample(hidden_states, sampling_metadata)
        batch = runner.input_batch
        for row in range(base.shape[0] // slots):
            # token_ids_cpu lags behind the drafts accepted this step, so the
            # committed prefix is taken from the final output at the anchor's position
            prompt_length = int(batch.num_prompt_tokens[row])
            records.append(
                {
                    "prompt": batch.token_ids_cpu[row, :prompt_length].tolist(),
                    "anchor_position": int(drafter.positions[row * slots]),
                    "anchor": int(drafter._anchors[row]),
                    "base_logits": rows[row * slots : (row + 1) * slots],
                    "drafts": drafts[row * slots : (row + 1) * slots].tolist(),
                }
            )
        return drafts, probs

    drafter._sample_draft_tokens = recording
    worker.dspark_records = records
    if hasattr(drafter, "draft_groups"):  # the V4 drafter: its context can be swapped
        worker.served_context = ServedContext(runner, drafter)
    worker.published_ids = _capture_published_request_ids(runner)


class ServedContext:
    """The V4 drafter's context rows, by request and position: recorded while the
    served requests run, then written over a recompute's own (``mode``).

    A committed position's row is written once, in the step that verified its token
    (rejected rows carry slot -1 and are skipped), so the last row recorded for a
    position is the one every later block of that request read."""

    def __init__(self, runner, drafter) -> None:  # noqa: ANN001
        self.runner, self.drafter = runner, drafter
        self.rows: dict[str, dict[int, object]] = {}
        self.prompts: dict[str, tuple[int, ...]] = {}
        self.mode = "record"  # then "off" (a pristine recompute), then "substitute"
        self.replaced = self.missing = 0
        self.common = None
        set_inputs, build_inputs = (
            drafter.set_inputs_first_pass,
            drafter.build_model_inputs_first_pass,
        )

        def keep_common(**kwargs):  # noqa: ANN003, ANN202
            self.common = kwargs["cad"]
            return set_inputs(**kwargs)

        def visit_context(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            self.visit()
            return build_inputs(*args, **kwargs)

        drafter.set_inputs_first_pass = keep_common
        drafter.build_model_inputs_first_pass = visit_context

    def visit(self) -> None:
        if self.mode == "off":
            return
        from vllm_v4_patches.dspark.v4_proposer import token_rows

        drafter, batch = self.drafter, self.runner.input_batch
        count = drafter._dflash_num_context
        hidden = drafter._dflash_hidden_states
        rows = token_rows(self.common.query_start_loc, self.common.num_reqs, count).tolist()
        positions = drafter._context_positions_buffer[:count].tolist()
        slots = drafter._context_slot_mapping_buffer[:count].tolist()
        prompts: dict[int, tuple[int, ...]] = {}  # a batch row's prompt, read once a step
        for index, (row, position, slot) in enumerate(zip(rows, positions, slots, strict=True)):
            if slot < 0:
                continue
            request = batch.req_ids[row]
            if row not in prompts:
                length = int(batch.num_prompt_tokens[row])
                prompts[row] = tuple(batch.token_ids_cpu[row, :length].tolist())
            prompt = prompts[row]
            if self.mode == "record":
                self.prompts[request] = prompt
                self.rows.setdefault(request, {})[position] = hidden[index].clone()
                continue
            served = self.rows.get(self.source_of(prompt), {}).get(position)
            if served is None:
                # past the committed prefix (the recompute's own next step) the served
                # request may have no row; within it every row must be replaced
                self.missing += position < len(prompt)
            else:
                hidden[index].copy_(served)
                self.replaced += 1

    def source_of(self, prompt: tuple[int, ...]) -> str | None:
        """The served request whose prompt the recompute's prompt extends (longest)."""
        matches = [
            (len(own), request)
            for request, own in self.prompts.items()
            if prompt[: len(own)] == own
        ]
        return max(matches)[1] if matches else None


def set_context_mode(mode: str):  # noqa: ANN201
    """A worker call that stops recording (``off``) or starts substituting."""

    def set_mode(worker) -> None:  # noqa: ANN001
        worker.served_context.mode = mode

    return set_mode


def substitution_counts(worker) -> dict:  # noqa: ANN001
    """Context rows replaced by served ones, and committed-prefix rows without one."""
    context = worker.served_context
    return {"replaced": context.replaced, "missing": context.missing}


def _capture_published_request_ids(runner) -> list:  # noqa: ANN001
    """What ``vllm_v4_patches.request_ids.current()`` says inside the target's real
    attention builders, next to the batch's own ids: a builder's view of the API."""
    from vllm_v4_patches import request_ids

    seen: list = []
    for groups in runner.attn_groups:
        for group in groups:
            builder = group.get_metadata_builder()
            build = builder.build

            def build_and_look(*args, build=build, **kwargs):  # noqa: ANN002, ANN003, ANN202
                # (common_prefix_len, common_attn_metadata, ...), by position or name
                cam = kwargs.get("common_attn_metadata") or args[1]
                expected = list(runner.input_batch.req_ids[: cam.num_reqs])
                seen.append([list(request_ids.current()[: cam.num_reqs]), expected])
                return build(*args, **kwargs)

            builder.build = build_and_look
    return seen


def collect_records(worker) -> dict:  # noqa: ANN001
    """Runs in the worker: what was recorded since the last collection."""
    collected = {"records": list(worker.dspark_records), "published_ids": worker.published_ids}
    worker.dspark_records.clear()
    return collected


def committed_prefixes(run: dict) -> list[list[int]]:
    """Each record's context: its request's final sequence up to the anchor, whose
    next token must be the anchor. Blocks drafted in a request's last step (anchor
    past the end: never verified) are dropped from ``run["records"]``."""
    by_prompt = {}
    for sequence in run["sequences"]:
        for record in run["records"]:
            if sequence[: len(record["prompt"])] == record["prompt"]:
                by_prompt[tuple(record["prompt"])] = sequence
    kept, prefixes = [], []
    for record in run["records"]:
        sequence = by_prompt[tuple(record["prompt"])]
        if record["anchor_position"] >= len(sequence):
            continue
        if sequence[record["anchor_position"]] != record["anchor"]:
            raise AssertionError(f"anchor {record['anchor']} is not the sequence's token")
        kept.append(record)
        prefixes.append(sequence[: record["anchor_position"]])
    run["records"] = kept
    return prefixes


def serve(llm, prompts: list, max_tokens: int) -> dict:  # noqa: ANN001
    """Greedy answers with the drafter recording, and what it recorded."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    (collected,) = llm.collective_rpc(collect_records)
    sequences = [list(out.prompt_token_ids) + list(out.outputs[0].token_ids) for out in outputs]
    return {"sequences": sequences, **collected}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("target")
    parser.add_argument("draft")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--spec-tokens", type=int, default=4)
    parser.add_argument("--prompts", nargs="*", default=DEFAULT_PROMPTS)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-dtype", help="vLLM's kv_cache_dtype (DeepSeek-V4: fp8)")
    parser.add_argument("--kv-cache-gib", type=float, help="a fixed KV cache (GPU sharing)")
    parser.add_argument(
        "--recompute",
        action="store_true",
        help="then serve each committed prefix as a new prompt in the same engine, prefix "
        "caching off: each block's from-scratch twin (RESULT's 'fresh')",
    )
    parser.add_argument(
        "--sparse-logits",
        action="store_true",
        help="record each slot's draft logits as its non-zero entries (a result the GPU "
        "suite can keep)",
    )
    parser.add_argument(
        "--served-context",
        action="store_true",
        help="with --recompute and a DeepSeek-V4 draft: recompute again with the served "
        "context rows in place of the recompute's own (RESULT's 'fresh_served')",
    )
    options = parser.parse_args()
    # collective_rpc ships the recorder to the worker by value
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    from generate import dspark_speculation, tiny_llm

    llm = tiny_llm(
        options.target,
        dtype=options.dtype,
        kv_cache_gib=options.kv_cache_gib,
        speculative_config=dspark_speculation(options.draft, options.spec_tokens),
        # a recomputed prefix must not read the cache the served requests wrote
        **({"enable_prefix_caching": False} if options.recompute else {}),
        **({"kv_cache_dtype": options.kv_cache_dtype} if options.kv_cache_dtype else {}),
    )
    llm.collective_rpc(install_recorder, args=(options.sparse_logits,))
    result = serve(llm, options.prompts, options.max_tokens)
    if options.recompute:
        prefixes = committed_prefixes(result)
        prompts = [{"prompt_token_ids": ids} for ids in prefixes]
        if options.served_context:
            llm.collective_rpc(set_context_mode("off"))
        result.update(prefixes=prefixes, fresh=serve(llm, prompts, 2))
        if options.served_context:
            llm.collective_rpc(set_context_mode("substitute"))
            served = serve(llm, prompts, 2)
            (served["substituted"],) = llm.collective_rpc(substitution_counts)
            result["fresh_served"] = served
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
