"""Print one line on stdout and one on stderr, naming the rank.

Each line goes out in one write: unbuffered, ``print`` writes the text and its newline separately, and two
ranks sharing torchrun's terminal then interleave inside a line.
"""

import os
import sys

rank = os.environ["RANK"]
for stream in (sys.stdout, sys.stderr):
    name = "stdout" if stream is sys.stdout else "stderr"
    stream.write(f"hello on {name} from rank {rank}\n")
    stream.flush()
