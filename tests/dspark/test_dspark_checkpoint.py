"""DSpark draft checkpoints: config parsing (DeepSpec Qwen3 and DeepSeek-V4 formats),
DSV4 ``mtp.*`` weight names, and the distilled tiny draft / target built by
``tools/distill_dspark.py`` (those tests skip when ``.cache/models`` lacks them).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from vllm_v4_patches.dspark.checkpoint import (
    FORMAT_DEEPSEEK_V4,
    FORMAT_DEEPSEEK_V41,
    FORMAT_DEEPSPEC_QWEN3,
    DSparkDraftSpec,
    deepspec_qwen3_weight_shapes,
    dspark_v4_weight_role,
    group_dspark_v4_weights,
    load_draft_spec,
    parse_deepseek_v4_config,
    parse_deepspec_qwen3_config,
    parse_draft_config,
)

REPO = Path(__file__).resolve().parents[2]
MODELS = REPO / ".cache" / "models"
TARGET_DIR = MODELS / "tiny-qwen3"
DRAFT_DIR = MODELS / "tiny-qwen3-dspark"

DEEPSPEC_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3DSparkModel"],
    "model_type": "qwen3",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 5,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "block_size": 7,
    "mask_token_id": 151669,
    "target_layer_ids": [1, 9, 17, 25, 33],
    "num_target_layers": 36,
    "num_anchors": 512,
    "markov_rank": 256,
    "markov_head_type": "vanilla",
    "enable_confidence_head": True,
    "confidence_head_with_markov": True,
}

V4_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "hidden_size": 4096,
    "vocab_size": 129280,
    "num_hidden_layers": 43,
    "num_nextn_predict_layers": 1,
    "dspark_block_size": 5,
    "dspark_markov_rank": 256,
    "dspark_target_layer_ids": [40, 41, 42],
    "dspark_noise_token_id": 128799,
}


def v4_weight_names(stages: int = 3, *, confidence: bool = True) -> list[str]:
    """Synthetic DSV4 names, including FFN ``w1`` shards next to ``markov_w1``."""
    names = ["embed.weight", "layers.0.attn.wq_a.weight", "head.weight"]  # target's own
    for stage in range(stages):
        prefix = f"mtp.{stage}."
        names += [
            prefix + "attn.wq_a.weight",
            prefix + "attn.wq_a.scale",
            prefix + "attn.attn_sink",
            prefix + "attn_norm.weight",
            prefix + "ffn.experts.0.w1.weight",
            prefix + "ffn.shared_experts.w1.weight",
            prefix + "hc_attn_fn",
        ]
    last = f"mtp.{stages - 1}."
    names += ["mtp.0.main_proj.weight", "mtp.0.main_proj.scale", "mtp.0.main_norm.weight"]
    names += [last + "norm.weight", last + "hc_head_fn", last + "hc_head_base"]
    names += [last + "markov_head.markov_w1.weight", last + "markov_head.markov_w2.weight"]
    if confidence:
        names.append(last + "confidence_head.proj.weight")
    return names


def assert_one_line_error(error: pytest.ExceptionInfo[ValueError], key: str, prefix: str) -> None:
    message = str(error.value)
    assert "\n" not in message, message
    assert message.startswith(prefix), message
    assert key in message, message


# --- DeepSpec Qwen3 format --------------------------------------------------------------


def test_deepspec_config_parses() -> None:
    spec = parse_deepspec_qwen3_config(DEEPSPEC_CONFIG)
    assert spec == DSparkDraftSpec(
        format=FORMAT_DEEPSPEC_QWEN3,
        block_size=7,
        mask_token_id=151669,
        target_layer_ids=(1, 9, 17, 25, 33),
        markov_rank=256,
        markov_head_type="vanilla",
        enable_confidence_head=True,
        confidence_head_with_markov=True,
        hidden_size=4096,
        num_draft_layers=5,
        vocab_size=151936,
        weight_prefix="",
        num_target_layers=36,
    )
    assert parse_draft_config(DEEPSPEC_CONFIG) == spec
    with pytest.raises(AttributeError):
        spec.block_size = 3  # type: ignore[misc]  # frozen


def test_deepspec_optional_keys_and_defaults() -> None:
    config = copy.deepcopy(DEEPSPEC_CONFIG)
    for key in ("enable_confidence_head", "confidence_head_with_markov", "num_target_layers"):
        del config[key]
    config["target_layer_ids"] = [-1, 3]  # -1 is DeepSpec's embedding-output tap
    spec = parse_deepspec_qwen3_config(config)
    assert not spec.enable_confidence_head and not spec.confidence_head_with_markov
    assert spec.num_target_layers is None and spec.target_layer_ids == (-1, 3)

    config.update(markov_rank=0, enable_confidence_head=True)
    del config["markov_head_type"]  # not needed without a Markov head
    spec = parse_deepspec_qwen3_config(config, target_num_layers=4)
    assert spec.markov_rank == 0 and spec.markov_head_type is None
    assert spec.enable_confidence_head and spec.num_target_layers == 4


def _set(key: str, value: Any) -> Callable[[dict], None]:
    return lambda config: config.__setitem__(key, value)


def _drop(key: str) -> Callable[[dict], None]:
    return lambda config: config.pop(key)


DEEPSPEC_MALFORMED: list[tuple[str, Callable[[dict], None], str]] = [
    ("no block_size", _drop("block_size"), "block_size"),
    ("block_size 0", _set("block_size", 0), "block_size"),
    ("block_size string", _set("block_size", "7"), "block_size"),
    ("block_size bool", _set("block_size", True), "block_size"),
    ("block_size float", _set("block_size", 7.0), "block_size"),
    ("no mask_token_id", _drop("mask_token_id"), "mask_token_id"),
    ("mask_token_id past vocab", _set("mask_token_id", 151936), "mask_token_id"),
    ("mask_token_id negative", _set("mask_token_id", -1), "mask_token_id"),
    ("no target_layer_ids", _drop("target_layer_ids"), "target_layer_ids"),
    ("empty target_layer_ids", _set("target_layer_ids", []), "target_layer_ids"),
    ("target_layer_ids not a list", _set("target_layer_ids", 9), "target_layer_ids"),
    ("target_layer_ids str item", _set("target_layer_ids", [1, "9"]), "target_layer_ids"),
    ("target_layer_ids unsorted", _set("target_layer_ids", [9, 1]), "target_layer_ids"),
    ("target_layer_ids repeated", _set("target_layer_ids", [1, 1]), "target_layer_ids"),
    ("target_layer_ids past target", _set("target_layer_ids", [1, 36]), "target_layer_ids"),
    ("target_layer_ids below -1", _set("target_layer_ids", [-2, 1]), "target_layer_ids"),
    ("no markov_rank", _drop("markov_rank"), "markov_rank"),
    ("markov_rank negative", _set("markov_rank", -1), "markov_rank"),
    ("markov_head_type unknown", _set("markov_head_type", "foo"), "markov_head_type"),
    ("no markov_head_type", _drop("markov_head_type"), "markov_head_type"),
    ("confidence flag string", _set("enable_confidence_head", "yes"), "enable_confidence_head"),
    (
        "with_markov flag int",
        _set("confidence_head_with_markov", 1),
        "confidence_head_with_markov",
    ),
    ("no hidden_size", _drop("hidden_size"), "hidden_size"),
    ("no vocab_size", _drop("vocab_size"), "vocab_size"),
    ("zero draft layers", _set("num_hidden_layers", 0), "num_hidden_layers"),
    ("num_target_layers 0", _set("num_target_layers", 0), "num_target_layers"),
    ("wrong architecture", _set("architectures", ["Qwen3ForCausalLM"]), "architectures"),
    (
        "with_markov without markov",
        lambda config: config.update(markov_rank=0),
        "confidence_head_with_markov",
    ),
]


@pytest.mark.parametrize(
    ("mutate", "key"),
    [case[1:] for case in DEEPSPEC_MALFORMED],
    ids=[case[0] for case in DEEPSPEC_MALFORMED],
)
def test_deepspec_malformed_config(mutate: Callable[[dict], None], key: str) -> None:
    config = copy.deepcopy(DEEPSPEC_CONFIG)
    mutate(config)
    with pytest.raises(ValueError) as error:
        parse_deepspec_qwen3_config(config)
    assert_one_line_error(error, key, "dspark draft config: ")


def test_markov_head_type_message_lists_accepted_values() -> None:
    config = dict(DEEPSPEC_CONFIG, markov_head_type="foo")
    with pytest.raises(ValueError) as error:
        parse_deepspec_qwen3_config(config)
    assert str(error.value) == (
        "dspark draft config: markov_head_type='foo' is not one of vanilla, gated, rnn"
    )


def test_deepspec_target_layer_range_comes_from_target() -> None:
    target = {"num_hidden_layers": 36}
    assert parse_draft_config(DEEPSPEC_CONFIG, target_config=target).num_target_layers == 36
    with pytest.raises(ValueError) as error:
        parse_draft_config(DEEPSPEC_CONFIG, target_config={"num_hidden_layers": 28})
    assert_one_line_error(error, "num_target_layers", "dspark draft config: ")
    config = {k: v for k, v in DEEPSPEC_CONFIG.items() if k != "num_target_layers"}
    with pytest.raises(ValueError) as error:
        parse_draft_config(config, target_config={"num_hidden_layers": 28})
    assert_one_line_error(error, "target_layer_ids", "dspark draft config: ")
    assert "33" in str(error.value)


def test_not_a_dspark_config() -> None:
    with pytest.raises(ValueError) as error:
        parse_draft_config({"architectures": ["LlamaForCausalLM"], "hidden_size": 8})
    assert_one_line_error(error, "architectures", "dspark draft config: ")
    with pytest.raises(ValueError) as error:
        parse_draft_config(["not", "a", "mapping"])  # type: ignore[arg-type]
    assert_one_line_error(error, "JSON object", "dspark draft config: ")


def test_long_values_are_shortened() -> None:
    config = dict(DEEPSPEC_CONFIG, target_layer_ids=list(range(100, 0, -1)))
    with pytest.raises(ValueError) as error:
        parse_deepspec_qwen3_config(config)
    assert len(str(error.value)) < 200


# --- DeepSeek-V4 format -----------------------------------------------------------------


def test_v4_config_parses() -> None:
    spec = parse_draft_config(V4_CONFIG, inference_config={"n_mtp_layers": 3, "dim": 4096})
    assert spec == DSparkDraftSpec(
        format=FORMAT_DEEPSEEK_V4,
        block_size=5,
        mask_token_id=128799,
        target_layer_ids=(40, 41, 42),
        markov_rank=256,
        markov_head_type="vanilla",
        enable_confidence_head=True,
        confidence_head_with_markov=True,
        hidden_size=4096,
        num_draft_layers=3,
        vocab_size=129280,
        weight_prefix="mtp.",
        num_target_layers=43,
    )
    # num_nextn_predict_layers is not the stage count: unknown without more input.
    assert parse_deepseek_v4_config(V4_CONFIG).num_draft_layers is None
    counted = parse_deepseek_v4_config(V4_CONFIG, weight_names=v4_weight_names(2))
    assert counted.num_draft_layers == 2


def test_v4_keys_from_inference_config_and_v41() -> None:
    config = {k: v for k, v in V4_CONFIG.items() if k != "dspark_block_size"}
    config.update(model_type="deepseek_v41", enable_confidence_head=False)
    spec = parse_deepseek_v4_config(config, inference_config={"dspark_block_size": 5})
    assert spec.block_size == 5 and spec.format == FORMAT_DEEPSEEK_V41
    assert not spec.enable_confidence_head and not spec.confidence_head_with_markov


V4_MALFORMED: list[tuple[str, Callable[[dict], None], str]] = [
    ("no dspark_block_size", _drop("dspark_block_size"), "dspark_block_size"),
    ("dspark_block_size 0", _set("dspark_block_size", 0), "dspark_block_size"),
    ("no dspark_markov_rank", _drop("dspark_markov_rank"), "dspark_markov_rank"),
    ("dspark_markov_rank 0", _set("dspark_markov_rank", 0), "dspark_markov_rank"),
    ("no noise token", _drop("dspark_noise_token_id"), "dspark_noise_token_id"),
    ("noise token past vocab", _set("dspark_noise_token_id", 129280), "dspark_noise_token_id"),
    ("no layer ids", _drop("dspark_target_layer_ids"), "dspark_target_layer_ids"),
    ("layer id past target", _set("dspark_target_layer_ids", [41, 43]), "dspark_target_layer_ids"),
    ("embedding tap", _set("dspark_target_layer_ids", [-1, 42]), "dspark_target_layer_ids"),
    ("confidence flag string", _set("enable_confidence_head", "1"), "enable_confidence_head"),
    ("n_mtp_layers 0", _set("n_mtp_layers", 0), "n_mtp_layers"),
    ("no num_hidden_layers", _drop("num_hidden_layers"), "num_hidden_layers"),
]


@pytest.mark.parametrize(
    ("mutate", "key"),
    [case[1:] for case in V4_MALFORMED],
    ids=[case[0] for case in V4_MALFORMED],
)
def test_v4_malformed_config(mutate: Callable[[dict], None], key: str) -> None:
    config = copy.deepcopy(V4_CONFIG)
    mutate(config)
    with pytest.raises(ValueError) as error:
        parse_deepseek_v4_config(config)
    assert_one_line_error(error, key, "dspark draft config: ")


def test_v4_config_files_disagree() -> None:
    with pytest.raises(ValueError) as error:
        parse_deepseek_v4_config(V4_CONFIG, inference_config={"dspark_block_size": 7})
    assert_one_line_error(error, "dspark_block_size", "dspark draft config: ")
    with pytest.raises(ValueError) as error:
        parse_deepseek_v4_config(
            dict(V4_CONFIG, n_mtp_layers=3), weight_names=v4_weight_names(stages=2)
        )
    assert_one_line_error(error, "n_mtp_layers", "dspark draft config: ")


def test_v4_weight_roles() -> None:
    assert dspark_v4_weight_role("layers.3.ffn.experts.0.w1.weight") is None
    assert dspark_v4_weight_role("mtp.2.markov_head.markov_w1.weight") == (
        2,
        "markov_w1",
        "markov_head.markov_w1.weight",
    )
    # The FFN w1 shard must stay a layer tensor (the vLLM remap pitfall).
    assert dspark_v4_weight_role("mtp.0.ffn.experts.7.w1.weight")[1] == "layer"
    assert dspark_v4_weight_role("mtp.2.markov_head.embed.weight")[1] == "markov_w1"  # V4.1
    assert dspark_v4_weight_role("mtp.2.markov_head.head.weight")[1] == "markov_w2"
    assert dspark_v4_weight_role("mtp.1.attn_norm.weight")[1] == "layer"
    assert dspark_v4_weight_role("mtp.2.norm.weight")[1] == "norm"


def test_v4_weight_grouping() -> None:
    spec = parse_deepseek_v4_config(V4_CONFIG, inference_config={"n_mtp_layers": 3})
    shapes = {
        "mtp.2.markov_head.markov_w1.weight": (129280, 256),
        "mtp.2.markov_head.markov_w2.weight": (129280, 256),
        "mtp.2.confidence_head.proj.weight": (1, 4096 + 256),
    }
    layout = group_dspark_v4_weights(v4_weight_names(), shapes=shapes, spec=spec)
    assert layout.num_stages == 3
    assert layout.markov_w1 == "mtp.2.markov_head.markov_w1.weight"
    assert layout.markov_w2 == "mtp.2.markov_head.markov_w2.weight"
    assert layout.has_confidence_head
    assert layout.heads["main_proj"] == ("mtp.0.main_proj.scale", "mtp.0.main_proj.weight")
    assert "mtp.1.ffn.experts.0.w1.weight" in layout.stage_layers[1]
    assert all(len(names) == 7 for names in layout.stage_layers)
    without = group_dspark_v4_weights(v4_weight_names(confidence=False))
    assert not without.has_confidence_head  # a missing head disables it


def _rename(old: str, new: str) -> Callable[[list[str]], list[str]]:
    return lambda names: [new if name == old else name for name in names]


def _remove(unwanted: str) -> Callable[[list[str]], list[str]]:
    return lambda names: [name for name in names if name != unwanted]


V4_BAD_WEIGHTS: list[tuple[str, Callable[[list[str]], list[str]], str]] = [
    ("no mtp tensors", lambda names: names[:3], "mtp."),
    (
        "stage gap",
        lambda names: [n.replace("mtp.1.", "mtp.3.") for n in names],
        "stages are 0, 2, 3",
    ),
    (
        "markov in stage 1",
        _rename("mtp.2.markov_head.markov_w1.weight", "mtp.1.markov_head.markov_w1.weight"),
        "mtp.1.markov_head.markov_w1.weight",
    ),
    (
        "main_proj in stage 1",
        _rename("mtp.0.main_proj.weight", "mtp.1.main_proj.weight"),
        "mtp.1.main_proj.weight",
    ),
    ("no markov_w2", _remove("mtp.2.markov_head.markov_w2.weight"), "markov_w2"),
    ("no main_norm", _remove("mtp.0.main_norm.weight"), "main_norm"),
    ("no final norm", _remove("mtp.2.norm.weight"), "norm"),
]


@pytest.mark.parametrize(
    ("edit", "named"),
    [case[1:] for case in V4_BAD_WEIGHTS],
    ids=[case[0] for case in V4_BAD_WEIGHTS],
)
def test_v4_bad_weight_names(edit: Callable[[list[str]], list[str]], named: str) -> None:
    with pytest.raises(ValueError) as error:
        group_dspark_v4_weights(edit(v4_weight_names()))
    assert_one_line_error(error, named, "dspark draft weights: ")


def test_v4_weight_shape_and_stage_count_checks() -> None:
    spec = parse_deepseek_v4_config(V4_CONFIG, inference_config={"n_mtp_layers": 3})
    bad = {"mtp.2.confidence_head.proj.weight": (1, 4096)}  # missing the + r Markov part
    with pytest.raises(ValueError) as error:
        group_dspark_v4_weights(v4_weight_names(), shapes=bad, spec=spec)
    assert_one_line_error(error, "confidence_head", "dspark draft weights: ")
    with pytest.raises(ValueError) as error:
        group_dspark_v4_weights(v4_weight_names(stages=2), spec=spec)
    assert_one_line_error(error, "n_mtp_layers", "dspark draft weights: ")


# --- the distilled tiny draft and its target --------------------------------------------

needs_draft = pytest.mark.skipif(
    not (DRAFT_DIR / "model.safetensors").exists(),
    reason=f"{DRAFT_DIR} not built (python tools/distill_dspark.py)",
)
needs_target = pytest.mark.skipif(
    not (TARGET_DIR / "model.safetensors").exists(),
    reason=f"{TARGET_DIR} not built (python tools/distill_dspark.py)",
)


@pytest.fixture(scope="module")
def single_thread() -> Iterator[None]:
    """One torch thread: on a shared 2-core box, OpenMP waits dominate tiny ops."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tiny_target(single_thread: None) -> Any:
    from dspark_model import TinyQwen3ForCausalLM  # tools/ is on sys.path (conftest)

    return TinyQwen3ForCausalLM.from_pretrained(TARGET_DIR)


@pytest.fixture(scope="module")
def tiny_draft(single_thread: None) -> Any:
    from dspark_model import DSparkDraft

    return DSparkDraft.from_pretrained(DRAFT_DIR)


def prompt_ids(*texts: str) -> list[list[int]]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(TARGET_DIR / "tokenizer.json"))
    return [tokenizer.encode(text).ids for text in texts]


@needs_draft
def test_built_draft_config_and_weights() -> None:
    from safetensors import safe_open

    spec = load_draft_spec(DRAFT_DIR, target_path=TARGET_DIR)
    assert spec.format == FORMAT_DEEPSPEC_QWEN3
    assert spec.block_size == 4 and spec.markov_rank == 32 and spec.markov_head_type == "vanilla"
    assert spec.target_layer_ids == (0, 1, 2) and spec.num_target_layers == 4
    assert spec.enable_confidence_head and spec.confidence_head_with_markov
    assert (spec.hidden_size, spec.vocab_size, spec.num_draft_layers) == (128, 1024, 2)
    config = json.loads((DRAFT_DIR / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["model_type"] == "qwen3"
    expected = deepspec_qwen3_weight_shapes(config)
    with safe_open(str(DRAFT_DIR / "model.safetensors"), "pt") as handle:
        shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
        embed = handle.get_tensor("embed_tokens.weight")
        head = handle.get_tensor("lm_head.weight")
    assert shapes == expected
    with safe_open(str(TARGET_DIR / "model.safetensors"), "pt") as handle:
        # Shared embedding / LM head: the draft's copies equal the target's.
        assert embed.equal(handle.get_tensor("model.embed_tokens.weight"))
        assert head.equal(handle.get_tensor("lm_head.weight"))
    report = json.loads((DRAFT_DIR / "distill_report.json").read_text())
    assert report["acceptance"]["mean_acceptance_length"] >= 2.0
    assert report["acceptance"]["spec_output_differs_from_greedy"] == 0


@needs_target
def test_transformers_loads_target_and_matches_pure_torch_greedy(tiny_target: Any) -> None:
    import torch
    from dspark_model import greedy_decode
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(str(TARGET_DIR), dtype=torch.float32).eval()
    assert type(hf_model).__name__ == "Qwen3ForCausalLM"
    for prompt in prompt_ids("def main", "import os\n", "class Foo:\n    def __init__(self"):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            hf_logits = hf_model(ids).logits
            hf_tokens = hf_model.generate(
                ids, max_new_tokens=24, do_sample=False, pad_token_id=3, attention_mask=None
            )[0, len(prompt) :].tolist()
        torch.testing.assert_close(hf_logits, tiny_target(ids).logits, atol=1e-4, rtol=1e-4)
        assert hf_tokens == greedy_decode(tiny_target, prompt, 24)


@needs_draft
@needs_target
def test_draft_inference_matches_training_form(tiny_target: Any, tiny_draft: Any) -> None:
    """``draft_logits`` (one anchor, from scratch) equals the many-anchor training pass."""
    import torch
    from dspark_model import greedy_decode

    prompt = prompt_ids("def main(argv):\n    ")[0]
    sequence = torch.tensor([prompt + greedy_decode(tiny_target, prompt, 20)])
    with torch.no_grad():
        taps = tiny_target.taps(tiny_target(sequence).layer_outputs, tiny_draft.target_layer_ids)
        anchors = torch.tensor([[1, len(prompt), len(prompt) + 7]])
        batched, _ = tiny_draft.forward_anchors(sequence, taps, anchors)
    for index, anchor in enumerate(anchors[0].tolist()):
        single = tiny_draft.draft_logits(taps[0], anchor, int(sequence[0, anchor]))
        torch.testing.assert_close(single, batched[0, index], atol=1e-5, rtol=1e-5)
    # Rows at or after the anchor are ignored: the context is strictly before it.
    anchor = len(prompt)
    perturbed = taps[0].clone()
    perturbed[anchor:] += 1.0
    torch.testing.assert_close(
        tiny_draft.draft_logits(perturbed, anchor, int(sequence[0, anchor])),
        tiny_draft.draft_logits(taps[0], anchor, int(sequence[0, anchor])),
    )


@needs_draft
@needs_target
def test_pure_torch_speculative_decoding_is_lossless(tiny_target: Any, tiny_draft: Any) -> None:
    import torch
    from dspark_model import greedy_decode, greedy_speculative_decode

    for prompt in prompt_ids("def main", "import os\n"):
        result = greedy_speculative_decode(tiny_target, tiny_draft, prompt, 32)
        assert result.tokens == greedy_decode(tiny_target, prompt, 32)
        assert max(result.accepted_lengths) > 1  # drafts were actually accepted
        with torch.no_grad():
            outputs = tiny_target(torch.tensor([prompt])).layer_outputs
        taps = tiny_target.taps(outputs, tiny_draft.target_layer_ids)[0]
        proposal = tiny_draft.propose_greedy(taps, len(prompt) - 1, prompt[-1])
        assert proposal.tokens.shape == (4,) and proposal.logits.shape == (4, 1024)
        assert ((proposal.confidence > 0) & (proposal.confidence < 1)).all()


def test_drafting_past_the_block_gets_one_line_naming_both_settings(dspark_pair, caplog):
    from vllm_v4_patches.dspark.config_hooks import validate_draft_paths, warn_past_block

    target, draft = dspark_pair
    spec = validate_draft_paths(str(draft), str(target))
    with caplog.at_level("WARNING", logger="vllm_v4_patches"):
        quiet = [warn_past_block(n, spec.block_size, str(draft)) for n in (1, spec.block_size)]
        assert caplog.records == [] and quiet == [False, False]
        assert warn_past_block(spec.block_size + 2, spec.block_size, str(draft))
    [record] = caplog.records
    line = record.getMessage()
    assert "\n" not in line and f"num_speculative_tokens={spec.block_size + 2}" in line
    assert f"block_size={spec.block_size}" in line and f"{draft}/config.json" in line


def test_serving_reads_the_spec_of_a_loaded_config_under_either_format() -> None:
    """Serving reads a draft through ``draft_spec`` of the ``hf_config`` vLLM loaded
    (a real transformers config here): the same spec the checkpoint parser gives,
    whatever the architecture has been renamed to since (vLLM's DFlash route, the
    overlay's own class), a DeepSeek-V4 config's noise token as the mask token, and
    a malformed key as one line. The DFlash exposure takes its values from it."""
    from transformers import PretrainedConfig

    from vllm_v4_patches.dspark.checkpoint import draft_spec
    from vllm_v4_patches.dspark.config_hooks import expose_keys_to_dflash

    renamed = {**DEEPSPEC_CONFIG, "architectures": ["DFlashQwen3DSparkModel"]}
    assert draft_spec(PretrainedConfig(**renamed)) == parse_deepspec_qwen3_config(DEEPSPEC_CONFIG)
    v4 = PretrainedConfig(**V4_CONFIG)
    assert draft_spec(v4) == parse_deepseek_v4_config(V4_CONFIG)
    assert draft_spec(v4).mask_token_id == V4_CONFIG["dspark_noise_token_id"]

    assert expose_keys_to_dflash(v4) == ("target_layer_ids", "mask_token_id")
    assert v4.dflash_config == {"target_layer_ids": [40, 41, 42], "mask_token_id": 128799}
    kept = PretrainedConfig(**DEEPSPEC_CONFIG, dflash_config={"mask_token_id": 3})
    assert expose_keys_to_dflash(kept) == ("target_layer_ids",)  # a key already set wins
    assert kept.dflash_config["mask_token_id"] == 3

    broken = PretrainedConfig(**{**DEEPSPEC_CONFIG, "markov_head_type": "lstm"})
    with pytest.raises(ValueError) as error:
        draft_spec(broken)
    message = str(error.value)
    assert "\n" not in message and "markov_head_type='lstm'" in message
    assert "vanilla, gated, rnn" in message


@pytest.mark.parametrize(
    ("keys", "anchor_first"),
    [
        ({}, True),  # DeepSpec's and DeepSeek-V4's own exports carry no layout key
        ({"sample_from_anchor": True}, True),
        ({"sample_from_anchor": False}, False),
        ({"dflash_config": {"sample_from_anchor": False}}, False),
        ({"dspark_bonus_anchor": True}, False),
        ({"dspark_bonus_anchor": False}, True),
    ],
)
def test_the_block_layout_is_read_from_either_exporters_key(keys: dict, anchor_first: bool):
    for base, parse in (
        (DEEPSPEC_CONFIG, parse_deepspec_qwen3_config),
        (V4_CONFIG, parse_draft_config),
    ):
        assert parse({**copy.deepcopy(base), **keys}).anchor_first is anchor_first
    with pytest.raises(ValueError) as error:
        parse_deepspec_qwen3_config({**DEEPSPEC_CONFIG, "sample_from_anchor": "no"})
    assert_one_line_error(error, "sample_from_anchor", "dspark draft config: ")


def test_a_fill_in_draft_is_refused_on_v1_in_one_line(dspark_pair, tmp_path: Path) -> None:
    """A real draft folder (the distilled tiny draft's config and weights) whose config
    declares the fill-in layout: the V1 route refuses it rather than serve it
    anchor-first at near-zero acceptance (upstream vLLM #56792); V2 is left to serve
    it. The vLLM config is a stand-in holding the fields the hook reads."""
    import shutil
    from types import SimpleNamespace

    from vllm_v4_patches.dspark.config_hooks import validate_draft_checkpoint

    target, draft = dspark_pair
    fill_in = tmp_path / "fill-in"
    shutil.copytree(draft, fill_in)
    config = json.loads((fill_in / "config.json").read_text())
    (fill_in / "config.json").write_text(json.dumps({**config, "sample_from_anchor": False}))

    def vllm_config(path: Path) -> SimpleNamespace:
        speculative = SimpleNamespace(
            model=str(path), num_speculative_tokens=4, draft_model_config=None
        )
        return SimpleNamespace(
            speculative_config=speculative, model_config=SimpleNamespace(model=str(target))
        )

    with pytest.raises(ValueError) as refused:
        validate_draft_checkpoint(vllm_config(fill_in), runner="V1")
    line = str(refused.value)
    assert "\n" not in line and "sample_from_anchor=false" in line and str(fill_in) in line
    assert validate_draft_checkpoint(vllm_config(fill_in), runner="V2") == ()
    assert validate_draft_checkpoint(vllm_config(draft), runner="V1") == ()  # control


def test_taps_follow_each_formats_meaning() -> None:
    """vLLM's aux index i is the stream entering layer i: a DeepSpec or V4 tap of
    layer L (its output) is aux L + 1, a V4.1 tap of layer L (its input) is aux L."""
    from vllm_v4_patches.dspark.runner_hooks import aux_layers

    deepspec = parse_deepspec_qwen3_config(copy.deepcopy(DEEPSPEC_CONFIG))
    v4 = parse_draft_config(copy.deepcopy(V4_CONFIG))
    v41 = parse_draft_config({**copy.deepcopy(V4_CONFIG), "model_type": "deepseek_v41"})
    assert aux_layers(deepspec) == tuple(i + 1 for i in deepspec.target_layer_ids)
    assert aux_layers(v4) == tuple(i + 1 for i in v4.target_layer_ids)
    assert v41.target_layer_ids == v4.target_layer_ids
    assert aux_layers(v41) == v41.target_layer_ids


def test_v41_stages_are_refused_on_v1_even_when_the_v4_route_is_on(monkeypatch) -> None:
    from vllm_v4_patches.dspark import checkpoint
    from vllm_v4_patches.dspark.config_hooks import (
        V4_ON_V1_SETTING,
        refuse_in_checkpoint_draft_on_v1,
    )

    monkeypatch.setenv(V4_ON_V1_SETTING, "on")
    with pytest.raises(ValueError) as refused:
        refuse_in_checkpoint_draft_on_v1(checkpoint.FORMAT_DEEPSEEK_V41, "/ckpt/v41")
    line = str(refused.value)
    assert "\n" not in line and "DeepSeek-V4.1" in line and "/ckpt/v41" in line
    refuse_in_checkpoint_draft_on_v1(checkpoint.FORMAT_DEEPSEEK_V4, "/ckpt/v4")  # control
    refuse_in_checkpoint_draft_on_v1(checkpoint.FORMAT_DEEPSPEC_QWEN3, "/ckpt/qwen3")


def test_the_v1_route_takes_a_v4_draft_at_its_block_size_only() -> None:
    """N above and below ``dspark_block_size`` are refused in one line naming the
    setting and the N accepted; a DeepSpec draft past its block is served (a warning)."""
    from vllm_v4_patches.dspark import checkpoint
    from vllm_v4_patches.dspark.config_hooks import refuse_other_v4_block_on_v1

    block = parse_draft_config(copy.deepcopy(V4_CONFIG)).block_size
    for v4_format in (checkpoint.FORMAT_DEEPSEEK_V4, checkpoint.FORMAT_DEEPSEEK_V41):
        refuse_other_v4_block_on_v1(v4_format, block, block, "/ckpt/v4")
        refuse_other_v4_block_on_v1(v4_format, None, block, "/ckpt/v4")  # vLLM's default
        for n in (block - 1, block + 2):
            with pytest.raises(ValueError) as refused:
                refuse_other_v4_block_on_v1(v4_format, n, block, "/ckpt/v4")
            line = str(refused.value)
            assert "\n" not in line and f"num_speculative_tokens={n}" in line
            assert f"num_speculative_tokens={block} only" in line and "/ckpt/v4" in line
    refuse_other_v4_block_on_v1(checkpoint.FORMAT_DEEPSPEC_QWEN3, block + 2, block, "/q")


def test_before_025_v4_stages_are_refused_before_vllms_dflash_config_sees_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On vLLM 0.24.0 (H200, 2026-12-04) the stand-in route handed a DeepSeek-V4
    checkpoint to vLLM's DFlash config, which failed naming an architecture no
    registry holds. The installed source here is a tree without V4's draft class,
    as 0.24.0's (the probe reads that tree); vLLM's config call is recorded, not run."""
    from vllm_v4_patches import sources
    from vllm_v4_patches.dspark.config_hooks import V4_ON_V1_SETTING, accept_dspark_as_dflash

    registry = tmp_path / "src" / "vllm" / "model_executor" / "models" / "registry.py"
    registry.parent.mkdir(parents=True)
    registry.write_text('_MODELS = {"DeepseekV4ForCausalLM": ("vllm.models.deepseek_v4", "X")}\n')
    monkeypatch.setattr(
        sources, "InstalledSource", lambda: sources.TreeSource(str(tmp_path / "src"))
    )
    monkeypatch.setenv(V4_ON_V1_SETTING, "on")
    checkpoint_dir = tmp_path / "v4"
    checkpoint_dir.mkdir()
    (checkpoint_dir / "config.json").write_text(json.dumps(V4_CONFIG))
    called: list[dict] = []

    def vllm_init(*args: Any, **kwargs: Any) -> None:
        called.append(kwargs)

    class Target:
        model = str(checkpoint_dir)

    request = {"method": "dspark", "model": str(checkpoint_dir), "target_model_config": Target()}
    with pytest.raises(ValueError) as refused:
        accept_dspark_as_dflash(vllm_init, None, (), request)
    line = str(refused.value)
    assert "\n" not in line and "speculative_config.model" in line and "vLLM >= 0.25" in line
    assert called == []
