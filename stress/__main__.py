"""``python -m stress``; see :mod:`stress.cli`."""

import sys

from stress.cli import main
from stress.ucx_env import confine_to_loopback

confine_to_loopback()  # before any agent is made: see stress.ucx_env
sys.exit(main())
