"""The sandbox's judge zygote: `python -I -S main.py <socket fd>` (see judge.py)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import judge  # noqa: E402

judge.serve_forever(int(sys.argv[1]))
