"""Build a tiny Llama model locally: no downloads, deterministic.

The tokenizer is a byte-level BPE trained with ``tokenizers`` on standard-library
sources; the weights are random (seed 0) and saved as safetensors, so HF
transformers and vLLM load the same model and greedy outputs can be compared.

    python tools/build_tiny_model.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig

STDLIB_FILES = (
    "ast.py", "inspect.py", "argparse.py", "json/encoder.py", "json/decoder.py",
    "textwrap.py", "string.py", "functools.py", "collections/__init__.py",
    "dataclasses.py", "enum.py", "pathlib.py", "shutil.py", "tempfile.py",
    "logging/__init__.py", "subprocess.py", "threading.py", "typing.py",
    "random.py", "statistics.py",
)  # fmt: skip
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]
VOCAB_SIZE = 1024

LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 3,
    "torch_dtype": "float32",
}


def train_tokenizer(out_dir: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    stdlib = sysconfig.get_paths()["stdlib"]
    files = [os.path.join(stdlib, name) for name in STDLIB_FILES]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1000,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([f for f in files if os.path.exists(f)], trainer)
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    _write_json(
        out_dir,
        "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "pad_token": "<pad>",
            "model_max_length": 256,
        },
    )
    _write_json(
        out_dir,
        "special_tokens_map.json",
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"},
    )


def save_random_llama(out_dir: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**{k: v for k, v in LLAMA_CONFIG.items() if k != "torch_dtype"})
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    _write_json(out_dir, "config.json", LLAMA_CONFIG)
    _write_json(
        out_dir,
        "generation_config.json",
        {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3},
    )


def build_eagle_draft(target_dir: str, out_dir: str) -> str:
    """A 1-layer Llama EAGLE draft for the tiny target (random weights, seed 1)."""
    if os.path.exists(os.path.join(out_dir, "model.safetensors")):
        return out_dir
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    partial = _partial_with_tokenizer(target_dir, out_dir)

    config = dict(LLAMA_CONFIG, num_hidden_layers=1)
    torch.manual_seed(1)
    fields = {k: v for k, v in config.items() if k != "torch_dtype"}
    weights = LlamaForCausalLM(LlamaConfig(**fields)).state_dict()
    # EAGLE's layout: one decoder layer fed by fc([embedding, target hidden]); the
    # LM head (and embedding) are shared with the target.
    weights = {
        k.removeprefix("model."): v
        for k, v in weights.items()
        if k.startswith("model.layers.") and "input_layernorm" not in k  # EAGLE has none
    }
    hidden = config["hidden_size"]
    weights["fc.weight"] = torch.randn(hidden, 2 * hidden) * 0.02
    save_file({k: v.contiguous() for k, v in weights.items()}, f"{partial}/model.safetensors")
    _write_json(partial, "config.json", config)
    os.replace(partial, out_dir)
    return out_dir


MIXTRAL_EXPERTS = {"num_local_experts": 4, "num_experts_per_tok": 2}


def build_mixtral(target_dir: str, out_dir: str) -> str:
    """A 2-layer Mixtral with the tiny Llama's widths and tokenizer, 4 experts, top-2
    (random weights, seed 2): a mixture-of-experts model whose expert layers run
    collectives across data-parallel ranks."""
    if os.path.exists(os.path.join(out_dir, "model.safetensors")):
        return out_dir
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    partial = _partial_with_tokenizer(target_dir, out_dir)
    config = {
        **LLAMA_CONFIG,
        **MIXTRAL_EXPERTS,
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
    }
    torch.manual_seed(2)
    fields = {k: v for k, v in config.items() if k != "torch_dtype"}
    MixtralForCausalLM(MixtralConfig(**fields)).save_pretrained(partial, safe_serialization=True)
    _write_json(partial, "config.json", config)
    os.replace(partial, out_dir)
    return out_dir


def _partial_with_tokenizer(target_dir: str, out_dir: str) -> str:
    """``out_dir``'s partial folder, holding the tiny target's tokenizer: a model built
    there is moved into place whole (``os.replace``) once written."""
    import shutil

    partial = out_dir + ".partial"
    os.makedirs(partial, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(os.path.join(target_dir, name), partial)
    return partial


def _write_json(out_dir: str, name: str, data: dict) -> None:
    with open(os.path.join(out_dir, name), "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=1)


def build(out_dir: str) -> str:
    """Build into ``out_dir`` unless a complete model is already there."""
    if os.path.exists(os.path.join(out_dir, "model.safetensors")):
        return out_dir
    partial = out_dir + ".partial"
    os.makedirs(partial, exist_ok=True)
    train_tokenizer(partial)
    save_random_llama(partial)
    os.replace(partial, out_dir)  # concurrent builders never see a half-built model
    return out_dir


if __name__ == "__main__":
    target = build(sys.argv[1] if len(sys.argv) > 1 else ".cache/models/tiny-llama")
    print(target)
    print(build_eagle_draft(target, target + "-eagle"))
    print(build_mixtral(target, os.path.join(os.path.dirname(target), "tiny-mixtral")))
