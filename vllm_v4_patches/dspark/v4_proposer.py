"""The V1 DSpark drafter for DeepSeek-V4's own draft (the ``mtp.*`` stages of a V4
checkpoint), served by vLLM's V4 draft class (``DSparkDeepseekV4ForCausalLM``).

The DeepSpec drafter (``proposer``) does the block layout, the Markov head and the
verification plumbing; a V4 draft differs from a DeepSpec one in four places that
vLLM's V1 base drafter gets wrong for it:

* its context is ``main_x``: the taps (mHC streams averaged by the target, as
  vLLM's V2 path feeds them) through ``main_proj`` and ``main_norm``, ``H`` wide.
  V1 sizes the context buffer ``hc_mult * H`` for any V4 draft (that is what V4's
  MTP layer reads), and combines taps only for the draft classes it lists;
* its three sliding-window caches land in separate KV cache groups (vLLM's V4
  grouping strides same-spec layers across groups), each with its own block
  table, where V1 asserts one group per drafter. Slots are computed here per
  group: the block's query slots for each group's attention metadata, and the
  context slots ``precompute_and_store_context_kv`` takes as one list entry per
  layer (V1's DFlash code passes one tensor there);
* its sparse sliding-window metadata carries no ``causal`` field, so DFlash's
  per-layer non-causal assertion cannot hold; the block is non-causal because
  the common metadata says ``causal=False`` and the method is ``dspark``, which
  is what the V4 builder reads;
* its forward returns one tensor (the pre-norm head hidden state).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


def drafts_deepseek_v4(hf_config: Any) -> bool:
    """A DeepSeek-V4 (or V4.1) checkpoint's own DSpark stages, by the config."""
    return hasattr(hf_config, "dspark_block_size") and hasattr(hf_config, "hc_mult")


def attach_confidence_head(model: Any, weight: Any, device: Any) -> None:
    """Give vLLM's V4 draft model the checkpoint's confidence head (``[1, H + r]``, no
    bias, scored in float32 from the pre-norm head hidden state and the previous
    token's Markov embedding), where the drafter looks for one: ``model.model.
    confidence_head`` and ``model.compute_confidence``."""
    import torch

    from vllm_v4_patches.dspark.draft_model import confidence_head_class

    hidden_size = model.config.hidden_size
    head = confidence_head_class()(weight.shape[-1], weight.shape[-1] != hidden_size, bias=False)
    with torch.no_grad():
        head.proj.weight.copy_(weight.reshape(1, -1).float())
    head = head.to(device)
    model.model.confidence_head = head

    def compute_confidence(hidden_states: Any, markov_embed: Any) -> Any:
        return torch.sigmoid(head(hidden_states, markov_embed))

    model.compute_confidence = compute_confidence


@dataclass
class DraftGroup:
    """The draft layers one KV cache group holds, and this step's slots in it."""

    kv_cache_gid: int
    attn_group: Any
    layer_names: list[str] = field(default_factory=list)
    context_slots: Any = None
    query_slots: Any = None


@contextlib.contextmanager
def method_shown(drafter: Any, method: str) -> Iterator[None]:
    original = drafter.method
    drafter.method = method
    try:
        yield
    finally:
        drafter.method = original


def slots_in_group(
    block_table: Any, positions: Any, rows: Any, block_size: int, primary_slots: Any
) -> Any:
    """Each token's slot in one group's cache (``-1`` where the primary group's
    slot is, i.e. padding and rejected rows)."""
    import torch

    # a position past the table (a padded or clamped row) reads the last entry; its
    # slot is masked below or never attended
    columns = torch.div(positions, block_size, rounding_mode="floor").clamp_(
        max=block_table.shape[1] - 1
    )
    blocks = block_table[rows, columns]
    slots = blocks.to(torch.int64) * block_size + positions % block_size
    return torch.where(primary_slots < 0, primary_slots, slots)


def token_rows(query_start_loc: Any, num_reqs: int, num_tokens: int) -> Any:
    """Each of a step's tokens' request row: the first request whose end lies past
    it (no host sync; tokens past the last request read the last row)."""
    import torch

    ends = query_start_loc[1 : num_reqs + 1].to(torch.int64)
    positions = torch.arange(num_tokens, device=ends.device)
    return torch.searchsorted(ends, positions, right=True).clamp_(max=max(num_reqs - 1, 0))


@functools.cache
def v4_proposer_class() -> type:
    import torch

    from vllm_v4_patches.dspark.proposer import proposer_class

    class DSparkV4Proposer(proposer_class()):  # type: ignore[misc]
        """The DSpark drafter with a DeepSeek-V4 checkpoint's own stages."""

        def __init__(self, vllm_config: Any, device: Any, runner: Any = None) -> None:
            super().__init__(vllm_config, device, runner)
            self.runner = runner
            from vllm_v4_patches.dspark.v4_cudagraphs import drafter_graphs_allowed

            # read once: the draft's dispatch asks for it every draft step
            self.draft_graphs = drafter_graphs_allowed()
            self.draft_groups: list[DraftGroup] = []
            width = self.draft_model_config.get_hidden_size()
            if self.hidden_size != width:
                self.hidden_size = width
                rows = self.hidden_states.shape[0]
                self.hidden_states = torch.zeros(
                    (rows, width), dtype=self.hidden_states.dtype, device=self.hidden_states.device
                )

        def model_returns_tuple(self) -> bool:
            return False

        def _determine_batch_execution_and_padding(
            self, num_tokens: int, use_cudagraphs: bool = True
        ) -> tuple[Any, int, Any]:
            allowed = use_cudagraphs and self.draft_graphs
            return super()._determine_batch_execution_and_padding(num_tokens, allowed)

        def load_confidence_head(self) -> None:
            # vLLM's V4 class drops the head's tensor; a local checkpoint's is read here
            import os

            from vllm_v4_patches.dspark import checkpoint

            path = self.draft_model_config.model
            if not os.path.isdir(path):
                return
            spec = checkpoint.draft_spec(self.draft_model_config.hf_config)
            weight = checkpoint.read_v4_confidence_weight(path, spec)
            if weight is not None:
                attach_confidence_head(self.model, weight, self.device)

        def propose(self, **kwargs: Any) -> Any:
            # main_x from the taps, then the base propose with DFlash's own
            # combination (gated on its list of draft classes) skipped
            kwargs["target_hidden_states"] = self.model.combine_hidden_states(
                kwargs["target_hidden_states"]
            )
            with method_shown(self, "dspark"):
                return super().propose(**kwargs)

        def validate_same_kv_cache_group(self, kv_cache_config: Any) -> None:
            return  # the draft layers' caches are grouped per layer stride, see above

        def initialize_attn_backend(
            self, kv_cache_config: Any, kernel_block_sizes: list[int] | None = None
        ) -> None:
            self.draft_groups = build_draft_groups(
                self.vllm_config,
                self.device,
                self._draft_attn_layer_names,
                kv_cache_config,
                kernel_block_sizes,
            )
            self.draft_attn_groups = [group.attn_group for group in self.draft_groups]
            self.kv_cache_gid = self.draft_groups[0].kv_cache_gid
            builder = self.draft_attn_groups[0].get_metadata_builder()
            self.block_size = builder.kv_cache_spec.block_size

        def set_inputs_first_pass(self, **kwargs: Any) -> tuple[int, Any, Any]:
            cad = kwargs["cad"]
            num_query, sample_rows, block_cad = super().set_inputs_first_pass(**kwargs)
            self._slots_per_group(cad, block_cad, num_query)
            return num_query, sample_rows, block_cad

        def _slots_per_group(self, cad: Any, block_cad: Any, num_query: int) -> None:
            num_context = self._dflash_num_context
            num_reqs = cad.num_reqs
            context_rows = token_rows(cad.query_start_loc, num_reqs, num_context)
            # the block is N query tokens per request, request-major
            query_rows = torch.div(
                torch.arange(num_query, device=self.device),
                self.num_speculative_tokens,
                rounding_mode="floor",
            )
            primary_context = self._context_slot_mapping_buffer[:num_context]
            primary_query = block_cad.slot_mapping
            for group in self.draft_groups:
                if group.kv_cache_gid == self.kv_cache_gid:
                    group.context_slots, group.query_slots = primary_context, primary_query
                    continue
                table = self.runner.input_batch.block_table[group.kv_cache_gid]
                block_table = table.get_device_tensor(num_reqs)
                positions = self._context_positions_buffer[:num_context]
                group.context_slots = slots_in_group(
                    block_table, positions, context_rows, table.block_size, primary_context
                )
                group.query_slots = slots_in_group(
                    block_table,
                    self.positions[:num_query],
                    query_rows,
                    table.block_size,
                    primary_query,
                )

        def _get_slot_mapping(self, num_tokens: int, slot_mapping: Any = None) -> dict:
            # the block's slots in each layer's own group (vLLM gives every draft
            # layer the primary group's)
            by_layer = super()._get_slot_mapping(num_tokens, slot_mapping)
            if slot_mapping is None:
                return by_layer
            for group in self.draft_groups:
                if group.kv_cache_gid == self.kv_cache_gid or group.query_slots is None:
                    continue
                slots = group.query_slots[:num_tokens]
                if slots.shape[0] < num_tokens:
                    slots = torch.nn.functional.pad(
                        slots, (0, num_tokens - slots.shape[0]), value=-1
                    )
                by_layer.update({name: slots for name in group.layer_names})
            return by_layer

        def build_per_group_and_layer_attn_metadata(
            self, common_attn_metadata: Any, draft_index: int = 0
        ) -> tuple[list[object], dict[str, object]]:
            per_group: list[object] = []
            per_layer: dict[str, object] = {}
            for group in self.draft_groups:
                cad = common_attn_metadata
                if group.kv_cache_gid != self.kv_cache_gid:
                    table = self.runner.input_batch.block_table[group.kv_cache_gid]
                    cad = replace_tables(
                        cad, table.get_device_tensor(cad.num_reqs), group.query_slots
                    )
                metadata = group.attn_group.get_metadata_builder().build_for_drafting(
                    common_attn_metadata=cad, draft_index=draft_index
                )
                per_group.append(metadata)
                per_layer.update({name: metadata for name in group.layer_names})
            return per_group, per_layer

        def build_model_inputs_first_pass(
            self, num_tokens: int, num_input_tokens: int, mm_embed_inputs: Any
        ) -> tuple[dict[str, Any], int]:
            num_context = self._dflash_num_context
            slots_by_layer = {
                name: group.context_slots
                for group in self.draft_groups
                for name in group.layer_names
            }
            # the draft's own layer order; each layer writes where its group maps
            layer_names = self.model.get_draft_kv_cache_layer_names()
            layer_slots = [slots_by_layer[name] for name in layer_names]
            self.model.precompute_and_store_context_kv(
                self._dflash_hidden_states,
                self._context_positions_buffer[:num_context],
                layer_slots,
            )
            inputs = dict(
                input_ids=self.input_ids[:num_input_tokens],
                positions=self._get_positions(num_input_tokens),
                inputs_embeds=None,
            )
            return inputs, num_input_tokens

    return DSparkV4Proposer


def replace_tables(cad: Any, block_table: Any, slot_mapping: Any) -> Any:
    """The common metadata with another group's block table and slots."""
    import copy

    grouped = copy.copy(cad)
    grouped.block_table_tensor = block_table
    grouped.slot_mapping = slot_mapping
    return grouped


def build_draft_groups(
    vllm_config: Any,
    device: Any,
    draft_layer_names: set[str],
    kv_cache_config: Any,
    kernel_block_sizes: list[int] | None,
) -> list[DraftGroup]:
    """One attention group (and metadata builder) per KV cache group holding draft
    layers, in group order."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.v1.worker.utils import AttentionGroup

    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase)  # type: ignore[type-abstract]
    groups = []
    for gid, kv_group in enumerate(kv_cache_config.kv_cache_groups):
        names = [name for name in kv_group.layer_names if name in draft_layer_names]
        if not names:
            continue
        spec = kv_group.kv_cache_spec
        specs = getattr(spec, "kv_cache_specs", None)  # a group of uniform-type specs
        attn_group = AttentionGroup(
            backend=layers[names[0]].get_attn_backend(),
            layer_names=names,
            kv_cache_spec=specs[names[0]] if specs else spec,
            kv_cache_group_id=gid,
        )
        block_size = None
        if kernel_block_sizes is not None and gid < len(kernel_block_sizes):
            block_size = kernel_block_sizes[gid]
        attn_group.create_metadata_builders(vllm_config, device, kernel_block_size=block_size)
        groups.append(DraftGroup(gid, attn_group, names))
    if not groups:
        raise ValueError("dspark: no KV cache group holds the DeepSeek-V4 draft's layers")
    backends = {group.attn_group.backend.full_cls_name() for group in groups}
    if len(backends) != 1:
        raise ValueError(f"dspark: the V4 draft's layers use several backends: {sorted(backends)}")
    return groups
