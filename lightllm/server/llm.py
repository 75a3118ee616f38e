"""Offline API: the same engine, in this process, without HTTP.

from lightllm import LLM, SamplingParams
with LLM("path/to/checkpoint", ssm_state_mode="replay", mtp_step=2) as llm:
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
outs[0].outputs[0].text
"""

from __future__ import annotations

import gc
import uuid
import weakref
from dataclasses import dataclass, field

import msgspec

from lightllm.engine.messages import MAX_PRIORITY, MIN_PRIORITY, Finished, NewRequest, TokenChunk
from lightllm.engine.sampling_params import SamplingParams
from lightllm.server.args import load_server_args
from lightllm.server.collector import quiet_garbage_collector
from lightllm.server.engine_process import build_engine
from lightllm.server.http.schema_base import RequestError
from lightllm.server.http.structured import constrained, offline_grammar, opens_reasoning, reasoning_end
from lightllm.server.llm_lifecycle import ProcessSettings, release_engine
from lightllm.server.output import PromptLogprobs, SequenceOutput, default_length, prompt_problem
from lightllm.server.runner_factory import DEFAULT_RUNNER_FACTORY
from lightllm.server.token_fields import with_token_fields
from lightllm.server.tokenizer import Tokenizer, opening_problem


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    # "stop", "length", "abort" or "error"
    finish_reason: str | None
    # per token: (logprob, [(token_id, logprob), ...]) when SamplingParams.logprobs was set
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


@dataclass
class RequestOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    # prompt tokens resumed from the prefix cache instead of computed (for the prompt's first sequence)
    num_cached_tokens: int = 0
    # when SamplingParams.prompt_logprobs was set: per prompt token (logprob, [(token_id, logprob), ...]) given the
    # tokens before it; None for the first token
    prompt_logprobs: PromptLogprobs | None = None
    # and each prompt token's rank among the vocabulary there (1: the most likely; None for the first token)
    prompt_ranks: list[int | None] | None = None


class LLM:
    """`LLM(model_dir=None, **flags)`: every server flag is accepted under its name (see docs/server_args.md);
    without a model_dir the tiny demo checkpoint is used. `runner_factory` swaps the model runner (tests).

    `close()` (or leaving a `with LLM(...) as llm:` block, or the object being garbage-collected, or the
    interpreter exiting) releases the engine: device memory, CUDA graphs, and with `tp > 1` the follower
    processes and the process group. Another `LLM` can then start in the same process. While an engine on a GPU
    lives, this process runs torch on one intra-op thread and its garbage collector with higher thresholds (see
    `lightllm.server.engine_process`); closing puts both back.

    `generate` and `chat` without SamplingParams sample with `default_sampling_params()`: the checkpoint's
    generation-config defaults (`--generation_config`), as the HTTP server does for a request that sets nothing."""

    def __init__(self, model_dir: str | None = None, *, runner_factory: str = DEFAULT_RUNNER_FACTORY, **flags):
        self.args, self.info = load_server_args([], model_dir=model_dir, **flags)
        self.tokenizer = Tokenizer(self.info)
        settings = ProcessSettings()
        # an earlier LLM's engine that someone's reference kept past its close is cyclic garbage by now: collect it
        # before this one loads weights and sizes its KV cache from the device's free memory
        gc.collect()
        self.engine = build_engine(self.args, self.info, runner_factory)
        # runs once: at close(), when this object is collected, or at interpreter exit (before torch tears down)
        self._release = weakref.finalize(self, release_engine, self.engine, settings)
        # token chunks of unfinished sequences whose text is built at finish (see `_absorb`)
        self._buffered: dict[str, list[TokenChunk]] = {}
        quiet_garbage_collector()

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams carrying the model's sampling defaults (`--generation_config`), the rest OpenAI's."""
        return SamplingParams(**dict(self.info.sampling_defaults))

    def close(self) -> None:
        """Release the engine (idempotent); `generate` and `chat` refuse to run afterwards."""
        self._release()
        self.engine = None
        self._buffered.clear()

    @property
    def closed(self) -> bool:
        return not self._release.alive

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def generate(
        self,
        prompts: str | list[str] | list[int] | list[list[int]],
        sampling_params: SamplingParams | None = None,
        priority: list[int] | None = None,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt (text or token ids), each with `params.n` outputs, in prompt order.
        `priority`: one per prompt, lower admitted first (with `scheduling_policy="priority"`, as vLLM's).
        `cache_salt`: these prompts share cached prefixes only with requests of the same salt (vLLM's)."""
        return self._generate(prompts, sampling_params, priority=priority, cache_salt=cache_salt)

    def _generate(
        self,
        prompts,
        sampling_params: SamplingParams | None,
        checkpoint_hints: list[int] = (),
        chat: bool = False,
        priority: list[int] | None = None,
        cache_salt: str | None = None,
    ):
        """`generate`; `checkpoint_hints[p]`: a position of prompt p worth a prefix-cache checkpoint (0: none);
        `chat`: the prompts are rendered conversations (a grammar starts after a reasoning block they open)."""
        if self.closed:
            raise RuntimeError("this LLM is closed; create a new one")
        params = sampling_params or self.default_sampling_params()
        # the model's answer length, as a default, is clipped to each prompt's room as over HTTP
        answer_length = dict(self.info.sampling_defaults).get("max_tokens") if sampling_params is None else None
        if answer_length is not None:
            params = msgspec.structs.replace(params, max_tokens=None)
        # params may have been changed since they were built: checked again before anything reads them
        params.validate()
        params = with_token_fields(self._compile_constraint(params), self.tokenizer)
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        priority = self._priorities(priority, len(prompts))
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError("cache_salt: a non-empty string")
        results: list[RequestOutput] = []
        prompt_params: list[SamplingParams] = []
        seqs: dict[str, SequenceOutput] = {}
        for prompt in prompts:
            text = prompt if isinstance(prompt, str) else None
            ids = self.tokenizer.encode(prompt) if text is not None else list(prompt)
            problem = prompt_problem(ids, params, self.info.vocab_size, self.args.max_req_total_len)
            if problem is not None:
                raise ValueError(f"{problem[1]}: {problem[0]}")
            results.append(RequestOutput(text, ids))
            prompt_params.append(default_length(ids, params, answer_length, self.args.max_req_total_len))
        starts = [self._grammar_start(params, r.prompt_token_ids) if chat else None for r in results]
        base = uuid.uuid4().hex
        for p, result in enumerate(results):
            for j in range(params.n):
                # the prompt is scored once, by its first sequence
                sub = msgspec.structs.replace(
                    prompt_params[p],
                    n=1,
                    seed=None if params.seed is None else params.seed + j,
                    prompt_logprobs=params.prompt_logprobs if j == 0 else None,
                    grammar_start_token=starts[p] if starts[p] is not None else params.grammar_start_token,
                )
                req_id = f"{base}-{p}-{j}"
                seqs[req_id] = SequenceOutput(self.tokenizer, sub, self.tokenizer.eos_token_ids)
                self._absorb(
                    self.engine.add_request(
                        NewRequest(
                            req_id,
                            result.prompt_token_ids,
                            sub,
                            list(self.tokenizer.eos_token_ids),
                            [checkpoint_hints[p]] if p < len(checkpoint_hints) and checkpoint_hints[p] else [],
                            # a grammar (SamplingParams.grammar) is matched against this checkpoint's vocabulary
                            tokenizer_dir=self.info.model_dir if sub.grammar is not None else "",
                            priority=priority[p],
                            cache_salt=cache_salt,
                        )
                    ),
                    seqs,
                )
        # until idle: the last step's prefix-cache publishes run in one more step
        while any(not s.finished for s in seqs.values()) or self.engine.has_work():
            self._absorb(self.engine.step(), seqs)
        for p, result in enumerate(results):
            result.num_cached_tokens = seqs[f"{base}-{p}-0"].num_cached_tokens
            if params.prompt_logprobs is not None:
                result.prompt_logprobs = seqs[f"{base}-{p}-0"].prompt_logprobs
                result.prompt_ranks = seqs[f"{base}-{p}-0"].prompt_ranks
            for j in range(params.n):
                out = seqs[f"{base}-{p}-{j}"]
                logprobs = out.logprobs if params.logprobs is not None else None
                result.outputs.append(CompletionOutput(j, out.text, out.token_ids, out.finish_reason, logprobs))
        return results

    def _priorities(self, priority: list[int] | None, num_prompts: int) -> list[int]:
        """One priority per prompt (0 without any); ValueError for a list of another length, or for non-zero
        priorities when the engine schedules in arrival order."""
        if priority is None:
            return [0] * num_prompts
        if not isinstance(priority, list) or len(priority) != num_prompts:
            raise ValueError(f"priority: give one integer per prompt ({num_prompts})")
        if any(not isinstance(v, int) or not MIN_PRIORITY <= v <= MAX_PRIORITY for v in priority):
            raise ValueError(f"priority: integers in [{MIN_PRIORITY}, {MAX_PRIORITY}]")
        if any(priority) and self.args.scheduling_policy != "priority":
            raise ValueError(
                'priority: this LLM schedules in arrival order; create it with scheduling_policy="priority"'
            )
        return priority

    def _compile_constraint(self, params: SamplingParams) -> SamplingParams:
        """`params.structured_outputs` compiled into the grammar the engine applies (ValueError naming the
        constraint when it does not compile or cannot apply)."""
        if params.structured_outputs is None:
            return params
        try:
            grammar = offline_grammar(params.structured_outputs, self.tokenizer.whole_tokens)
            return constrained(msgspec.structs.replace(params, structured_outputs=None), grammar)
        except RequestError as exc:
            raise ValueError(str(exc)) from None

    def _grammar_start(self, params: SamplingParams, prompt_ids: list[int]) -> int | None:
        """A rendered conversation that opens a reasoning block keeps the block free of the grammar."""
        if params.grammar is None or not opens_reasoning(self.tokenizer, prompt_ids):
            return None
        try:
            return reasoning_end(self.tokenizer)
        except RequestError as exc:
            raise ValueError(str(exc)) from None

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation (one, or a list of them) with the checkpoint's chat template and generate the
        assistant's reply: one RequestOutput per conversation, as vLLM's `LLM.chat`. `continue_final_message`
        (with `add_generation_prompt=False`) continues the final assistant message instead of opening a new turn;
        `chat_template_kwargs` and `tools` reach the template; `cache_salt` as in `generate`."""
        if self.closed:
            raise RuntimeError("this LLM is closed; create a new one")
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        if continue_final_message and sampling_params is not None and sampling_params.structured_outputs is not None:
            # a grammar constrains a whole reply, not the rest of one already begun
            raise ValueError("continue_final_message: cannot be combined with structured_outputs")
        kwargs = dict(chat_template_kwargs or {}, **({"tools": tools} if tools else {}))
        prompts, hints = [], []
        for conversation in conversations:
            if not conversation:
                raise ValueError("messages: a conversation needs at least one message")
            problem = opening_problem(add_generation_prompt, continue_final_message, conversation[-1].get("role"))
            if problem is not None:
                raise ValueError(problem)
            ids = self.tokenizer.encode_rendered(
                self.tokenizer.render_chat(
                    conversation,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    **kwargs,
                )
            )
            prompts.append(ids)
            # the conversation without the opened turn is where the next turn's prompt parts from this one
            hints.append(self.tokenizer.history_len(conversation, ids, **kwargs) if add_generation_prompt else 0)
        return self._generate(prompts, sampling_params, hints, chat=True, cache_salt=cache_salt)

    def _absorb(self, outputs, seqs: dict[str, SequenceOutput]) -> None:
        """Feed engine outputs to their sequences. Tokens of a sequence without stop strings are only buffered
        until it finishes (nothing needs its text before then), keeping detokenization out of the step loop."""
        for out in outputs:
            seq = seqs.get(getattr(out, "req_id", None))
            if seq is None or seq.finished:
                continue
            if isinstance(out, TokenChunk):
                if not seq.params.stop:
                    self._buffered.setdefault(out.req_id, []).append(out)
                    continue
                seq.on_tokens(out)
                if seq.stop_string_hit:
                    # the engine's own Finished("abort") for it is ignored: the sequence already ended on "stop"
                    self.engine.abort(out.req_id)
            elif isinstance(out, Finished):
                for chunk in self._buffered.pop(out.req_id, []):
                    seq.on_tokens(chunk)
                seq.on_finished(out)
