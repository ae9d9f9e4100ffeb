"""``python -m tools.sglang``: see :mod:`tools.sglang.venvs`."""

from tools.sglang.venvs import main

raise SystemExit(main())
