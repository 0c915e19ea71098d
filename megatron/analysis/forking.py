"""Process pools for the analysis: forked workers, made safe for a busy parent process.

Workers are forked (no re-import of torch, nothing pickled but the tasks). A forked child
inherits the parent's heap but not its threads, so a garbage object whose destructor waits
on a thread (a finished torch.distributed process group, say) would hang the child if the
child's garbage collector got to it. `pool()` therefore collects garbage in the parent and
freezes the survivors (gc.freeze) while the workers live.
"""

from __future__ import annotations

import gc
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager


def fork_available() -> bool:
    return "fork" in multiprocessing.get_all_start_methods()


@contextmanager
def pool(workers: int, initializer=None):
    """A ProcessPoolExecutor of `workers` processes (fork when available, else spawn)."""
    method = "fork" if fork_available() else "spawn"
    ctx = multiprocessing.get_context(method)
    gc.collect()
    gc.freeze()
    try:
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx,
                                 initializer=initializer) as executor:
            yield executor
    finally:
        gc.unfreeze()
