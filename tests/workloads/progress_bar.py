"""Draw a progress bar as tqdm does (carriage returns, no newline), wait for MARKER to exist, then end the line."""

import os
import sys
import time

marker = sys.argv[1]
for percent in (10, 50):
    sys.stderr.write(f"\rprogress {percent}%")
    sys.stderr.flush()
while not os.path.exists(marker):  # the test creates it once it has seen the bar on ftrun's console
    time.sleep(0.02)
sys.stderr.write("\rprogress 100%\n")
