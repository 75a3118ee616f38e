"""ServerArgs: CLI parsing, resolution of every "auto", and start-up refusals that say what to change."""

from __future__ import annotations

import dataclasses

import pytest

from lightllm.server.args import ServerArgs, build_parser, parse_args, resolve
from lightllm.server.model_info import ModelInfo


def _info(**kw) -> ModelInfo:
    base = dict(
        model_dir="/models/tiny-q35",
        architecture="Qwen3_5ForConditionalGeneration",
        model_type="qwen3_5",
        vocab_size=512,
        max_position_embeddings=8192,
        torch_dtype="bfloat16",
        num_mtp_layers=1,
        eos_token_ids=(2,),
    )
    return ModelInfo(**{**base, **kw})


def _resolve(*argv: str, info: ModelInfo | None = None) -> ServerArgs:
    args = dataclasses.replace(parse_args(list(argv)), model_dir="/models/tiny-q35")
    return resolve(args, info or _info())


def test_parse_args_types_and_defaults():
    args = parse_args(["--port", "9001", "--mtp_step", "3", "--mem_fraction", "0.5", "--ssm_state_mode", "replay"])
    assert (args.port, args.mtp_step, args.mem_fraction, args.ssm_state_mode) == (9001, 3, 0.5, "replay")
    assert (args.host, args.tp, args.run_mode, args.device) == ("127.0.0.1", 1, "normal", "auto")


def test_parser_rejects_bad_choice():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--ssm_state_mode", "fancy"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--replay_capacity", "12"])


def test_resolve_cpu_defaults():
    args = _resolve("--device", "cpu")
    assert args.device == "cpu" and args.data_type == "float32"
    assert args.served_model_name == "tiny-q35"
    assert (args.max_running_requests, args.chunked_prefill_size, args.max_req_total_len) == (16, 512, 4096)
    assert args.mem_fraction == 0.8 and args.max_total_token_num is None
    assert args.replay_capacity is None and args.replay_projection_mode is None


def test_resolve_is_idempotent():
    once = _resolve("--device", "cpu", "--ssm_state_mode", "replay", "--spec_ngram", "3")
    assert resolve(once, _info()) == once


@pytest.mark.parametrize(
    "argv, expected",
    [
        ((), 8),
        (("--mtp_step", "3"), 8),
        (("--spec_ngram", "9"), 16),
        (("--mtp_step", "40"), 64),
    ],
    ids=["plain", "mtp3", "ngram9", "mtp40"],
)
def test_resolve_replay_capacity_covers_verify_width(argv, expected):
    args = _resolve("--device", "cpu", "--ssm_state_mode", "replay", *argv)
    assert args.replay_capacity == expected and args.replay_projection_mode == "inline"


def test_resolve_max_req_total_len_capped_by_model_and_kv():
    assert _resolve("--device", "cpu", info=_info(max_position_embeddings=1024)).max_req_total_len == 1024
    args = _resolve("--device", "cpu", "--max_total_token_num", "2000")
    assert args.max_req_total_len == 2000 and args.mem_fraction is None


@pytest.mark.parametrize(
    "argv, info, message",
    [
        (("--run_mode", "prefill", "--pd_master_port", "0"), None, "--pd_master_port must be in 1..65535"),
        (("--run_mode", "decode", "--pd_transfer_timeout_s", "0"), None, "--pd_transfer_timeout_s must be positive"),
        (("--run_mode", "pd_master", "--pd_queue_timeout_s", "-1"), None, "--pd_queue_timeout_s must be positive"),
        (("--ssm_state_mode", "compact"), None, "add --mtp_step N or --spec_ngram K"),
        (("--replay_projection_mode", "precompute"), None, "applies to --ssm_state_mode replay only"),
        (("--replay_capacity", "16"), None, "applies to --ssm_state_mode replay only"),
        (
            ("--ssm_state_mode", "replay", "--replay_capacity", "4", "--mtp_step", "5"),
            None,
            "raise it to at least 8",
        ),
        (("--mtp_step", "2"), _info(num_mtp_layers=0), "has no MTP weights"),
        (("--mtp_step", "2", "--spec_ngram", "2"), None, "exclusive"),
        (("--mtp_step", "-1"), None, "must be >= 0"),
        (("--max_total_token_num", "4096", "--mem_fraction", "0.5"), None, "give only one"),
        (("--mem_fraction", "1.5"), None, "must be in (0, 1]"),
        (("--max_req_total_len", "9000"), None, "exceeds the model's max_position_embeddings"),
        (("--max_req_total_len", "3000", "--max_total_token_num", "2000"), None, "one request must fit"),
        (("--max_running_requests", "0"), None, "--max_running_requests must be positive"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_resolve_refusals(argv, info, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("]", r"\]")):
        _resolve("--device", "cpu", *argv, info=info)


def test_compact_accepted_with_speculation():
    assert _resolve("--device", "cpu", "--ssm_state_mode", "compact", "--spec_ngram", "2").max_width == 3


def test_every_flag_is_documented():
    with open("docs/server_args.md", encoding="utf-8") as f:
        doc = f.read()
    missing = [f.name for f in dataclasses.fields(ServerArgs) if f"`--{f.name}`" not in doc]
    assert not missing, f"docs/server_args.md lacks {missing}"


def test_api_key_defaults_to_environment(monkeypatch):
    monkeypatch.setenv("LIGHTLLM_API_KEY", "from-env")
    assert _resolve("--device", "cpu").api_key == "from-env"
    assert _resolve("--device", "cpu", "--api_key", "from-flag").api_key == "from-flag"
    assert "from-env" not in repr(_resolve("--device", "cpu"))
    monkeypatch.delenv("LIGHTLLM_API_KEY")
    assert _resolve("--device", "cpu").api_key is None


def test_edge_flags_parse():
    args = parse_args(["--enable_docs", "--max_queue_len", "0", "--max_request_body_bytes", "100"])
    assert (args.enable_docs, args.max_queue_len, args.max_request_body_bytes) == (True, 0, 100)
    defaults = parse_args([])
    assert (defaults.enable_docs, defaults.trust_request_chat_template, defaults.keep_serving_after_engine_exit) == (
        False,
        False,
        False,
    )
    assert (defaults.max_queue_len, defaults.max_sequences_per_request, defaults.log_stats_interval) == (
        1024,
        256,
        10.0,
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--max_queue_len", "-1"), "--max_queue_len must be at least 0"),
        (("--max_sequences_per_request", "0"), "--max_sequences_per_request must be at least 1"),
        (("--max_request_body_bytes", "0"), "--max_request_body_bytes must be at least 1"),
        (("--log_stats_interval", "-2"), "--log_stats_interval must be >= 0"),
        (("--prefill_graph_max_tokens", "-1"), "--prefill_graph_max_tokens must be at least 0"),
    ],
    ids=lambda v: v[0] if isinstance(v, tuple) else None,
)
def test_edge_flag_refusals(argv, message):
    with pytest.raises(ValueError, match=message):
        _resolve("--device", "cpu", *argv)
    # twin: the limit itself is accepted
    fixed = {"--max_queue_len": "0", "--max_sequences_per_request": "1", "--max_request_body_bytes": "1"}
    _resolve("--device", "cpu", argv[0], fixed.get(argv[0], "0"))


@pytest.mark.parametrize(
    "argv, expected",
    [
        (("--device", "cpu"), (512, 512)),
        (("--device", "cpu", "--chunked_prefill_size", "96"), (96, 96)),
        (("--device", "cpu", "--max_num_batched_tokens", "300"), (300, 300)),
        (("--device", "cpu", "--max_num_batched_tokens", "300", "--chunked_prefill_size", "64"), (300, 64)),
    ],
    ids=["auto", "chunk-only", "budget-only", "both"],
)
def test_step_budget_and_chunk_resolve(argv, expected):
    args = _resolve(*argv)
    assert (args.max_num_batched_tokens, args.chunked_prefill_size) == expected


def test_chunk_over_step_budget_is_refused():
    with pytest.raises(ValueError, match="--chunked_prefill_size 600 exceeds --max_num_batched_tokens 300"):
        _resolve("--device", "cpu", "--max_num_batched_tokens", "300", "--chunked_prefill_size", "600")


@pytest.mark.parametrize(
    "argv, expected",
    [
        (("--device", "cpu"), 512),
        (("--device", "cuda"), 2048),
        (("--device", "cuda", "--max_num_batched_tokens", "1000"), 250),
        (("--device", "cuda", "--max_num_batched_tokens", "3"), 1),
        (("--device", "cuda", "--disable_cudagraph"), 8192),
        (("--device", "cuda", "--prefill_graph_max_tokens", "0"), 8192),
        (("--device", "cuda", "--max_mixed_prefill_tokens", "700"), 700),
    ],
    ids=[
        "cpu-whole-budget",
        "cuda-quarter",
        "cuda-quarter-of-given-budget",
        "cuda-at-least-one",
        "cuda-graphs-off-whole-budget",
        "cuda-prefill-graphs-off-whole-budget",
        "given",
    ],
)
def test_mixed_prefill_cap_resolves(argv, expected, monkeypatch):
    import lightllm.server.args as server_args

    # resolved as on a host with one GPU
    monkeypatch.setattr(server_args, "_cuda_available", lambda: True)
    monkeypatch.setattr(server_args, "visible_cuda_devices", lambda: 1)
    assert _resolve(*argv).max_mixed_prefill_tokens == expected


@pytest.mark.parametrize("cap", ["0", "513"])
def test_mixed_prefill_cap_outside_the_budget_is_refused(cap):
    with pytest.raises(
        ValueError, match=f"--max_mixed_prefill_tokens {cap} must be in 1..--max_num_batched_tokens 512"
    ):
        _resolve("--device", "cpu", "--max_mixed_prefill_tokens", cap)
    # twin: the budget itself is accepted
    assert _resolve("--device", "cpu", "--max_mixed_prefill_tokens", "512").max_mixed_prefill_tokens == 512


@pytest.mark.parametrize(
    "argv, cores, expected",
    [
        (("--device", "cpu"), 64, 1),
        (("--device", "cuda"), 16, 4),
        (("--device", "cuda"), 64, 4),
        (("--device", "cuda"), 9, 2),
        (("--device", "cuda"), 2, 1),
        (("--device", "cuda", "--dp", "2"), 64, 1),
        (("--device", "cuda", "--run_mode", "prefill"), 64, 1),
        (("--device", "cuda", "--http_workers", "3"), 2, 3),
    ],
    ids=["cpu", "gpu-16-cores", "gpu-64-cores", "gpu-9-cores", "gpu-2-cores", "dp", "pd-node", "given"],
)
def test_http_workers_resolve(argv, cores, expected, monkeypatch):
    import lightllm.server.args as server_args

    # resolved as on a host with two GPUs and `cores` usable CPU cores
    monkeypatch.setattr(server_args, "_cuda_available", lambda: True)
    monkeypatch.setattr(server_args, "visible_cuda_devices", lambda: 2)
    monkeypatch.setattr(server_args.os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert _resolve(*argv).http_workers == expected
