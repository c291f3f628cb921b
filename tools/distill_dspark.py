"""Build a tiny trained Qwen3 target and a DSpark draft distilled from it (CPU, offline).

    python tools/distill_dspark.py [MODELS_DIR]      # default .cache/models

Writes (each skipped when already complete; built in ``*.partial`` then renamed):

* ``tiny-qwen3``: ``Qwen3ForCausalLM`` (vocab 1024, hidden 128, 4 layers, 4 heads /
  2 KV heads of dim 32, float32), tokenizer trained like ``build_tiny_model.py``,
  weights trained briefly on standard-library sources so greedy continuations are
  regular enough for a draft to learn.
* ``tiny-qwen3-dspark``: a DeepSpec-format DSpark draft (``architectures:
  ["Qwen3DSparkModel"]``, ``model_type: qwen3``), trained on the target's own greedy
  continuations with the DSpark loss (``docs/dspark.md`` sections 2, 3, 11), plus
  ``distill_report.json``.

Draft config keys (besides the Qwen3 keys, ``num_hidden_layers`` = draft layers):
``block_size``, ``mask_token_id``, ``target_layer_ids``, ``num_target_layers``
(target layer count), ``num_anchors`` (training only), ``markov_rank``,
``markov_head_type`` (``vanilla``), ``enable_confidence_head``,
``confidence_head_with_markov``.

Draft tensor names (DeepSpec's, no prefix; all float32):

* ``embed_tokens.weight`` [V, H], ``lm_head.weight`` [V, H]: frozen copies of the target's;
* ``fc.weight`` [H, m*H] (m = len(target_layer_ids)), ``hidden_norm.weight`` [H];
* ``layers.{i}.input_layernorm.weight``, ``layers.{i}.post_attention_layernorm.weight``,
  ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{i}.self_attn.{q,k}_norm.weight``,
  ``layers.{i}.mlp.{gate,up,down}_proj.weight`` (Qwen3 layout);
* ``norm.weight`` [H];
* ``markov_head.markov_w1.weight`` [V, r] (embedding), ``markov_head.markov_w2.weight``
  [V, r] (``Linear(r, V)``);
* ``confidence_head.proj.weight`` [1, H + r], ``confidence_head.proj.bias`` [1].

Loss per slot k (weights ``exp(-k / 4)``): cross-entropy of the Markov-corrected
logits (teacher-forced ``prev``) against the target's greedy token, total variation
``TV = 1/2 |p_draft - p_target|_1``, and BCE of the confidence logit against
``c*_k = 1 - TV`` (detached). Deterministic for a given thread count; a few minutes
on two cores.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import sysconfig
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dspark_model import (  # noqa: E402
    DSparkDraft,
    TinyQwen3ForCausalLM,
    exp_position_weights,
    greedy_decode,
    greedy_speculative_decode,
    mean_acceptance,
)

from build_tiny_model import STDLIB_FILES, train_tokenizer  # noqa: E402

TARGET_NAME = "tiny-qwen3"
DRAFT_NAME = "tiny-qwen3-dspark"
VOCAB_SIZE = 1024
MASK_TOKEN_ID = 1000  # first id past the trained tokenizer: a row no text ever uses
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

TARGET_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,  # the vLLM CPU attention backend wants head_dim >= 32
    "hidden_act": "silu",
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "sliding_window": None,
    "layer_types": ["full_attention"] * 4,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 3,
    "torch_dtype": "float32",
}

BLOCK_SIZE = 4
MARKOV_RANK = 32
TARGET_LAYER_IDS = [0, 1, 2]  # not the last layer: HF's last hidden_states entry is post-norm
NUM_DRAFT_LAYERS = 2
NUM_ANCHORS = 16
DRAFT_CONFIG: dict[str, Any] = {
    **TARGET_CONFIG,
    "architectures": ["Qwen3DSparkModel"],
    "num_hidden_layers": NUM_DRAFT_LAYERS,
    "layer_types": ["full_attention"] * NUM_DRAFT_LAYERS,
    "block_size": BLOCK_SIZE,
    "mask_token_id": MASK_TOKEN_ID,
    "target_layer_ids": TARGET_LAYER_IDS,
    "num_target_layers": TARGET_CONFIG["num_hidden_layers"],
    "num_anchors": NUM_ANCHORS,
    "markov_rank": MARKOV_RANK,
    "markov_head_type": "vanilla",
    "enable_confidence_head": True,
    "confidence_head_with_markov": True,
}

# Target pre-training (kept to roughly a minute on two cores).
TARGET_STEPS = 300
TARGET_BATCH = 16
TARGET_SEQ_LEN = 128
TARGET_LR = 3e-3

# Draft distillation data: target greedy continuations of corpus prompts. Prompt
# lengths vary (down to 2 tokens) because serving starts drafting right after
# short prompts, where the context is only a few rows.
DATA_PROMPT_LENGTHS = (2, 4, 8, 16, 24, 32)
DATA_SEQUENCES_PER_LENGTH = 40
DATA_SEQ_LEN = 96
DRAFT_STEPS = 700
DRAFT_BATCH = 16
DRAFT_LR = 2e-3
LOSS_DECAY = 4.0  # DeepSpec's loss_decay_gamma
CE_WEIGHT, TV_WEIGHT, CONFIDENCE_WEIGHT = 0.1, 0.9, 1.0  # paper section 10

# Acceptance is measured on files the target never trained on.
EVAL_FILES = ("heapq.py", "contextlib.py", "copy.py", "csv.py")
EVAL_PROMPTS = 16
EVAL_PROMPT_LEN = 16
EVAL_NEW_TOKENS = 48
LITERAL_PROMPTS = ("def main", "import os\n", "class Foo:\n    def ")


def read_corpus(files: tuple[str, ...]) -> str:
    stdlib = sysconfig.get_paths()["stdlib"]
    texts = []
    for name in files:
        path = os.path.join(stdlib, name)
        if os.path.exists(path):
            with open(path, encoding="utf-8") as handle:
                texts.append(handle.read())
    return "\n\n".join(texts)


def load_tokenizer(model_dir: str) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))


def random_windows(
    tokens: torch.Tensor, count: int, length: int, generator: torch.Generator
) -> torch.Tensor:
    starts = torch.randint(0, tokens.numel() - length, (count,), generator=generator)
    return torch.stack([tokens[start : start + length] for start in starts.tolist()])


def cosine_lr(step: int, total: int, peak: float, warmup: int = 20) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(total - warmup, 1)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def init_weights(module: torch.nn.Module, std: float) -> None:
    """HF-style init: normal(0, std) for matrices and embeddings, ones for norms."""
    for name, parameter in module.named_parameters():
        if parameter.dim() >= 2:
            torch.nn.init.normal_(parameter, std=std)
        elif name.endswith("bias"):
            torch.nn.init.zeros_(parameter)
        else:
            torch.nn.init.ones_(parameter)


def write_json(directory: str, name: str, data: dict) -> None:
    with open(os.path.join(directory, name), "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=1)


def save_weights(model: torch.nn.Module, directory: str) -> None:
    from safetensors.torch import save_file

    state = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
    save_file(state, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})


# --- target ----------------------------------------------------------------------------


def build_target(out_dir: str) -> dict[str, Any]:
    """Train and save ``tiny-qwen3`` unless present; returns its training summary."""
    if os.path.exists(os.path.join(out_dir, "model.safetensors")):
        return {"cached": True}
    started = time.perf_counter()
    partial = out_dir + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    train_tokenizer(partial)
    tokenizer = load_tokenizer(partial)
    corpus = torch.tensor(tokenizer.encode(read_corpus(STDLIB_FILES)).ids)

    torch.manual_seed(0)
    model = TinyQwen3ForCausalLM(TARGET_CONFIG)
    init_weights(model, TARGET_CONFIG["initializer_range"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=TARGET_LR, betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(0)
    losses = []
    for step in range(TARGET_STEPS):
        for group in optimizer.param_groups:
            group["lr"] = cosine_lr(step, TARGET_STEPS, TARGET_LR)
        batch = random_windows(corpus, TARGET_BATCH, TARGET_SEQ_LEN + 1, generator)
        logits = model(batch[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), batch[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == TARGET_STEPS - 1:
            print(f"target step {step:4d}  loss {loss.item():.3f}", flush=True)

    save_weights(model, partial)
    write_json(partial, "config.json", TARGET_CONFIG)
    write_json(
        partial, "generation_config.json", {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}
    )
    os.replace(partial, out_dir)  # concurrent builders never see a half-built model
    return {
        "cached": False,
        "steps": TARGET_STEPS,
        "corpus_tokens": corpus.numel(),
        "loss_first": _mean(losses[:10]),
        "loss_last": _mean(losses[-10:]),
        "wall_s": round(time.perf_counter() - started, 1),
    }


# --- draft -----------------------------------------------------------------------------


def make_distillation_data(
    target: TinyQwen3ForCausalLM, corpus: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Target greedy continuations with their taps and logits, all ``DATA_SEQ_LEN`` long."""
    generator = torch.Generator().manual_seed(1)
    sequences, prompt_lengths = [], []
    for prompt_length in DATA_PROMPT_LENGTHS:
        prompts = random_windows(corpus, DATA_SEQUENCES_PER_LENGTH, prompt_length, generator)
        sequences.append(target.greedy_generate(prompts, DATA_SEQ_LEN - prompt_length))
        prompt_lengths += [prompt_length] * DATA_SEQUENCES_PER_LENGTH
    input_ids = torch.cat(sequences)
    taps, logits = [], []
    with torch.no_grad():
        for chunk in input_ids.split(40):
            output = target(chunk)
            taps.append(target.taps(output.layer_outputs, TARGET_LAYER_IDS))
            logits.append(output.logits)
    return {
        "input_ids": input_ids,
        "taps": torch.cat(taps),
        "target_logits": torch.cat(logits),
        "prompt_lengths": torch.tensor(prompt_lengths),
    }


def sample_anchors(
    prompt_lengths: torch.Tensor, num_anchors: int, generator: torch.Generator
) -> torch.Tensor:
    """Anchors whose whole block is supervised by generated tokens.

    The first allowed anchor is the last prompt token (its first label is the first
    generated token); the last leaves room for ``BLOCK_SIZE`` labels.
    """
    lowest = prompt_lengths - 1
    highest = DATA_SEQ_LEN - 1 - BLOCK_SIZE
    span = (highest - lowest + 1).unsqueeze(1)
    draws = torch.rand(prompt_lengths.numel(), num_anchors, generator=generator)
    return lowest.unsqueeze(1) + (draws * span).long()


def dspark_loss(
    draft: DSparkDraft,
    input_ids: torch.Tensor,
    taps: torch.Tensor,
    target_logits: torch.Tensor,
    anchors: torch.Tensor,
    slot_weights: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, float]]:
    base_logits, hidden = draft.forward_anchors(input_ids, taps, anchors)
    offsets = torch.arange(BLOCK_SIZE)
    block_positions = anchors.unsqueeze(-1) + offsets  # [B, A, gamma]
    flat = block_positions.flatten(1)
    # Teacher-forced Markov input: prev of slot k is the token at anchor + k.
    prev_tokens = input_ids.gather(1, flat).view_as(block_positions)
    labels = input_ids.gather(1, flat + 1).view_as(block_positions)
    aligned = target_logits.gather(
        1, flat.unsqueeze(-1).expand(-1, -1, target_logits.shape[-1])
    ).view(*block_positions.shape, -1)
    corrected = base_logits + draft.markov_head(prev_tokens)

    weights = slot_weights.expand_as(labels)
    denominator = weights.sum()
    cross_entropy = F.cross_entropy(
        corrected.flatten(0, 2), labels.flatten(), reduction="none"
    ).view_as(labels)
    draft_probs = corrected.softmax(-1)
    target_probs = aligned.softmax(-1)
    total_variation = 0.5 * (draft_probs - target_probs).abs().sum(-1)
    confidence_label = (1.0 - total_variation).detach().clamp(0.0, 1.0)
    confidence = F.binary_cross_entropy_with_logits(
        draft.confidence_logits(hidden, prev_tokens), confidence_label, reduction="none"
    )
    ce_loss = (cross_entropy * weights).sum() / denominator
    tv_loss = (total_variation * weights).sum() / denominator
    confidence_loss = (confidence * weights).sum() / denominator
    loss = CE_WEIGHT * ce_loss + TV_WEIGHT * tv_loss + CONFIDENCE_WEIGHT * confidence_loss
    with torch.no_grad():
        greedy_match = (corrected.argmax(-1) == labels).float().mean().item()
    return loss, {
        "loss": loss.item(),
        "ce": ce_loss.item(),
        "tv": tv_loss.item(),
        "confidence_bce": confidence_loss.item(),
        "slot_match": greedy_match,
    }


def train_draft(
    target: TinyQwen3ForCausalLM, data: dict[str, torch.Tensor]
) -> tuple[DSparkDraft, list[dict[str, float]]]:
    torch.manual_seed(2)
    draft = DSparkDraft(DRAFT_CONFIG)
    init_weights(draft, TARGET_CONFIG["initializer_range"])
    with torch.no_grad():
        # Shared, frozen embedding / LM head (DeepSpec copies the target's).
        draft.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        draft.lm_head.weight.copy_(target.lm_head.weight)
        # A zero W2 starts the Markov bias at exactly 0, so early training sees the
        # backbone alone instead of a random bias over the whole vocabulary.
        draft.markov_head.markov_w2.weight.zero_()
    draft.embed_tokens.requires_grad_(False)
    draft.lm_head.requires_grad_(False)
    trainable = [parameter for parameter in draft.parameters() if parameter.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=DRAFT_LR, betas=(0.9, 0.95), weight_decay=0.0)
    slot_weights = exp_position_weights(BLOCK_SIZE, LOSS_DECAY)
    generator = torch.Generator().manual_seed(3)
    num_sequences = data["input_ids"].shape[0]
    history = []
    for step in range(DRAFT_STEPS):
        for group in optimizer.param_groups:
            group["lr"] = cosine_lr(step, DRAFT_STEPS, DRAFT_LR)
        rows = torch.randint(0, num_sequences, (DRAFT_BATCH,), generator=generator)
        anchors = sample_anchors(data["prompt_lengths"][rows], NUM_ANCHORS, generator)
        loss, metrics = dspark_loss(
            draft,
            data["input_ids"][rows],
            data["taps"][rows],
            data["target_logits"][rows],
            anchors,
            slot_weights,
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        history.append(metrics)
        if step % 100 == 0 or step == DRAFT_STEPS - 1:
            shown = "  ".join(f"{key} {value:.3f}" for key, value in metrics.items())
            print(f"draft step {step:4d}  {shown}", flush=True)
    return draft.eval(), history


def eval_prompts(tokenizer: Any) -> Iterator[list[int]]:
    corpus = torch.tensor(tokenizer.encode(read_corpus(EVAL_FILES)).ids)
    generator = torch.Generator().manual_seed(4)
    yield from random_windows(corpus, EVAL_PROMPTS, EVAL_PROMPT_LEN, generator).tolist()
    for text in LITERAL_PROMPTS:
        yield tokenizer.encode(text).ids


def measure_acceptance(
    target: TinyQwen3ForCausalLM, draft: DSparkDraft, tokenizer: Any
) -> dict[str, Any]:
    """Greedy speculative decoding in pure torch; checks it equals plain greedy."""
    results, mismatches = [], 0
    for prompt in eval_prompts(tokenizer):
        result = greedy_speculative_decode(target, draft, prompt, EVAL_NEW_TOKENS)
        if result.tokens != greedy_decode(target, prompt, EVAL_NEW_TOKENS):
            mismatches += 1
        results.append(result)
    histogram = [0] * (BLOCK_SIZE + 1)
    for result in results:
        for length in result.accepted_lengths:
            histogram[length - 1] += 1
    return {
        "mean_acceptance_length": round(mean_acceptance(results), 3),
        "max_acceptance_length": BLOCK_SIZE + 1,
        "prompts": len(results),
        "new_tokens_per_prompt": EVAL_NEW_TOKENS,
        "target_steps": sum(len(result.accepted_lengths) for result in results),
        "accepted_length_histogram": histogram,
        "spec_output_differs_from_greedy": mismatches,
    }


def build_draft(target_dir: str, out_dir: str) -> dict[str, Any] | None:
    """Distil and save the DSpark draft unless present; returns the report."""
    if os.path.exists(os.path.join(out_dir, "model.safetensors")):
        return None
    started = time.perf_counter()
    partial = out_dir + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    target = TinyQwen3ForCausalLM.from_pretrained(target_dir)
    target.requires_grad_(False)
    tokenizer = load_tokenizer(target_dir)
    corpus = torch.tensor(tokenizer.encode(read_corpus(STDLIB_FILES)).ids)
    data = make_distillation_data(target, corpus)
    data_s = time.perf_counter() - started
    print(f"distillation data: {tuple(data['input_ids'].shape)} in {data_s:.1f}s", flush=True)
    draft, history = train_draft(target, data)
    train_s = time.perf_counter() - started - data_s
    acceptance = measure_acceptance(target, draft, tokenizer)
    print(f"offline acceptance: {acceptance}", flush=True)

    save_weights(draft, partial)
    write_json(partial, "config.json", DRAFT_CONFIG)
    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(target_dir, name), partial)
    report = {
        "target": os.path.basename(target_dir),
        "block_size": BLOCK_SIZE,
        "markov_rank": MARKOV_RANK,
        "target_layer_ids": TARGET_LAYER_IDS,
        "draft_layers": NUM_DRAFT_LAYERS,
        "draft_parameters": sum(p.numel() for p in draft.parameters()),
        "draft_trainable_parameters": sum(
            p.numel() for name, p in draft.named_parameters() if _trainable_name(name)
        ),
        "data_sequences": int(data["input_ids"].shape[0]),
        "data_seq_len": DATA_SEQ_LEN,
        "steps": DRAFT_STEPS,
        "loss_weights": {"ce": CE_WEIGHT, "tv": TV_WEIGHT, "confidence": CONFIDENCE_WEIGHT},
        "loss_first": _mean_metrics(history[:10]),
        "loss_last": _mean_metrics(history[-10:]),
        "acceptance": acceptance,
        "data_wall_s": round(data_s, 1),
        "train_wall_s": round(train_s, 1),
        "wall_s": round(time.perf_counter() - started, 1),
        "torch_threads": torch.get_num_threads(),
    }
    write_json(partial, "distill_report.json", report)
    os.replace(partial, out_dir)
    return report


def _trainable_name(name: str) -> bool:
    return not name.startswith(("embed_tokens.", "lm_head."))


def _mean(values: list[float]) -> float:
    return round(sum(values) / max(len(values), 1), 4)


def _mean_metrics(history: list[dict[str, float]]) -> dict[str, float]:
    return {key: _mean([entry[key] for entry in history]) for key in history[0]}


def main() -> None:
    # One thread: on a small shared machine, OpenMP workers that wait for a busy
    # core make element-wise ops ~100x slower than running single-threaded.
    torch.set_num_threads(1)
    models_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(".cache", "models")
    os.makedirs(models_dir, exist_ok=True)
    target_dir = os.path.join(models_dir, TARGET_NAME)
    draft_dir = os.path.join(models_dir, DRAFT_NAME)
    started = time.perf_counter()
    target_summary = build_target(target_dir)
    print(f"{target_dir}: {target_summary}", flush=True)
    report = build_draft(target_dir, draft_dir)
    if report is None:
        with open(os.path.join(draft_dir, "distill_report.json"), encoding="utf-8") as handle:
            report = json.load(handle)
        print(f"{draft_dir}: cached")
    elif not target_summary.get("cached"):
        # Record the target's training next to the draft, which it was distilled from.
        report["target_training"] = target_summary
        report["total_wall_s"] = round(target_summary["wall_s"] + report["wall_s"], 1)
        write_json(draft_dir, "distill_report.json", report)
    print(f"{draft_dir}: mean acceptance length {report['acceptance']['mean_acceptance_length']}")
    print(f"total wall {time.perf_counter() - started:.1f}s")


if __name__ == "__main__":
    main()
