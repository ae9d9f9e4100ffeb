"""nixl-staging as an SGLang plugin: ``pip install nixl-staging`` into SGLang's environment.

SGLang's ``load_plugins()`` (run early by its scheduler, engine and other processes) calls
:func:`register`, found through the entry point ``nixl_staging`` of the group
``sglang.srt.plugins``. On a supported release it puts the prefill staging state on a
:class:`~staging.compat.CompatStagingContext` and makes ``clear()`` and the failure path
purge a room atomically and tombstone it; on any other it registers nothing and logs one
WARNING. ``python -m staging.sglang --check`` tells, without starting a server, whether the
plugin applies to the installed SGLang and what it would change. ``docs/ADOPTING.md``
describes it per release.

Importing this package imports neither SGLang nor torch nor nixl.
"""

from staging.sglang.plugin import DISABLE_ENV, ENTRY_POINT, Plan, plan, register
from staging.sglang.releases import RELEASES, Target

__all__ = ["DISABLE_ENV", "ENTRY_POINT", "RELEASES", "Plan", "Target", "plan", "register"]
