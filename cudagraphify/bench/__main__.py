"""``python -m cudagraphify.bench``: see :mod:`cudagraphify.bench`."""

import sys

from . import main

sys.exit(main())
