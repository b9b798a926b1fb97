"""llama-cpp-python as an Engine: one ``Llama`` per model, one worker thread, one queue.

llama.cpp's context holds one sequence here, so requests run one after another, in the order of
a priority queue (lower ``priority`` first, then arrival). Each request reuses the longest prefix
of its prompt that is still in the KV cache from the request before it; that count is reported as
``cached_tokens``. Sampling is ours (:mod:`.sampler`), so every knob means what it means on the
torch engine. A request asking for prompt logprobs has its whole prompt evaluated afresh, with
logits for every position (only those batches; the model keeps ``logits_all=False``).
"""

from __future__ import annotations

import asyncio
import ctypes
import heapq
import itertools
import logging
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Callable

import llama_cpp
import numpy as np

from router.bad_words import banned_tokens
from router.engine import (
    LOCAL_ENGINE_CAPABILITIES,
    EngineError,
    EngineRequest,
    EngineStep,
    TokenLogprobs,
    UnknownAdapter,
    finish_reason,
    submitted,
)

from .sampler import Sampler, token_logprobs
from .tokenizer import LlamaCppTokenizer

log = logging.getLogger("router.llamacpp")

# llama-cpp-python silences loading by pointing file descriptors 1 and 2 at /dev/null and back.
# Two loads at once interleave that dance and can leave stderr on /dev/null for good (every later
# log line lost), so loads take turns.
_LOAD_LOCK = threading.Lock()



@dataclass(eq=False)
class _Job:
    request: EngineRequest
    loop: asyncio.AbstractEventLoop
    deliver: Callable[[EngineStep | BaseException], None]
    cancelled: bool = False

    def emit(self, item: EngineStep | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.deliver, item)


class LlamaCppEngine:
    """Runs one GGUF model with llama.cpp on a dedicated thread."""

    def __init__(
        self,
        model_path: str,
        *,
        n_ctx: int,
        n_threads: int | None,
        n_threads_batch: int | None,
        n_batch: int,
        adapters: dict[str, Path] | None = None,
    ) -> None:
        with _LOAD_LOCK:
            self._llm = self._load(model_path, n_ctx, n_batch, n_threads, n_threads_batch)
        self._ctx = self._llm._ctx
        self._n_batch = n_batch
        self.tokenizer = LlamaCppTokenizer(self._llm)
        self.chat_template: str | None = self._llm.metadata.get("tokenizer.chat_template")
        self.max_model_len = self._llm.n_ctx()
        self.capabilities = LOCAL_ENGINE_CAPABILITIES | {"lora_adapters"}
        self._n_vocab = self._llm.n_vocab()
        self._cached: list[int] = []  # tokens whose KV is in the context, in order
        # What made them: the request's cache_salt and LoRA adapter (its load, not its name).
        self._made_by: tuple[str | None, int | None] = (None, None)
        # LoRA adapters: name -> (load number, llama.cpp's adapter). The worker sets a request's
        # on the context (``_applied``: the load set now) while holding ``_context``, which
        # loading and freeing take too.
        self._adapters: dict[str, tuple[int, object]] = {}  # the object: a ctypes pointer
        self._loads = itertools.count(1)
        self._applied: int | None = None
        self._context = threading.Lock()
        self._workdir = tempfile.TemporaryDirectory(prefix="router-lora-")
        self._heap: list[tuple[int, float, int, _Job]] = []
        self._order = itertools.count()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closing = False
        self.running: _Job | None = None
        try:
            for name, path in (adapters or {}).items():
                self._add_adapter(name, path)
        except BaseException:
            self._llm.close()
            self._workdir.cleanup()
            raise

    @staticmethod
    def _load(model_path: str, n_ctx: int, n_batch: int, n_threads: int | None, n_threads_batch: int | None) -> llama_cpp.Llama:
        return llama_cpp.Llama(
            model_path=model_path,
            n_ctx=n_ctx,
            n_batch=n_batch,
            n_ubatch=n_batch,
            n_threads=n_threads,
            n_threads_batch=n_threads_batch,
            logits_all=False,
            verbose=False,
        )

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        self._thread = threading.Thread(target=self._worker, name="llamacpp-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        with self._cv:
            self._closing = True
            for *_, job in self._heap:
                job.cancelled = True
            self._cv.notify_all()
        if self.running is not None:
            self.running.cancelled = True
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        with self._context:  # not under an adapter load (_add_adapter checks _closing)
            self._llm.close()  # frees the adapters with the model
        self._workdir.cleanup()

    def stats(self) -> dict[str, int]:
        waiting = sum(1 for *_, job in self._heap if not job.cancelled)
        return {"running": int(self.running is not None), "waiting": waiting}

    # --- asyncio side ---------------------------------------------------------------------

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineStep]:
        # Client gone or a stop string found: the thread drops it at its next step.
        return submitted(self.submit, request)

    def submit(self, request: EngineRequest, deliver: Callable[[EngineStep | BaseException], None]) -> Callable[[], None]:
        """:meth:`generate` without an iterator (see the torch engine's): ``deliver`` gets each
        step, or the exception that ends the request, on the calling event loop; the function
        returned aborts it."""
        if not request.prompt_ids:
            raise EngineError("the prompt is empty")
        job = _Job(request, asyncio.get_running_loop(), deliver)
        with self._cv:
            if self._closing:
                raise EngineError("the engine is shutting down")
            if request.adapter is not None and request.adapter not in self._adapters:
                raise UnknownAdapter(request.adapter)
            heapq.heappush(self._heap, (request.priority, request.arrival, next(self._order), job))
            self._cv.notify()

        def abort() -> None:
            job.cancelled = True

        return abort

    # --- worker thread --------------------------------------------------------------------

    def _worker(self) -> None:
        while True:
            with self._cv:
                while not self._heap and not self._closing:
                    self._cv.wait()
                if self._closing:
                    return
                *_, job = heapq.heappop(self._heap)
                if job.cancelled:
                    continue
                # Under the lock: remove_adapter counts the running request among its users.
                self.running = job
            try:
                with self._context:
                    self._run(job)
            except Exception as exc:  # noqa: BLE001 - reported to the request, engine lives on
                log.exception("request %s failed", job.request.request_id)
                self._cached = []
                job.emit(exc if isinstance(exc, EngineError) else EngineError(str(exc)))
            finally:
                self.running = None

    def _eval(self, tokens: list[int]) -> None:
        llm = self._llm
        llm.n_tokens = len(self._cached)
        llm.eval(tokens)
        self._cached.extend(tokens)

    def _eval_scored(self, tokens: list[int], following: list[int], k: int) -> list[TokenLogprobs]:
        """Evaluate one batch (at most ``n_batch`` tokens) as ``_eval`` does, but with a logits
        row for every token: row j scores ``following[j]``, the token after ``tokens[j]``.

        ``Llama.eval`` would only keep the last row (the model has ``logits_all=False``), so this
        is its loop body with ``logits_all=True`` for this batch alone; the rows are read before
        the next decode overwrites them.
        """
        llm = self._llm
        n_past = len(self._cached)
        n = len(tokens)
        assert 0 < n <= self._n_batch and len(following) == n
        self._ctx.kv_cache_seq_rm(-1, n_past, -1)
        llm._batch.set_batch(batch=tokens, n_past=n_past, logits_all=True)
        self._ctx.decode(llm._batch)
        # The bookkeeping Llama.eval does, so the Llama object agrees with the context.
        llm.input_ids[n_past : n_past + n] = tokens
        llm.n_tokens = n_past + n
        self._cached.extend(tokens)
        vocab = self.tokenizer.vocab_size
        scores = []
        for j, target in enumerate(following):
            row = np.ctypeslib.as_array(self._ctx.get_logits_ith(j), shape=(self._n_vocab,))
            scores.append(token_logprobs(row[:vocab], target, k, rank=True))
        return scores

    def _reusable(self, prompt: list[int], made_by: tuple[str | None, int | None]) -> int:
        """How many leading prompt tokens' KV to keep from the request before (see ``_run``):
        none for a request with another cache_salt or LoRA adapter than that request's."""
        if made_by != self._made_by:
            return 0
        keep = 0
        for a, b in zip(self._cached, prompt):
            if a != b:
                break
            keep += 1
        keep = min(keep, len(prompt) - 1)
        if keep > 0 and len(prompt) - 1 - keep == 1:
            keep -= 1  # never leave a lone token before the last one
        return keep

    def _run(self, job: _Job) -> None:
        req = job.request
        prompt = req.prompt_ids
        # llama.cpp computes a one-token batch differently from a token inside a larger batch
        # (logits differ by up to ~0.4 on SmolLM2), so the same request could answer differently
        # with and without a cache hit. To keep it deterministic: the prompt's last token is
        # always evaluated alone, everything before it in batches of two or more tokens, and only
        # KV computed that way (never generated tokens') is reused by later requests.
        # Prompt logprobs need a logits row at every prompt position, so such a request reuses
        # nothing; its batches are cut the same way, so it samples what it would without them.
        scored = req.prompt_logprobs is not None
        made_by = (req.cache_salt, self._apply_adapter(req.adapter))
        keep = 0 if scored else self._reusable(prompt, made_by)
        self._made_by = made_by
        if not self._ctx.kv_cache_seq_rm(-1, keep, -1):
            keep = 0
            self._ctx.kv_cache_seq_rm(-1, 0, -1)
        del self._cached[keep:]
        # With keep == 0, entry p scores prompt[p + 1] from the row of position p; it stays as
        # long as self._cached, so a position evaluated again is scored again.
        prompt_logprobs: list[TokenLogprobs] | None = [] if scored else None
        body = prompt[keep:-1]
        step = self._n_batch
        for i in range(0, len(body), step):
            if job.cancelled:
                return
            chunk = body[i : i + step]
            if len(chunk) == 1 and i > 0:
                # a lone remainder after a full batch: evaluate it with its predecessor instead
                self._ctx.kv_cache_seq_rm(-1, len(self._cached) - 1, -1)
                del self._cached[-1:]
                chunk = body[i - 1 : i + 1]
            if prompt_logprobs is None:
                self._eval(chunk)
            else:
                start = len(self._cached)
                del prompt_logprobs[start:]
                following = prompt[start + 1 : start + 1 + len(chunk)]
                prompt_logprobs += self._eval_scored(chunk, following, req.prompt_logprobs)
        if job.cancelled:
            return
        # The last token's row scores no prompt token (it is the first generated one's).
        self._eval(prompt[-1:])
        reusable = len(prompt)
        try:
            self._generate(job, keep, prompt_logprobs)
        finally:
            # Generated tokens were evaluated one by one: not reusable (see above).
            del self._cached[reusable:]

    def _apply_adapter(self, name: str | None) -> int | None:
        """Set the request's adapter (or none) on the context; its load number."""
        with self._cv:
            if name is not None and name not in self._adapters:
                raise UnknownAdapter(name)  # unloaded meanwhile: refused while queued, but be sure
            load, adapter = self._adapters[name] if name is not None else (None, None)
        if load != self._applied:
            _set_adapter(self._ctx.ctx, adapter)
            self._applied = load
        return load

    # --- LoRA adapters (capability ``lora_adapters``) ----------------------------------------

    async def add_adapter(self, name: str, path: Path) -> None:
        """Load a GGUF LoRA adapter file or a PEFT folder (:mod:`.lora`) and serve it as
        ``name``; raises :class:`backends.peft.AdapterError` naming what is wrong."""
        await asyncio.to_thread(self._add_adapter, name, path)

    async def remove_adapter(self, name: str) -> None:
        """Stop serving adapter ``name``; refused while a request waits or generates with it."""
        await asyncio.to_thread(self._remove_adapter, name)

    def _add_adapter(self, name: str, path: Path) -> None:
        from .lora import AdapterError, BaseModel, adapter_file

        if not hasattr(llama_cpp, "llama_set_adapters_lora"):
            raise AdapterError(f"LoRA adapter `{name}`: this llama-cpp-python ({llama_cpp.__version__}) is older "
                               "than the adapter API the llamacpp backend uses (llama_set_adapters_lora)")
        with self._cv:
            if name in self._adapters:
                raise AdapterError(f"LoRA adapter `{name}` is already loaded")
        file = adapter_file(name, path, BaseModel.from_metadata(self._llm.metadata), Path(self._workdir.name))
        with self._context:
            closing = self._closing  # stop() closes the model under this lock
            adapter = None if closing else llama_cpp.llama_adapter_lora_init(self._llm.model, str(file).encode())
        if file.parent == Path(self._workdir.name):
            file.unlink(missing_ok=True)  # llama.cpp holds the weights now
        if closing:
            raise EngineError("the engine is shutting down")
        if not adapter:
            raise AdapterError(f"LoRA adapter `{name}` ({path}): llama.cpp could not load it (its tensors do not fit "
                               "this base model)")
        with self._cv:
            self._adapters[name] = (next(self._loads), adapter)

    def _remove_adapter(self, name: str) -> None:
        from .lora import AdapterError

        with self._cv:
            if name not in self._adapters:
                raise AdapterError(f"LoRA adapter `{name}` is not loaded")
            jobs = [job for *_, job in self._heap] + ([self.running] if self.running is not None else [])
            users = sum(1 for job in jobs if job.request.adapter == name and not job.cancelled)
            if users:
                raise AdapterError(f"LoRA adapter `{name}` is serving {users} request(s); unload it once they end")
            load, adapter = self._adapters.pop(name)
        with self._context:  # no request runs: the context may drop it
            if self._applied == load:
                _set_adapter(self._ctx.ctx, None)
                self._applied = None
            llama_cpp.llama_adapter_lora_free(adapter)

    def _generate(self, job: _Job, keep: int, prompt_logprobs: list[TokenLogprobs] | None = None) -> None:
        """Sample until the request finishes; the first step carries ``keep`` as
        ``cached_tokens`` and ``prompt_logprobs`` when the request asked for them."""
        req = job.request
        prompt = req.prompt_ids
        tok = self.tokenizer
        sampler = Sampler(
            req.sampling,
            tok.vocab_size,
            prompt,
            min_tokens=req.min_tokens,
            suppress_until_min=tok.eos_token_ids | req.stop_token_ids,
        )
        only = None  # allowed_token_ids as a mask
        if req.sampling.allowed_token_ids is not None:
            only = np.zeros(tok.vocab_size, dtype=bool)
            only[list(req.sampling.allowed_token_ids)] = True
        first = True
        output: list[int] = []  # for bad_words, which look at what came before
        for n in range(1, req.max_tokens + 1):
            if job.cancelled:
                return
            logits = np.ctypeslib.as_array(self._ctx.get_logits_ith(-1), shape=(self._n_vocab,))
            allowed = req.constraint.allowed() if req.constraint is not None else only
            banned = banned_tokens(req.bad_words, output) if req.bad_words else frozenset()
            token, logprobs = sampler.sample(logits, allowed, banned)
            output.append(token)
            finish, stop_token = finish_reason(
                req, token, n, len(self._cached) + 1, self.max_model_len, tok.eos_token_ids
            )
            job.emit(
                EngineStep(
                    [token],
                    [logprobs] if logprobs is not None else None,
                    finish,
                    stop_token,
                    keep if first else None,
                    prompt_logprobs if first else None,
                )
            )
            first = False
            if finish is not None:
                return
            self._eval([token])


def _set_adapter(ctx: object, adapter: object | None) -> None:
    """Make ``adapter`` the context's only one, or leave it none. At scale 1: llama.cpp then
    scales by the file's ``alpha / r`` (1 in a converted PEFT folder, whose scale is in B)."""
    if adapter is None:
        done = llama_cpp.llama_set_adapters_lora(ctx, None, 0, None)
    else:
        adapters = (llama_cpp.llama_adapter_lora_p_ctypes * 1)(adapter)
        done = llama_cpp.llama_set_adapters_lora(ctx, adapters, 1, (ctypes.c_float * 1)(1.0))
    if done != 0:
        raise EngineError("llama.cpp could not set the LoRA adapter on its context")
