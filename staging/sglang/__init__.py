"""nixl-staging as an SGLang plugin (entry point ``nixl_staging``, group
``sglang.srt.plugins``): on a supported release :func:`register` puts the staging state on
the compat contexts; on any other it registers nothing and logs one WARNING.
``python -m staging.sglang --check`` says whether it applies; docs/ADOPTING.md describes it
per release. Importing this package imports neither SGLang nor torch nor nixl.
"""

from staging.sglang.plugin import DISABLE_ENV, ENTRY_POINT, Plan, plan, register
from staging.sglang.releases import RELEASES, Target

__all__ = ["DISABLE_ENV", "ENTRY_POINT", "RELEASES", "Plan", "Target", "plan", "register"]
