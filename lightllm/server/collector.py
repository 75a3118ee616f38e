"""Python's cyclic garbage collector in the server's long-running processes.

The objects made at start-up (modules, tokenizers, weights, pools) live for the whole process, yet every full
collection rescans them: with torch and transformers imported that is a few hundred thousand objects, 75 ms or more
per full collection on the host, during which the process does nothing else. Frozen into the permanent generation
after start-up, they are never scanned again, and a full collection costs what the live requests' objects cost.
"""

from __future__ import annotations

import gc


def freeze_startup_objects() -> None:
    """Move every object alive now out of the collector's reach. For a process whose start-up is over (the HTTP
    front-end before it serves): its event loop would stop for every stream during each full collection."""
    gc.collect()
    gc.freeze()


def quiet_garbage_collector() -> None:
    """`freeze_startup_objects`, and young collections less often: for a process that serves one engine (the engine
    process, the offline API, benchmarks), after it is built. Its step loop allocates little per step, and each
    collection it did run cost milliseconds per step at a few hundred requests."""
    freeze_startup_objects()
    gc.set_threshold(50_000, 20, 100)
