"""`TiktokenTokenizer` (Kimi's tiktoken.model format) against a hand-rolled BPE over ranks trained in the test."""

from __future__ import annotations

import base64
import json
import random
import shutil
from collections import Counter
from pathlib import Path

import jinja2
import pytest
import regex

from lightllm.server.checkpoint_check import check_tokenizer
from lightllm.server.tiktoken_tokenizer import (
    KIMI_PATTERN,
    MAX_RUN_CHARS,
    NUM_RESERVED_SPECIAL,
    TiktokenTokenizer,
    is_tiktoken_folder,
    read_ranks,
    split_long_runs,
)
from lightllm.tools.tiny_model.chat_templates import TEMPLATES

CORPUS = (
    "The quick brown fox jumps over the lazy dog. It's 2026 and the dog's owner said: I'll be back!\n"
    "我们在学习分词器。分词器把文本切成词元。 Hello World, HELLO world, hello world.\n"
    "Numbers 1234567 and 89 and 3.14159; emojis 🙂🙂 and accents café naïve.\n\n  indented   text\ttabs\r\n"
)
SPECIALS = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>"]
TEXTS = [
    "Hello world, it's a test!",
    "我们在学习分词器 and the fox's 12345678 apples",
    "  leading spaces\n\n\ttabs\r\nand   trailing   ",
    "🙂 café naïve über ÆØÅ",
    "HELLOworld HelloWORLD abcDEF",
    "text with <|im_end|> and [BOS] specials inside<|im_user|>",
    "",
]


def train_ranks(corpus: str, num_merges: int) -> dict[bytes, int]:
    """Byte-level BPE ranks: the 256 bytes, then the most frequent adjacent pair of each round, merged."""
    words = Counter(tuple(bytes([b]) for b in w.encode()) for w in regex.findall(KIMI_PATTERN, corpus, regex.V1))
    ranks = {bytes([b]): b for b in range(256)}
    for _ in range(num_merges):
        pairs: Counter = Counter()
        for word, count in words.items():
            for a, b in zip(word, word[1:]):
                pairs[a, b] += count
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda item: (item[1], item[0]))
        ranks[a + b] = len(ranks)
        merged: Counter = Counter()
        for word, count in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += count
        words = merged
    return ranks


def reference_encode(text: str, ranks: dict[bytes, int], specials: dict[str, int]) -> list[int]:
    """Special tokens matched first (longest first), then Kimi's split, then lowest-rank-pair-first merging."""
    ids: list[int] = []
    special_re = regex.compile("|".join(regex.escape(s) for s in sorted(specials, key=len, reverse=True)))
    pos = 0
    for match in [*special_re.finditer(text), None]:
        end = match.start() if match else len(text)
        for word in regex.findall(KIMI_PATTERN, text[pos:end], regex.V1):
            parts = [bytes([b]) for b in word.encode()]
            while len(parts) > 1:
                best = min(range(len(parts) - 1), key=lambda i: ranks.get(parts[i] + parts[i + 1], float("inf")))
                if parts[best] + parts[best + 1] not in ranks:
                    break
                parts[best : best + 2] = [parts[best] + parts[best + 1]]
            ids.extend(ranks[p] for p in parts)
        if match:
            ids.append(specials[match.group()])
            pos = match.end()
    return ids


def write_folder(
    path: Path, ranks: dict[bytes, int], specials: dict[int, str], template: str | None, in_file: bool
) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    lines = [f"{base64.b64encode(token).decode()} {rank}" for token, rank in ranks.items()]
    random.Random(0).shuffle(lines)
    (path / "tiktoken.model").write_text("\n".join(lines) + "\n")
    config = {
        "added_tokens_decoder": {
            str(i): {"content": t, "special": t != "<|im_middle|>", "lstrip": False} for i, t in specials.items()
        },
        "bos_token": "[BOS]",
        "eos_token": "<|im_end|>",
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
    }
    if template is not None and in_file:
        (path / "chat_template.jinja").write_text(template)
    elif template is not None:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def ranks() -> dict[bytes, int]:
    return train_ranks(CORPUS, 120)


def special_ids(first: int) -> dict[int, str]:
    return {first + i: t for i, t in enumerate(SPECIALS)}


@pytest.fixture()
def folder(tmp_path, ranks) -> Path:
    return write_folder(tmp_path / "tok", ranks, special_ids(len(ranks)), TEMPLATES["kimi_linear"], True)


def test_kimi_pattern_splits_like_the_release():
    # Han runs apart from Latin, cased words whole with their contraction, digits by three, spaces before words
    text = "Hello世界123456 it's HELLOworld ABC  x\n\n"
    assert regex.findall(KIMI_PATTERN, text, regex.V1) == [
        "Hello",
        "世界",
        "123",
        "456",
        " it's",
        " HELLOworld",
        " ABC",
        " ",
        " x",
        "\n\n",
    ]


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_encode_matches_reference_and_round_trips(folder, ranks, text):
    tok = TiktokenTokenizer(str(folder))
    specials = {t: i for i, t in special_ids(len(ranks)).items()}
    ids = tok.encode(text)
    assert ids == reference_encode(text, ranks, specials)
    assert tok.decode(ids) == text


def test_encode_twin_with_changed_ranks_differs(tmp_path, ranks):
    """Swapping two merged tokens' ranks changes the merge order: the reference must then disagree."""
    merged = [t for t, r in ranks.items() if r >= 256]
    swapped = dict(ranks)
    swapped[merged[0]], swapped[merged[1]] = ranks[merged[1]], ranks[merged[0]]
    folder = write_folder(tmp_path / "swapped", swapped, special_ids(len(ranks)), None, False)
    tok = TiktokenTokenizer(str(folder))
    specials = {t: i for i, t in special_ids(len(ranks)).items()}
    assert tok.encode(CORPUS) != reference_encode(CORPUS, ranks, specials)


def test_special_tokens_ids_and_skipping(folder, ranks):
    tok = TiktokenTokenizer(str(folder))
    n = len(ranks)
    assert len(tok) == n + NUM_RESERVED_SPECIAL
    assert tok.eos_token_id == n + SPECIALS.index("<|im_end|>")
    assert tok.encode("<|im_end|>") == [tok.eos_token_id]
    # unnamed reserved ids decode as their placeholder name
    assert tok.decode([n + len(SPECIALS)]) == f"<|reserved_token_{n + len(SPECIALS)}|>"
    ids = tok.encode("[BOS]hi<|im_middle|>there<|im_end|>")
    # <|im_middle|> is marked "special": false, so it is kept
    assert tok.decode(ids, skip_special_tokens=True) == "hi<|im_middle|>there"
    assert tok.decode(ids) == "[BOS]hi<|im_middle|>there<|im_end|>"
    table = tok.token_bytes()
    assert table[ranks["é".encode()]] == "é".encode() and table[n] == b"[BOS]"


@pytest.mark.parametrize("in_file", [True, False], ids=["chat_template.jinja", "tokenizer_config"])
def test_chat_template_renders_like_jinja(tmp_path, ranks, in_file):
    template = TEMPLATES["kimi_linear"]
    folder = write_folder(tmp_path / "t", ranks, special_ids(len(ranks)), template, in_file)
    tok = TiktokenTokenizer(str(folder))
    messages = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]
    messages.append({"role": "user", "content": "分词器"})
    expected = jinja2.Environment().from_string(template).render(messages=messages, add_generation_prompt=True)
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert rendered == expected
    assert rendered.endswith("<|im_assistant|>assistant<|im_middle|>")
    specials = {t: i for i, t in special_ids(len(ranks)).items()}
    assert tok.encode(rendered) == reference_encode(expected, ranks, specials)
    assert tok.apply_chat_template(messages, add_generation_prompt=False) != rendered


def test_long_runs_are_cut_and_rejoin():
    text = "a" * (MAX_RUN_CHARS * 2 + 7) + " " * (MAX_RUN_CHARS + 3) + "tail"
    pieces = list(split_long_runs(text))
    assert "".join(pieces) == text and len(pieces) == 4
    longest = max(len(m) for p in pieces for m in regex.findall(r"\s+|\S+", p))
    assert longest == MAX_RUN_CHARS


def test_bad_files_are_refused(tmp_path, ranks):
    folder = write_folder(tmp_path / "bad", ranks, special_ids(len(ranks)), None, False)
    assert is_tiktoken_folder(str(folder))
    check_tokenizer(str(folder))
    with open(folder / "tiktoken.model", "a") as f:
        f.write("not-base64! 9999\n")
    with pytest.raises(ValueError, match=r"tiktoken.model line \d+: expected a base64 token"):
        check_tokenizer(str(folder))
    with pytest.raises(ValueError, match="appears twice"):
        (folder / "tiktoken.model").write_text("YQ== 0\nYQ== 1\n")
        read_ranks(str(folder / "tiktoken.model"))
    folder = write_folder(tmp_path / "clash", ranks, special_ids(len(ranks) - 1), None, False)
    with pytest.raises(ValueError, match="expected an id >= "):
        check_tokenizer(str(folder))


def test_ranks_missing_a_byte_or_with_a_gap_are_refused(tmp_path, ranks):
    """tiktoken panics (not an exception a server catches) on a text holding a byte without a rank, and reserved
    special ids would land on ranks past a gap: both refused when the folder is checked. The twin, the full ranks,
    encodes the byte as the reference does."""
    full = write_folder(tmp_path / "full", ranks, special_ids(len(ranks)), None, False)
    specials = {t: i for i, t in special_ids(len(ranks)).items()}
    assert TiktokenTokenizer(str(full)).encode("xyz{") == reference_encode("xyz{", ranks, specials)
    # the byte "{" renumbered past the last rank: every byte but one, no gap
    without = {t: r for t, r in ranks.items() if t != b"{"}
    without = {t: i for i, t in enumerate(sorted(without, key=without.get))}
    folder = write_folder(tmp_path / "no-brace", without, special_ids(len(without)), None, False)
    with pytest.raises(
        ValueError, match=r"tiktoken\.model: expected a rank for each of the 256 single bytes, found none for b'\{'$"
    ):
        check_tokenizer(str(folder))
    gapped = {t: r + (r >= 300) for t, r in ranks.items()}
    folder = write_folder(tmp_path / "gap", gapped, special_ids(len(ranks) + 1), None, False)
    with pytest.raises(
        ValueError, match=rf"expected ranks 0\.\.{len(ranks) - 1} without gaps, found no token of rank 300"
    ):
        check_tokenizer(str(folder))


def test_ids_past_the_vocabulary_decode_to_nothing(folder):
    """A checkpoint may pad its vocabulary past the tokenizer's (a padded row can be sampled): those ids decode to
    nothing, as a Hugging Face tokenizer decodes ids it does not have, instead of failing the request."""
    tok = TiktokenTokenizer(str(folder))
    words = tok.encode("Hello world, 我们")
    padded = [len(tok), *words[:2], len(tok) + 63, *words[2:], 10**6]
    assert tok.decode(padded) == tok.decode(words) == "Hello world, 我们"
    assert tok.decode(padded, skip_special_tokens=True) == "Hello world, 我们"
    # the twin: the last id of the vocabulary (a reserved special token) is the tokenizer's own and decodes
    last = len(tok) - 1
    assert tok.decode([*words, last]) == f"Hello world, 我们<|reserved_token_{last}|>"


def test_tiny_kimi_served_with_tiktoken_tokenizer(tmp_path, ranks):
    """A tiny Kimi-Linear checkpoint whose tokenizer.json is replaced by tiktoken.model: the same greedy tokens as
    with the original tokenizer on the same prompt ids, and text, prompts and chat as the reference encoder says.
    The folder's remote-code tokenizer must never be imported."""
    from lightllm import LLM, SamplingParams
    from lightllm.tools.make_tiny_model import tiny_model_dir

    num_ranks = len(ranks)
    vocab_size = num_ranks + NUM_RESERVED_SPECIAL
    original = tiny_model_dir("kimi_linear", vocab_size=vocab_size)
    folder = tmp_path / "kimi"
    shutil.copytree(original, folder)
    (folder / "tokenizer.json").unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    specials = {int(i): e["content"] for i, e in config["added_tokens_decoder"].items()}
    assert min(specials) >= num_ranks
    write_folder(folder, ranks, specials, None, False)
    marker = tmp_path / "remote_code_ran"
    (folder / "tokenization_kimi.py").write_text(f"open({str(marker)!r}, 'w').close()\n")

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompt = "The quick brown fox 我们在学习"
    by_name = {t: i for i, t in specials.items()}
    prompt_ids = reference_encode(prompt, ranks, by_name)
    reference_llm = LLM(str(original), device="cpu", max_total_token_num=1024)
    expected = reference_llm.generate([prompt_ids], params)[0].outputs[0].token_ids
    del reference_llm

    llm = LLM(str(folder), device="cpu", max_total_token_num=1024)
    out = llm.generate(prompt, params)[0]
    assert out.prompt_token_ids == prompt_ids
    assert out.outputs[0].token_ids == expected
    # special tokens are skipped in the text, except <|im_middle|> (marked "special": false by write_folder)
    by_rank = {r: t for t, r in ranks.items()}
    kept = {by_name["<|im_middle|>"]: b"<|im_middle|>"}
    decoded = b"".join(by_rank.get(i, kept.get(i, b"")) for i in expected)
    assert out.outputs[0].text == decoded.decode("utf-8", errors="replace")
    (chat,) = llm.chat([{"role": "user", "content": "Hello world"}], params)
    rendered = (
        jinja2.Environment()
        .from_string(TEMPLATES["kimi_linear"])
        .render(messages=[{"role": "user", "content": "Hello world"}], add_generation_prompt=True)
    )
    assert chat.prompt_token_ids == reference_encode(rendered, ranks, by_name)
    assert not marker.exists()
