"""An independent reference for the shrunken DeepSeek-V4 and its DSpark stages.

    python tools/v4_reference.py CHECKPOINT RUN.json[.gz] [--job JOB] [--work DIR]

The target is Hugging Face transformers' own ``DeepseekV4ForCausalLM`` (float32, on
the CPU), loaded through its own loader from a dequantised copy of the checkpoint
(the fp8 and MXFP4 weights decoded exactly; bfloat16 holds every decoded value). The
DSpark stages are the same library's V4 decoder layers, loaded the same way from the
stage tensors; the block around them is written here from the draft's definition
(``shared/reference/dspark.md`` section 1.4): the taps are the tapped layers' output
streams averaged, ``main_x = main_norm(main_proj(taps))``; each stage attends, from
every block token, to the context rows of the ``sliding_window`` positions before the
anchor (``kv_norm(wkv(main_x))`` with RoPE at their own positions) and to the whole
block, with the attention sink; the last stage's head stack gives the pre-norm hidden
state and the target's LM head the base logits.

Given a GPU run's record of served draft blocks (``tools/record_dspark_drafts.py``: each
block's committed prefix, anchor and sparse base logits), it reports per slot the
difference between the served logits and this reference's, on the served ids, and a
control: the same served logits against the reference of another block's prefix;
and per slot whether the served draft is the greedy pick of the reference's vanilla
Markov walk (teacher-forced on the served drafts), over the reference's base logits
and over the served ones.
Given a run's greedy sequences, it reports the target's teacher-forced agreement:
each served pick against this reference's logits at that step. ``--score-jobs`` does
the same for other engine jobs of the run (``tools/generate.py`` answers on the same
prompts, first ones first, such as stock's without speculation), over as many
answer tokens as the recorded sequences have: whether a release's target itself
computes what the reference does, with or without the overlay.
``--teacher-forced-jobs`` compares the scores an engine gave its own answers
(``tools/generate.py --teacher-forced``: every prompt and answer in one prefill) with
this reference's, on the same packed batch.

``--hash-norm warp`` gives the reference vLLM 0.20's hash routing (``WarpHashNorm``):
that release's kernel divides a hash-routed token's expert weights by the sum over
every row its warp holds, not over the token's own row. With the shrunken model's 8
experts a warp holds 16 rows; with the real 256, one, where both agree.

Needs torch, transformers (with DeepSeek-V4) and safetensors.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import struct
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import build_tiny_v4 as tiny  # noqa: E402  (the checkpoint's own encodings)
from vllm_v4_patches.dspark.v4_stages import stage_tensor_place  # noqa: E402

SAFETENSORS_DTYPES = {
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "I64": torch.int64,
    "I8": torch.int8,
    "U8": torch.uint8,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E8M0": torch.uint8,  # the exponent byte; decoded with its weight
}


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of one file, in its stored dtype (``F8_E8M0`` as its bytes)."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    data = memoryview(raw)[8 + length :]
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        start, end = entry["data_offsets"]
        dtype = SAFETENSORS_DTYPES[entry["dtype"]]
        flat = torch.frombuffer(bytearray(data[start:end]), dtype=dtype)
        tensors[name] = flat.reshape(entry["shape"])
    return tensors


def decoded(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors with every quantised weight decoded (its ``.scale`` dropped): fp8
    128x128 blocks and MXFP4 groups of 32, into bfloat16 (exact for both)."""
    out = {}
    for name, tensor in tensors.items():
        if name.endswith(".scale"):
            continue
        scale = tensors.get(name.removesuffix(".weight") + ".scale")
        if scale is not None and tensor.dtype == torch.float8_e4m3fn:
            tensor = tiny.dequantize_fp8_block(tensor.view(torch.uint8), scale).bfloat16()
        elif scale is not None and tensor.dtype == torch.int8:
            tensor = tiny.dequantize_fp4_mx(tensor, scale).bfloat16()
        out[name] = tensor
    return out


def write_hf_copies(checkpoint: Path, work: Path) -> tuple[Path, Path, Path]:
    """Two checkpoints transformers loads as they are (``target``: the target's
    tensors; ``stages``: the DSpark stages as the layers of a V4 model with the
    target's embedding and head and the draft's head stack) and ``draft.safetensors``
    (the combiner and the Markov head)."""
    from safetensors.torch import save_file

    config = json.loads((checkpoint / "config.json").read_text())
    target_dir, stages_dir = work / "target", work / "stages"
    extras_path = work / "draft.safetensors"
    if extras_path.exists():
        return target_dir, stages_dir, extras_path
    for folder in (target_dir, stages_dir):
        folder.mkdir(parents=True, exist_ok=True)
    target_config = {k: v for k, v in config.items() if k != "quantization_config"}
    target_config["compress_ratios"] = config["compress_ratios"][: config["num_hidden_layers"]]
    stage_count = len(config["compress_ratios"]) - config["num_hidden_layers"]
    stage_config = {
        **target_config,
        "num_hidden_layers": stage_count,
        "compress_ratios": [0] * stage_count,
        "num_hash_layers": 0,  # the stages route by their learned gate
    }
    extras: dict[str, torch.Tensor] = {}
    last = f"mtp.{stage_count - 1}."
    weight_maps: dict[Path, dict[str, str]] = {target_dir: {}, stages_dir: {}}
    for index, shard in enumerate(sorted(checkpoint.glob("*.safetensors"))):
        tensors = decoded(read_safetensors(shard))
        target, stages = {}, {}
        for name, tensor in tensors.items():
            place = stage_tensor_place(name)
            if not name.startswith("mtp."):
                target[name] = tensor
                if name in ("embed.weight", "head.weight"):
                    stages[name] = tensor
            elif place is None:
                continue  # the confidence head: not part of the base logits
            elif place[0] == "layer":
                stages[place[1]] = tensor
            elif name.startswith(last) and place[1].startswith(("norm.", "hc_head")):
                stages[place[1]] = tensor
            else:
                extras[place[1]] = tensor
        for folder, part in ((target_dir, target), (stages_dir, stages)):
            if part:
                file_name = f"part-{index:02d}.safetensors"
                save_file({k: v.contiguous() for k, v in part.items()}, str(folder / file_name))
                weight_maps[folder].update(dict.fromkeys(part, file_name))
    for folder, folder_config in ((target_dir, target_config), (stages_dir, stage_config)):
        (folder / "config.json").write_text(json.dumps(folder_config))
        index_json = {"metadata": {}, "weight_map": weight_maps[folder]}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index_json))
    save_file({k: v.contiguous() for k, v in extras.items()}, str(extras_path))
    return target_dir, stages_dir, extras_path


HASH_NORMS = ("row", "warp")


def kernel_rows_per_warp(experts: int, lanes: int = 32, experts_per_load: int = 4) -> int:
    """How many tokens one warp of vLLM's ``topk_softplus_sqrt`` kernel routes: its
    float32 router logits are read 16 bytes (4 experts) a lane, at least one load per
    lane, so a token takes ``experts / (4 * max(1, experts / 128))`` lanes."""
    per_lane = experts_per_load * max(1, experts // (experts_per_load * lanes))
    return max(1, lanes // max(1, experts // per_lane))


def warp_sums(selected: torch.Tensor, rows: int) -> torch.Tensor:
    """Each row's warp total: ``selected [T]`` summed over consecutive groups of
    ``rows`` from the first (the last group as long as the tokens left; the kernel's
    lanes past the last token have returned and, taken as adding nothing, are so
    here)."""
    groups = selected.split(rows)
    return torch.cat([group.sum().expand(len(group)) for group in groups])


class WarpHashNorm:
    """vLLM 0.20's normalisation of hash-routed expert weights, on a transformers V4.

    Its CUDA kernel (``csrc/moe/topk_softplus_sqrt_kernels.cu`` in the 0.20.2 source
    distribution, the hash path) sums a token's selected scores with a reduction
    over all 32 lanes of the warp; 0.21.0 reduces over the token's own lanes only.
    Each hash-routed gate of ``model`` is given a forward that divides by its warp's
    total: the rows of one forward call grouped from its first, ``rows`` to a warp,
    unless ``fixed`` holds the denominators (by layer) of a packed batch that this
    forward is one sequence of. ``selected`` keeps, by layer, the last call's sums of
    selected scores."""

    def __init__(self, model: Any, rows: int) -> None:
        self.rows = rows
        self.fixed: dict[int, torch.Tensor] | None = None
        self.selected: dict[int, torch.Tensor] = {}
        self.layers = [i for i, layer in enumerate(model.model.layers) if layer.mlp.is_hash]
        for index in self.layers:
            gate = model.model.layers[index].mlp.gate
            gate.forward = functools.partial(self.route, gate, index)

    def route(
        self, gate: Any, layer: int, hidden_states: torch.Tensor, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = torch.nn.functional.linear(hidden_states.reshape(-1, gate.hidden_dim), gate.weight)
        indices = gate.tid2eid[input_ids.reshape(-1)].long()
        weights = gate.score_fn(logits).gather(1, indices)
        selected = weights.sum(dim=-1)
        self.selected[layer] = selected
        totals = warp_sums(selected, self.rows) if self.fixed is None else self.fixed[layer]
        return logits, weights / totals[:, None] * gate.routed_scaling_factor, indices


class Reference:
    """The target and the draft stages in float32, on the CPU."""

    def __init__(self, checkpoint: Path, work: Path, hash_norm: str = "row") -> None:
        from safetensors.torch import load_file
        from transformers import DeepseekV4ForCausalLM

        target_dir, stages_dir, extras_path = write_hf_copies(checkpoint, work)
        self.config = json.loads((checkpoint / "config.json").read_text())
        self.target = loaded(DeepseekV4ForCausalLM, target_dir)
        self.hash_norm = None
        if hash_norm == "warp":
            rows = kernel_rows_per_warp(self.config["n_routed_experts"])
            self.hash_norm = WarpHashNorm(self.target, rows)
        self.stages = loaded(DeepseekV4ForCausalLM, stages_dir)
        self.extras = {k: v.float() for k, v in load_file(str(extras_path)).items()}
        self.taps_cache: dict[tuple[int, ...], torch.Tensor] = {}

    @torch.inference_mode()
    def target_logits(self, tokens: list[int]) -> torch.Tensor:
        ids = torch.tensor([tokens])
        return self.target(input_ids=ids).logits[0].float()

    @torch.inference_mode()
    def taps(self, tokens: list[int]) -> torch.Tensor:
        """``[T, len(taps) * H]``: each tapped layer's output streams, averaged."""
        key = tuple(tokens)
        if key not in self.taps_cache:
            self.taps_cache[key] = self._taps(tokens)
        return self.taps_cache[key]

    def _taps(self, tokens: list[int]) -> torch.Tensor:
        outputs: dict[int, torch.Tensor] = {}
        hooks = [
            layer.register_forward_hook(
                lambda module, args, out, index=index: outputs.__setitem__(index, out)
            )
            for index, layer in enumerate(self.target.model.layers)
        ]
        try:
            self.target(input_ids=torch.tensor([tokens]))
        finally:
            for hook in hooks:
                hook.remove()
        layers = self.config["dspark_target_layer_ids"]
        return torch.cat([outputs[layer][0].mean(dim=1) for layer in layers], dim=-1)

    @torch.inference_mode()
    def draft_base_logits(
        self, prefix: list[int], anchor: int, variant: str = "exact"
    ) -> torch.Tensor:
        """``[N, vocab]``: the block's base logits (before the Markov head) for the
        block anchored at ``len(prefix)``, the prefix being the committed tokens.
        ``variant`` names a deliberate error, for the comparison's negative
        controls: ``causal`` (each block token sees only the block tokens before
        it), ``short-context`` (the last context row missing)."""
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
            apply_rotary_pos_emb,
            eager_attention_forward,
        )

        block = self.config["dspark_block_size"]
        window = self.config["sliding_window"]
        anchor_position = len(prefix)
        main_x = self.taps(prefix) @ self.extras["main_proj.weight"].T
        main_x = rms_norm(main_x, self.extras["main_norm.weight"], self.config["rms_norm_eps"])
        first = max(0, anchor_position - window)
        last = anchor_position - (variant == "short-context")
        context = main_x[first:last][None]
        context_positions = torch.arange(first, last)[None]
        mask = None
        if variant == "causal":
            later = torch.ones(block, block, dtype=torch.bool).triu(1)
            mask = torch.zeros(block, context.shape[1] + block)
            mask[:, context.shape[1] :][later] = float("-inf")
        block_positions = torch.arange(anchor_position, anchor_position + block)[None]
        ids = torch.tensor([[anchor] + [self.config["dspark_noise_token_id"]] * (block - 1)])
        model = self.stages.model
        rope_block = model.rotary_emb(context, block_positions, layer_type="main")
        rope_context = model.rotary_emb(context, context_positions, layer_type="main")
        hc = self.config["hc_mult"]
        streams = model.embed_tokens(ids)[:, :, None].expand(-1, -1, hc, -1).contiguous()
        for layer in model.layers:
            attn = layer.self_attn
            post, comb, collapsed = layer.attn_hc(streams)
            hidden = layer.input_layernorm(collapsed)
            heads = (1, block, -1, attn.head_dim)
            q = attn.q_b_proj(attn.q_a_norm(attn.q_a_proj(hidden))).view(heads).transpose(1, 2)
            q = apply_rotary_pos_emb(attn.q_b_norm(q), *rope_block)
            kv_block = attn.kv_norm(attn.kv_proj(hidden)).view(1, block, 1, -1).transpose(1, 2)
            kv_block = apply_rotary_pos_emb(kv_block, *rope_block)
            kv_context = attn.kv_norm(attn.kv_proj(context)).view(1, -1, 1, attn.head_dim)
            kv_context = apply_rotary_pos_emb(kv_context.transpose(1, 2), *rope_context)
            kv = torch.cat([kv_context, kv_block], dim=2)
            # no mask: every block token sees the window and the whole block
            out, _ = eager_attention_forward(attn, q, kv, kv, mask, attn.scaling)
            cos, sin = rope_block
            out = apply_rotary_pos_emb(out.transpose(1, 2), cos, -sin).transpose(1, 2)
            grouped = attn.o_a_proj(out.reshape(1, block, attn.config.o_groups, -1)).flatten(2)
            attn_out = attn.o_b_proj(grouped)
            streams = post.unsqueeze(-1) * attn_out.unsqueeze(-2) + torch.matmul(
                comb.transpose(-1, -2), streams
            )
            post, comb, collapsed = layer.ffn_hc(streams)
            mlp = layer.mlp(layer.post_attention_layernorm(collapsed), input_ids=ids)
            streams = post.unsqueeze(-1) * mlp.unsqueeze(-2) + torch.matmul(
                comb.transpose(-1, -2), streams
            )
        head_hidden = model.hc_head(streams)
        return self.stages.lm_head(model.norm(head_hidden))[0].float()


def loaded(model_class: Any, folder: Path) -> Any:
    """The model from ``folder`` in float32; every parameter must come from the file."""
    model, info = model_class.from_pretrained(
        str(folder), dtype=torch.float32, output_loading_info=True
    )
    missing = [k for k in info["missing_keys"] if "rotary" not in k]
    if missing or info["mismatched_keys"]:
        raise ValueError(
            f"{folder}: missing {missing[:5]}, mismatched {info['mismatched_keys'][:5]}"
        )
    return model.eval()


def markov_bias(extras: dict[str, torch.Tensor], previous: int) -> torch.Tensor:
    """``[vocab]``: the vanilla Markov head's bias after token ``previous``."""
    code = extras["markov_head.markov_w1.weight"][previous]
    return extras["markov_head.markov_w2.weight"] @ code


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def dense(sparse: dict[str, Any]) -> tuple[list[int], torch.Tensor]:
    return sparse["ids"], torch.tensor(sparse["values"], dtype=torch.float32)


DRAFT_VARIANTS = ("exact", "causal", "short-context")


def compare_drafts(
    reference: Reference, result: dict[str, Any], variant_blocks: int | None = None
) -> dict[str, Any]:
    """Per slot, the largest difference over the served ids between the served base
    logits and the reference's, both centred on their mean over those ids (a common
    offset moves no pick): against the reference of the block's own committed
    prefix, against its deliberately wrong variants, and (the control) against the
    reference of another block. The variants run on the first ``variant_blocks``
    blocks (all by default); ``closer_to_exact`` is the share of their slots whose
    served logits lie nearer the exact reference than the variant."""
    records = result["records"]
    cache: dict[tuple, torch.Tensor] = {}

    def reference_logits(record: dict[str, Any], variant: str = "exact") -> torch.Tensor:
        prompt = record["prompt"]
        sequence = next(s for s in result["sequences"] if s[: len(prompt)] == prompt)
        committed = tuple(sequence[: record["anchor_position"]])
        key = (committed, record["anchor"], variant)
        if key not in cache:
            cache[key] = reference.draft_base_logits(list(committed), record["anchor"], variant)
        return cache[key]

    def distances(served: list[dict], logits: torch.Tensor) -> list[float]:
        gaps = []
        for slot, sparse in enumerate(served):
            ids, values = dense(sparse)
            ours = logits[slot, ids]
            gaps.append(float(((values - values.mean()) - (ours - ours.mean())).abs().max()))
        return gaps

    by_variant: dict[str, list[list[float]]] = {name: [] for name in DRAFT_VARIANTS}
    control: list[float] = []
    draft_gaps: list[float] = []
    served_base_gaps: list[float] = []
    no_bias_gaps: list[float] = []  # the control: the served base logits' own argmax
    for index, record in enumerate(records):
        draft_gaps += markov_gaps(reference, record, reference_logits(record))
        served_base_gaps += markov_gaps(reference, record, served_dense(record))
        no_bias_gaps += markov_gaps(reference, record, served_dense(record), with_bias=False)
        for name in DRAFT_VARIANTS:
            if name != "exact" and variant_blocks is not None and index >= variant_blocks:
                continue
            by_variant[name].append(
                distances(record["base_logits"], reference_logits(record, name))
            )
        other = records[(index + 1) % len(records)]
        if (other["prompt"], other["anchor_position"]) != (
            record["prompt"],
            record["anchor_position"],
        ):
            control += distances(record["base_logits"], reference_logits(other))
    report: dict[str, Any] = {"blocks": len(records)}
    for name, per_block in by_variant.items():
        flat = [gap for block in per_block for gap in block]
        per_slot = list(zip(*per_block, strict=True))
        report[name] = {
            "median": statistics.median(flat),
            "p90": statistics.quantiles(flat, n=10)[-1],
            "max": max(flat),
            "median_per_slot": [round(statistics.median(slot), 4) for slot in per_slot],
        }
        if name != "exact":
            exact = [g for block in by_variant["exact"][: len(per_block)] for g in block]
            closer = sum(e < v for e, v in zip(exact, flat, strict=True))
            report[name]["closer_to_exact"] = closer / len(flat)
    report["control"] = {"median": statistics.median(control), "slots": len(control)}
    report["markov"] = {
        "slots": len(draft_gaps),
        "agree": sum(gap == 0.0 for gap in draft_gaps),
        "gap_max": max(draft_gaps),
        "on_served_base_agree": sum(gap == 0.0 for gap in served_base_gaps),
        "on_served_base_gap_max": max(served_base_gaps),
        "on_served_base_without_bias_agree": sum(gap == 0.0 for gap in no_bias_gaps),
    }
    return report


def served_dense(record: dict[str, Any]) -> torch.Tensor:
    """``[N, vocab]``: the served base logits on the recorded ids, 0 elsewhere (the
    shrunken checkpoint's LM head rows are zero outside its live ids, so those
    logits are exactly 0 when the recorded ids are the live ones)."""
    rows = []
    for sparse in record["base_logits"]:
        ids, values = dense(sparse)
        row = torch.zeros(sparse["size"])
        row[ids] = values
        rows.append(row)
    return torch.stack(rows)


def markov_gaps(
    reference: Reference, record: dict[str, Any], logits: torch.Tensor, with_bias: bool = True
) -> list[float]:
    """Per slot, teacher-forced on the served drafts: the reference's Markov-corrected
    logits (base plus the bias after the slot's served previous token: the anchor,
    then the served draft before it), and the gap from their best to the served
    draft (0 where the served draft is the reference's greedy pick)."""
    gaps = []
    previous = record["anchor"]
    for slot, draft in enumerate(record["drafts"]):
        corrected = logits[slot]
        if with_bias:
            corrected = corrected + markov_bias(reference.extras, previous)
        gaps.append(float(corrected.max() - corrected[draft]))
        previous = draft
    return gaps


def compare_target(
    reference: Reference, sequences: list[list[int]], prompt_lengths: list[int]
) -> dict[str, Any]:
    """Each served pick against the reference's logits at its step: the gap from the
    reference's best to the served pick (0 where they agree)."""
    gaps, agree, steps = [], 0, 0
    for sequence, start in zip(sequences, prompt_lengths, strict=True):
        logits = reference.target_logits(sequence[:-1])
        for position in range(start - 1, len(sequence) - 1):
            row = logits[position]
            pick = sequence[position + 1]
            gap = float(row.max() - row[pick])
            gaps.append(gap)
            agree += gap == 0.0
            steps += 1
    return {
        "steps": steps,
        "agree": agree,
        "gap_median": statistics.median(gaps),
        "gap_max": max(gaps),
    }


def packed_logits(reference: Reference, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Each sequence's target logits as one packed step of all of them computes them
    (a prefill of every sequence, the tokens of one after another's): with per-row
    hash routing the sequences are independent; with vLLM 0.20's warp-wide one a
    token's weights depend on its warp's rows, which may belong to the next
    sequence. Each pass fixes the warp totals of one more hash-routed layer (a
    layer's selected scores depend on the layers before it only), so the passes end
    exact."""
    norm = reference.hash_norm
    passes = 1 if norm is None else len(norm.layers) + 1
    totals: dict[int, list[torch.Tensor]] | None = None
    for _ in range(passes):
        logits, selected = [], {layer: [] for layer in (norm.layers if norm else [])}
        for index, sequence in enumerate(sequences):
            if norm is not None:
                norm.fixed = None if totals is None else {k: v[index] for k, v in totals.items()}
            logits.append(reference.target_logits(sequence))
            for layer in selected:
                selected[layer].append(norm.selected[layer])
        if norm is not None:
            lengths = [len(sequence) for sequence in sequences]
            totals = {
                layer: list(warp_sums(torch.cat(rows), norm.rows).split(lengths))
                for layer, rows in selected.items()
            }
    if norm is not None:
        norm.fixed = None
    return logits


def compare_teacher_forced(
    reference: Reference, prompts: list[list[int]], answers: list[list[int]], gaps: list
) -> dict[str, Any]:
    """An engine's teacher-forced scores of its own answers (per answer token, its
    best logprob minus the answer token's) against the reference's on the same
    packed batch: how often each calls the answer token its own pick, how often the
    two agree on that, and how far their gaps lie apart."""
    sequences = [p + a for p, a in zip(prompts, answers, strict=True)]
    ours, theirs = [], []
    for logits, prompt, answer, engine in zip(
        packed_logits(reference, sequences), prompts, answers, gaps, strict=True
    ):
        rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(answer)]
        ours += [float(row.max() - row[token]) for row, token in zip(rows, answer, strict=True)]
        theirs += engine
    differences = [abs(a - b) for a, b in zip(ours, theirs, strict=True)]
    return {
        "tokens": len(ours),
        "reference_picks": sum(gap == 0.0 for gap in ours),
        "engine_picks": sum(gap == 0.0 for gap in theirs),
        "same_verdict": sum((a == 0.0) == (b == 0.0) for a, b in zip(ours, theirs, strict=True)),
        "gap_max": max(ours),
        "difference_median": statistics.median(differences),
        "difference_max": max(differences),
    }


def suite_prompts(checkpoint: Path, recorded: list[list[int]]) -> list[list[int]]:
    """The GPU suite's V4 prompts as the engine tokenised them (the checkpoint's own
    tokenizer, its BOS first), checked against the prompts a run recorded."""
    from transformers import AutoTokenizer

    sys.path.insert(0, str(HERE / "gpu"))
    import suite

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    prompts = [tokenizer(text)["input_ids"] for text in suite.V4_PROMPTS]
    for prompt in recorded:
        if prompt not in prompts:
            raise ValueError(f"the run's prompt {prompt} is not one of the suite's V4 prompts")
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("run", type=Path, help="a GPU run's results JSON")
    parser.add_argument("--job", default="v4-dspark-overlay-v1-exact-served")
    parser.add_argument("--work", type=Path, default=Path(".cache") / "v4-reference")
    parser.add_argument("--variant-blocks", type=int, help="blocks the wrong variants run on")
    parser.add_argument(
        "--score-jobs", nargs="*", default=[], help="engine jobs whose answers to score too"
    )
    parser.add_argument(
        "--teacher-forced-jobs",
        nargs="*",
        default=[],
        help="engine jobs whose own teacher-forced scores to compare with the reference's",
    )
    parser.add_argument(
        "--hash-norm",
        choices=HASH_NORMS,
        default="row",
        help="row: per token (transformers, vLLM 0.21+); warp: vLLM 0.20's kernel",
    )
    parser.add_argument(
        "--only-teacher-forced", action="store_true", help="skip the served job's comparisons"
    )
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    reference = Reference(args.checkpoint, args.work, args.hash_norm)
    sys.path.insert(0, str(HERE / "gpu"))
    from record import read_run  # a kept run is gzipped

    results = read_run(args.run)["results"]
    report: dict[str, Any] = {"hash_norm": args.hash_norm}
    if not args.only_teacher_forced:
        report.update(served_job_report(reference, results, args))
    if args.teacher_forced_jobs:
        served = results.get(args.job, {}).get("records", [])
        prompts = suite_prompts(args.checkpoint, [record["prompt"] for record in served])
    for job in args.teacher_forced_jobs:
        answers = results[job]["token_ids"]
        report[f"teacher-forced ({job})"] = compare_teacher_forced(
            reference, prompts[: len(answers)], answers, results[job]["teacher_forced"]["gaps"]
        )
    print(json.dumps(report, indent=1))


def served_job_report(
    reference: Reference, results: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    """The served job's target picks and draft blocks, and other jobs' answers on its
    prompts, against the reference."""
    result = results[args.job]
    prompt_lengths = [
        next(len(r["prompt"]) for r in result["records"] if s[: len(r["prompt"])] == r["prompt"])
        for s in result["sequences"]
    ]
    report = {
        "target": compare_target(reference, result["sequences"], prompt_lengths),
        "drafts": compare_drafts(reference, result, args.variant_blocks),
    }
    for job in args.score_jobs:
        answers = continued(result["sequences"], prompt_lengths, results[job]["token_ids"])
        report[f"target ({job})"] = compare_target(reference, answers, prompt_lengths)
    return report


def continued(
    sequences: list[list[int]], prompt_lengths: list[int], answers: list[list[int]]
) -> list[list[int]]:
    """Each recorded sequence's prompt followed by another job's answer to that prompt
    (the job answered the same prompts in the same order, maybe more of them), cut to
    the recorded sequence's length."""
    return [
        sequence[:start] + answer[: len(sequence) - start]
        for sequence, start, answer in zip(sequences, prompt_lengths, answers, strict=False)
    ]


if __name__ == "__main__":
    main()
