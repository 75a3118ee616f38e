"""Without --model_dir the server serves the trained demo model shipped in the package, and falls back to the tiny
random checkpoint (with a warning) while the package lacks its weights."""

from __future__ import annotations

import logging
import shutil

import pytest

import lightllm.tools.demo_model as demo_model
from lightllm.server.args import load_server_args
from lightllm.server.demo_checkpoint import random_demo_model_dir
from unit_tests.helpers.demo_toy import toy_demo_checkpoint


def test_default_serves_the_trained_weights_when_present(monkeypatch, caplog):
    toy, _ = toy_demo_checkpoint()
    monkeypatch.setattr(demo_model, "WEIGHTS_DIR", toy)
    with caplog.at_level(logging.WARNING, logger="lightllm.server.demo_checkpoint"):
        args, info = load_server_args([], device="cpu")
    assert args.model_dir == str(toy) and args.served_model_name == demo_model.SERVED_NAME
    assert info.vocab_size == 512
    assert not [r for r in caplog.records if "demo model" in r.getMessage()]
    # an explicit checkpoint and an explicit name still win
    args, _ = load_server_args([], device="cpu", model_dir=random_demo_model_dir(), served_model_name="x")
    assert args.model_dir == random_demo_model_dir() and args.served_model_name == "x"


@pytest.mark.parametrize("missing", ["all", "model.safetensors", "tokenizer.json"])
def test_default_falls_back_to_the_random_model_with_a_warning(monkeypatch, caplog, tmp_path, missing):
    weights = tmp_path / "weights"
    if missing != "all":
        shutil.copytree(toy_demo_checkpoint()[0], weights)
        (weights / missing).unlink()
    monkeypatch.setattr(demo_model, "WEIGHTS_DIR", weights)
    with caplog.at_level(logging.WARNING, logger="lightllm.server.demo_checkpoint"):
        args, _ = load_server_args([], device="cpu")
    assert args.model_dir == random_demo_model_dir() and args.served_model_name == demo_model.SERVED_NAME
    assert any("serving a tiny random checkpoint" in r.getMessage() for r in caplog.records)
