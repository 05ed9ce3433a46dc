"""Write this worker's environment to OUT_DIR/env_<restart count>_<local rank>.json.

--fail-first-attempt: then exit 1 on attempt 0 (TORCHELASTIC_RESTART_COUNT == "0").
"""

import json
import os
import sys

out_dir = sys.argv[1]
attempt, local_rank = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["LOCAL_RANK"]
path = os.path.join(out_dir, f"env_{attempt}_{local_rank}.json")
with open(path + ".tmp", "w") as f:
    json.dump(dict(os.environ), f)
os.replace(path + ".tmp", path)
if "--fail-first-attempt" in sys.argv and attempt == "0":
    sys.exit(f"failing on purpose on attempt {attempt}")
