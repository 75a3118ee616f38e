"""A prefix-cache scenario for engines on tiny checkpoints: requests run one after another, so each sees what the
earlier ones cached, with hits at an interval checkpoint, between checkpoints, inside the first interval (a
learned branch point), at a prefill-chunk boundary, at a finished request's end (next turn) and on exact repeats;
and the helpers that compare such a run with a cold one (cache disabled)."""

from __future__ import annotations

import random

import numpy as np

from lightllm.engine.messages import NewRequest, TokenChunk
from lightllm.engine.sampling_params import SamplingParams
from lightllm.server.args import load_server_args
from lightllm.server.engine_process import build_engine
from lightllm.tools.make_tiny_model import tiny_model_dir

VOCAB = 512
INTERVAL = 16
CHUNK = 8


def make_engine(arch: str, mode: str, spec: dict, cache: bool = True, **flags):
    """An engine on the tiny `arch` checkpoint (CPU unless `flags` say otherwise), checkpoints every 16 tokens."""
    sizes = dict(device="cpu", max_running_requests=4, chunked_prefill_size=CHUNK, max_total_token_num=512)
    sizes.update(flags)
    if cache:
        sizes.setdefault("prefix_cache_state_bytes", 64 * 20_000)
    args, info = load_server_args(
        [],
        model_dir=str(tiny_model_dir(arch)),
        ssm_state_mode=mode,
        prefix_cache_checkpoint_interval=INTERVAL,
        disable_prefix_cache=not cache,
        **spec,
        **sizes,
    )
    return build_engine(args, info, "lightllm.server.runner_factory:create_runner")


class Result:
    def __init__(self):
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.cached: int | None = None
        self.reason: str | None = None


def submit(engine, req_id: str, prompt: list[int], max_tokens: int, cache_salt: str | None = None) -> None:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    assert engine.add_request(NewRequest(req_id, prompt, params, cache_salt=cache_salt)) == []


def drain(engine, results: dict[str, Result], abort_after: dict[str, int] | None = None) -> None:
    """Step until idle; `abort_after[req_id] = k` aborts that request after its k-th engine step with output."""
    abort_after = dict(abort_after or {})
    seen: dict[str, int] = {}

    def absorb(outputs) -> None:
        for o in outputs:
            res = results.get(getattr(o, "req_id", None))
            if res is None:
                continue
            if isinstance(o, TokenChunk):
                res.tokens += o.token_ids
                res.logprobs += o.logprobs
                if o.num_cached_tokens is not None:
                    res.cached = o.num_cached_tokens
                seen[o.req_id] = seen.get(o.req_id, 0) + 1
            elif hasattr(o, "reason"):
                res.reason = o.reason

    while engine.has_work():
        absorb(engine.step())
        for rid, k in list(abort_after.items()):
            if seen.get(rid, 0) >= k:
                absorb(engine.abort(rid))
                del abort_after[rid]


def preemption_prompts(rng: random.Random) -> list[list[int]]:
    """Three 36-token prompts that `run_preempting` admits together."""
    return [fresh(rng, 36) for _ in range(3)]


# KV for 128 tokens: three requests of 36 + 14 tokens cannot all run, so the latest admission is preempted; chunks
# of 16 put checkpoints at 16 and 32 along each prompt
PREEMPTION_FLAGS = dict(max_total_token_num=128, max_req_total_len=64, chunked_prefill_size=16)


def preemption_engine(cache: bool):
    """The preemption scenario's engine: replay with n-gram drafts (windows of 3) on the tiny Qwen3.5."""
    return make_engine("qwen3_5", "replay", {"spec_ngram": 2}, cache=cache, **PREEMPTION_FLAGS)


def run_preempting(engine, prompts: list[list[int]]) -> list[Result]:
    """The `preemption_prompts` submitted at once, 14 tokens each, run until idle; at least one was preempted."""
    res = {f"p{i}": Result() for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        submit(engine, f"p{i}", p, 14)
    drain(engine, res)
    assert engine.scheduler.num_preemptions > 0
    return [res[f"p{i}"] for i in range(len(prompts))]


def run_one_by_one(
    engine, prompts: list[list[int]], max_tokens: int, cache_salts: list[str | None] | None = None
) -> list[Result]:
    """Each request runs alone to its end before the next arrives, so it sees everything earlier ones cached (of
    its cache salt: `cache_salts[i]` for prompt i)."""
    out = []
    for i, prompt in enumerate(prompts):
        res = {f"q{i}": Result()}
        submit(engine, f"q{i}", prompt, max_tokens, cache_salts[i] if cache_salts else None)
        drain(engine, res)
        out.append(res[f"q{i}"])
    return out


def assert_same(hot: list[Result], cold: list[Result]) -> None:
    for i, (h, c) in enumerate(zip(hot, cold)):
        assert h.tokens == c.tokens, f"request {i}: tokens differ from the cold run"
        np.testing.assert_allclose(h.logprobs, c.logprobs, atol=1e-5, err_msg=f"request {i}: logprobs")


def fresh(rng: random.Random, n: int, avoid: int | None = None) -> list[int]:
    """`n` random token ids; the first differs from `avoid` (so a prompt branches exactly there)."""
    out = [rng.randrange(1, VOCAB) for _ in range(n)]
    while avoid is not None and out and out[0] == avoid:
        out[0] = rng.randrange(1, VOCAB)
    return out


MAX_TOKENS = 6


def scenario(seed: int) -> tuple[list[list[int]], list[int]]:
    """Prompts run one after another, and the tokens each is expected to resume (interval 16, chunks of 8)."""
    rng = random.Random(seed)
    base = fresh(rng, 40)
    return (
        [
            base,  # cold: checkpoints at 16 and 32 (interval), 39 (prefill end), 45 (end of prompt + output)
            base[:37] + fresh(rng, 5, base[37]),  # between checkpoints: resumes at 32 (and checkpoints its branch, 37)
            base[:10] + fresh(rng, 6, base[10]),  # inside the first interval: nothing yet; checkpoints the branch, 10
            base[:10] + fresh(rng, 8, base[10]),  # resumes at the learned branch point
            base[:24] + fresh(rng, 4, base[24]),  # at the interval checkpoint (a prefill-chunk boundary too)
            None,  # the next turn (first prompt + its output + new tokens): resumes at the first request's end but
            # its last output token (45 = 40 + 6 - 1; that token was sampled, never fed), prefilled with the new ones
            base,  # the first repeat: resumes before its last token (39) and feeds only that token
            base,  # again
            base[:5] + fresh(rng, 3, base[5]),  # a 5-token shared prefix: branch point 5 ...
            base[:5] + fresh(rng, 4, base[5]),  # ... then resumes there
        ],
        [0, 32, 0, 10, 16, 45, 39, 39, 0, 5],
    )


def run_scenario(engine, seed: int) -> list[Result]:
    prompts, _ = scenario(seed)
    results = run_one_by_one(engine, prompts[:5], MAX_TOKENS)
    follow_up = prompts[0] + results[0].tokens + fresh(random.Random(seed + 1), 3)
    results += run_one_by_one(engine, [follow_up], MAX_TOKENS)
    return results + run_one_by_one(engine, prompts[6:], MAX_TOKENS)


def staggered_prompts(rng: random.Random) -> list[list[int]]:
    """Six prompts sharing a 21-token system prompt, each with its own 3..11-token question."""
    system = fresh(rng, 21)
    return [system + fresh(rng, rng.randrange(3, 12)) for _ in range(6)]


def run_staggered(engine, prompts: list[list[int]], gap: int = 3, max_tokens: int = 8, group: int = 1) -> list[Result]:
    """Prompts arrive `group` at a time every `gap` engine steps, while the earlier ones decode: steps mix
    prefills (a cache hit's suffix, once the system prompt is cached) with the others' decode rows."""
    results = [Result() for _ in prompts]
    step = submitted = 0
    while submitted < len(prompts) or engine.has_work():
        while submitted < len(prompts) and step >= submitted // group * gap:
            submit(engine, f"s{submitted}", prompts[submitted], max_tokens)
            submitted += 1
        for out in engine.step():
            if isinstance(out, TokenChunk):
                res = results[int(out.req_id[1:])]
                res.tokens += out.token_ids
                res.logprobs += out.logprobs
                if out.num_cached_tokens is not None:
                    res.cached = out.num_cached_tokens
        step += 1
    return results
