"""Bad checkpoints and bad flags are refused before the engine starts: exit code 2 and one message on stderr that
names the file (and the field or tensor) with what was expected vs what was found, no traceback.

Every case copies a tiny checkpoint, breaks it, and runs `python -m lightllm.server.api_server` for real; the
unbroken copy passes the same check (`check_checkpoint`, called directly to stay fast).
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lightllm.models.hybrid import HybridModel
from lightllm.models.loader import load_weights
from lightllm.models.registry import load_model_config
from lightllm.server.checkpoint_check import check_checkpoint
from lightllm.tools.make_tiny_model import tiny_model_dir
from lightllm.tools.quantize_fp8 import quantize_checkpoint
from lightllm.tools.tiny_model.sizes import ARCHS
from unit_tests.server.live_server import single_threaded_env

# the tiny checkpoints have hidden_size 64 and a 512-token vocabulary
HIDDEN, VOCAB = 64, 512
# logged by api_server.main once the flags and the checkpoint are accepted, right before the engine is spawned
ENGINE_START_MARKER = "lightllm.server INFO serving"


def _copy(arch: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_model_dir(arch), tmp_path / f"tiny-{arch}"))


def _edit_config(model_dir: Path, edit: Callable[[dict], None]) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config, indent=2))


def _truncate(path: Path, size: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:size])


# each case: how to break a qwen3_next copy, extra flags, and the fragments the message must contain
def _corrupt_config(d: Path) -> None:
    text = (d / "config.json").read_text()
    (d / "config.json").write_text(text[:30] + "\x01" + text[30:])


def _truncate_header(d: Path) -> None:
    _truncate(d / "model.safetensors", 200)


def _truncate_data(d: Path) -> None:
    _truncate(d / "model.safetensors", (d / "model.safetensors").stat().st_size // 2)


# a full-attention projection of the tiny qwen3_next
O_PROJ = "model.layers.3.self_attn.o_proj.weight"


def _fp8_without_a_scale(d: Path) -> None:
    fp8 = quantize_checkpoint(d, d.parent / "fp8", (32, 32))
    tensors = load_file(fp8 / "model.safetensors")
    del tensors[O_PROJ + "_scale_inv"]
    save_file(tensors, d / "model.safetensors")
    shutil.copy(fp8 / "config.json", d / "config.json")


def _fp8_without_a_quantization_config(d: Path) -> None:
    tensors = load_file(d / "model.safetensors")
    tensors[O_PROJ] = tensors[O_PROJ].to(torch.float8_e4m3fn)
    save_file(tensors, d / "model.safetensors")


def _tiktoken_without_a_byte(d: Path) -> None:
    """Kimi's tokenizer format in place of tokenizer.json, its ranks lacking the byte 0xff."""
    (d / "tokenizer.json").unlink()
    (d / "tiktoken.model").write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(255)))


CASES = {
    "corrupt-config": (_corrupt_config, [], ["config.json: expected valid JSON", "line 3 column", "control character"]),
    "truncated-header": (
        _truncate_header,
        [],
        ["model.safetensors: truncated: expected at least", "bytes for the header, found 200 bytes"],
    ),
    "truncated-data": (
        _truncate_data,
        [],
        ["model.safetensors: truncated: expected at least", "(the end of tensor 'model.", "found "],
    ),
    "no-safetensors": (
        lambda d: (d / "model.safetensors").unlink(),
        [],
        ["expected *.safetensors weight files, found none", "the folder holds config.json"],
    ),
    "unsupported-model-type": (
        lambda d: _edit_config(d, lambda c: c.update(model_type="llama")),
        [],
        ["config.json: unsupported model_type 'llama'", "supported: qwen3_next"],
    ),
    "missing-hidden-size": (
        lambda d: _edit_config(d, lambda c: c.pop("hidden_size")),
        [],
        ["config.json: required field 'hidden_size' is missing (model_type 'qwen3_next')"],
    ),
    "missing-tokenizer": (
        lambda d: (d / "tokenizer.json").unlink(),
        [],
        ["tokenizer.json: expected the tokenizer", "found no such file"],
    ),
    "unreadable-tokenizer": (
        lambda d: (d / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": 7}}'),
        [],
        ["tokenizer.json: expected a readable tokenizer.json, found an unreadable one"],
    ),
    "tiktoken-without-a-byte": (
        _tiktoken_without_a_byte,
        [],
        ["tiktoken.model: expected a rank for each of the 256 single bytes, found none for b'\\xff'"],
    ),
    "config-vs-weights-shape": (
        lambda d: _edit_config(d, lambda c: c.update(hidden_size=2 * HIDDEN)),
        [],
        [
            "model.safetensors: the weights do not match config.json",
            "hidden_size 128",
            f"model.embed_tokens.weight: expected [{VOCAB}, {2 * HIDDEN}], found [{VOCAB}, {HIDDEN}]",
        ],
    ),
    "port-out-of-range": (lambda d: None, ["--port", "99999"], ["--port must be in 1..65535, got 99999"]),
    "awq-checkpoint": (
        lambda d: _edit_config(d, lambda c: c.update(quantization_config={"quant_method": "awq", "bits": 4})),
        [],
        ["config.json: quantization_config.quant_method 'awq' is not supported", "supported: quant_method fp8"],
    ),
    "bitsandbytes-without-method": (
        lambda d: _edit_config(d, lambda c: c.update(quantization_config={"load_in_4bit": True})),
        [],
        ["config.json: quantization_config.quant_method 'bitsandbytes' is not supported", "weight_block_size"],
    ),
    "fp8-weight-without-scale": (
        _fp8_without_a_scale,
        [],
        [
            "model.safetensors: the weights do not match config.json",
            f"float8 without a _scale_inv beside it (1): {O_PROJ} (F8_E4M3)",
        ],
    ),
    "fp8-weight-without-quantization-config": (
        _fp8_without_a_quantization_config,
        [],
        [f"float8 but config.json has no fp8 quantization_config (1): {O_PROJ} (F8_E4M3)"],
    ),
    "fp8-per-tensor": (
        lambda d: _edit_config(d, lambda c: c.update(quantization_config={"quant_method": "fp8"})),
        [],
        ["config.json: quantization_config fp8 without weight_block_size (per-tensor weight scales)"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cli_refuses_before_the_engine_starts(case, tmp_path):
    breaks, flags, fragments = CASES[case]
    model_dir = _copy("qwen3_next", tmp_path)
    breaks(model_dir)
    proc = subprocess.run(
        [sys.executable, "-m", "lightllm.server.api_server", "--model_dir", str(model_dir), "--device", "cpu", *flags],
        capture_output=True,
        text=True,
        timeout=120,
        env=single_threaded_env(),
    )
    assert proc.returncode == 2, proc.stderr
    refusals = [line for line in proc.stderr.splitlines() if line.startswith("lightllm: refusing to start: ")]
    assert len(refusals) == 1, proc.stderr
    for fragment in fragments:
        assert fragment in proc.stderr, f"{fragment!r} not in:\n{proc.stderr}"
    if case != "port-out-of-range":
        # the message names the broken file by its path in the copy
        assert str(model_dir) in refusals[0]
    assert "Traceback" not in proc.stderr, proc.stderr
    # refused from the file headers: no engine, no weight loading
    assert ENGINE_START_MARKER not in proc.stderr and "loading weights" not in proc.stderr, proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize("arch", ARCHS)
def test_unbroken_copy_passes_the_check(arch, tmp_path):
    checked = check_checkpoint(str(_copy(arch, tmp_path)))
    assert checked.model_config.hidden_size == HIDDEN and checked.tensors


@pytest.mark.parametrize("arch", ARCHS)
def test_config_that_disagrees_with_the_weights_is_named_per_tensor(arch, tmp_path):
    model_dir = _copy(arch, tmp_path)

    def wider(config: dict) -> None:
        (config.get("text_config") or config)["hidden_size"] = 2 * HIDDEN

    _edit_config(model_dir, wider)
    with pytest.raises(ValueError) as err:
        check_checkpoint(str(model_dir))
    text = str(err.value)
    assert text.startswith(f"{model_dir / 'model.safetensors'}: the weights do not match config.json")
    # Qwen3.5 stores the decoder under model.language_model.: the message names the tensor as stored
    embed = "model.language_model.embed_tokens.weight" if arch.startswith("qwen3_5") else "model.embed_tokens.weight"
    assert f"{embed}: expected [{VOCAB}, {2 * HIDDEN}], found [{VOCAB}, {HIDDEN}]" in text
    assert "(+" in text, "only the first few mismatches are listed"


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    model_dir = _copy("qwen3_next", tmp_path)
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.1.linear_attn.A_log"]
    tensors["model.layers.0.linear_attn.bogus.weight"] = torch.zeros(3)
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(ValueError) as err:
        check_checkpoint(str(model_dir))
    text = str(err.value)
    assert "missing (1): model.layers.1.linear_attn.A_log" in text
    assert "unexpected (1): model.layers.0.linear_attn.bogus.weight" in text


def test_missing_field_under_text_config_is_named(tmp_path):
    model_dir = _copy("qwen3_5", tmp_path)
    _edit_config(model_dir, lambda c: c["text_config"].pop("num_hidden_layers"))
    with pytest.raises(
        ValueError, match=r"config\.json: required field 'num_hidden_layers' is missing under text_config"
    ):
        check_checkpoint(str(model_dir))


def test_index_naming_an_absent_shard_is_refused(tmp_path):
    model_dir = _copy("qwen3_next", tmp_path)
    names = load_file(model_dir / "model.safetensors")
    half = len(names) // 2
    weight_map = {n: "model.safetensors" if i < half else "model-00002.safetensors" for i, n in enumerate(names)}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(
        ValueError, match=r"index\.json: expected the 2 shard files it names, found 1 \(absent: model-00002"
    ):
        check_checkpoint(str(model_dir))


def test_load_weights_refuses_a_wrongly_shaped_tensor(tmp_path):
    """The engine-side loader checks the same declared shapes (a checkpoint that bypassed the server check)."""
    model_dir = tiny_model_dir("kimi_linear")
    tensors = load_file(model_dir / "model.safetensors")
    tensors["model.norm.weight"] = torch.zeros(HIDDEN + 1)
    model = HybridModel(load_model_config(model_dir))
    with pytest.raises(KeyError, match=rf"model\.norm\.weight: expected \[{HIDDEN}\], found \[{HIDDEN + 1}\]"):
        load_weights(model, tensors, torch.float32, show_progress=False)
