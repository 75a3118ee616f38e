"""KDA's operator entry points; the KDA state classes call these (see ../README.md)."""

from lightllm.linear_att.kda.kernels.cursor import native_accept, replay_accept  # noqa: F401
from lightllm.linear_att.kda.kernels.fold import compact_commit, replay_fold  # noqa: F401
from lightllm.linear_att.kda.kernels.verify import compact_verify, native_verify, replay_verify  # noqa: F401
