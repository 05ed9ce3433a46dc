"""Write MARKER_DIR/started_<rank> with this pid (and a child's with --child), then wait for a signal."""

import os
import signal
import subprocess
import sys

marker_dir, rank = sys.argv[1], os.environ["RANK"]
pids = [os.getpid()]
if "--child" in sys.argv:
    child = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
    pids.append(child.pid)
path = os.path.join(marker_dir, f"started_{rank}")
with open(path + ".tmp", "w") as f:
    f.write(" ".join(map(str, pids)))
os.replace(path + ".tmp", path)
while True:
    signal.pause()
