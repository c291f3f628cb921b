"""On vLLM 0.20-0.21, VllmConfig runs the speculative config's tap-model list check a
second time while it validates its fields (pydantic re-runs a nested config's
after-validators); the H200's 0.20.2 run of 2026-12-05 refused the V4 target there,
after ``accept_dspark_as_dflash`` had let it through.

The two configs here are stand-ins, because 0.20-0.21's own need a GPU model: pydantic
dataclasses made by this vLLM's real ``config`` decorator, the speculative one's
after-validator being the release's own list check compiled from its source. So the
re-validation is pydantic's real behaviour, and the check is the release's code."""

# no postponed annotations: pydantic must resolve the nested local class
from types import SimpleNamespace
from typing import Any

import pytest
import wrapt
from pydantic import ConfigDict, model_validator

from vllm_v4_patches.dspark import DRAFT_METHOD_MARK, TAPS_GATE_LIST
from vllm_v4_patches.dspark.config_hooks import (
    hide_v4_target_from_revalidation,
    taps_gate_passed,
    target_back_before_post_init,
)


def config_classes(version: str) -> tuple[type, type, list]:
    """A speculative config checked by ``version``'s list and a VllmConfig holding it,
    whose ``__post_init__`` records the target type it reads."""
    import vllm_builds
    from release_code import release_method
    from vllm.config.utils import config

    list_check = release_method(
        vllm_builds.fetch_source(version),
        "vllm/config/speculative.py",
        "SpeculativeConfig",
        "_verify_args",
        keep={TAPS_GATE_LIST},
    )
    seen_by_post_init: list = []

    @config(config=ConfigDict(arbitrary_types_allowed=True))
    class SpeculativeConfig:
        method: str
        target_model_config: Any = None
        draft_model_config: Any = None

        @model_validator(mode="after")
        def _verify_args(self) -> Any:
            list_check(self)
            return self

    @config(config=ConfigDict(arbitrary_types_allowed=True))
    class VllmConfig:
        speculative_config: SpeculativeConfig | None = None

        def __post_init__(self) -> None:
            target = self.speculative_config.target_model_config
            seen_by_post_init.append(target.hf_text_config.model_type)

    return SpeculativeConfig, VllmConfig, seen_by_post_init


def dspark_config(speculative_class: type, model_type: str) -> Any:
    """A dflash config marked as DSpark, built past the list as the stand-in route
    builds it (``taps_gate_passed``)."""
    target = SimpleNamespace(hf_text_config=SimpleNamespace(model_type=model_type))
    draft = SimpleNamespace(hf_config=SimpleNamespace(**{DRAFT_METHOD_MARK: "dspark"}))
    with taps_gate_passed(target):
        return speculative_class(
            method="dflash", target_model_config=target, draft_model_config=draft
        )


@pytest.mark.parametrize("version", ["0.20.2", "0.21.0"])
def test_a_v4_target_is_hidden_from_the_list_while_vllm_config_validates(
    version: str,
) -> None:
    speculative_class, vllm_class, seen_by_post_init = config_classes(version)
    speculative = dspark_config(speculative_class, "deepseek_v4")
    target = speculative.target_model_config
    # pydantic re-runs the list check: without the hooks the V4 target is refused
    with pytest.raises(ValueError, match="is only supported for"):
        vllm_class(speculative_config=speculative)
    assert seen_by_post_init == []

    wrapt.wrap_function_wrapper(vllm_class, "__init__", hide_v4_target_from_revalidation)
    wrapt.wrap_function_wrapper(vllm_class, "__post_init__", target_back_before_post_init)
    built = vllm_class(speculative_config=speculative)
    assert built.speculative_config is speculative
    assert speculative.target_model_config is target
    assert seen_by_post_init == ["deepseek_v4"]

    # a target of another unlisted type is still refused, and a failed call
    # leaves the V4 target in place
    olmo = dspark_config(speculative_class, "deepseek_v4")
    olmo.target_model_config = SimpleNamespace(hf_text_config=SimpleNamespace(model_type="olmo"))
    with pytest.raises(ValueError, match="is only supported for"):
        vllm_class(speculative_config=olmo)
    with pytest.raises(ValueError, match="not_a_field"):
        vllm_class(speculative_config=speculative, not_a_field=1)
    assert speculative.target_model_config is target
