"""Environment settings of the overlay, parsed leniently and loudly.

Precedence (first match wins):
1. ``VLLM_V4_PATCHES`` off: every patch is ``disabled``;
2. ``VLLM_V4_PATCH_<ID>`` on or off: that patch;
3. the patch's own default (``PatchRecord.default_enabled``).

A malformed value never raises: it logs one warning naming the variable and the
accepted values (once per process, however often the setting is read), and the
default applies.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping

GLOBAL_SWITCH = "VLLM_V4_PATCHES"
PATCH_SWITCH_PREFIX = "VLLM_V4_PATCH_"
STRICT = "VLLM_V4_PATCHES_STRICT"
VERSION_OVERRIDE = "VLLM_V4_PATCHES_VLLM_VERSION"
STATUS_DIR = "VLLM_V4_PATCHES_STATUS_DIR"

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")
ACCEPTED_BOOLEANS = ", ".join(_TRUE + _FALSE)

logger = logging.getLogger("vllm_v4_patches")
_warned: set[tuple[str, str]] = set()  # (variable, value) pairs this process warned of


def warn_once(name: str, raw: str, message: str, *args: object) -> None:
    """Settings are read once per patch and per engine, so a bad value would
    otherwise be reported dozens of times in one process."""
    if (name, raw) in _warned:
        return
    _warned.add((name, raw))
    logger.warning(message, *args)


def toggle_name(patch_id: str) -> str:
    """The per-patch switch, e.g. ``VLLM_V4_PATCH_EMBEDDING``."""
    return PATCH_SWITCH_PREFIX + patch_id.upper()


def read_bool(name: str, default: bool, env: Mapping[str, str] | None = None) -> bool:
    """A boolean setting; unset or empty means ``default``."""
    raw = (os.environ if env is None else env).get(name, "").strip()
    if not raw:
        return default
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    warn_once(
        name,
        raw,
        "vllm_v4_patches: %s=%r is not a boolean; accepted: %s; using the default (%s)",
        name,
        raw,
        ACCEPTED_BOOLEANS,
        "on" if default else "off",
    )
    return default


def read_choice(
    name: str, choices: tuple[str, ...], consequence: str, env: Mapping[str, str] | None = None
) -> str:
    """One of ``choices`` (case-insensitive); unset, empty or anything else means the
    first, and anything else also logs one warning ending in ``consequence``."""
    raw = (os.environ if env is None else env).get(name, "").strip().lower()
    if raw in choices:
        return raw
    if raw:
        warn_once(
            name,
            raw,
            "vllm_v4_patches: %s=%r is not one of %s; %s",
            name,
            raw,
            ", ".join(choices),
            consequence,
        )
    return choices[0]


def globally_enabled(env: Mapping[str, str] | None = None) -> bool:
    return read_bool(GLOBAL_SWITCH, True, env)


def strict_mode(env: Mapping[str, str] | None = None) -> bool:
    return read_bool(STRICT, False, env)


def patch_enabled(
    patch_id: str, default: bool, env: Mapping[str, str] | None = None
) -> tuple[bool, str]:
    """Whether a patch may run, and which setting decided it (for the status)."""
    if not globally_enabled(env):
        return False, f"{GLOBAL_SWITCH} is off"
    name = toggle_name(patch_id)
    value = (os.environ if env is None else env).get(name, "").strip()
    if value:
        enabled = read_bool(name, default, env)
        return enabled, f"{name}={value}"
    return default, "default " + ("on" if default else "off")


def all_settings(patch_ids: Iterable[str], patch_settings: Iterable[str] = ()) -> list[str]:
    """Every variable the overlay reads: its own, each patch's switch and settings."""
    fixed = [GLOBAL_SWITCH, STRICT, VERSION_OVERRIDE, STATUS_DIR]
    return fixed + [toggle_name(patch_id) for patch_id in patch_ids] + list(patch_settings)


def warn_unknown_patch_switches(
    known_ids: Iterable[str], env: Mapping[str, str] | None = None
) -> None:
    """A misspelt per-patch switch would otherwise be ignored without a word."""
    known = {toggle_name(patch_id) for patch_id in known_ids}
    for name in sorted(os.environ if env is None else env):
        if name.startswith(PATCH_SWITCH_PREFIX) and name not in known:
            warn_once(
                name,
                "",
                "vllm_v4_patches: %s names no patch; accepted per-patch switches: %s",
                name,
                ", ".join(sorted(known)),
            )


def status_dir(env: Mapping[str, str] | None = None) -> str | None:
    return (os.environ if env is None else env).get(STATUS_DIR, "").strip() or None
