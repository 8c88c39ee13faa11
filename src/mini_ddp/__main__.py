"""``python -m mini_ddp``: see :mod:`mini_ddp.tools.cli`."""

import sys

from mini_ddp.tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
