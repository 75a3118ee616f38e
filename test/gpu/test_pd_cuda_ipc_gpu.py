"""CUDA IPC of the prefill node's staging buffer between two real processes (skipped without CUDA).

A child process opens the parent's buffer from the msgpack-encoded handle (the bytes a `PdTransfer` carries) and
copies a staged region into its own memory; the tensors it rebuilds from the blobs equal the parent's bit for bit.
Teeth: a region the parent overwrote before the child read it gives other bytes. And a 1P1D deployment (master,
prefill and decode node processes on the one GPU) moving the state by CUDA IPC serves the monolithic engine's
greedy tokens.
"""

from __future__ import annotations

import pytest
import torch

from lightllm.server.pd.cuda_ipc import share_cuda_buffer
from lightllm.server.pd.staging import StagingBuffer
from unit_tests.helpers.region_reader_child import read_region_in_child

pytestmark = pytest.mark.gpu


def test_a_staged_region_read_by_another_process_equals_the_tensors():
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    buffer = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    staging = StagingBuffer(buffer, share_cuda_buffer(buffer), "cuda_ipc@here")
    # a filler region first, so the transfer's region does not start at offset 0
    filler = staging.stage([torch.ones(1000, device="cuda")])
    tensors = [
        torch.randn(2, 37, 4, 128, generator=gen, device="cuda").bfloat16(),
        torch.randn(3, 1, 96, 3, generator=gen, device="cuda"),
        torch.randn(3, 1, 8, 64, 64, generator=gen, device="cuda"),
        torch.randn(1, 512, generator=gen, device="cuda").half(),
    ]
    region, blobs = staging.stage(tensors)
    assert region.offset > 0 and all(b.data == b"" for b in blobs)
    found = read_region_in_child(region, blobs)
    for want, got in zip(tensors, found):
        assert got.dtype == want.dtype and torch.equal(got, want.cpu())
    staging.release(region)
    staging.release(filler[0])
    assert staging.allocator.num_free_bytes() == 64 << 20

    # teeth: the region overwritten before the read
    region, blobs = staging.stage(tensors)
    staging.buffer[region.offset : region.offset + region.nbytes] = 0
    torch.cuda.synchronize()
    found = read_region_in_child(region, blobs)
    assert not any(torch.equal(got, want.cpu()) for want, got in zip(tensors, found))


def test_a_1p1d_deployment_over_cuda_ipc_equals_the_monolithic_engine():
    """Real node processes on one GPU (tiny Qwen3.5, fp32, MTP 2; prefill native, decode replay), the state moved by
    CUDA IPC (the decode node registered that it reads this host's regions, nothing fell back to host bytes):
    greedy tokens equal the monolithic engine's and logprobs agree to 1e-3 (GPU kernels, other batch shapes)."""
    import httpx

    from lightllm.engine.sampling_params import SamplingParams
    from lightllm.server.llm import LLM
    from lightllm.tools.make_tiny_model import tiny_model_dir
    from unit_tests.server.conftest import wait_for
    from unit_tests.server.pd_cluster import Master, node_log, start_node, stop

    model_dir = str(tiny_model_dir("qwen3_5"))
    flags = [
        "--device",
        "cuda",
        "--data_type",
        "float32",
        "--mtp_step",
        "2",
        "--max_total_token_num",
        "4096",
        "--max_running_requests",
        "8",
        "--pd_transport",
        "cuda_ipc",
        "--pd_ipc_buffer_mb",
        "64",
    ]
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    prompts = [torch.randint(10, 200, (n,), generator=gen).tolist() for n in (5, 40, 300)]
    master = Master(model_dir, node_timeout_s=30.0)
    procs = [
        start_node(master, model_dir, "prefill", *flags, "--ssm_state_mode", "native"),
        start_node(master, model_dir, "decode", *flags, "--ssm_state_mode", "replay"),
    ]
    try:
        wait_for(lambda: httpx.get(f"{master.url}/pd/ready").status_code == 200, 300, "both nodes registered")
        (reads,) = [n["reads"] for n in master.nodes("decode")]
        assert len(reads) == 1 and reads[0].startswith("cuda_ipc@")
        found = []
        for p in prompts:
            body = dict(
                model=master.args.served_model_name, prompt=p, max_tokens=16, temperature=0, logprobs=1, ignore_eos=True
            )
            reply = httpx.post(f"{master.url}/v1/completions", json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            found.append(reply.json()["choices"][0])
        assert "host-staged" not in node_log(procs[0])
    finally:
        for proc in procs:
            stop(proc)
        master.close()
    reference = LLM(
        model_dir, device="cuda", data_type="float32", mtp_step=2, max_total_token_num=4096, max_running_requests=8
    )
    want = reference.generate(prompts, SamplingParams(temperature=0, max_tokens=16, logprobs=1, ignore_eos=True))
    for choice, expected in zip(found, want):
        assert choice["text"] == expected.outputs[0].text
        lps = choice["logprobs"]["token_logprobs"]
        assert max(abs(a - b[0]) for a, b in zip(lps, expected.outputs[0].logprobs)) < 1e-3
