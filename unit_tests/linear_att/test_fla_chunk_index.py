"""The chunk index built on the host for fla's varlen kernels equals the one fla derives from the device offsets
(fla-core's own `prepare_chunk_indices`, run on CPU tensors), for random row lengths including empty rows and
lengths at chunk boundaries; and fla's GDN entry point takes it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightllm.linear_att.fla_prefill import FLA_CHUNK_SIZE, _takes, chunk_index

fla_index = pytest.importorskip("fla.ops.utils.index")


@pytest.mark.parametrize("seed", range(4))
def test_chunk_index_equals_fla_for_random_rows(seed):
    rng = np.random.default_rng(seed)
    lens = rng.choice([0, 1, 63, 64, 65, 128, 300, 8191], size=int(rng.integers(1, 12)))
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    expected = fla_index.prepare_chunk_indices(torch.from_numpy(cu), FLA_CHUNK_SIZE)
    assert chunk_index(cu).tolist() == expected.tolist()
    # twin: offsets one token off change the index
    shifted = cu.copy()
    shifted[1:] += 64
    assert chunk_index(shifted).tolist() != expected.tolist()


def test_fla_entry_points_that_take_the_index():
    gdn = pytest.importorskip("fla.ops.gated_delta_rule")
    kda = pytest.importorskip("fla.ops.kda")
    assert _takes(gdn.chunk_gated_delta_rule, "chunk_indices") and _takes(kda.chunk_kda, "cu_seqlens_cpu")
    assert not _takes(lambda q, k, v, cu_seqlens=None: None, "chunk_indices")
