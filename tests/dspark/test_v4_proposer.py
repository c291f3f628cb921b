"""The V4 drafter's slot arithmetic (``dspark.v4_proposer``), on real torch tensors.

A DeepSeek-V4 draft's three sliding-window caches land in separate KV cache groups,
each with its own block table, so the drafter computes every draft token's slot
per group itself. These tests check that arithmetic against a per-token reference
written here; the engine path around it needs the GPU (the suite's ``v4`` part).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vllm_v4_patches.dspark.v4_proposer import drafts_deepseek_v4, slots_in_group, token_rows


def reference_slots(table: list[list[int]], positions, rows, block_size: int, primary) -> list:
    slots = []
    for position, row, first in zip(positions, rows, primary, strict=True):
        if first < 0:
            slots.append(first)
            continue
        column = min(position // block_size, len(table[row]) - 1)
        slots.append(table[row][column] * block_size + position % block_size)
    return slots


def test_slots_in_group_match_a_per_token_reference() -> None:
    generator = torch.Generator().manual_seed(7)
    block_size, num_reqs, width = 64, 5, 6
    table = torch.randint(0, 900, (num_reqs, width), generator=generator, dtype=torch.int32)
    positions = torch.randint(0, block_size * width, (40,), generator=generator)
    rows = torch.randint(0, num_reqs, (40,), generator=generator)
    primary = torch.randint(0, 1000, (40,), generator=generator)
    primary[::7] = -1  # padding and rejected rows stay unwritten in every group
    positions[3] = block_size * width + 5  # past the table: reads its last entry
    got = slots_in_group(table, positions, rows, block_size, primary)
    expected = reference_slots(
        table.tolist(), positions.tolist(), rows.tolist(), block_size, primary.tolist()
    )
    assert got.dtype == torch.int64
    assert got.tolist() == expected
    # a control: another group's table gives other slots for the same tokens
    other = slots_in_group(table.flip(0), positions, rows, block_size, primary)
    assert other.tolist() != expected


def test_token_rows_follow_the_query_start_locations() -> None:
    # four requests with 3, 1, 0 and 4 tokens; a padded batch adds two more tokens
    query_start_loc = torch.tensor([0, 3, 4, 4, 8, 8], dtype=torch.int32)
    rows = token_rows(query_start_loc, num_reqs=4, num_tokens=10)
    assert rows.tolist() == [0, 0, 0, 1, 3, 3, 3, 3, 3, 3]
    assert token_rows(query_start_loc, num_reqs=1, num_tokens=3).tolist() == [0, 0, 0]


@pytest.mark.parametrize(
    ("config", "is_v4"),
    [
        ({"model_type": "deepseek_v4", "dspark_block_size": 5, "hc_mult": 4}, True),
        ({"model_type": "deepseek_v4", "hc_mult": 4}, False),  # V4 without DSpark stages
        ({"architectures": ["Qwen3DSparkModel"], "block_size": 4}, False),  # DeepSpec
    ],
)
def test_only_a_v4_checkpoint_with_dspark_stages_takes_the_v4_drafter(
    tmp_path: Path, config: dict, is_v4: bool
) -> None:
    from transformers import PretrainedConfig

    (tmp_path / "config.json").write_text(json.dumps(config))
    hf_config = PretrainedConfig.from_pretrained(tmp_path)
    assert drafts_deepseek_v4(hf_config) is is_v4
