"""Front-end request handling shared by the OpenAI routes: validation, fan-out to engine requests, streaming of
per-sequence deltas, aborts on stop strings and client disconnects."""

from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import Executor
from dataclasses import dataclass

import jinja2
import msgspec

from lightllm.engine.messages import NewRequest, TokenChunk
from lightllm.engine.sampling_params import SamplingParams
from lightllm.server.args import ServerArgs
from lightllm.server.http.edge import ON_FINISH, REQUEST_SCOPE
from lightllm.server.http.engine_client import EngineClient
from lightllm.server.http.metrics import Metrics
from lightllm.server.model_info import ModelInfo
from lightllm.server.output import Delta, SequenceOutput, prompt_problem
from lightllm.server.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
# what a 429 tells the client to wait before retrying, seconds
RETRY_AFTER_S = 1
# scope key: the sequences a request holds room for
CLAIMED = "lightllm.claimed_sequences"


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was complete; its sequences have been aborted."""


# put on a request's queue by its disconnect watcher
_DISCONNECTED = object()


class ApiError(Exception):
    """A request problem reported as an OpenAI-style error body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers = headers


@dataclass
class Sequence:
    """One generated sequence of an HTTP request: prompt index × n."""

    index: int
    prompt_index: int
    req_id: str
    output: SequenceOutput


class PromptTooLong(ApiError):
    """A prompt with more characters than `max_req_total_len` tokens can hold (known before tokenizing it)."""


class Frontend:
    def __init__(
        self,
        args: ServerArgs,
        info: ModelInfo,
        tokenizer: Tokenizer,
        client: EngineClient,
        metrics: Metrics,
        engine_alive=lambda: True,
        pool: Executor | None = None,
    ):
        self.args, self.info, self.tokenizer, self.client, self.metrics = args, info, tokenizer, client, metrics
        self.engine_alive = engine_alive
        # tokenizing and template rendering run here, off the event loop (None: inline, for tests of pure logic)
        self.pool = pool
        self.max_prompt_chars = tokenizer.max_chars(args.max_req_total_len)
        # the model's values for the sampling knobs a request leaves out
        self.sampling_defaults = dict(info.sampling_defaults)
        # sequences that HTTP requests hold room for, from their capacity check until their response is over (a
        # stream's sequences are submitted only once its response starts: counting submissions would let every
        # concurrent stream pass the check)
        self.num_claimed = 0

    def check_engine(self) -> None:
        if not self.engine_alive():
            raise ApiError(503, "the engine process is not running", kind="server_error")

    def check_priority(self, priority: int) -> None:
        """A request may set a priority only where the operator lets requests jump the queue."""
        if priority and self.args.scheduling_policy != "priority":
            raise ApiError(
                400, "priority: this server schedules in arrival order (--scheduling_policy fcfs)", "priority"
            )

    def check_model(self, model: str) -> None:
        if model != self.args.served_model_name:
            raise ApiError(400, f"model {model!r} is not served here; use {self.args.served_model_name!r}", "model")

    async def offload(self, fn, *args, **kwargs):
        """Run CPU-bound text work in the pool: the Rust tokenizer releases the GIL there, and pure-Python work
        (jinja) is preempted every switch interval, so the event loop keeps answering other clients."""
        call = functools.partial(fn, *args, **kwargs)
        if self.pool is None:
            return call()
        return await asyncio.get_running_loop().run_in_executor(self.pool, call)

    def check_chars(self, text: str, param: str) -> None:
        if len(text) > self.max_prompt_chars:
            raise PromptTooLong(
                400,
                f"the prompt has {len(text)} characters; no more than {self.max_prompt_chars} can fit in "
                f"max_req_total_len ({self.args.max_req_total_len}) tokens",
                param,
            )

    async def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """`text`'s ids; `add_special_tokens`: with the markers the tokenizer adds around a text (a BOS, ...)."""
        self.check_chars(text, param)
        return await self.offload(self._encoder(add_special_tokens), text)

    def _encoder(self, add_special_tokens: bool):
        return self.tokenizer.encode if add_special_tokens else self.tokenizer.encode_rendered

    async def encode_chat(
        self,
        messages: list[dict],
        chat_template: str | None,
        template_kwargs: dict,
        add_special_tokens: bool = False,
        **opening,
    ) -> list[int]:
        """Render and encode a conversation; `opening`: `Tokenizer.render_chat`'s add_generation_prompt /
        continue_final_message. The template writes the markers it wants: `add_special_tokens` adds the tokenizer's
        own around the rendering too (vLLM's field of that name)."""
        if chat_template is not None:
            if not self.args.trust_request_chat_template:
                raise ApiError(
                    400,
                    "chat_template: client chat templates are refused (they run inside the server); the server's "
                    "operator can allow them with --trust_request_chat_template",
                    "chat_template",
                )
        elif not self.tokenizer.has_chat_template:
            raise ApiError(400, "this model has no chat template; use /v1/completions", "messages")
        try:
            prompt = await self.offload(
                self.tokenizer.render_chat, messages, chat_template, **opening, **template_kwargs
            )
        except jinja2.TemplateError as exc:
            # the template's own complaint (e.g. raise_exception("roles must alternate")) is meant for the client
            raise ApiError(400, f"the chat template could not render these messages: {exc}", "messages") from None
        except Exception as exc:
            if opening.get("continue_final_message") and "continue_final_message" in str(exc):
                # transformers found no final message to leave open in the rendering: the client's to fix
                raise ApiError(
                    400,
                    "continue_final_message: the chat template does not write the final message as sent (it rewrites "
                    "or drops part of it), so it cannot be continued",
                    "continue_final_message",
                ) from None
            logger.exception("chat template rendering failed")
            raise ApiError(400, "the chat template could not render these messages", "messages") from None
        self.check_chars(prompt, "messages")
        return await self.offload(self._encoder(add_special_tokens), prompt)

    async def chat_history_len(
        self, messages: list[dict], chat_template: str | None, template_kwargs: dict, prompt_ids: list[int]
    ) -> int:
        """Prompt tokens of the conversation before the opened assistant turn (a prefix-cache checkpoint hint);
        0 when the template does not render it as a prefix. Call after `encode_chat` accepted the messages."""
        try:
            return await self.offload(
                self.tokenizer.history_len, messages, prompt_ids, chat_template, **template_kwargs
            )
        except Exception:
            # only a hint: a template that renders no conversation without the opened turn gets none
            return 0

    def check_capacity(self, num_seqs: int, param: str) -> None:
        """Refuse a request asking for too many sequences (400) or arriving when the wait queue is full (429).
        The room is held for the HTTP request being served until its response is over (checking again holds no
        more)."""
        cap = self.args.max_sequences_per_request
        if num_seqs > cap:
            raise ApiError(
                400, f"this request asks for {num_seqs} sequences (prompts x n); at most {cap} are allowed", param
            )
        limit = self.args.max_running_requests + self.args.max_queue_len
        scope = REQUEST_SCOPE.get()
        held = scope.get(CLAIMED, 0) if scope is not None else 0
        # with several front-end processes the limit is the server's: theirs count too (as they last wrote them)
        in_flight = max(self.client.num_in_flight, self.num_claimed) + self.metrics.in_flight_elsewhere()
        if in_flight - held + num_seqs > limit:
            raise ApiError(
                429,
                f"the server is at capacity ({in_flight} sequences in flight, room for {limit}); "
                f"retry in {RETRY_AFTER_S} s",
                kind="rate_limit_error",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        if scope is not None and num_seqs > held:
            if not held:
                scope.setdefault(ON_FINISH, []).append(lambda: self._unclaim(scope))
            self.num_claimed += num_seqs - held
            scope[CLAIMED] = num_seqs

    def _unclaim(self, scope: dict) -> None:
        self.num_claimed -= scope.pop(CLAIMED, 0)

    def check_prompt(self, ids: list[int], params: SamplingParams, param: str) -> None:
        problem = prompt_problem(ids, params, self.info.vocab_size, self.args.max_req_total_len)
        if problem is not None:
            message, field = problem
            raise ApiError(400, message, param if field == "prompt" else field)

    async def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        request=None,
        checkpoint_hints: list[int] = (),
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[tuple[Sequence, Delta]]:
        """Run `params.n` sequences per prompt; yields (sequence, delta) as tokens arrive, in arrival order.
        `params.prompt_logprobs` goes to each prompt's first sequence only (sequence index a multiple of n): the
        prompt is scored once. `priority`: the scheduler's (lower first), checked by `check_priority`. `cache_salt`:
        the prefix-cache namespace's (`NewRequest.cache_salt`)."""
        base = uuid.uuid4().hex
        queue: asyncio.Queue = asyncio.Queue()
        seqs: dict[str, Sequence] = {}
        # submitted and not finished; everything left here at exit is aborted
        pending: set[str] = set()
        watcher = None if request is None else asyncio.create_task(_watch_disconnect(request, queue))
        try:
            for p, ids in enumerate(prompts):
                for j in range(params.n):
                    index = p * params.n + j
                    # n sequences from one seed must differ, and stay reproducible
                    sub = msgspec.structs.replace(
                        params,
                        n=1,
                        seed=None if params.seed is None else params.seed + j,
                        prompt_logprobs=params.prompt_logprobs if j == 0 else None,
                    )
                    output = SequenceOutput(self.tokenizer, sub, self.tokenizer.eos_token_ids)
                    seq = seqs[f"{base}-{index}"] = Sequence(index, p, f"{base}-{index}", output)
                    self.metrics.on_submit(seq.req_id)
                    pending.add(seq.req_id)
                    msg = NewRequest(
                        seq.req_id,
                        ids,
                        sub,
                        list(self.tokenizer.eos_token_ids),
                        list(checkpoint_hints),
                        # a grammar is matched against this checkpoint's vocabulary
                        tokenizer_dir=self.info.model_dir if sub.grammar is not None else "",
                        priority=priority,
                        cache_salt=cache_salt,
                    )
                    await self.client.submit(msg, queue)
            while pending:
                msg = await queue.get()
                if msg is _DISCONNECTED:
                    raise ClientDisconnected()
                seq = seqs[msg.req_id]
                out = seq.output
                delta = out.on_tokens(msg) if isinstance(msg, TokenChunk) else out.on_finished(msg)
                if out.finished:
                    pending.discard(seq.req_id)
                    self.client.release(seq.req_id)
                    if out.stop_string_hit:
                        self.client.abort(seq.req_id)
                    self.metrics.count_finished(out.finish_reason)
                yield seq, delta
        finally:
            if watcher is not None:
                watcher.cancel()
            # the client went away (or the handler failed): every unfinished sequence gives its slot back
            # no await here: a cancelled handler may be cancelled again at any await, skipping the rest
            for req_id in pending:
                self.client.abort(req_id)
                self.client.release(req_id)
                self.metrics.count_finished("abort")


async def _watch_disconnect(request, queue: asyncio.Queue) -> None:
    """Wake the request's consumer when the client disconnects. A blocking receive sees the disconnect however
    the ASGI stack wraps `receive` (a zero-timeout poll can miss it); the body was read before the handler ran,
    so nothing else is waiting for these messages."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    queue.put_nowait(_DISCONNECTED)
