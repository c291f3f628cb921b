"""Test-only vLLM plugin: async scheduling on vLLM's CPU platform when asked for.

vLLM's CPU platform turns ``async_scheduling`` off in ``check_and_update_config``
whatever the user asked, so a CPU server never runs the engine core's batch queue,
the path GPU users get by default. This plugin (a fake of the GPU's setting, for
the soak on this machine) keeps it on where ``--async-scheduling`` asked for it
explicitly, and logs one line saying so. vLLM loads general plugins in every
process; the config is settled in the front end and handed to the engine core.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("vllm")
_done = [False]


def register() -> None:
    if _done[0]:
        return
    _done[0] = True
    import wrapt

    wrapt.register_post_import_hook(_wrap_platform, "vllm.platforms.cpu")


def _wrap_platform(module: Any) -> None:
    import wrapt

    wrapt.wrap_function_wrapper(module, "CpuPlatform.check_and_update_config", _keep_requested)


def _keep_requested(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    config = args[0] if args else kwargs["vllm_config"]
    requested = config.scheduler_config.async_scheduling
    result = wrapped(*args, **kwargs)
    if requested and not config.scheduler_config.async_scheduling:
        config.scheduler_config.async_scheduling = True
        logger.warning("vllm_v4_cpu_async: async scheduling kept on, as requested")
    return result
