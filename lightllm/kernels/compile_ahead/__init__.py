"""Triton kernels compiled ahead, in other processes, while a fresh engine loads its weights.

A fresh GPU machine has an empty Triton cache: every kernel variant the start-up warm-up reaches compiles there, one
after another in the engine process (Triton holds the GIL while it lowers, so threads do not overlap them). A
compile list names those variants, per GPU kind and Triton version: each entry is a kernel (`module:qualname`) and
its specialization (signature, constexpr values, pointer alignment attributes, compile options), recorded from a real
start-up (`record.py`, driven by `lightllm.tools.record_compiles`) and grouped by a key the caller chooses (the
engine uses one per model shape). At start-up `pool.py` hands the entries of the engine's key to worker processes
(`worker.py`) that compile them into the shared Triton cache; the warm-up then finds its kernels there. Nothing
depends on the list being right: an entry that no longer matches its kernel compiles something unused or fails in
its worker, and the warm-up compiles what it needs as it always did.
"""
