"""``python -m bench``: see :mod:`bench.cli`."""

from bench.cli import main
from stress.ucx_env import confine_to_loopback

confine_to_loopback()  # before any agent is made: see stress.ucx_env
raise SystemExit(main())
