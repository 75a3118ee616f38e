"""GDN's operator entry points; the GDN state classes call these (see ../README.md)."""

from lightllm.linear_att.gdn.kernels.cursor import native_accept, replay_accept  # noqa: F401
from lightllm.linear_att.gdn.kernels.fold import compact_commit, replay_fold  # noqa: F401
from lightllm.linear_att.gdn.kernels.verify import compact_verify, native_verify, replay_verify  # noqa: F401
