"""``python -m staging.sglang --check``: does the plugin apply to the installed SGLang?

Prints what the plugin would change, or why nothing. Exit status: 0 it applies, 1 it does
not, 2 it is turned off (``NIXL_STAGING_SGLANG_PLUGIN``). ``--fingerprint`` prints the
installed targets' fingerprints (for a new entry of ``releases.py``). Registers nothing.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from staging.sglang.plugin import (
    DISABLE_ENV,
    ENTRY_POINT,
    fingerprint,
    plan,
    resolve,
    use_a_supported_release,
)
from staging.sglang.releases import RELEASES


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m staging.sglang",
        description="Check whether the nixl-staging SGLang plugin applies here.",
    )
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--check", action="store_true", help="what the plugin would do here")
    g.add_argument(
        "--fingerprint",
        metavar="RELEASE",
        help="print the fingerprints of RELEASE's targets as installed (for a new entry)",
    )
    args = p.parse_args(argv)
    if args.fingerprint:
        template = RELEASES.get(args.fingerprint) or next(reversed(RELEASES.values()))
        for target in template:
            try:
                print(f"{fingerprint(resolve(target.path))}  {target.path}")
            except Exception as exc:  # reported, per target
                print(f"MISSING           {target.path} ({type(exc).__name__}: {exc})")
        return 0
    result = plan()
    print(f"sglang installed: {result.release or 'no'}")
    print(f"supported releases: {', '.join(RELEASES)}")
    print(f"entry point: sglang.srt.plugins -> {ENTRY_POINT} (staging.sglang:register)")
    if not result.enabled:
        print(f"plugin: OFF ({result.problem}); unset {DISABLE_ENV} to turn it on")
        return 2
    if not result.applies:
        print(f"plugin: does NOT apply, no hook would be registered: {result.problem}")
        if result.release is None:  # the unsupported-release problem already says it
            print(use_a_supported_release())
        return 1
    print("plugin: APPLIES; SGLang's load_plugins() will install:")
    for target, _ in result.hooks:
        print(f"  {target.hook_type:<8} {target.path}: {target.does}")
    for target in result.checked:
        if target.hook is None:
            print(f"  checked  {target.path}: {target.does}")
    print(f"log line at start-up (logger staging.sglang, INFO): {result.summary()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
