"""``python -m stress``; see :mod:`stress.cli`."""

import sys

from stress.cli import main

sys.exit(main())
