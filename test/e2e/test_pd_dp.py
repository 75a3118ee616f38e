"""A decode node started with `--dp 2` under prefill/decode disaggregation, as deployed on 127.0.0.1: one command
runs two decode node processes, each registered with the pd_master as a node; greedy text through the master
equals a monolithic engine's with requests decoded on both replicas; a killed replica is started again by its
supervisor and registers anew while the other serves, and the text stays the same."""

from __future__ import annotations

import os
import signal
import threading

import httpx
import pytest

from lightllm.engine.sampling_params import SamplingParams
from lightllm.server.args import load_server_args
from lightllm.server.llm import LLM
from lightllm.tools.make_tiny_model import tiny_model_dir
from unit_tests.server.conftest import wait_for
from unit_tests.server.pd_cluster import Master, node_log, start_node, stop

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ARCH = "qwen3_5"
FLAGS = {"max_running_requests": 4, "max_total_token_num": 1024, "chunked_prefill_size": 16}
NODE_FLAGS = ["--device", "cpu", *[str(x) for k, v in FLAGS.items() for x in (f"--{k}", v)]]
PROMPTS = [[5 + i, 9, 13, 2, 7, 8, 1, 3, 22, 41 + i, 17, 6] for i in range(4)]
MAX_TOKENS = 8


def _healthy_decode(master: Master) -> list[dict]:
    return [n for n in master.nodes("decode") if n["healthy"]]


def _generate(master: Master) -> list[str]:
    texts: list[str | None] = [None] * len(PROMPTS)

    def run(i: int) -> None:
        body = {"model": master.args.served_model_name, "prompt": PROMPTS[i], "max_tokens": MAX_TOKENS}
        body.update(temperature=0, ignore_eos=True)
        r = httpx.post(f"{master.url}/v1/completions", json=body, timeout=120)
        r.raise_for_status()
        texts[i] = r.json()["choices"][0]["text"]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return texts


def test_a_dp_decode_node_registers_each_replica_and_serves_the_monolithic_tokens():
    model_dir = str(tiny_model_dir(ARCH))
    reference = LLM(model_dir, device="cpu", **FLAGS)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [out.outputs[0].text for out in reference.generate(PROMPTS, params)]
    del reference
    # the comparison has teeth: the prompts' texts differ
    assert len(set(expected)) == len(PROMPTS)

    master = Master(model_dir, node_timeout_s=4.0)
    prefill = start_node(master, model_dir, "prefill", *NODE_FLAGS)
    decode = start_node(master, model_dir, "decode", *NODE_FLAGS, "--dp", "2", "--dp_restart_backoff_s", "0.2")
    try:
        wait_for(lambda: len(_healthy_decode(master)) == 2 and master.nodes("prefill"), 180, "two decode replicas")
        replicas = _healthy_decode(master)
        # one command, two nodes: distinct processes, children of the decode command
        assert len({n["pid"] for n in replicas}) == 2 and decode.pid not in {n["pid"] for n in replicas}
        steps = {n["node_id"]: n["stats"]["num_steps"] for n in replicas}
        assert _generate(master) == expected
        wait_for(
            lambda: all(n["stats"]["num_steps"] > steps[n["node_id"]] for n in _healthy_decode(master)),
            what="both replicas decoding",
        )

        killed = replicas[0]["pid"]
        os.kill(killed, signal.SIGKILL)
        pids = lambda: [n["pid"] for n in _healthy_decode(master)]  # noqa: E731
        wait_for(lambda: len(pids()) == 2 and killed not in pids(), 120, "the killed replica to register again")
        assert "decode node replica 0 exited" in node_log(decode) or "decode node replica 1 exited" in node_log(decode)
        assert _generate(master) == expected
        assert decode.poll() is None
    except BaseException:
        print(node_log(decode))
        raise
    finally:
        stop(prefill)
        stop(decode)
        master.close()
    assert decode.returncode == 0


def test_the_pd_master_refuses_dp():
    with pytest.raises(ValueError, match="the pd_master runs no engine"):
        load_server_args([], run_mode="pd_master", dp=2, device="cpu")
