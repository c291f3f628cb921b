"""DSpark draft checkpoints: parse both config formats into one ``DSparkDraftSpec``,
and check a draft's weights before loading.

Two formats exist (``docs/dspark.md`` section 8):

* **DeepSpec Qwen3** (``deepseek-ai/dspark_qwen3_*``): a standalone HF model with
  ``architectures: ["Qwen3DSparkModel"]``, the ordinary Qwen3 keys describing the
  *draft* (``num_hidden_layers`` = draft layers) and the DSpark keys ``block_size``,
  ``mask_token_id``, ``target_layer_ids``, ``num_target_layers`` (the target's layer
  count), ``num_anchors`` (training only), ``markov_rank``, ``markov_head_type``,
  ``enable_confidence_head``, ``confidence_head_with_markov``. Weights carry no
  prefix (``layers.*``, ``fc``, ``hidden_norm``, ``norm``, ``markov_head.*``, ...).
* **DeepSeek-V4** (-Flash-DSpark, -0731, V4-Pro, V4.1): the draft lives inside the
  target checkpoint. The target's ``config.json`` has ``dspark_block_size``,
  ``dspark_markov_rank``, ``dspark_target_layer_ids``, ``dspark_noise_token_id``
  (optionally ``enable_confidence_head``); the stage count is ``n_mtp_layers`` of
  ``inference/config.json`` or the number of ``mtp.{i}.`` weight prefixes
  (``num_nextn_predict_layers`` is *not* the stage count). The V4 layers themselves
  are out of scope here; :func:`group_dspark_v4_weights` only maps and checks names.

Defaults follow what loaders do when an optional key is absent: vLLM treats a
missing ``enable_confidence_head`` as false for Qwen3 drafts and as true for V4,
and a missing ``confidence_head_with_markov`` as false. DeepSpec itself always
writes ``markov_head_type`` when ``markov_rank > 0``, so it is required then.

Every malformed config raises one ``ValueError`` whose one-line message names the
key and what is accepted. No torch or vLLM import: this package is read by tools
and tests that must not pay for (or depend on) either.

Modules: ``spec`` (the spec, format names, error helpers), ``config`` (both config
formats; ``draft_spec`` for a config vLLM loaded), ``deepspec_weights`` (a DeepSpec
draft's tensor shapes against its safetensors headers), ``v4_weights`` (V4's
``mtp.*`` names).
"""

from __future__ import annotations

from vllm_v4_patches.dspark.checkpoint.config import (
    draft_spec,
    load_draft_spec,
    parse_deepseek_v4_config,
    parse_deepspec_qwen3_config,
    parse_draft_config,
)
from vllm_v4_patches.dspark.checkpoint.deepspec_weights import (
    check_deepspec_weights,
    deepspec_qwen3_weight_shapes,
)
from vllm_v4_patches.dspark.checkpoint.spec import (
    DEEPSPEC_QWEN3_ARCHITECTURE,
    FORMAT_DEEPSEEK_V4,
    FORMAT_DEEPSEEK_V41,
    FORMAT_DEEPSPEC_QWEN3,
    MARKOV_HEAD_TYPES,
    V4_KEY_NAMES,
    V4_WEIGHT_PREFIX,
    DSparkDraftSpec,
)
from vllm_v4_patches.dspark.checkpoint.v4_weights import (
    DSparkV4WeightLayout,
    check_v4_entries,
    check_v4_weights,
    dspark_v4_weight_role,
    group_dspark_v4_weights,
    read_v4_confidence_weight,
)

__all__ = [
    "DEEPSPEC_QWEN3_ARCHITECTURE",
    "FORMAT_DEEPSEEK_V4",
    "FORMAT_DEEPSEEK_V41",
    "FORMAT_DEEPSPEC_QWEN3",
    "MARKOV_HEAD_TYPES",
    "V4_KEY_NAMES",
    "V4_WEIGHT_PREFIX",
    "DSparkDraftSpec",
    "DSparkV4WeightLayout",
    "check_deepspec_weights",
    "check_v4_entries",
    "check_v4_weights",
    "read_v4_confidence_weight",
    "deepspec_qwen3_weight_shapes",
    "draft_spec",
    "dspark_v4_weight_role",
    "group_dspark_v4_weights",
    "load_draft_spec",
    "parse_deepseek_v4_config",
    "parse_deepspec_qwen3_config",
    "parse_draft_config",
]
