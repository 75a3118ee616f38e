"""KDA folds of pending work into the canonical state: compact's merge of accepted records
(`kernels/serial.py`) and replay's fold of the history (`kernels/replay_fold.py`), gate width checked."""

from lightllm.linear_att.kda.algorithm import KDA
from lightllm.linear_att.kernels.bound import bind

compact_commit, replay_fold = bind(KDA, "compact_commit", "replay_fold")
