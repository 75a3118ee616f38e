"""A follower rank of a tensor-parallel engine (ranks 1..N-1): `python -m lightllm.server.tp_follower`.

Started by rank 0 (`lightllm.worker.tp.group.TPGroup`), which writes a pickled `RankSetup` to its stdin. It joins
the process group, then builds and drives its own runner as rank 0's plans say. It dies with rank 0: through the
parent-death signal, or when the control group's next broadcast fails.
"""

from __future__ import annotations

import logging
import pickle
import signal
import sys
import traceback

from lightllm.server.termination import die_with_parent


def main() -> int:
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    setup = pickle.loads(sys.stdin.buffer.read())
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp rank {setup.rank} %(levelname)s %(message)s")
    from lightllm.server.runner_factory import build_rank_runner
    from lightllm.worker.tp.group import join_group
    from lightllm.worker.tp.lockstep import follow

    try:
        control = join_group(setup)
        follow(control, lambda args, info: build_rank_runner(args, info, setup.rank, setup.size))
    except Exception:
        # a follower that cannot keep up with rank 0 must not linger: rank 0's watchdog sees it exit
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
