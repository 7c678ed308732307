"""``python -m minigpt.checkpoint consolidate RUN_DIR``: checkpoint tools on the command line."""

import sys

from minigpt.checkpoint.consolidate import main

if __name__ == "__main__":
    sys.exit(main())
