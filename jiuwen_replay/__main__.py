"""``python -m jiuwen_replay replay ...`` / ``make-trace ...`` (the ``jiuwen-bench`` command)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
