"""Security flags in `ServerArgs`: the PD secret comes from --pd_secret, else LIGHTLLM_PD_SECRET, else the API key,
and is never printed; PD roles beyond loopback without one are refused at start-up; the HTTP deadlines and
bounds must be positive."""

from __future__ import annotations

import pytest

from lightllm.server.args import load_server_args


def test_the_secret_falls_back_from_the_flag_to_the_environment_to_the_api_key(monkeypatch):
    monkeypatch.delenv("LIGHTLLM_PD_SECRET", raising=False)
    monkeypatch.delenv("LIGHTLLM_API_KEY", raising=False)
    assert load_server_args(["--run_mode", "pd_master"])[0].pd_secret is None
    assert load_server_args(["--run_mode", "pd_master", "--api_key", "k"])[0].pd_secret == "k"
    monkeypatch.setenv("LIGHTLLM_PD_SECRET", "from-env")
    assert load_server_args(["--run_mode", "pd_master", "--api_key", "k"])[0].pd_secret == "from-env"
    args = load_server_args(["--run_mode", "pd_master", "--pd_secret", "from-flag"])[0]
    assert args.pd_secret == "from-flag" and "from-flag" not in repr(args)


@pytest.mark.parametrize(
    "argv",
    [
        ["--run_mode", "pd_master", "--host", "0.0.0.0"],
        ["--run_mode", "prefill", "--host", "10.0.0.5"],
        ["--run_mode", "decode", "--pd_master_ip", "10.0.0.1"],
    ],
)
def test_pd_beyond_loopback_needs_a_secret(argv, monkeypatch):
    monkeypatch.delenv("LIGHTLLM_PD_SECRET", raising=False)
    monkeypatch.delenv("LIGHTLLM_API_KEY", raising=False)
    with pytest.raises(ValueError, match="needs a shared secret"):
        load_server_args(argv)
    # teeth: the same flags with a secret are accepted
    assert load_server_args([*argv, "--pd_secret", "s"])[0].pd_secret == "s"


def test_a_normal_server_beyond_loopback_needs_no_pd_secret(monkeypatch):
    monkeypatch.delenv("LIGHTLLM_PD_SECRET", raising=False)
    monkeypatch.delenv("LIGHTLLM_API_KEY", raising=False)
    assert load_server_args(["--host", "0.0.0.0"])[0].pd_secret is None


@pytest.mark.parametrize(
    "flag, value",
    [
        ("http_header_timeout_s", "0"),
        ("http_body_timeout_s", "-1"),
        ("http_keep_alive_s", "0"),
        ("max_request_json_items", "0"),
        ("progress_timeout_s", "-1"),
        ("pd_request_timeout_s", "0"),
    ],
)
def test_deadlines_and_bounds_must_be_positive(flag, value):
    argv = [f"--{flag}", value] + (["--run_mode", "pd_master"] if flag.startswith("pd_") else [])
    with pytest.raises(ValueError, match=flag):
        load_server_args(argv)
