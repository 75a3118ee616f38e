"""`--pd_transport nixl` as deployed (skipped without a NIXL package): a pd_master in this process, a prefill and a
decode node as real processes on 127.0.0.1 (tiny Qwen3.5, fp32, on the CPU: NIXL moves host memory over UCX),
prefill native, decode replay, 2 MTP drafts. The decode node registers that it reads NIXL regions; greedy text and
logprobs through the master equal a monolithic engine's, and every pool (and staging region) empties."""

from __future__ import annotations

import httpx
import openai
import pytest

from lightllm.engine.sampling_params import SamplingParams
from lightllm.server.llm import LLM
from lightllm.server.pd.nixl import nixl_module_name
from lightllm.tools.make_tiny_model import tiny_model_dir
from unit_tests.server.conftest import wait_for
from unit_tests.server.pd_cluster import Master, node_log, start_node, stop

pytestmark = [
    pytest.mark.skipif(nixl_module_name() is None, reason="no NIXL package installed (nixl-cu13)"),
    pytest.mark.usefixtures("one_torch_thread"),
]
NODE_FLAGS = [
    "--device",
    "cpu",
    "--mtp_step",
    "2",
    "--max_running_requests",
    "4",
    "--max_total_token_num",
    "1024",
    "--chunked_prefill_size",
    "16",
    "--pd_transport",
    "nixl",
    "--pd_ipc_buffer_mb",
    "8",
]
PROMPTS = [[5, 9, 13, 2, 7, 8, 1, 3, 22, 41, 17, 6, 5, 4, 3, 2, 1, 9, 9, 30, 31], [11, 12, 13, 14, 15]]


def test_nixl_transfers_equal_a_monolithic_engine():
    model_dir = str(tiny_model_dir("qwen3_5"))
    master = Master(model_dir, node_timeout_s=10.0)
    procs = [
        start_node(master, model_dir, "prefill", *NODE_FLAGS, "--ssm_state_mode", "native"),
        start_node(master, model_dir, "decode", *NODE_FLAGS, "--ssm_state_mode", "replay"),
    ]
    try:
        wait_for(lambda: httpx.get(f"{master.url}/pd/ready").status_code == 200, 120, "both nodes registered")
        assert master.nodes("decode")[0]["reads"] == ["nixl"]
        reference = LLM(
            model_dir,
            device="cpu",
            mtp_step=2,
            max_running_requests=4,
            max_total_token_num=1024,
            chunked_prefill_size=16,
        )
        want = reference.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, logprobs=1, ignore_eos=True))
        client = openai.OpenAI(base_url=f"{master.url}/v1", api_key="unused", max_retries=0, timeout=60)
        for prompt, expected in zip(PROMPTS, want):
            r = client.completions.create(
                model=master.args.served_model_name,
                prompt=prompt,
                max_tokens=10,
                temperature=0,
                logprobs=1,
                extra_body={"ignore_eos": True},
            )
            assert r.choices[0].text == expected.outputs[0].text
            found = r.choices[0].logprobs.token_logprobs
            assert max(abs(a - b[0]) for a, b in zip(found, expected.outputs[0].logprobs)) < 1e-5

        def empty() -> bool:
            nodes = master.nodes("prefill") + master.nodes("decode")
            return all(n["num_requests"] == 0 and n["stats"]["num_running"] == 0 for n in nodes)

        wait_for(empty, 20, "every pool empty")
        # the staging buffer had room: nothing fell back to host bytes
        assert "host-staged" not in node_log(procs[0])
    finally:
        for proc in procs:
            stop(proc)
        master.close()
