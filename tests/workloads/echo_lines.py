"""Print one line on stdout and one on stderr, naming the rank."""

import os
import sys

rank = os.environ["RANK"]
print(f"hello on stdout from rank {rank}")
print(f"hello on stderr from rank {rank}", file=sys.stderr)
