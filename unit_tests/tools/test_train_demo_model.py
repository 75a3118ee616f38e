"""lightllm.tools.train_demo_model: a toy-sized run end to end on the CPU; its checkpoint loads in lightllm and in
transformers with equal logits (main model and MTP drafts), the export keeps the trained weights, the tokenizer
round-trips, the corpus and run are fixed by their arguments, and the default size fits the repository's budget."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from lightllm.tools.demo_model.corpus import (
    HELDOUT,
    MODULES,
    heldout_documents,
    manifest,
    package_documents,
    package_versions,
    training_documents,
)
from lightllm.tools.demo_model.data import END_OF_TEXT, chat_example, examples, snippets
from lightllm.tools.demo_model.export import write_checkpoint_weights
from lightllm.tools.demo_model.model import ARCH, DEFAULT_SIZES, DemoModel, demo_config
from lightllm.tools.tiny_model.configs import generation_config
from lightllm.tools.tiny_model.sizes import TinySizes
from lightllm.tools.tiny_model.token_specs import special_token_ids
from lightllm.tools.train_demo_model import learning_rate
from unit_tests.helpers.demo_toy import toy_demo_checkpoint
from unit_tests.helpers.hf_oracle import HFOracle, torch_paths
from unit_tests.models.drive import make_runner, prefill
from unit_tests.models.test_mtp import hf_draft_chain
from unit_tests.models.test_parity import MAX_REL, max_rel

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _prompt(seed: int, length: int, vocab: int = 470) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def toy():
    return toy_demo_checkpoint()


@pytest.fixture(scope="module")
def toy_oracle(toy):
    return HFOracle(toy[0])


def test_toy_run_lowers_training_and_heldout_loss(toy):
    _, summary = toy
    history = summary["history"]
    first, last = history[0], history[-1]
    assert last["step"] == summary["steps"] == 100 and summary["stopped_by"] == "steps"
    assert last["loss"] < first["loss"] - 0.5, (first, last)
    assert last["mtp_loss"] < first["mtp_loss"] - 0.5, (first, last)
    evals = [row for row in history if "heldout_loss" in row]
    assert len(evals) == 5 and evals[-1]["heldout_loss"] < first["loss"] - 0.5


def test_checkpoint_has_the_qwen3_5_layout_with_an_mtp_head(toy):
    model_dir, summary = toy
    cfg = json.loads((model_dir / "config.json").read_text())
    text = cfg["text_config"]
    assert cfg["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + [
        "full_attention"
    ]
    assert text["mtp_num_hidden_layers"] == 1 and text["vocab_size"] == 512 and text["hidden_size"] == 64
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert {"mtp.fc.weight", "mtp.norm.weight", "mtp.layers.0.self_attn.q_proj.weight", "lm_head.weight"} <= names
    assert summary["training_text"]["num_files"] == 8


def test_toy_checkpoint_logits_match_transformers(toy, toy_oracle):
    """lightllm's prefill logits and chained MTP drafts equal transformers' on the trained checkpoint; a prompt
    with one token changed does not (the comparison can fail)."""
    model_dir, _ = toy
    ids = _prompt(0, 29)
    runner = make_runner(str(model_dir), mtp_step=2)
    h = runner.add_request()
    logits = prefill(runner, h, ids, chunk=11)
    expected = toy_oracle.prefill_logits(ids)[0, -1]
    assert max_rel(logits, expected) < MAX_REL
    changed = ids[:-1] + [(ids[-1] + 1) % 470]
    assert max_rel(logits, toy_oracle.prefill_logits(changed)[0, -1]) > 100 * MAX_REL
    nxt = int(logits.argmax())
    drafts, draft_logits = runner.draft_with_logits([h], torch.tensor([nxt]), 2)
    hf = hf_draft_chain(toy_oracle, ids, nxt, 2)
    for s in range(2):
        assert max_rel(draft_logits[0, s], hf[s]) < MAX_REL, f"draft step {s}"
    assert drafts[0].tolist() == hf.argmax(-1).tolist()


def _perturbed_model(seed: int) -> tuple[DemoModel, dict]:
    small = {"hidden_size": 32, "intermediate_size": 48, "vocab_size": 384, "head_dim": 16}
    sizes = TinySizes(**{**DEFAULT_SIZES, **small, "linear_key_head_dim": 16, "linear_value_head_dim": 16})
    config = demo_config(sizes, "float32", special_token_ids(ARCH, sizes.vocab_size))
    model = DemoModel(config)
    model.init_weights(seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        # every tensor off its initial value (zero-initialised norms would hide swapped names)
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    return model.eval(), config


def _export(model: DemoModel, config: dict, out) -> HFOracle:
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    write_checkpoint_weights(model, out, torch.float32, seed=0)
    return HFOracle(out)


def test_export_keeps_every_trained_tensor(tmp_path):
    """transformers on the exported files reproduces the in-memory model's logits and MTP logits; an export of a
    model whose MTP input norms differ does not."""
    model, config = _perturbed_model(3)
    oracle = _export(model, config, tmp_path / "a")
    ids = torch.tensor([_prompt(5, 21, 380)])
    with torch.no_grad(), torch_paths():
        hidden = model.lm.model(input_ids=ids).last_hidden_state
        logits = model.lm.lm_head(hidden)
        draft = model.mtp_logits(hidden, ids)
    assert max_rel(oracle.prefill_logits(ids), logits) < MAX_REL
    assert max_rel(oracle.mtp_draft_logits(ids), draft) < MAX_REL
    with torch.no_grad():
        model.mtp.layers[0].enorm.weight.add_(0.5)
    other = _export(model, config, tmp_path / "b")
    assert max_rel(other.mtp_draft_logits(ids), draft) > 100 * MAX_REL


def test_tokenizer_round_trips_text_and_keeps_chat_markup_whole(toy):
    from transformers import AutoTokenizer

    model_dir, _ = toy
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = special_token_ids(ARCH, 512)
    doc = heldout_documents()[0]
    texts = [doc.text[:2000], chat_example("textwrap", snippets(doc)[1]), "naïve café 東京 🙂\n\tx = 1\r\n"]
    for text in texts:
        enc = tok.encode(text, add_special_tokens=False)
        assert max(enc) < 512 and tok.decode(enc) == text
    chat = tok.encode(texts[1], add_special_tokens=False)
    assert chat[0] == ids["<|im_start|>"] and chat.count(ids["<|im_end|>"]) == 2
    rendered = tok.apply_chat_template([{"role": "user", "content": "Write a loop."}], add_generation_prompt=True)
    rendered = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    assert tok.decode(rendered) == "<|im_start|>user\nWrite a loop.<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert tok.decode(tok.encode(texts[0][:500] + "x", add_special_tokens=False)) != texts[0][:500]
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert gen == generation_config(ARCH, ids)
    assert tok.convert_tokens_to_ids(END_OF_TEXT) == ids[END_OF_TEXT]


def test_corpus_is_pinned_and_heldout_is_disjoint():
    assert list(MODULES) == sorted(MODULES) and not set(MODULES) & set(HELDOUT)
    train, held = training_documents(), heldout_documents()
    assert not {d.name for d in train} & {d.name for d in held}
    assert not any("/test/" in f"/{d.name}" or "/tests/" in f"/{d.name}" for d in train)
    assert manifest(train) == manifest(training_documents())
    assert manifest(train[:-1]) != manifest(train)
    # plain and chat examples alternate, in document order
    first = list(examples(train[:1]))
    assert first[0] == snippets(train[0])[0] and first[1].startswith("<|im_start|>user\nWrite `")


def test_package_source_joins_the_training_text_without_tests():
    import transformers

    docs = package_documents(("transformers",))
    names = [d.name for d in docs]
    assert len(docs) > 100 and all(n.startswith("transformers/") and n.endswith(".py") for n in names)
    assert "transformers/__init__.py" in names and len(set(names)) == len(names)
    assert not any({"test", "tests", "__pycache__"} & set(n.split("/")[:-1]) for n in names)
    assert package_versions(("transformers",)) == {"transformers": transformers.__version__}
    with pytest.raises(ModuleNotFoundError, match="package 'no_such_pkg_xyz' is not installed"):
        package_documents(("no_such_pkg_xyz",))


def _small_demo_model() -> DemoModel:
    small = {"hidden_size": 64, "intermediate_size": 128, "head_dim": 16, "linear_key_head_dim": 16, "vocab_size": 512}
    sizes = TinySizes(**{**DEFAULT_SIZES, **small})
    model = DemoModel(demo_config(sizes, "float32", special_token_ids(ARCH, 512)))
    model.init_weights(3)
    return model


def _grads(model: DemoModel, loss: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def test_distillation_term_is_the_heads_cross_entropy_against_the_detached_model():
    """loss(ids, 1, w) adds w x CE(draft, softmax(main logits of the same token)), the teacher detached: the same
    value and gradients as that term written out here; twin: a teacher left attached changes the gradients."""
    model = _small_demo_model()
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(5))

    def written_out(detach: bool) -> torch.Tensor:
        hidden = model.lm.model(input_ids=ids).last_hidden_state
        logits = model.lm.lm_head(hidden)
        main = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        draft = model.mtp_logits(hidden, ids)[:, :-1].reshape(-1, 512)
        teacher = logits[:, 1:-1].reshape(-1, 512).softmax(-1)
        teacher = teacher.detach() if detach else teacher
        soft = -(teacher * draft.log_softmax(-1)).sum(-1).mean()
        return main + F.cross_entropy(draft, ids[:, 2:].flatten()) + 0.5 * soft

    with torch_paths():
        total, main, mtp = model.loss(ids, 1.0, 0.5)
        plain, _, _ = model.loss(ids, 1.0, 0.0)
        assert plain.item() == pytest.approx((main + mtp).item(), rel=1e-6) and total.item() > plain.item() + 0.1
        got = _grads(model, total)
        expected = written_out(detach=True)
        assert expected.item() == pytest.approx(total.item(), rel=1e-5)
        want = _grads(model, expected)
        assert all(torch.allclose(g, w, rtol=1e-4, atol=1e-7) for g, w in zip(got, want))
        attached = _grads(model, written_out(detach=False))
        assert not all(torch.allclose(g, w, rtol=1e-4, atol=1e-7) for g, w in zip(got, attached))


def test_same_arguments_give_identical_files(tmp_path):
    from lightllm.tools.train_demo_model import parse_args, train

    small = ["--max_steps", "2", "--max_train_files", "2", "--hidden_size", "32", "--intermediate_size", "48"]
    small += ["--head_dim", "16", "--linear_key_head_dim", "16", "--vocab_size", "384", "--batch_size", "2"]
    small += ["--seq_len", "32", "--acceptance_prompts", "0", "--device", "cpu", "--eval_batches", "1"]

    def digest(name: str, *extra: str) -> dict[str, str]:
        out = tmp_path / name
        train(parse_args(["--out", str(out), *small, *extra]))
        files = ("model.safetensors", "tokenizer.json", "config.json")
        return {f: hashlib.sha256((out / f).read_bytes()).hexdigest() for f in files}

    a, b, c = digest("a"), digest("b"), digest("c", "--seed", "1")
    assert a == b
    assert c["model.safetensors"] != a["model.safetensors"] and c["tokenizer.json"] == a["tokenizer.json"]


def test_default_size_fits_the_repository_budget():
    """The shipped checkpoint (bf16) stays under 16 MB: parameters of the text model and MTP head, plus the vision
    tower of the released layout."""
    sizes = TinySizes(**DEFAULT_SIZES)
    config = demo_config(sizes, "bfloat16", special_token_ids(ARCH, sizes.vocab_size))
    with torch.device("meta"):
        model = DemoModel(config)
    num_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    assert 6e6 < num_params and 2 * num_params + 100_000 < 16e6


def test_learning_rate_warms_up_then_decays_to_a_tenth():
    assert learning_rate(0.0, 1.0, 0.1) == 0.0
    assert learning_rate(0.05, 1.0, 0.1) == pytest.approx(0.5)
    assert learning_rate(0.1, 1.0, 0.1) == pytest.approx(1.0)
    assert learning_rate(0.55, 1.0, 0.1) == pytest.approx(0.55)
    assert learning_rate(1.0, 1.0, 0.1) == pytest.approx(0.1)
