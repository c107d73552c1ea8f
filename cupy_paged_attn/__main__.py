"""``python -m cupy_paged_attn``: see :mod:`cupy_paged_attn.cli`."""

import sys

from .cli import main

sys.exit(main())
