"""The cudagraph mode of a V1 engine drafting a DeepSeek-V4 checkpoint's own stages
where vLLM captures V4 in breakable CUDA graphs (0.23+, turned on by vLLM itself
for V4's architecture).

Breakable graphs capture the whole forward with the attention run eagerly between
captured segments, for mixed prefill-decode batches (the piecewise half of
FULL_AND_PIECEWISE) and, in the V1 runner, for the drafter's forward too. Under that
mode the overlay's V4 route was not lossless on the H200, where the same engines
with FULL_DECODE_ONLY or NONE were (vLLM 0.24.0; docs/dspark.md, section 13). Which
captured piece goes wrong is not isolated yet, so by default the route drops the
piecewise half, as ``CUDAGraphMode.without_piecewise()`` does: decode batches keep
their full graphs.

``VLLM_V4_DSPARK_V4_PIECEWISE``, for finding the fault on a GPU: ``off`` (that
default), ``target`` (vLLM's mode for the target, the drafter's forward without
graphs) or ``on`` (vLLM's mode for both).
"""

from __future__ import annotations

import logging
from typing import Any

SETTING = "VLLM_V4_DSPARK_V4_PIECEWISE"
CHOICES = ("off", "target", "on")

logger = logging.getLogger("vllm_v4_patches")


def setting() -> str:
    from vllm_v4_patches.toggles import read_choice

    return read_choice(SETTING, CHOICES, "keeping piecewise graphs off")


def keep_off_piecewise(vllm_config: Any) -> None:
    """Before the V1 runner of a V4-stages DSpark engine reads its cudagraph mode:
    without the piecewise half where breakable graphs would capture it."""
    from vllm_v4_patches.graph_modes import breakable_cudagraphs_enabled, without_piecewise

    compilation = vllm_config.compilation_config
    mode = compilation.cudagraph_mode
    if mode is None or not mode.has_piecewise_cudagraphs():
        return
    if not breakable_cudagraphs_enabled():
        return  # 0.20-0.22: piecewise graphs of the compiled model, measured lossless
    choice = setting()
    if choice != "off":
        logger.warning(
            "vllm_v4_patches: dspark: %s=%s keeps cudagraph mode %s for DeepSeek-V4's "
            "own stages on V1 (%s); its breakable piecewise graphs lost tokens on the H200",
            SETTING,
            choice,
            mode.name,
            "the drafter's forward without graphs" if choice == "target" else "the drafter's too",
        )
        return
    demoted = without_piecewise(mode)
    logger.warning(
        "vllm_v4_patches: dspark: cudagraph mode %s -> %s for DeepSeek-V4's own stages "
        "on V1: breakable piecewise graphs lost tokens on the H200 (%s=on keeps them)",
        mode.name,
        demoted.name,
        SETTING,
    )
    compilation.cudagraph_mode = demoted


def drafter_graphs_allowed() -> bool:
    """Whether the V4 drafter's forward may replay graphs: not under ``target``."""
    from vllm_v4_patches.graph_modes import breakable_cudagraphs_enabled

    return not (breakable_cudagraphs_enabled() and setting() == "target")
