"""server/grammar_vocab.py: a grammar's vocabulary read from Kimi's tiktoken format (a folder built here, with BPE
ranks trained in the test) masks exactly the tokens whose bytes continue the grammar's text, special tokens never
spelling text; and a tiny Kimi-Linear checkpoint with only tiktoken.model decodes to its grammar through the engine,
its vocabulary built at start-up."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from lightllm.engine.grammar import unpack_bitmask
from lightllm.engine.messages import Finished, NewRequest, TokenChunk
from lightllm.engine.sampling_params import SamplingParams
from lightllm.server.args import load_server_args
from lightllm.server.engine_process import build_engine
from lightllm.server.grammar_vocab import load_grammar_vocabulary
from lightllm.server.http.structured import json_schema_grammar
from lightllm.server.tiktoken_tokenizer import NUM_RESERVED_SPECIAL, TiktokenTokenizer
from lightllm.server.tokenizer import Tokenizer
from lightllm.tools.make_tiny_model import tiny_model_dir
from lightllm.tools.tiny_model.chat_templates import TEMPLATES
from unit_tests.server.test_tiktoken_tokenizer import CORPUS, special_ids, train_ranks, write_folder

# a grammar that forces no text (llguidance allows only the canonical token where the text is forced): any run of
# these characters, so a token is allowed exactly when its bytes can start such a run
CHARS = "abcdefghijklmnopqrstuvwxyz 分词器é"
GRAMMAR = f"start: /[{CHARS}]+/"
TEXT = "quick brown fox said 分词器 café"
NUM_MERGES = 120
# the tiny checkpoint's logits: wider than the tokenizer (256 bytes + merges + reserved specials)
MODEL_VOCAB = 640
SCHEMA = {"type": "object", "properties": {"word": {"enum": ["fox", "dog"]}, "n": {"type": "integer"}}}
SCHEMA["required"], SCHEMA["additionalProperties"] = ["word", "n"], False


@pytest.fixture(scope="module")
def ranks() -> dict[bytes, int]:
    return train_ranks(CORPUS, NUM_MERGES)


@pytest.fixture(scope="module")
def folder(tmp_path_factory, ranks):
    path = tmp_path_factory.mktemp("kimi_tok")
    return write_folder(path, ranks, special_ids(len(ranks)), TEMPLATES["kimi_linear"], True)


def _mask(matcher) -> torch.Tensor:
    bitmask = torch.zeros((1, (MODEL_VOCAB + 31) // 32), dtype=torch.int32)
    matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)
    return unpack_bitmask(bitmask, MODEL_VOCAB)[0]


def _masks(vocabulary, ids: list[int]) -> list[torch.Tensor]:
    """Allowed tokens (bool [MODEL_VOCAB]) after each prefix of `ids`."""
    from llguidance import LLMatcher

    matcher = LLMatcher(vocabulary, LLMatcher.grammar_from_lark(GRAMMAR), log_level=0)
    masks = [_mask(matcher)]
    for token in ids:
        assert matcher.consume_token(token), matcher.get_error()
        masks.append(_mask(matcher))
    return masks


def _starts_a_run(piece: bytes) -> bool:
    """Whether `piece` is the start of a run of CHARS in UTF-8 (it may end inside a character)."""
    encoded = [c.encode() for c in CHARS]
    i = 0
    while i < len(piece):
        whole = next((e for e in encoded if piece.startswith(e, i)), None)
        if whole is None:
            return any(e.startswith(piece[i:]) for e in encoded)
        i += len(whole)
    return bool(piece)


def _reference(tok: TiktokenTokenizer, num_positions: int) -> list[torch.Tensor]:
    """The same masks from the token bytes alone (at character boundaries every position allows the same tokens;
    EOS once the run has begun; special tokens never: they are not text, nor ids past the tokenizer)."""
    special = set(tok.special.ids.values())
    allowed = torch.zeros(MODEL_VOCAB, dtype=torch.bool)
    for t, piece in enumerate(tok.token_bytes()):
        allowed[t] = t not in special and _starts_a_run(piece)
    after = allowed.clone()
    after[tok.eos_token_id] = True
    return [allowed] + [after] * (num_positions - 1)


def test_tiktoken_vocabulary_masks_the_token_bytes(folder, ranks):
    tok = TiktokenTokenizer(str(folder))
    assert len(tok) == len(ranks) + NUM_RESERVED_SPECIAL <= MODEL_VOCAB
    vocabulary = load_grammar_vocabulary(str(folder), MODEL_VOCAB, (tok.eos_token_id,))
    ids = tok.encode(TEXT)
    table = tok.token_bytes()
    # merged tokens, a merged run of Han characters, and every token ending on a character boundary
    assert any(len(table[t]) > 3 for t in ids) and "分词器".encode() in [table[t] for t in ids]
    assert all(table[t].decode() for t in ids)
    masks, reference = _masks(vocabulary, ids), _reference(tok, len(ids) + 1)
    for k, (got, want) in enumerate(zip(masks, reference)):
        assert torch.equal(got, want), (k, [table[t] if t < len(table) else t for t in (got ^ want).nonzero()])
    # partial characters are allowed where a character of the run can start, uppercase and digits never
    assert masks[0]["分".encode()[0]] and masks[0]["é".encode()[0]] and not masks[0]["é".encode()[1]]
    assert not masks[0][ord("Q")] and not masks[0][ord("1")] and not masks[0][tok.eos_token_id]


def test_swapped_ranks_give_other_masks(tmp_path, folder, ranks):
    """Twin: a folder where a merged lowercase token swaps ids with a merged token outside the run masks other
    ids."""
    tok = TiktokenTokenizer(str(folder))
    inside = next(t for t, r in ranks.items() if r >= 256 and _starts_a_run(t))
    outside = next(t for t, r in ranks.items() if r >= 256 and not _starts_a_run(t))
    swapped = {**ranks, inside: ranks[outside], outside: ranks[inside]}
    path = write_folder(tmp_path / "swapped", swapped, special_ids(len(ranks)), None, False)
    vocabulary = load_grammar_vocabulary(str(path), MODEL_VOCAB, (tok.eos_token_id,))
    got, want = _masks(vocabulary, [])[0], _reference(tok, 1)[0]
    assert (got ^ want).nonzero().flatten().tolist() == sorted([ranks[inside], ranks[outside]])


def test_a_folder_without_a_tokenizer_is_named(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json or tiktoken.model"):
        load_grammar_vocabulary(str(tmp_path), MODEL_VOCAB, (1,))


@pytest.fixture(scope="module")
def kimi_tiktoken_dir(tmp_path_factory, ranks):
    """The tiny Kimi-Linear checkpoint with its tokenizer replaced by a tiktoken folder (its EOS in the configs)."""
    src = tiny_model_dir("kimi_linear", vocab_size=MODEL_VOCAB)
    path = tmp_path_factory.mktemp("kimi_tiktoken")
    for name in ("model.safetensors", "config.json", "generation_config.json"):
        shutil.copy(src / name, path / name)
    write_folder(path, ranks, special_ids(len(ranks)), TEMPLATES["kimi_linear"], True)
    specials = {t: i for i, t in special_ids(len(ranks)).items()}
    for name in ("config.json", "generation_config.json"):
        config = json.loads((path / name).read_text())
        config.update(bos_token_id=specials["[BOS]"], eos_token_id=specials["<|im_end|>"])
        config.pop("pad_token_id", None)
        (path / name).write_text(json.dumps(config))
    return path


def _generate(engine, info, tok, grammar: str | None) -> tuple[str, str]:
    params = SamplingParams(temperature=0.0, max_tokens=60, grammar=grammar)
    msg = NewRequest("r", tok.encode("Pick a word"), params, list(tok.eos_token_ids), tokenizer_dir=info.model_dir)
    assert engine.add_request(msg) == []
    ids, reason = [], None
    while engine.has_work():
        for out in engine.step():
            if isinstance(out, TokenChunk):
                ids += out.token_ids
            elif isinstance(out, Finished):
                reason = out.reason
    # a free random model may write the padding ids past the tokenizer: they spell nothing
    return tok.decode([t for t in ids if t not in tok.eos_token_ids and t < len(tok.hf)]), reason


def _valid(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) and set(value) == {"word", "n"} and value["word"] in ("fox", "dog")


def test_kimi_tiktoken_checkpoint_decodes_to_its_grammar(kimi_tiktoken_dir):
    args, info = load_server_args(
        [], model_dir=str(kimi_tiktoken_dir), device="cpu", max_total_token_num=512, max_running_requests=2
    )
    tok = Tokenizer(info)
    assert isinstance(tok.hf, TiktokenTokenizer)
    engine = build_engine(args, info, "lightllm.server.runner_factory:create_runner")
    # built at start-up, with the EOS ids the front-end sends
    assert set(engine.grammars._tokenizers) == {(info.model_dir, tok.eos_token_ids)}
    text, reason = _generate(engine, info, tok, json_schema_grammar(SCHEMA))
    assert reason == "stop" and _valid(text), (reason, text)
    # twin: the random model without the grammar writes no such object
    text, _ = _generate(engine, info, tok, None)
    assert not _valid(text), text


def test_warm_grammars_takes_the_vocabulary_built_beside_the_runner():
    """The engine process builds the vocabulary on a thread while its runner starts: warm_grammars takes that one
    instead of loading the tokenizer again; one whose build failed is built again (the backend records why)."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    from lightllm.engine.grammar import GrammarBackend
    from lightllm.server.grammar_vocab import build_grammar_vocabulary, warm_grammars

    _, info = load_server_args([], model_dir=str(tiny_model_dir("qwen3_5")), device="cpu")
    loads = []

    def engine():
        def loader(*a):
            loads.append(a)
            return load_grammar_vocabulary(*a)

        return SimpleNamespace(grammars=GrammarBackend(info.vocab_size, loader))

    built, done = build_grammar_vocabulary(info), Future()
    done.set_result(built)
    warmed = engine()
    warm_grammars(warmed, info, "cpu", done)
    assert loads == [] and warmed.grammars._tokenizers == {(info.model_dir, built[0]): built[1]}
    # twin: a build that failed is done again where the backend records it
    failed = Future()
    failed.set_exception(ValueError("no vocabulary"))
    warm_grammars(engine(), info, "cpu", failed)
    assert len(loads) == 1 and loads[0][0] == info.model_dir


def _transformers_vocabulary(folder: str, n_vocab: int, eos: tuple[int, ...]):
    """The reference: llguidance's own construction from the transformers tokenizer of the folder."""
    import llguidance.hf
    from transformers import AutoTokenizer

    return llguidance.hf.from_tokenizer(AutoTokenizer.from_pretrained(folder), n_vocab=n_vocab, eos_token=list(eos))


def _token_table(vocabulary, n_vocab: int) -> list[tuple[bytes, bool]]:
    """What a grammar sees of each id: its bytes and whether it is special."""
    return [(vocabulary.decode_bytes([i]), vocabulary.is_special_token(i)) for i in range(n_vocab)]


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5", "qwen3_5_moe", "kimi_linear", "demo"])
def test_the_vocabulary_read_without_transformers_is_transformers(arch):
    from lightllm.server.demo_checkpoint import demo_model_dir
    from lightllm.server.grammar_vocab import tokenizer_eos_id
    from lightllm.server.model_info import read_model_info
    from lightllm.server.tokenizer import eos_token_ids

    folder = demo_model_dir() if arch == "demo" else str(tiny_model_dir(arch))
    info = read_model_info(folder)
    eos = eos_token_ids(info, tokenizer_eos_id(folder))
    assert eos == Tokenizer(info).eos_token_ids and len(eos) >= 1
    ours = load_grammar_vocabulary(folder, info.vocab_size, eos)
    reference = _transformers_vocabulary(folder, info.vocab_size, eos)
    assert _token_table(ours, info.vocab_size) == _token_table(reference, info.vocab_size)
    assert ours.tokenize_str(TEXT) == reference.tokenize_str(TEXT)


def test_added_tokens_only_the_config_lists_are_added_at_their_ids(tmp_path):
    """A tokenizer.json without the last added token (tokenizer_config.json still lists it): transformers adds it,
    and so does the vocabulary read without it; a read that skipped the config would not know the token."""
    from lightllm.server.model_info import read_model_info

    folder = tmp_path / "qwen3_5"
    shutil.copytree(tiny_model_dir("qwen3_5"), folder)
    spec = json.loads((folder / "tokenizer.json").read_text())
    dropped = spec["added_tokens"].pop()
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["added_tokens_decoder"][str(dropped["id"])]["content"] == dropped["content"]
    info = read_model_info(str(folder))
    ours = load_grammar_vocabulary(str(folder), info.vocab_size, (dropped["id"],))
    reference = _transformers_vocabulary(str(folder), info.vocab_size, (dropped["id"],))
    assert _token_table(ours, info.vocab_size) == _token_table(reference, info.vocab_size)
    assert ours.is_special_token(dropped["id"]) == dropped["special"]
    assert ours.decode_bytes([dropped["id"]]) == dropped["content"].encode()


def test_the_engine_builds_the_vocabulary_without_importing_transformers():
    """transformers' import is seconds of Python: in the engine process it would hold the GIL beside the runner's
    start-up. The twin: the front-end's tokenizer does import it (the check can fail)."""
    code = (
        "import sys\n"
        "from lightllm.server.grammar_vocab import build_grammar_vocabulary\n"
        "from lightllm.server.model_info import read_model_info\n"
        "info = read_model_info(sys.argv[1])\n"
        "build_grammar_vocabulary(info)\n"
        "print('transformers' in sys.modules)\n"
        "from lightllm.server.tokenizer import Tokenizer\n"
        "Tokenizer(info)\n"
        "print('transformers' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tiny_model_dir("qwen3_5"))], capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["False", "True"], out.stderr[-2000:]
