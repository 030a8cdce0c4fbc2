"""``python -m elasticd``, the same as the ``elasticd`` console script."""

import sys

from elasticd.cli import main

sys.exit(main())
