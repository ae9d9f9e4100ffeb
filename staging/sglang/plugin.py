"""The SGLang plugin's decision: what applies to the installed SGLang, and registering it.

:func:`register` (SGLang's ``load_plugins()`` entry point) is all or nothing: turned off by
``NIXL_STAGING_SGLANG_PLUGIN=0``; otherwise the installed release must be in
:data:`~staging.sglang.releases.RELEASES` and every target must resolve with its
fingerprint, or nothing is registered and ONE WARNING says why; else every hook is
registered and ONE INFO line says so. :func:`plan` imports SGLang only for a supported
release. Thread-safety: both run once, single-threaded, in ``load_plugins()``.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import inspect
import logging
import os
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from staging.sglang import hooks
from staging.sglang.releases import RELEASES, Target

__all__ = [
    "DISABLE_ENV",
    "ENTRY_POINT",
    "LOG",
    "Plan",
    "fingerprint",
    "installed_release",
    "plan",
    "register",
]

LOG: Final = logging.getLogger("staging.sglang")
"""The plugin's logger: one INFO line when it applies, one WARNING when it does not."""

DISABLE_ENV: Final = "NIXL_STAGING_SGLANG_PLUGIN"
"""``0``, ``false``, ``no`` or ``off`` turns the plugin off (anything else, or unset: on)."""

ENTRY_POINT: Final = "nixl_staging"
"""The plugin's name in the ``sglang.srt.plugins`` entry-point group (``SGLANG_PLUGINS``)."""

_OFF = frozenset({"0", "false", "no", "off"})


@dataclass
class Plan:
    """What the plugin would do: ``hooks`` is empty unless everything checked out;
    ``problem`` then says why."""

    release: str | None  # installed sglang version, None if not installed
    enabled: bool = True
    problem: str | None = None
    hooks: list[tuple[Target, Callable[..., Any] | type]] = field(default_factory=list)
    checked: list[Target] = field(default_factory=list)

    @property
    def applies(self) -> bool:
        return self.enabled and self.problem is None and bool(self.hooks)

    def summary(self) -> str:
        """The INFO line of a plan that applies."""
        parts = [f"{'.'.join(t.path.rsplit('.', 2)[-2:])} ({t.hook_type})" for t, _ in self.hooks]
        return (
            f"nixl-staging plugin applied to sglang {self.release}: "
            + "; ".join(parts)
            + ": the prefill staging sets are locked views and clear()/failure_exception() "
            "purge a room atomically and tombstone it; the decode staging dicts are "
            "locked views on one lock"
        )


def installed_release() -> str | None:
    """The installed sglang distribution's version, or ``None``."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def fingerprint(obj: object) -> str:
    """The first 16 hex digits of the SHA-256 of ``obj``'s (unwrapped) source.

    Raises:
        OSError, TypeError: the source cannot be read.
    """
    if not isinstance(obj, type):
        obj = inspect.unwrap(obj)  # type: ignore[arg-type]
    source = inspect.getsource(obj)  # type: ignore[arg-type]
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def resolve(path: str) -> object:
    """The object at a dotted ``module.attr[.attr]`` path, as ``HookRegistry`` resolves it.

    Raises:
        ImportError, AttributeError, ValueError: it does not resolve.
    """
    owner_path, attr = path.rsplit(".", 1)
    owner = pkgutil.resolve_name(owner_path)
    if isinstance(owner, type):
        for klass in owner.__mro__:
            if attr in klass.__dict__:
                raw = klass.__dict__[attr]
                return raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
        raise AttributeError(f"{owner_path} has no attribute {attr!r}")
    return getattr(owner, attr)


def _disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip().lower() in _OFF


def use_a_supported_release() -> str:
    """Advice where the installed SGLang is not supported. Raises: nothing."""
    newest = next(reversed(RELEASES))
    return (
        f"To use the plugin, run a supported release: pip install 'sglang=={newest}' (or "
        f"{', '.join(r for r in RELEASES if r != newest)}); for another or a vendored SGLang, "
        "make the change by hand (docs/ADOPTING.md)"
    )


def plan(release: str | None = None, *, check_fingerprints: bool = True) -> Plan:
    """Check SGLang (``release``: the version to assume, default the installed one) and
    build the hooks, registering nothing.

    Raises: nothing; every problem is in ``Plan.problem``.
    """
    release = installed_release() if release is None else release
    result = Plan(release)
    if _disabled():
        result.enabled = False
        result.problem = f"turned off by {DISABLE_ENV}={os.environ.get(DISABLE_ENV)}"
        return result
    supported = ", ".join(RELEASES)
    if release is None:
        result.problem = f"sglang is not installed (supported releases: {supported})"
        return result
    where = f"sglang {release} (supported: {supported})"
    targets = RELEASES.get(release)
    if targets is None:
        result.problem = (
            f"sglang {release} is not a supported release (supported: {supported}); "
            f"missing target: the whole release table entry for {release} "
            f"(staging/sglang/releases.py). {use_a_supported_release()}"
        )
        return result
    resolved: list[tuple[Target, object]] = []
    for target in targets:
        try:
            obj = resolve(target.path)
        except Exception as exc:  # any import or attribute failure means: does not apply
            result.problem = f"{where}: missing target {target.path} ({type(exc).__name__}: {exc})"
            return result
        if check_fingerprints:
            try:
                got = fingerprint(obj)
            except (OSError, TypeError) as exc:
                got = f"unreadable ({exc})"
            if got != target.fingerprint:
                result.problem = (
                    f"{where}: target {target.path} is not the released code the plugin was "
                    f"written against (fingerprint {got}, expected {target.fingerprint})"
                )
                return result
        resolved.append((target, obj))
        result.checked.append(target)
    try:
        for target, obj in resolved:
            if target.hook is not None:
                result.hooks.append((target, hooks.HOOKS[target.hook][1](obj)))
    except Exception as exc:  # a released object not as the hook expects: does not apply
        result.hooks.clear()
        result.problem = (
            f"{where}: cannot build the hook of {target.path} ({type(exc).__name__}: {exc})"
        )
    return result


def register() -> Plan:
    """The entry point: register every hook or none; log one INFO or WARNING line.

    Raises: nothing.
    """
    result = plan()
    if not result.enabled:
        LOG.info("nixl-staging plugin: %s; SGLang runs as released", result.problem)
        return result
    if not result.applies:
        LOG.warning(
            "nixl-staging plugin NOT applied, no hook registered: %s. SGLang runs as "
            "released (unlocked staging sets). `python -m staging.sglang --check` says more.",
            result.problem,
        )
        return result
    registry = importlib.import_module("sglang.srt.plugins.hook_registry")
    for target, hook in result.hooks:
        registry.HookRegistry.register(
            target.path, hook, getattr(registry.HookType, str(target.hook_type))
        )
    LOG.info("%s", result.summary())
    return result
