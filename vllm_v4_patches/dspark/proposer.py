"""The V1 DSpark drafter, built on vLLM's V1 DFlash drafter.

DSpark reuses DFlash's machinery (context K/V projected from the target's tapped
hidden states and written for accepted rows only, a non-causal query block), with
three differences handled here:

* the query block is ``[anchor, mask × (N-1)]``: the anchor (the bonus token) is
  the first prediction slot, so every one of the N query positions is sampled.
  That is DFlash's ``[bonus, mask × M]`` layout with ``M = N - 1``;
* the N base logits are corrected left to right by the Markov head, each slot
  given the token drafted before it (the anchor for slot 0);
* in probabilistic mode the corrected distribution each draft was sampled from is
  what ``take_last_draft_probs()`` hands the rejection sampler, so standard
  rejection sampling stays lossless.

The class is built on first use (``proposer_class()``) because it subclasses a
vLLM class and the package must not import vLLM at import time.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def presented_as(speculative_config: Any, method: str) -> Iterator[None]:
    """Show vLLM's DFlash constructor the method it asserts on, then restore."""
    original = speculative_config.method
    object.__setattr__(speculative_config, "method", method)
    try:
        yield
    finally:
        object.__setattr__(speculative_config, "method", original)


def _verification(runner: Any) -> Any:
    """The drafter's ScheduledVerification where confidence-scheduled verification
    is on, lagged under async scheduling; None where every draft is verified."""
    from vllm_v4_patches.dspark import verify

    if verify.verify_mode() != "confidence":
        return None
    fixed = verify.fixed_cost()
    if not getattr(runner, "use_async_scheduling", False):
        return verify.ScheduledVerification(fixed, lagged=False)
    world_size = getattr(getattr(runner, "parallel_config", None), "world_size", 1)
    if world_size > 1 and fixed is None:
        # each rank cuts its own copy of the step: measured step periods differ
        # between ranks, a fixed cost model does not
        verify.logger.warning(
            "vllm_v4_patches: %s=confidence with async scheduling on %d ranks needs %s "
            "(every rank must cut the same drafts); verifying every draft",
            verify.MODE_SETTING,
            world_size,
            verify.COST_SETTING,
        )
        return None
    return verify.ScheduledVerification(fixed, lagged=True)


def serve_with_overlay_class_where_needed(hf_config: Any, needs_confidence: bool) -> None:
    """Give a DeepSpec Qwen3 draft the overlay's draft class where vLLM's would not
    serve all of it.

    vLLM's own DSpark Qwen3 class (0.25+) has the vanilla Markov head only and fails
    on the other heads' tensors, and before 0.28 it has no confidence head, which
    confidence-scheduled verification (``needs_confidence``) plans from. Its loader
    resolves the class from the draft's ``hf_config.architectures``. Drafts marked
    by the 0.20-0.24 route already resolve to the overlay's class; other draft
    architectures are left to vLLM.
    """
    from vllm_v4_patches.dspark import DRAFT_METHOD_MARK, DSPARK_ARCHITECTURE, OVERLAY_ARCHITECTURE

    if getattr(hf_config, DRAFT_METHOD_MARK, None) is not None:
        return
    if DSPARK_ARCHITECTURE not in (getattr(hf_config, "architectures", None) or []):
        return
    from vllm_v4_patches.dspark.checkpoint import draft_spec

    spec = draft_spec(hf_config)
    kind = spec.markov_head_type or "vanilla"
    scores_confidence = spec.enable_confidence_head and needs_confidence
    if kind != "vanilla" or (scores_confidence and not _native_class_scores_confidence()):
        hf_config.architectures = [OVERLAY_ARCHITECTURE]


def _scores_confidence(model: Any) -> bool:
    return getattr(getattr(model, "model", None), "confidence_head", None) is not None


def _native_class_scores_confidence() -> bool:
    import importlib

    try:
        module = importlib.import_module("vllm.model_executor.models.qwen3_dspark")
    except ImportError:
        return False
    return hasattr(getattr(module, "Qwen3DSparkForCausalLM", None), "compute_confidence")


@functools.cache
def proposer_class() -> type:
    from vllm.v1.spec_decode.dflash import DFlashProposer

    class DSparkV1Proposer(DFlashProposer):
        """DFlash's V1 drafter with DSpark's anchor slot, Markov head and confidence."""

        def __init__(self, vllm_config: Any, device: Any, runner: Any = None) -> None:
            with presented_as(vllm_config.speculative_config, "dflash"):
                super().__init__(vllm_config, device, runner)
            # The base class keys its DFlash code paths (aux-state combination,
            # single-tensor model output) on self.method; DSpark shares them all.
            self.method = "dflash"
            self.draft_method = "dspark"
            self.last_confidence: Any = None
            self._anchors: Any = None
            from vllm_v4_patches.dspark.sampling import kernel_choice

            choice = kernel_choice()  # read once, warned once
            self.fused_markov = choice != "torch"
            self.markov_graphs: Any = None  # built in load_model where choice is auto
            self.graph_markov = choice == "auto"
            self.verification = _verification(runner)  # None: every draft verified
            self.warming_up = False  # serving the engine core's warm-up requests
            self.reset_counters()

        @property
        def verify_counts(self) -> dict[str, int]:
            """Drafts scheduled and verified where scheduled verification cut them."""
            if self.verification is None:
                return {"scheduled": 0, "verified": 0}
            return self.verification.counts

        def reset_counters(self) -> None:
            """Counters and step-cost history from zero (after the engine core's
            warm-up requests, whose steps include compilation)."""
            self.draft_steps = 0
            self.fused_draft_steps = 0  # of draft_steps, those the fused kernel drafted
            self.graph_draft_steps = 0  # of those, the ones replayed from a CUDA graph
            self.sharded_draft_steps = 0  # of draft_steps, walked over a vocabulary shard
            if self.verification is not None:
                self.verification.restart()

        def load_model(self, target_model: Any) -> None:
            from vllm_v4_patches.dspark.context_norm import fix_context_k_norm

            draft_config = self.draft_model_config.hf_config
            serve_with_overlay_class_where_needed(draft_config, self.verification is not None)
            super().load_model(target_model)
            fix_context_k_norm(self.model)
            self.load_confidence_head()
            self.markov_graphs = self._greedy_stage_graphs()
            if self.verification is not None and not _scores_confidence(self.model):
                from vllm_v4_patches.dspark import verify

                verify.logger.warning(
                    "vllm_v4_patches: %s=confidence needs a draft with a confidence head "
                    "(enable_confidence_head); this one has none, so every draft is verified",
                    verify.MODE_SETTING,
                )
                self.verification = None

        def load_confidence_head(self) -> None:
            """Where the draft class leaves its checkpoint's confidence head unloaded,
            load it (the DeepSpec classes load their own)."""

        def _greedy_stage_graphs(self) -> Any:
            from vllm_v4_patches.dspark import graphs, sampling

            if not (self.graph_markov and graphs.engine_captures_graphs(self.vllm_config)):
                return None
            num_slots = self.num_speculative_tokens
            max_batch = self.vllm_config.scheduler_config.max_num_seqs
            stage = sampling.greedy_stage(self.model, num_slots)
            return graphs.GreedyStageGraphs(stage, num_slots, graphs.graph_batch_sizes(max_batch))

        def _init_parallel_drafting_params(self) -> None:
            try:
                super()._init_parallel_drafting_params()
            except ValueError:
                # before 0.29 vLLM looks for the mask token only where DFlash and
                # PARD keep it; DSpark drafts name it mask_token_id (DeepSpec) or
                # dspark_noise_token_id (DeepSeek-V4)
                from vllm_v4_patches.dspark.checkpoint import draft_spec

                spec = draft_spec(self.draft_model_config.hf_config)
                self.parallel_drafting_token_id = spec.mask_token_id

        def set_inputs_first_pass(
            self,
            target_token_ids: Any,
            next_token_ids: Any,
            target_positions: Any,
            target_hidden_states: Any,
            token_indices_to_sample: Any,
            cad: Any,
            num_rejected_tokens_gpu: Any,
        ) -> tuple[int, Any, Any]:
            num_slots = self.num_speculative_tokens
            self._anchors = next_token_ids
            # DFlash lays out [bonus, mask x M]; with M = N - 1 that is DSpark's block.
            self.num_speculative_tokens = num_slots - 1
            try:
                num_query, _, block_cad = super().set_inputs_first_pass(
                    target_token_ids,
                    next_token_ids,
                    target_positions,
                    target_hidden_states,
                    token_indices_to_sample,
                    cad,
                    num_rejected_tokens_gpu,
                )
            finally:
                self.num_speculative_tokens = num_slots
            # every query position is a prediction slot; DFlash keeps a device arange
            return num_query, self.arange[:num_query], block_cad

        def _sample_draft_tokens(
            self, hidden_states: Any, sampling_metadata: Any
        ) -> tuple[Any, Any]:
            from vllm_v4_patches.dspark import sampling

            temperature = sampling.temperatures_for(self, sampling_metadata)
            block = None
            if temperature is None and self.markov_graphs is not None:
                block = self.markov_graphs.draft(hidden_states, self._anchors)
                self.graph_draft_steps += block is not None
            if block is None:
                block = sampling.draft_with_markov_head(
                    self.model,
                    hidden_states,
                    self._anchors,
                    self.num_speculative_tokens,
                    temperature,
                    fused=self.fused_markov,
                    generators=getattr(sampling_metadata, "generators", None),
                )
            self.last_confidence = block.confidence
            self.draft_steps += 1
            self.fused_draft_steps += block.fused
            self.sharded_draft_steps += block.sharded
            probs = None if block.probs is None else block.probs.flatten(0, 1)
            return block.tokens.flatten(), probs

        def _greedy_sample(self, hidden_states: Any) -> Any:
            # vLLM 0.20-0.21 draft parallel blocks through this directly (there is
            # no _sample_draft_tokens yet); later releases only reach it from the
            # base _sample_draft_tokens, which this class replaces
            return self._sample_draft_tokens(hidden_states, None)[0]

    return DSparkV1Proposer
