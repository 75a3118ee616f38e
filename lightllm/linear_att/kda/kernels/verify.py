"""KDA decode / verify per mode (W = 1 is plain decode): shared bodies in `kernels/serial.py` (native, compact)
and `kernels/replay_verify.py` (replay), gate width checked."""

from lightllm.linear_att.kda.algorithm import KDA
from lightllm.linear_att.kernels.bound import bind

native_verify, compact_verify, replay_verify = bind(KDA, "native_verify", "compact_verify", "replay_verify")
