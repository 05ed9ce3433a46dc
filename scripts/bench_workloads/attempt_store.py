"""Give each restart attempt its own keys in the launcher's store, so a restarted Gloo group can form.

torchrun 2.14.1 (c10d and static rendezvous alike) hands the restarted workers the same agent store
as the first attempt, and ``init_process_group("gloo")`` (env://) uses it without a per-attempt
prefix: the new ranks read the dead ranks' addresses and fail with "Gloo connectFullMesh failed ...
Connection refused" (c10d) or hang (static). Importing this module before the process group is
created wraps the env:// store in ``PrefixStore("attempt_<TORCHELASTIC_RESTART_COUNT>/")``; the
benchmark workloads import it under every launcher, so all of them run the same code.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

from torch.distributed import PrefixStore, Store
from torch.distributed.constants import default_pg_timeout

rendezvous = importlib.import_module("torch.distributed.rendezvous")  # the module: the package exports a function
_ENV_HANDLER = rendezvous._rendezvous_handlers["env"]
_PREFIX = f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def _per_attempt(url: str, timeout: timedelta = default_pg_timeout, **kwargs: Any) -> Iterator[tuple[Store, int, int]]:
    """torch's env:// handler, its store prefixed with this attempt's number."""
    for store, rank, world_size in _ENV_HANDLER(url, timeout, **kwargs):
        yield PrefixStore(_PREFIX, store), rank, world_size


rendezvous._rendezvous_handlers["env"] = _per_attempt
