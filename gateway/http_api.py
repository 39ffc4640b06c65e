"""The OpenAI-compatible HTTP front: /v1/models, /v1/completions, /v1/chat/completions, /tokenize, /detokenize,
/health, /metrics.

It runs in the gateway's own event loop (uvicorn as a task) and turns each HTTP request into the same
GenerateRequest the gRPC API takes (gateway/http_requests.py), so both share validation, the scheduler and the
engines; here are the routes, the answers and their event streams.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from ddtree_serve.proto import gateway_pb2
from gateway.http_requests import (MAX_PROMPTS, ApiError, ChatCompletionRequest, CompletionRequest,
                                   DetokenizeRequest, GenerationRequest, TokenizeRequest, answer_calls,
                                   add_tools, api_error_for, chat_messages, check_body, generate_request, samples,
                                   stop_reason, tool_mode, wanted_logprobs)
from gateway.limits import MAX_CHARS_PER_TOKEN
from gateway.reasoning import END, ReasoningStream, split_reasoning, starts_in_reasoning
from gateway.tool_calls import CallDelta, HermesStream, RequiredCallsStream

log = logging.getLogger(__name__)

OPEN_PATHS = ("/health", "/metrics")  # no API key needed, as in vLLM: probes and scrapers
PROMPT_TAIL_TOKENS = 32   # the prompt's last tokens whose text says whether its answer starts inside reasoning


class HttpFront:
    """The FastAPI app and the uvicorn server that runs it inside the gateway's event loop."""

    def __init__(self, servicer, host: str, port: int, registry=None, api_key: str | None = None):
        self.servicer = servicer
        self.host, self.port = host, port
        self.registry = registry
        self.api_key = api_key or None
        self.created = int(time.time())
        self.app = self._build_app()
        self._server = None
        self._task: asyncio.Task | None = None

    # ---- lifecycle ----------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Binds and starts serving (raises when the port cannot be bound)."""
        import uvicorn

        class _Server(uvicorn.Server):
            # The gRPC host owns SIGTERM/SIGINT and stops us through stop(); uvicorn must not take the signals.
            @contextlib.contextmanager
            def capture_signals(self):
                yield

        # Streams still open at shutdown get 5 s (the gRPC side's grace), then are cut.
        config = uvicorn.Config(self.app, host=self.host, port=self.port, log_level="warning", access_log=False,
                                lifespan="off", timeout_graceful_shutdown=5)
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(), name="http-front")
        while not self._server.started:
            if self._task.done():  # bind failed: uvicorn logged why and exited
                raise RuntimeError(f"HTTP front could not start on {self.host}:{self.port}")
            await asyncio.sleep(0.05)
        log.info("OpenAI-compatible HTTP on http://%s:%d/v1", self.host, self.port)

    async def stop(self) -> None:
        """Stops accepting, lets running responses end (uvicorn's own grace), returns."""
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    # ---- helpers ------------------------------------------------------------------------------------------------
    @property
    def model_id(self) -> str:
        return getattr(self.servicer, "model_name", "") or "ddtree-serve"

    def _check_ready(self) -> None:
        if not self.servicer.ready.is_set():
            raise ApiError(503, "model is still loading", "service_unavailable", code="unavailable")

    def _check_model(self, model: str | None) -> None:
        if model and model != self.model_id:
            raise ApiError(404, f"The model `{model}` does not exist; this server serves `{self.model_id}`.",
                           "not_found_error", code="model_not_found", param="model")

    async def _finish_prompt(self, req: gateway_pb2.GenerateRequest, max_tokens: int | None) -> int:
        """Tokenizes the prompt once (as token ids from then on); fills the default max_tokens; returns its length."""
        ids = await self.servicer._prompt_ids(req)   # size-capped, tokenized off the event loop
        req.token_ids.ids[:] = ids
        if max_tokens is None and req.max_tokens <= 0:
            # like vLLM: no max_tokens means "up to the context limit"
            req.max_tokens = max(1, self.servicer.max_seq_len - len(ids))
        return len(ids)

    def _logprobs_json(self, chat: bool, token_ids: list[int], logprobs: list, offset: int = 0,
                       top: int | None = None) -> tuple[dict, int]:
        """Tokens' log-probs (TokenLogprob messages; at most `top` alternatives each) in OpenAI's shape -> (the
        choice's "logprobs", the text offset after them): chat's {"content": [{token, logprob, bytes,
        top_logprobs}]}, completions' {tokens, token_logprobs, top_logprobs, text_offset}; each token's text is its
        own decoding."""
        decode = self.servicer.tokenizer.decode
        pairs = list(zip(token_ids, logprobs))

        def entry(token_id: int, logprob: float) -> dict:
            text = decode([token_id])
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        if chat:
            return {"content": [{**entry(t, lp.logprob), "top_logprobs": [entry(i, v) for i, v in
                                                                          zip(lp.top_ids, lp.top_logprobs)]}
                                for t, lp in pairs]}, offset
        tokens, offsets = [], []
        for t, _ in pairs:
            tokens.append(decode([t]))
            offsets.append(offset)
            offset += len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": [lp.logprob for _, lp in pairs],
                "top_logprobs": [{decode([i]): v for i, v in list(zip(lp.top_ids, lp.top_logprobs))[:top]}
                                 for _, lp in pairs],
                "text_offset": offsets}, offset

    def _echo_logprobs_json(self, seq, prompt_logprobs: list, top: int) -> tuple[dict, int]:
        """The echoed prompt's tokens and log-probs in completions' shape, `top` alternatives each -> (that dict, the
        text offset after them): the first token has no log-prob (null, as OpenAI gives it)."""
        first = self.servicer.tokenizer.decode(seq.prompt_ids[:1])
        rest, end = self._logprobs_json(False, seq.prompt_ids[1:], prompt_logprobs, len(first), top)
        return {"tokens": [first] + rest["tokens"], "token_logprobs": [None] + rest["token_logprobs"],
                "top_logprobs": [None] + rest["top_logprobs"], "text_offset": [0] + rest["text_offset"]}, end

    def _prompt_logprobs_json(self, seq, prompt_logprobs: list, top: int) -> list:
        """vLLM's prompt_logprobs: null for the first prompt token, then per token {id: {logprob, rank,
        decoded_token}} for the token itself and its `top` likeliest alternatives (ranked 1..top)."""
        decode = self.servicer.tokenizer.decode
        out: list[dict | None] = [None]
        for token, lp in zip(seq.prompt_ids[1:], prompt_logprobs):
            entry = {str(token): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": decode([token])}}
            for rank, (i, v) in enumerate(list(zip(lp.top_ids, lp.top_logprobs))[:top], start=1):
                entry.setdefault(str(i), {"logprob": v, "rank": rank, "decoded_token": decode([i])})
            out.append(entry)
        return out

    @staticmethod
    def _ddtree_stats(seq) -> dict:
        s = seq.stats
        return {"mode": seq.mode if seq.drafting else "ar", "requested_mode": seq.mode, "budget": seq.budget,
                "drafter_fallback": not seq.drafting, "steps": s.steps, "accepted_tokens": s.accepted_tokens,
                "draft_tokens": s.draft_tokens, "mean_acceptance_length": round(s.mean_acceptance_length, 4),
                "ttft_seconds": round(seq.first_token_at - seq.arrival, 4) if seq.first_token_at else 0.0,
                "e2e_seconds": round(time.perf_counter() - seq.arrival, 4)}

    @staticmethod
    def _usage(seqs: list, n: int) -> dict:
        """Token counts of a request's sequences (n samples of each prompt, in order): each prompt once, every
        sample's completion."""
        prompt, completion = sum(len(s.prompt_ids) for s in seqs[::n]), sum(len(s.output_ids) for s in seqs)
        cached = sum(s.cached_tokens for s in seqs[::n])
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    async def _run(self, reqs: list[gateway_pb2.GenerateRequest], chat: bool, body: GenerationRequest,
                   echoes: list[str] | None = None, reasoning: bool | None = None) -> Any:
        """Answers one HTTP request of one prompt or several (body.n samples of each; choice p * n + i is prompt
        p's sample i, as vLLM numbers them): a JSON body, or server-sent events when body.stream. echoes: each
        prompt's text, which completions' echo puts before its answers (with the prompt's log-probs, if asked).
        reasoning: a chat answer's reasoning is split from its content (gateway/reasoning.py), the answer starting
        inside a reasoning block when True; None: no split."""
        gens = [self.servicer.stream(r) for req in reqs for r in samples(req, body.n)]
        echo = [e for e in echoes for _ in range(body.n)] if echoes is not None else None
        # Every sample admitted at once; validation errors surface here, before any byte is sent.
        firsts = await asyncio.gather(*(g.__anext__() for g in gens), return_exceptions=True)
        failed = next((f for f in firsts if isinstance(f, BaseException)), None)
        if failed is not None:
            for g in gens:
                await g.aclose()
            raise failed
        created = int(time.time())
        rid = ("chatcmpl-" if chat else "cmpl-") + firsts[0][0].request_id
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(self._sse(gens, firsts, rid, created, chat, include_usage, body, echo,
                                               wanted_logprobs(body) or 0, reasoning),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        tasks = [asyncio.ensure_future(_collect(g, f)) for g, f in zip(gens, firsts)]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:   # one sample failed, or the client left: the others are cancelled (caches freed)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        choices, seqs = [], []
        wanted_top = wanted_logprobs(body)
        wanted = wanted_top is not None
        prompt_scores = None
        for i, (seq, finish_reason, content, ids, logprobs) in enumerate(results):
            choice = {"index": i, "finish_reason": finish_reason, "stop_reason": stop_reason(seq, body),
                      "logprobs": self._logprobs_json(chat, ids, logprobs)[0] if wanted else None}
            if echo is not None:
                if wanted:
                    prompt_part, offset = self._echo_logprobs_json(seq, firsts[i][1].prompt_logprobs, wanted_top)
                    answer_part = self._logprobs_json(False, ids, logprobs, offset)[0]
                    choice["logprobs"] = {k: prompt_part[k] + answer_part[k] for k in prompt_part}
                content = echo[i] + content
            if chat:
                thought = None
                if reasoning is not None:
                    thought, content = split_reasoning(content, reasoning)
                content, calls = answer_calls(tool_mode(body), body, content or "")
                choice["message"] = {"role": "assistant", "content": content or (None if thought else content)}
                if thought is not None:   # vLLM's field, and its former name, which clients still read
                    choice["message"].update(reasoning=thought, reasoning_content=thought)
                if calls:
                    choice["message"]["tool_calls"] = [c.as_json() for c in calls]
                    choice["finish_reason"] = "tool_calls" if finish_reason == "stop" else finish_reason
            else:
                choice["text"] = content
            if body.prompt_logprobs is not None and (not chat or prompt_scores is None):
                # vLLM puts them in each completion choice, once in a chat answer
                prompt_scores = self._prompt_logprobs_json(seq, firsts[i][1].prompt_logprobs or [],
                                                           body.prompt_logprobs)
                if not chat:
                    choice["prompt_logprobs"] = prompt_scores
            if len(results) > 1:
                choice["ddtree"] = self._ddtree_stats(seq)
            choices.append(choice)
            seqs.append(seq)
        answer = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                  "model": self.model_id, "choices": choices, "usage": self._usage(seqs, body.n),
                  "ddtree": self._ddtree_stats(seqs[0])}
        if chat and prompt_scores is not None:
            answer["prompt_logprobs"] = prompt_scores
        return JSONResponse(answer)

    async def _sse(self, gens, firsts, rid: str, created: int, chat: bool, include_usage: bool, body: GenerationRequest,
                   echo: list[str] | None = None, echo_top: int = 0, reasoning: bool | None = None
                   ) -> AsyncIterator[str]:
        """The event stream: one chunk per engine emission of each sample (its index; with echo, the prompt's text
        first, with echo_top alternatives per token when log-probs were asked; reasoning as in _run, in the deltas'
        reasoning fields), each sample's finish reason, optional usage, then [DONE]."""
        obj = "chat.completion.chunk" if chat else "text_completion"
        # vLLM's continuous_usage_stats: every chunk carries its sample's token counts so far
        continuous = include_usage and bool((body.stream_options or {}).get("continuous_usage_stats"))
        sample_seqs = [first[0] for first in firsts]

        def chunk(index: int, text: str | None, finish_reason: str | None, role: bool = False,
                  logprobs: dict | None = None, tool_calls: list[dict] | None = None, thought: str = "") -> dict:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
                if thought:
                    delta.update(reasoning=thought, reasoning_content=thought)
                if tool_calls:
                    delta["tool_calls"] = tool_calls
                choice = {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}
            else:
                choice = {"index": index, "text": text or "", "finish_reason": finish_reason, "logprobs": logprobs}
            payload = {"id": rid, "object": obj, "created": created, "model": self.model_id, "choices": [choice]}
            if include_usage:
                payload["usage"] = self._usage([sample_seqs[index]], 1) if continuous else None
            return payload

        def line(payload: dict) -> str:
            return f"data: {json.dumps(payload)}\n\n"

        # One task per sample feeds a queue, so the samples' chunks go out as they come.
        events: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, gen, first) -> None:
            try:
                seq, event = first
                while True:
                    events.put_nowait((index, seq, event, None))
                    if event.finished:
                        return
                    seq, event = await gen.__anext__()
            except Exception as exc:  # noqa: BLE001 - handed to the stream, which reports it
                events.put_nowait((index, None, None, exc))

        pumps = [asyncio.create_task(pump(i, g, f)) for i, (g, f) in enumerate(zip(gens, firsts))]
        mode = tool_mode(body)
        splitters = [HermesStream() for _ in gens] if mode == "auto" else None
        named_begun: set[int] = set()   # samples whose named function call's head went out
        required = [RequiredCallsStream() for _ in gens]
        thinking = [ReasoningStream(reasoning) for _ in gens] if chat and reasoning is not None else None
        called: set[int] = set()   # samples that made tool calls

        def tool_split(index: int, text: str, finished: bool) -> tuple[str, list[dict]]:
            """The content to stream now and the tool-call pieces to send now, of one sample's new text."""
            if mode == "auto":
                content, deltas = splitters[index].feed(text, final=finished)
                return content, [d.as_json() for d in deltas]
            if mode == "forced" and isinstance(body.tool_choice, dict):
                # The answer is the named function's arguments: its head, then the arguments as they come
                if not text:
                    return "", []
                head = [] if index in named_begun else [CallDelta(0, "", body.tool_choice["function"]["name"])]
                named_begun.add(index)
                return "", [d.as_json() for d in head + [CallDelta(0, text)]]
            if mode == "forced":   # "required": the calls' array, each call streamed once its name is read
                return "", [d.as_json() for d in required[index].feed(text)]
            return text, []
        try:
            try:
                if chat:
                    for i in range(len(gens)):
                        yield line(chunk(i, None, None, role=True))
                finished: dict[int, Any] = {}
                offsets = [0] * len(gens)   # each sample's text so far, for completions' text_offset
                echoed: set[int] = set()    # samples whose prompt went out (echo)
                while len(finished) < len(gens):
                    index, seq, event, exc = await events.get()
                    if exc is not None:
                        raise exc
                    if echo is not None and index not in echoed:   # its first event: the prompt goes first
                        echoed.add(index)
                        prompt_part = None
                        if event.prompt_logprobs is not None:   # asked for with the answer's log-probs
                            prompt_part, offsets[index] = self._echo_logprobs_json(seq, event.prompt_logprobs,
                                                                                   echo_top)
                        yield line(chunk(index, echo[index], None, logprobs=prompt_part))
                    thought, text = ("", event.text) if thinking is None else \
                        thinking[index].feed(event.text, event.finished)
                    text, calls = tool_split(index, text, event.finished) if chat else (text, [])
                    if calls:
                        called.add(index)
                    if event.logprobs:   # a chunk for every token with a log-prob, text or not
                        logprobs, offsets[index] = self._logprobs_json(chat, event.token_ids, event.logprobs,
                                                                       offsets[index])
                        yield line(chunk(index, text, None, logprobs=logprobs, tool_calls=calls, thought=thought))
                    elif text or calls or thought:
                        yield line(chunk(index, text, None, tool_calls=calls, thought=thought))
                    if event.finished:
                        finished[index] = seq
                        reason = event.finish_reason
                        final = chunk(index, None, "tool_calls" if index in called and reason == "stop" else reason)
                        final["choices"][0]["stop_reason"] = stop_reason(seq, body)
                        final["ddtree"] = self._ddtree_stats(seq)
                        yield line(final)
                if include_usage:
                    seqs = [finished[i] for i in range(len(gens))]
                    yield line({"id": rid, "object": obj, "created": created, "model": self.model_id,
                                "choices": [], "usage": self._usage(seqs, body.n)})
            except Exception as exc:  # noqa: BLE001 - headers are sent: the error goes in the stream, as vLLM does
                err = api_error_for(exc)
                log.warning("stream %s failed: %s", rid, err.message)
                yield line(err.body())
            yield "data: [DONE]\n\n"
        finally:   # done, failed, or the client went away: unfinished samples are cancelled (their caches freed)
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            for g in gens:
                await g.aclose()

    # ---- the app ------------------------------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        app = FastAPI(title="ddtree-serve", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(ApiError)
        async def _api_error(_request: Request, exc: ApiError):
            return exc.response()

        @app.exception_handler(RequestValidationError)
        async def _validation_error(_request: Request, exc: RequestValidationError):
            first = exc.errors()[0] if exc.errors() else {}
            where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
            return ApiError(400, f"{where}: {first.get('msg', 'invalid request')}" if where else
                            str(first.get("msg", "invalid request")), param=where or None).response()

        @app.exception_handler(Exception)
        async def _any_error(_request: Request, exc: Exception):
            err = api_error_for(exc)
            if err.status >= 500:
                log.error("HTTP request failed: %s", err.message, exc_info=exc)
            return err.response()

        async def auth(request: Request) -> None:
            """Bearer API key on /v1/* when --api-key is set."""
            if not self.api_key:
                return
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
                raise ApiError(401, "Incorrect API key provided (send Authorization: Bearer <key>).",
                               "authentication_error", code="invalid_api_key")

        guarded = [Depends(auth)]

        @app.get("/health")
        async def health():
            """200 once every pair is connected, 503 before."""
            if not self.servicer.ready.is_set():
                return PlainTextResponse("loading", status_code=503)
            return PlainTextResponse("ok")

        @app.get("/version")
        async def version():
            """The server's version, as vLLM's /version answers it."""
            from ddtree_serve import __version__

            return {"version": __version__}

        @app.get("/metrics")
        async def metrics():
            """The gateway's Prometheus metrics (the same registry as --metrics-port)."""
            from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

            if self.registry is None:
                raise ApiError(404, "metrics are off", "not_found_error")
            return PlainTextResponse(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

        @app.get("/v1/models", dependencies=guarded)
        async def models():
            """The one model this gateway serves."""
            self._check_ready()
            info = self.servicer.pairs[0].target_info
            return {"object": "list", "data": [{
                "id": self.model_id, "object": "model", "created": self.created, "owned_by": "ddtree-serve",
                "max_model_len": info.max_seq_len, "root": self.model_id, "parent": None}]}

        @app.post("/v1/chat/completions", dependencies=guarded)
        async def chat_completions(body: ChatCompletionRequest):
            """Chat: the messages rendered with the model's chat template."""
            return await self._guard(self._chat(body))

        @app.post("/v1/completions", dependencies=guarded)
        async def completions(body: CompletionRequest):
            """Plain completion of a text prompt or of token ids."""
            return await self._guard(self._completion(body))

        @app.post("/tokenize", dependencies=guarded)
        async def tokenize(body: TokenizeRequest):
            """The prompt's token ids, as the completions endpoints would see them (vLLM's shape)."""
            return await self._guard(self._tokenize(body))

        @app.post("/detokenize", dependencies=guarded)
        async def detokenize(body: DetokenizeRequest):
            """Token ids back to text (vLLM's shape)."""
            return await self._guard(self._detokenize(body))

        return app

    async def _guard(self, coro):
        """Every failure becomes an OpenAI-shaped error response, never a traceback."""
        try:
            return await coro
        except ApiError as exc:
            return exc.response()
        except Exception as exc:  # noqa: BLE001 - validation ValueErrors, gRPC errors, bugs: all get a status
            err = api_error_for(exc)
            if err.status >= 500:
                log.error("HTTP request failed: %s", err.message, exc_info=exc)
            return err.response()

    async def _chat(self, body: ChatCompletionRequest):
        """Chat: the messages rendered with the model's chat template."""
        self._check_ready()
        self._check_model(body.model)
        check_body(body)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        req = generate_request(body, max_tokens, None)
        req.chat.CopyFrom(chat_messages(body.messages, body))
        add_tools(req, body)
        await self._finish_prompt(req, max_tokens)
        reasoning = None
        if self.servicer.cfg.reasoning_parser:
            tail = self.servicer.tokenizer.decode(list(req.token_ids.ids[-PROMPT_TAIL_TOKENS:]))
            reasoning = starts_in_reasoning(tail)
            if reasoning and req.HasField("guide"):   # as vLLM: free reasoning, the grammar from the end tag on
                req.guide.start_after[:] = self.servicer.tokenizer.encode(END, add_special_tokens=False)
        return await self._run([req], chat=True, body=body, reasoning=reasoning)

    async def _tokenize(self, body: TokenizeRequest):
        self._check_ready()
        self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give either prompt or messages", param="prompt")
        servicer = self.servicer
        if body.messages is not None:
            chat = chat_messages(body.messages, body)
            if body.tools:
                chat.tools_json = json.dumps(body.tools)
            ids = await servicer._chat_ids(chat)
        else:
            limit = servicer.max_seq_len * MAX_CHARS_PER_TOKEN
            if len(body.prompt) > limit:
                raise ApiError(400, f"prompt of {len(body.prompt)} characters is over the {limit}-character limit",
                               param="prompt")
            ids = await servicer._tokenize(servicer._encode, body.prompt, body.add_special_tokens)
        return {"count": len(ids), "max_model_len": servicer.max_seq_len, "tokens": ids}

    async def _detokenize(self, body: DetokenizeRequest):
        self._check_ready()
        self._check_model(body.model)
        vocab = self.servicer.pairs[0].target_info.vocab_size
        if len(body.tokens) > self.servicer.max_seq_len:
            raise ApiError(400, f"{len(body.tokens)} tokens; at most max_model_len ({self.servicer.max_seq_len})",
                           param="tokens")
        if any(not 0 <= t < vocab for t in body.tokens):
            raise ApiError(400, f"token ids must lie in [0, {vocab})", param="tokens")
        text = await self.servicer._tokenize(self.servicer.tokenizer.decode, body.tokens)
        return {"prompt": text}

    async def _completion(self, body: CompletionRequest):
        """Plain completion of a text prompt or of token ids."""
        self._check_ready()
        self._check_model(body.model)
        check_body(body)
        if body.suffix or (body.best_of or 1) != 1:
            raise ApiError(400, "suffix and best_of are not supported", param="suffix" if body.suffix else "best_of")
        prompts = body.prompt
        if not (isinstance(prompts, list) and prompts and isinstance(prompts[0], (str, list))):
            prompts = [prompts]   # one text, or one list of token ids
        if not 1 <= len(prompts) <= MAX_PROMPTS:
            raise ApiError(400, f"a batch of {len(prompts)} prompts; 1 to {MAX_PROMPTS} per request", param="prompt")
        reqs, echoes = [], []
        wanted = wanted_logprobs(body)
        for prompt in prompts:
            req = generate_request(body, body.max_tokens, 16)  # OpenAI's completions default
            if isinstance(prompt, str):
                req.text = prompt
            else:
                req.token_ids.ids.extend(prompt)
            await self._finish_prompt(req, body.max_tokens if body.max_tokens is not None else 16)
            if body.echo:
                # the prompt as given; token ids as their text
                echoes.append(prompt if isinstance(prompt, str) else self.servicer.tokenizer.decode(list(prompt)))
                if wanted is not None:
                    req.prompt_logprobs = True
                    req.prompt_top_logprobs = max(wanted, req.prompt_top_logprobs)
            reqs.append(req)
        return await self._run(reqs, chat=False, body=body, echoes=echoes if body.echo else None)


async def _collect(gen, first) -> tuple[Any, str, str, list[int], list]:
    """(the sequence, its finish reason, its whole text, its token ids, their log-probs if reported) of one
    sample's stream."""
    seq, event = first
    text, ids, logprobs = [event.text], list(event.token_ids), list(event.logprobs or [])
    async with contextlib.aclosing(gen):
        while not event.finished:
            seq, event = await gen.__anext__()
            text.append(event.text)
            ids.extend(event.token_ids)
            logprobs.extend(event.logprobs or [])
    return seq, event.finish_reason, "".join(text), ids, logprobs

