"""What an example does when it cannot run here: name what is missing and exit 3, or with ``--skip-missing`` say
"skipped: ..." and exit 0 (for scripts that run every example wherever they are)."""

from __future__ import annotations

import sys

EXIT_MISSING = 3


def cannot_run(reason: str) -> None:
    """Stop the example: ``reason`` says what this machine lacks."""
    if "--skip-missing" in sys.argv[1:]:
        print(f"skipped: {reason}")
        sys.exit(0)
    print(f"cannot run: {reason} (pass --skip-missing to exit 0 instead)", file=sys.stderr)
    sys.exit(EXIT_MISSING)
