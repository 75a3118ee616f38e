"""Block-FP8 checkpoints (Qwen's format), written by the test from a bf16 tiny checkpoint with
`lightllm.tools.quantize_fp8`: weights and scales land per block (partial edge blocks included), modules left
unquantized keep their dtype, transposed scales are caught, TP shards keep whole blocks, `quantization="fp8"`
quantizes at load with the same kernels, float8 weights without their scales are refused, and the FP8 model's
logits follow the dequantized-weight model's."""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from lightllm.engine.batch import ForwardBatch
from lightllm.kernels.fp8 import FP8_DTYPE, quantize_weight_blocks
from lightllm.kernels.fp8.shapes import SERVED_GEMMS
from lightllm.models import loader
from lightllm.models.dummy_weights import load_dummy_weights
from lightllm.models.hybrid import HybridModel
from lightllm.models.layers.quantized_linear import Fp8Weight, stack_experts
from lightllm.models.loader import load_weights
from lightllm.models.quant_config import KEPT_UNQUANTIZED, kept_unquantized
from lightllm.models.registry import load_model_config, model_config_from_dict
from lightllm.models.tp import TPInfo
from lightllm.server.checkpoint_check import check_checkpoint
from lightllm.tools.dummy_model_dir import PRESETS
from lightllm.tools.quantize_fp8 import dequantize_checkpoint, quantize_checkpoint
from lightllm.tools.tiny_model.configs import model_config
from unit_tests.models.drive import make_runner

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK = (32, 32)
# odd sizes: hidden 80 = 2.5 blocks, the shared expert's 72 = 2.25 blocks (its down_proj has a square 3 x 3 grid)
SIZES = dict(hidden_size=80, intermediate_size=88, moe_intermediate_size=40, shared_expert_intermediate_size=72)
SHARED_DOWN = "model.layers.0.mlp.shared_expert.down_proj.weight"
GDN_OUT = "model.layers.0.linear_attn.out_proj.weight"
ATTN_Q = "model.layers.3.self_attn.q_proj.weight"
ATTN_O = "model.layers.3.self_attn.o_proj.weight"
# the kept set without GDN's b / a projections: every GDN projection FP8
QUANTIZES_BA = tuple(m for m in KEPT_UNQUANTIZED if not m.startswith("linear_attn."))
EXPERT_DOWN = "model.layers.1.mlp.experts.2.down_proj.weight"


@pytest.fixture(scope="module")
def bf16_dir(tiny_model):
    return tiny_model("qwen3_next", dtype="bfloat16", **SIZES)


@pytest.fixture(scope="module")
def fp8_dir(bf16_dir, tmp_path_factory):
    return quantize_checkpoint(bf16_dir, tmp_path_factory.mktemp("fp8") / "ckpt", BLOCK)


def load(model_dir, tp: TPInfo | None = None, quantization: str | None = None) -> HybridModel:
    model = HybridModel(load_model_config(model_dir), tp)
    load_weights(model, model_dir, torch.float32, "cpu", tp, show_progress=False, quantization=quantization)
    return model


def blockwise_dequantized(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Independent reference: every tile multiplied by its own scale, tile by tile."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(math.ceil(q.shape[0] / block[0])):
        for j in range(math.ceil(q.shape[1] / block[1])):
            rows, cols = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            out[rows, cols] = q[rows, cols].double() * scale[i, j].double()
    return out


def query_rows(attn):
    """The rows of an attention layer's fused q|k|v projection that hold its q_proj shard (queries and gates)."""
    rows, w = 2 * attn.num_heads * attn.cfg.head_dim, attn.qkv_proj
    if isinstance(w, Fp8Weight):
        return Fp8Weight(w.weight[:rows], w.weight_scale_inv[: rows // w.block[0]], w.block)
    return w[:rows]


def module_weight(model: HybridModel, name: str):
    layer = model.layers[int(name.split(".")[2])]
    return {
        SHARED_DOWN: lambda: layer.ffn.shared.down,
        GDN_OUT: lambda: layer.mixer.out_proj,
        ATTN_Q: lambda: query_rows(layer.mixer),
        ATTN_O: lambda: layer.mixer.o_proj,
        # stacked experts: expert 2 of the [E, H, I] weight
        EXPERT_DOWN: lambda: layer.ffn.down[2],
    }[name]()


def test_checkpoint_declares_block_fp8_and_its_unquantized_modules(fp8_dir):
    qc = json.loads((fp8_dir / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == list(BLOCK)
    assert {"model.embed_tokens", "lm_head", "model.layers.0.mlp.gate", "model.layers.0.mlp.shared_expert_gate"} <= set(
        qc["modules_to_not_convert"]
    )
    tensors = load_file(fp8_dir / "model.safetensors")
    assert tensors[SHARED_DOWN].dtype == FP8_DTYPE and tensors[SHARED_DOWN + "_scale_inv"].shape == (3, 3)
    assert tensors[GDN_OUT + "_scale_inv"].shape == (3, 2)
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert check_checkpoint(str(fp8_dir)).model_config.hidden_size == SIZES["hidden_size"]


@pytest.mark.parametrize(
    "name", [SHARED_DOWN, GDN_OUT, ATTN_O, EXPERT_DOWN], ids=["shared-expert-down", "gdn-out", "attn-o", "expert-down"]
)
def test_loaded_weights_are_the_checkpoint_blocks(fp8_dir, name):
    tensors = load_file(fp8_dir / "model.safetensors")
    q, scale = tensors[name], tensors[name + "_scale_inv"]
    w = module_weight(load(fp8_dir), name)
    assert isinstance(w, Fp8Weight)
    # dequantized at load and quantized again over the same tiles: the checkpoint's values and scales come back
    assert torch.equal(w.weight.view(torch.uint8), q.view(torch.uint8))
    torch.testing.assert_close(w.weight_scale_inv, scale, rtol=1e-6, atol=0)
    torch.testing.assert_close(w.dequantize().double(), blockwise_dequantized(q, scale, BLOCK), rtol=1e-6, atol=0)


def test_twin_with_transposed_square_scale_grid_loads_wrong_weights(fp8_dir, tmp_path):
    """Twin of the test above: the 3 x 3 scale grid transposed has the right shape, so it loads, but every
    off-diagonal tile gets another tile's scale."""
    twin = shutil.copytree(fp8_dir, tmp_path / "twin")
    tensors = load_file(twin / "model.safetensors")
    true_scale = tensors[SHARED_DOWN + "_scale_inv"].clone()
    tensors[SHARED_DOWN + "_scale_inv"] = true_scale.T.contiguous()
    save_file(tensors, twin / "model.safetensors")
    w = module_weight(load(twin), SHARED_DOWN)
    reference = blockwise_dequantized(tensors[SHARED_DOWN], true_scale, BLOCK)
    assert not torch.allclose(w.dequantize().double(), reference, rtol=1e-3, atol=0)


def test_transposed_non_square_scale_grid_is_refused(fp8_dir, tmp_path):
    twin = shutil.copytree(fp8_dir, tmp_path / "twin")
    tensors = load_file(twin / "model.safetensors")
    tensors[GDN_OUT + "_scale_inv"] = tensors[GDN_OUT + "_scale_inv"].T.contiguous()
    save_file(tensors, twin / "model.safetensors")
    expected = rf"{GDN_OUT}_scale_inv: expected \[3, 2\], found \[2, 3\]".replace(".", r"\.")
    with pytest.raises(KeyError, match=expected):
        load(twin)
    with pytest.raises(ValueError, match=expected):
        check_checkpoint(str(twin))


def test_gdn_keeps_in_proj_fp8_when_the_checkpoint_leaves_in_proj_ba_unquantized(bf16_dir, tmp_path):
    """Qwen's FP8 releases store in_proj_ba unquantized (the tool's default): q|k|v|z stay FP8 in their own GEMM,
    b|a in the model dtype (one fused GEMM when both parts agree)."""
    fp8 = quantize_checkpoint(bf16_dir, tmp_path / "ckpt", BLOCK)
    all_fp8 = quantize_checkpoint(bf16_dir, tmp_path / "all", BLOCK, QUANTIZES_BA)
    for split, fused in zip(load(fp8).layers[:3], load(all_fp8).layers):
        assert isinstance(split.mixer.in_proj, Fp8Weight) and split.mixer.ba_proj.dtype == torch.float32
        assert isinstance(fused.mixer.in_proj, Fp8Weight) and fused.mixer.ba_proj is None
        assert split.mixer.in_proj.shape[0] + split.mixer.ba_proj.shape[0] == fused.mixer.in_proj.shape[0]


def test_scaled_weight_stored_in_another_dtype_is_refused(fp8_dir, tmp_path):
    twin = shutil.copytree(fp8_dir, tmp_path / "twin")
    tensors = load_file(twin / "model.safetensors")
    tensors[GDN_OUT] = tensors[GDN_OUT].to(torch.bfloat16)
    save_file(tensors, twin / "model.safetensors")
    with pytest.raises(ValueError, match=rf"not float8_e4m3fn despite a _scale_inv \(1\): {GDN_OUT} \(BF16\)"):
        check_checkpoint(str(twin))
    with pytest.raises(ValueError, match=rf"{GDN_OUT}: has a {GDN_OUT}_scale_inv so it must be float8_e4m3fn"):
        load(twin)


def test_fp8_weight_without_its_scale_is_refused(fp8_dir, tmp_path):
    """Its raw float8 values are not the weights (each block is scaled): refused before loading and by the loader,
    naming the tensor. The intact copy is the twin."""
    assert check_checkpoint(str(fp8_dir)).tensors[ATTN_O + "_scale_inv"].dtype == "F32"
    assert isinstance(module_weight(load(fp8_dir), ATTN_O), Fp8Weight)
    twin = shutil.copytree(fp8_dir, tmp_path / "twin")
    tensors = load_file(twin / "model.safetensors")
    del tensors[ATTN_O + "_scale_inv"]
    save_file(tensors, twin / "model.safetensors")
    with pytest.raises(ValueError, match=rf"float8 without a _scale_inv beside it \(1\): {ATTN_O} \(F8_E4M3\)"):
        check_checkpoint(str(twin))
    with pytest.raises(ValueError, match=rf"{ATTN_O}: stored as torch.float8_e4m3fn without the {ATTN_O}_scale_inv"):
        load(twin)


@pytest.mark.parametrize(
    "dtype,header", [(torch.float8_e4m3fn, "F8_E4M3"), (torch.float8_e5m2, "F8_E5M2")], ids=["e4m3", "e5m2"]
)
def test_fp8_weight_without_a_quantization_config_is_refused(bf16_dir, tmp_path, dtype, header):
    """A float8 tensor in a checkpoint whose config.json declares no fp8 quantization has no scale to apply,
    whether the checkpoint loads as it is or is quantized at load. The unbroken checkpoint is the twin."""
    assert check_checkpoint(str(bf16_dir)).tensors[ATTN_O].dtype == "BF16"
    assert isinstance(module_weight(load(bf16_dir), ATTN_O), torch.Tensor)
    twin = shutil.copytree(bf16_dir, tmp_path / "twin")
    tensors = load_file(twin / "model.safetensors")
    tensors[ATTN_O] = tensors[ATTN_O].to(dtype)
    save_file(tensors, twin / "model.safetensors")
    expected = rf"float8 but config.json has no fp8 quantization_config \(1\): {ATTN_O} \({header}\)"
    with pytest.raises(ValueError, match=expected):
        check_checkpoint(str(twin))
    expected = rf"{ATTN_O}: stored as {dtype} but config.json has no fp8 quantization_config"
    for quantization in (None, "fp8"):
        with pytest.raises(ValueError, match=expected):
            load(twin, quantization=quantization)


def test_fp8_checkpoint_without_its_quantization_config_lists_the_float8_weights(fp8_dir, tmp_path):
    twin = shutil.copytree(fp8_dir, tmp_path / "twin")
    config = json.loads((twin / "config.json").read_text())
    del config["quantization_config"]
    (twin / "config.json").write_text(json.dumps(config))
    scaled = [n for n in load_file(twin / "model.safetensors") if n.endswith("_scale_inv")]
    with pytest.raises(ValueError) as err:
        check_checkpoint(str(twin))
    # the scales are unexpected without the config, and every float8 weight is named as such
    assert f"float8 but config.json has no fp8 quantization_config ({len(scaled)}): " in str(err.value)
    assert f"(+{len(scaled) - 5} more)" in str(err.value) and f"unexpected ({len(scaled)})" in str(err.value)


def test_unquantized_modules_keep_their_dtype(bf16_dir, tmp_path):
    fp8 = quantize_checkpoint(bf16_dir, tmp_path / "ckpt", BLOCK, KEPT_UNQUANTIZED + ("o_proj",))
    model = load(fp8)
    o_proj, source = module_weight(model, ATTN_O), load_file(bf16_dir / "model.safetensors")[ATTN_O]
    assert isinstance(o_proj, torch.Tensor) and torch.equal(o_proj, source.float())
    assert isinstance(module_weight(model, ATTN_Q), Fp8Weight)
    mlp = model.layers[0].ffn
    assert isinstance(mlp.router, torch.Tensor) and isinstance(mlp.shared_gate, torch.Tensor)


@pytest.mark.parametrize("rank", [0, 1])
def test_tp_shards_keep_whole_blocks(fp8_dir, rank):
    """q_proj's 4 heads x 32 rows split over 2 ranks on a block boundary: each rank holds the checkpoint's own
    blocks and scales; o_proj's 64 input columns likewise."""
    tensors = load_file(fp8_dir / "model.safetensors")
    model = load(fp8_dir, TPInfo(rank, 2))
    q, o = module_weight(model, ATTN_Q), module_weight(model, ATTN_O)
    rows = slice(rank * 64, (rank + 1) * 64)
    assert torch.equal(q.weight.view(torch.uint8), tensors[ATTN_Q][rows].view(torch.uint8))
    torch.testing.assert_close(q.weight_scale_inv, tensors[ATTN_Q + "_scale_inv"][rank * 2 : (rank + 1) * 2])
    # the fused projection stacks this rank's q, k and v shards: k's and v's 16 rows a rank cut the checkpoint's
    # 32-row blocks, so they are quantized again over the fused weight's tiles (within e4m3's rounding)
    qkv = model.layers[3].mixer.qkv_proj.dequantize().double()
    shards = []
    for n in ("q_proj", "k_proj", "v_proj"):
        name = ATTN_Q.replace("q_proj", n)
        shards.append(blockwise_dequantized(tensors[name], tensors[name + "_scale_inv"], BLOCK).chunk(2)[rank])
    reference = torch.cat(shards)
    assert qkv.shape == reference.shape and ((qkv - reference).norm() / reference.norm()).item() < 0.03
    cols = slice(rank * 32, (rank + 1) * 32)
    assert torch.equal(o.weight.view(torch.uint8), tensors[ATTN_O][:, cols].view(torch.uint8))
    torch.testing.assert_close(o.weight_scale_inv, tensors[ATTN_O + "_scale_inv"][:, rank : rank + 1])


def test_quantization_fp8_at_load_matches_the_quantized_checkpoint(bf16_dir, fp8_dir):
    """`--quantization fp8` on the bf16 checkpoint runs the same kernels as the offline tool (default 128 blocks)."""
    model = load(bf16_dir, quantization="fp8")
    w = module_weight(model, ATTN_O)
    q, scale = quantize_weight_blocks(load_file(bf16_dir / "model.safetensors")[ATTN_O])
    assert isinstance(w, Fp8Weight) and w.block == (128, 128)
    assert torch.equal(w.weight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(w.weight_scale_inv, scale)
    assert all(isinstance(layer.mixer.in_proj, Fp8Weight) for layer in model.layers[:3])
    assert isinstance(model.embed, torch.Tensor) and model.embed.dtype == torch.float32
    # the same modules stay unquantized as in the offline tool's checkpoint: GDN's b|a among them
    assert all(layer.mixer.ba_proj.dtype == torch.float32 for layer in model.layers[:3])
    offline = load(fp8_dir)
    for (name, at_load), (_, from_file) in zip(model.named_modules(), offline.named_modules(), strict=True):
        assert isinstance(at_load, Fp8Weight) == isinstance(from_file, Fp8Weight), name


def prompt_logits(model_dir, ids: torch.Tensor) -> torch.Tensor:
    runner = make_runner(str(model_dir), max_req_total_len=len(ids) + 8, max_total_token_num=len(ids) + 64)
    handle = runner.add_request()
    out = runner.forward(ForwardBatch([handle], [len(ids)], [0], 1, ids, [True], [True]))
    return out.prompt_logits


# Untrained tiny weights give flat logits (the best and second-best tokens are often close), so W8A8's activation
# rounding (~2.4% per GEMM, compounding through the GDN decay gates over 512 tokens) flips the top-1 at near-ties
# far more often than on a trained model: measured 0.88-0.92 overall here. What must hold everywhere: where the
# reference's top-1 leads by more than CONFIDENT_MARGIN x the position's RMS logit error, FP8 picks the same token.
MIN_TOP1_AGREEMENT = 0.85
CONFIDENT_MARGIN = 4.0
MIN_CONFIDENT_SHARE = 0.35
MAX_LOGITS_REL = 0.1


@pytest.mark.parametrize(
    "block,not_converted",
    [((32, 32), QUANTIZES_BA), ((128, 128), QUANTIZES_BA), ((128, 128), KEPT_UNQUANTIZED)],
    ids=["b32", "b128", "b128-ba-unquantized"],
)
def test_fp8_logits_follow_the_dequantized_weight_model(bf16_dir, tmp_path, block, not_converted):
    fp8 = quantize_checkpoint(bf16_dir, tmp_path / "fp8", block, not_converted)
    reference = dequantize_checkpoint(fp8, tmp_path / "dequantized")
    ids = torch.randint(0, 470, (512,), generator=torch.Generator().manual_seed(5))
    actual, expected = prompt_logits(fp8, ids), prompt_logits(reference, ids)
    agree = actual.argmax(-1) == expected.argmax(-1)
    rel = ((actual - expected).norm() / expected.norm()).item()
    noise = (actual - expected).pow(2).mean(-1).sqrt()
    best_two = expected.topk(2, dim=-1).values
    confident = best_two[:, 0] - best_two[:, 1] > CONFIDENT_MARGIN * noise
    summary = f"top-1 agreement {agree.float().mean():.3f}, on {confident.sum()} confident positions "
    summary += f"{agree[confident].float().mean():.3f}, logits rel error {rel:.3f}"
    assert agree.float().mean() >= MIN_TOP1_AGREEMENT and rel <= MAX_LOGITS_REL, summary
    assert confident.float().mean() >= MIN_CONFIDENT_SHARE and agree[confident].all(), summary
    # the reference differs from the FP8 model by the activation rounding only: not by a hair, not by a lot
    assert rel > 1e-3, summary


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "plain"])
def test_stack_experts_equals_a_stack_of_the_parts(fp8):
    """Experts copied into the stack one by one equal `torch.stack` of the parts (values and scales); a count that
    does not match the parts, or FP8 and plain parts mixed, is refused."""
    gen = torch.Generator().manual_seed(5)
    weights = [torch.randn(40, 72, generator=gen) for _ in range(5)]
    parts = [Fp8Weight.quantize(t, BLOCK) if fp8 else t for t in weights]
    stacked = stack_experts(iter(parts), len(parts))
    if fp8:
        assert torch.equal(stacked.weight.view(torch.uint8), torch.stack([p.weight for p in parts]).view(torch.uint8))
        assert torch.equal(stacked.weight_scale_inv, torch.stack([p.weight_scale_inv for p in parts]))
        assert stacked.block == BLOCK
    else:
        assert torch.equal(stacked, torch.stack(parts))
    with pytest.raises(ValueError, match="expected 6"):
        stack_experts(iter(parts), 6)
    with pytest.raises(ValueError, match="more than 4"):
        stack_experts(iter(parts), 4)
    mixed = [parts[0], Fp8Weight.quantize(weights[1], BLOCK) if not fp8 else weights[1]]
    with pytest.raises(ValueError, match="mix FP8 and plain"):
        stack_experts(iter(mixed), 2)


def served_fp8_shapes(preset: str) -> set[tuple[int, int]]:
    """The `[N, K]` of every dense FP8 projection a model at the served checkpoint's widths holds after quantizing at
    load (random weights; two layers, one GDN and one attention, two experts, no MTP: the dense widths are the
    released model's)."""
    arch, sizes, _ = PRESETS[preset]
    sizes = dataclasses.replace(
        sizes, num_layers=2, full_attention_interval=2, vocab_size=512, num_experts=2, num_experts_per_tok=1
    )
    cfg = model_config(arch, dataclasses.replace(sizes, num_mtp_layers=0), "float32", collections.defaultdict(int))
    model = HybridModel(model_config_from_dict(cfg))
    load_dummy_weights(model, torch.float32, "cpu", quantization="fp8")
    return {tuple(m.weight.shape) for m in model.modules() if isinstance(m, Fp8Weight) and m.weight.dim() == 2}


@pytest.mark.parametrize("preset", list(SERVED_GEMMS))
def test_served_gemm_list_names_the_projections_the_engine_runs(preset):
    """What the tuner and the GEMM benchmarks run (`SERVED_GEMMS`) is every dense FP8 GEMM shape the engine runs for
    that checkpoint, GDN's b / a unquantized as in Qwen's releases."""
    assert served_fp8_shapes(preset) == set(SERVED_GEMMS[preset].values())


def test_twin_gdn_with_b_a_quantized_runs_another_input_projection(monkeypatch):
    """Twin: with b / a quantized too, GDN's input GEMM takes their rows (q|k|v|z|b|a): a shape the list lacks."""
    monkeypatch.setattr(loader, "kept_unquantized", lambda name: kept_unquantized(name, QUANTIZES_BA))
    shapes = served_fp8_shapes("qwen3.5-35b-a3b")
    assert (12352, 2048) in shapes and shapes != set(SERVED_GEMMS["qwen3.5-35b-a3b"].values())
