"""The torch engine: a scheduler loop on its own thread, talking to asyncio through queues.

``generate`` hands a sequence to the engine thread and streams back its steps. Every loop
iteration takes in new and aborted sequences, schedules one step (continuous batching), runs it,
and posts every sequence's new token back to the event loop in one call. Closing a ``generate``
iterator aborts its sequence: its KV blocks are freed before the next step.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Callable

import torch

from router.engine import (
    LOCAL_ENGINE_CAPABILITIES,
    EngineError,
    EngineRequest,
    EngineStep,
    UnknownAdapter,
    finish_reason,
    submitted,
)

from .draft import DraftModel
from .kv_cache import BlockPool, KVCache
from .loader import Checkpoint
from .model import CausalLM, ModelSpec
from .runner import ModelRunner
from .sampler import BatchSampler
from .scheduler import Scheduler
from .sequence import Sequence, Status
from .speculative import PREDICTION_ONLY, NgramOptions, NgramProposer
from .state import STATE_MODELS, RecurrentState, StateCache, StateSlots

log = logging.getLogger("router.torch")



@dataclass
class EngineOptions:
    """How to run: device, precision, memory, batching."""

    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    kv_dtype: torch.dtype | None = None  # the KV cache's element type; None: dtype
    block_size: int = 16
    kv_cache_bytes: int = 1 << 30
    max_num_seqs: int = 64
    max_batched_tokens: int = 512
    prefix_caching: bool = True
    num_threads: int | None = None
    seed: int | None = None
    weight_format: str = "native"  # native | fp16 | int8 | int4 (the last three: CPU, float32)
    # Decode-only steps on static buffers (graphs.py): "capture" replays CUDA graphs; "eager"
    # runs the same padded path without capturing (how it is tested without a GPU); "off".
    decode_graphs: str = "off"
    lora_modules: dict[str, Path] = field(default_factory=dict)  # adapter name -> PEFT LoRA folder
    speculative: NgramOptions | None = None  # speculative decoding by n-gram lookup; None: off
    draft_model: Path | None = None  # speculative decoding by a draft model (draft.py), with ``speculative``


def release_freed_memory() -> None:
    """Hand the C heap's free pages back to the system. Loading dequantizes the checkpoint and
    packing copies the weights; glibc keeps what they freed, and the KV cache allocated next
    would come on top (``bench/engines.py --skip hf,llamacpp``, SmolLM2 at int4 with 1 GiB of
    cache: peak RSS 2,346 MiB without this, 2,129 with it). A no-op where the C library has no
    ``malloc_trim``."""
    gc.collect()
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


class TorchEngine:
    """Serves one model with the project's own PyTorch engine."""

    def __init__(self, load: Callable[[], Checkpoint], options: EngineOptions) -> None:
        """Load and build on the engine's own thread, which then runs the scheduler loop.

        All torch work of the engine happens on that one thread: a second thread touching
        torch gets its own OpenMP team, and two teams on two cores slow every step by a third.
        """
        self.options = options
        self._cv = threading.Condition()
        self._inbox: list[Sequence] = []
        self._aborts: list[Sequence] = []
        self._arriving: list[Sequence] = []  # taken from the inbox, not yet in the scheduler
        self._commands: list[tuple[Callable[[], object], asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._closing = False
        self.steps = 0
        ready = threading.Event()
        failure: list[BaseException] = []

        def main() -> None:
            try:
                self._build(load())
            except BaseException as exc:  # noqa: BLE001 - re-raised on the constructing thread
                failure.append(exc)
                return
            finally:
                ready.set()
            self._loop()

        self._thread = threading.Thread(target=main, name="torch-engine", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            raise failure[0]

    def _build(self, checkpoint: Checkpoint) -> None:
        options = self.options
        spec = checkpoint.spec
        self.tokenizer = checkpoint.tokenizer
        self.chat_template = checkpoint.chat_template
        self.capabilities = LOCAL_ENGINE_CAPABILITIES | {"lora_adapters", "prediction"}
        if options.num_threads and options.device.type == "cpu":
            torch.set_num_threads(options.num_threads)
        if options.device.type == "cuda":
            # Streams, graph captures and synchronizations of this thread use the current device.
            torch.cuda.set_device(options.device)
        if spec.is_moe and options.decode_graphs == "capture":
            # Routing reads each expert's token count back to the host: nothing a graph can hold.
            log.info("torch engine: a mixture of experts; decode steps run eagerly (no CUDA graphs)")
            options.decode_graphs = "off"
        if spec.conv_layers and options.decode_graphs != "off":
            # The static decode path builds no convolution windows (conv.conv_windows).
            log.info("torch engine: short convolutions (LFM2); decode steps run eagerly (no CUDA graphs)")
            options.decode_graphs = "off"
        state_bytes = cached_states = 0
        if spec.recurrent:
            self._recurrent_options(options)
            state_bytes = self._state_slots(spec, options)
            cached_states = self._cached_states(spec, options, state_bytes)
            state_bytes += cached_states * RecurrentState.bytes_for(spec, 1, options.dtype)
            self.capabilities -= {"lora_adapters"}
        kv_dtype = options.kv_dtype or options.dtype
        per_block = KVCache.bytes_per_block(spec, options.block_size, kv_dtype)
        draft = None
        if options.draft_model is not None:
            draft = self._load_draft(checkpoint, min(options.max_model_len, spec.context_length))
        if draft is not None:  # its keys and values take a share of every block's budget
            per_block += KVCache.bytes_per_block(draft.spec, options.block_size, kv_dtype)
        num_blocks = max(1, (options.kv_cache_bytes - state_bytes) // per_block)
        graphs = options.decode_graphs != "off"
        # Static decode steps need one block the pool never hands out (padding rows write there).
        pool_blocks = num_blocks - 1 if graphs else num_blocks
        if pool_blocks < 1:
            raise ValueError("the KV budget holds a single block; decode graphs need two")
        self._block_bytes = per_block
        # A sequence can never be longer than the whole cache.
        self.max_model_len = min(options.max_model_len, spec.context_length, pool_blocks * options.block_size)
        from .quantize import PACKINGS

        # The packed formats pack each layer as it loads (CPU, float32); "native" has no packing.
        pack = PACKINGS.get(options.weight_format)
        model = CausalLM.from_state_dict(spec, self.max_model_len, checkpoint.weights, options.dtype, pack)
        checkpoint.weights.clear()
        # Already in options.dtype; the rotary tables stay float32 (exact), cast per use.
        self.model = model.to(device=options.device).eval()
        release_freed_memory()
        self.kv = KVCache.for_model(spec, num_blocks, options.block_size, kv_dtype, options.device)
        self.pool = BlockPool(pool_blocks, options.block_size, prefix_caching=options.prefix_caching)
        self.states = self.state_cache = None
        if spec.recurrent:  # the running sequences' slots, then the cached states'
            self.states = RecurrentState.for_model(spec, options.max_num_seqs + cached_states, options.dtype,
                                                   options.device)
            if cached_states:
                self.state_cache = StateCache(self.states, options.max_num_seqs, cached_states, options.device)
        self._state_bytes = state_bytes
        # Without speculative_config the proposer drafts only from requests' predictions, and
        # not at all where decode steps replay CUDA graphs: a step with a draft runs eagerly,
        # every sequence in it, and one client's prediction should not slow everyone's steps.
        self.proposer: NgramProposer | None = None
        self.draft: DraftModel | None = None
        if draft is not None:
            self.proposer = NgramProposer(options.speculative, lookup=False)
            # In the model's weight format too (its packed matmuls run as torch operations).
            draft_model = CausalLM.from_state_dict(draft.spec, self.max_model_len, draft.weights, options.dtype, pack)
            draft.weights.clear()
            draft_kv = KVCache.for_model(draft.spec, num_blocks, options.block_size, kv_dtype, options.device)
            self.draft = DraftModel(draft_model.to(device=options.device).eval(), draft_kv, self.tokenizer.vocab_size,
                                    options.device, max_catch_up=options.max_batched_tokens)
        elif options.speculative is not None:
            self.proposer = NgramProposer(options.speculative)
        elif options.decode_graphs != "capture" and not spec.recurrent:
            self.proposer = NgramProposer(PREDICTION_ONLY, lookup=False)
        self.scheduler = Scheduler(
            self.pool,
            max_num_seqs=options.max_num_seqs,
            max_batched_tokens=options.max_batched_tokens,
            proposer=self.proposer,
            eos_ids=self.tokenizer.eos_token_ids,
            draft_model=self.draft,
            state_slots=StateSlots(options.max_num_seqs) if spec.recurrent else None,
            state_cache=self.state_cache,
        )
        sampler = BatchSampler(self.tokenizer.vocab_size, options.device, seed=options.seed)
        decoder = None
        # Steps that decode or compute short prompts: one C call (mixtures of experts included;
        # what the C step lacks runs its packed matmuls as torch operations).
        if options.weight_format in ("int8", "int4"):
            from .cpu_decode import CpuDecoder, c_step_refusal

            refusal = c_step_refusal(spec)
            if refusal is None:
                decoder = CpuDecoder(self.model, self.kv)
            else:
                log.info("torch engine: the C decode step has no %s; steps run as torch operations", refusal)
        self.adapters = None  # lora.Adapters once the first adapter loads
        self._decoder = decoder
        for name, path in options.lora_modules.items():  # after the C decoder read the packed projections
            self._add_adapter(name, path)
        decode_graphs = None
        if graphs:
            from .graphs import DecodeGraphs

            decode_graphs = DecodeGraphs(
                self.model,
                self.kv,
                max_batch=options.max_num_seqs,
                max_blocks=-(-self.max_model_len // options.block_size),
                scratch_block=num_blocks - 1,
                capture=options.decode_graphs == "capture",
            )
            if decode_graphs.capture:
                decode_graphs.capture_all()
        self.runner = ModelRunner(
            self.model, self.kv, sampler, options.device, self.tokenizer.eos_token_ids,
            decoder=decoder, graphs=decode_graphs, adapters=self.adapters, states=self.states,
            state_cache=self.state_cache,
        )

    @staticmethod
    def _state_slots(spec: ModelSpec, options: EngineOptions) -> int:
        """The bytes of ``options.max_num_seqs`` sequences' linear-attention states, out of the KV
        budget. Where they would take all of it, ``max_num_seqs`` is lowered to what half of it
        holds (vLLM's hybrid models too run as many sequences as their states' memory allows);
        refused where that is not one."""
        per_sequence = RecurrentState.bytes_for(spec, 1, options.dtype)
        budget = options.kv_cache_bytes
        if per_sequence * options.max_num_seqs >= budget:
            fits = budget // 2 // per_sequence
            if fits < 1:
                raise ValueError(f"a sequence's linear-attention states take {per_sequence / 2**20:.1f} MiB, more than "
                                 f"half the KV budget of {budget / 2**20:.1f} MiB: raise kv_cache_gb")
            log.info("torch engine: the linear-attention states of max_num_seqs = %d sequences would take the whole "
                     "KV budget; max_num_seqs lowered to %d (half of it)", options.max_num_seqs, fits)
            options.max_num_seqs = fits
        elif 2 * per_sequence * options.max_num_seqs > budget:
            log.info("torch engine: the linear-attention states of max_num_seqs = %d sequences take %.0f%% of the KV "
                     "budget; lower max_num_seqs for more KV blocks", options.max_num_seqs,
                     100 * per_sequence * options.max_num_seqs / budget)
        return per_sequence * options.max_num_seqs

    @staticmethod
    def _cached_states(spec: ModelSpec, options: EngineOptions, running_bytes: int) -> int:
        """How many states the prefix cache keeps at block boundaries (state.StateCache): two for
        each of ``max_num_seqs`` sequences (each generating sequence keeps its latest, the
        others are prompts': a prompt chunk keeps one or two, the second where blocks it shares
        with an earlier prompt end), within a quarter of the KV budget the running sequences'
        states leave. None fitting, the prefix cache is off."""
        if not options.prefix_caching:
            return 0
        per_sequence = RecurrentState.bytes_for(spec, 1, options.dtype)
        count = min(2 * options.max_num_seqs, (options.kv_cache_bytes - running_bytes) // 4 // per_sequence)
        if count < 1:
            log.info("torch engine: no room in a quarter of the KV budget for one sequence's linear-attention "
                     "states; no prefix cache")
            options.prefix_caching = False
        return max(count, 0)

    @staticmethod
    def _recurrent_options(options: EngineOptions) -> None:
        """What a model with per-sequence states (linear attention) runs without: CUDA graphs and
        draft tokens (a rejected one would have moved the state on); speculative decoding is
        refused."""
        if options.speculative is not None or options.draft_model is not None:
            raise ValueError("speculative_config: speculative decoding is not supported for a model with "
                             f"linear-attention or Mamba layers ({STATE_MODELS})")
        if options.decode_graphs != "off":
            log.info("torch engine: linear-attention layers; decode steps run eagerly (no CUDA graphs)")
            options.decode_graphs = "off"

    def _load_draft(self, checkpoint: Checkpoint, context: int) -> Checkpoint:
        """The draft model's checkpoint; its tokenizer must be the model's (same vocabulary), and
        learned positions (GPT-2's, OPT's) must reach the ``context`` the model serves."""
        from .loader import load_checkpoint

        draft = load_checkpoint(self.options.draft_model)
        if draft.spec.learned_positions and draft.spec.context_length < context:
            raise ValueError(f"speculative_config.model ({self.options.draft_model}): its learned positions end at "
                             f"{draft.spec.context_length}, short of the model's context of {context} tokens; set "
                             f"max_model_len to at most {draft.spec.context_length}")
        if draft.spec.recurrent:
            raise ValueError(f"speculative_config.model ({self.options.draft_model}): a draft model with "
                             "linear-attention layers is not supported")
        if draft.spec.conv_layers:
            raise ValueError(f"speculative_config.model ({self.options.draft_model}): a draft model with short "
                             "convolutions (LFM2) is not supported; its target model can use one without them")
        ours, theirs = checkpoint.tokenizer, draft.tokenizer
        if theirs.vocab_size != ours.vocab_size or any(
            theirs.token_bytes(i) != ours.token_bytes(i) for i in range(0, ours.vocab_size, max(1, ours.vocab_size // 512))
        ):
            raise ValueError(f"speculative_config.model ({self.options.draft_model}): its tokenizer is not the model's "
                             f"({theirs.vocab_size} tokens against {ours.vocab_size}, or other tokens); a draft model "
                             "must share the model's vocabulary")
        return draft

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """The engine thread is already running (it loaded the model)."""

    async def stop(self) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        await asyncio.to_thread(self._thread.join)

    def stats(self) -> dict[str, int]:
        out = {
            "running": len(self.scheduler.running),
            "waiting": self.scheduler.num_waiting + len(self._inbox),
            "kv_blocks_used": self.pool.num_used,
            "kv_blocks_total": self.pool.num_blocks,
            "kv_cache_bytes": self.kv.num_blocks * self._block_bytes,
            "preemptions": self.scheduler.preemptions,
        }
        if self.states is not None:  # linear attention's per-sequence states, out of the same budget
            out["state_bytes"] = self._state_bytes
            if self.state_cache is not None:  # the prefix cache's states, and how many sequences started from one
                out |= {"cached_states": len(self.state_cache), "cached_state_hits": self.state_cache.restored}
        if self.proposer is not None and (self.proposer.lookup or self.draft is not None or self.proposer.drafts):
            # configured, or predictions seen
            out |= {
                "spec_drafts": self.proposer.drafts,
                "spec_draft_tokens": self.proposer.draft_tokens,
                "spec_accepted_tokens": self.proposer.accepted_tokens,
            }
        if self.options.device.type == "cuda":
            out["cuda_peak_allocated_bytes"] = torch.cuda.max_memory_allocated(self.options.device)
            # What the fleet counts beside the worker's resident memory (router/fleet.py).
            out["device_memory_bytes"] = torch.cuda.memory_reserved(self.options.device)
        return out

    # --- asyncio side ---------------------------------------------------------------------

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineStep]:
        return submitted(self.submit, request)

    def submit(self, request: EngineRequest, deliver: Callable[[EngineStep | BaseException], None]) -> Callable[[], None]:
        """:meth:`generate` without an iterator (a worker's host serves every request this way):
        ``deliver`` is called on the calling event loop with each step, or with the exception
        that ends the request; the function returned aborts it (its KV blocks are freed before
        the next step)."""
        if not request.prompt_ids:
            raise EngineError("the prompt is empty")
        if len(request.prompt_ids) + request.max_tokens > self.max_model_len:
            raise EngineError(
                f"prompt ({len(request.prompt_ids)}) plus max_tokens ({request.max_tokens}) exceeds "
                f"the engine's context of {self.max_model_len} tokens"
            )
        loop = asyncio.get_running_loop()
        with self._cv:
            if self._closing:
                raise EngineError("the engine is shutting down")
            # Under the lock: adapters change only on the engine thread, holding it too.
            adapter, root = 0, None
            if request.adapter is not None:
                adapter = self.adapters.index.get(request.adapter, 0) if self.adapters is not None else 0
                if not adapter:
                    raise UnknownAdapter(request.adapter)
                root = self.adapters.roots[adapter]
            if request.cache_salt is not None:
                # A salted chain starts elsewhere: its blocks match only the same salt's.
                root = hash((root, "cache_salt", request.cache_salt))
            seq = Sequence(request, deliver, self.options.block_size, adapter, root)
            seq.loop = loop
            self._inbox.append(seq)
            self._cv.notify()

        def abort() -> None:
            if not seq.aborted:
                seq.aborted = True
                with self._cv:
                    self._aborts.append(seq)
                    self._cv.notify()

        return abort

    # --- LoRA adapters at run time ------------------------------------------------------

    async def add_adapter(self, name: str, path: Path) -> None:
        """Load a PEFT LoRA folder and serve it as ``name`` from the next step on (capability
        ``lora_adapters``); raises :class:`.lora.AdapterError` naming what is wrong."""
        await self._on_engine_thread(lambda: self._add_adapter(name, path))

    async def remove_adapter(self, name: str) -> None:
        """Stop serving adapter ``name``; refused while a request generates with it."""
        await self._on_engine_thread(lambda: self._remove_adapter(name))

    async def _on_engine_thread(self, fn: Callable[[], object]) -> object:
        """Run ``fn`` on the engine thread between two steps (where all torch work happens)."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        with self._cv:
            if self._closing or not self._thread.is_alive():
                raise EngineError("the engine is shutting down")
            self._commands.append((fn, loop, done))
            self._cv.notify()
        return await done

    def _add_adapter(self, name: str, path: Path) -> None:
        from .lora import Adapters, load_adapter

        adapter = load_adapter(name, path, self.model.spec, self.options.dtype, self.options.device)
        with self._cv:
            if self.adapters is None:
                self.adapters = Adapters(self.model, self.options.device)
                if hasattr(self, "runner"):
                    self.runner.adapters = self.adapters
            self.adapters.add(adapter)
        try:
            self._describe_adapters()
        except BaseException:
            with self._cv:
                self.adapters.remove(name)
            raise

    def _remove_adapter(self, name: str) -> None:
        from .lora import AdapterError

        with self._cv:
            index = self.adapters.index.get(name) if self.adapters is not None else None
            if index is None:
                raise AdapterError(f"LoRA adapter `{name}` is not loaded")
            holders = [s for s in (*self.scheduler.sequences(), *self._inbox) if s.adapter == index]
            users = [s for s in holders if not s.aborted]
            if users:
                raise AdapterError(f"LoRA adapter `{name}` is serving {len(users)} request(s); unload it once they end")
            for seq in holders:  # aborted, their abort not yet taken in: no step may run them now
                if seq.status is not Status.FINISHED and seq in self.scheduler.running:
                    self.scheduler.finish(seq)
            self.adapters.remove(name)
        self._describe_adapters()

    def _describe_adapters(self) -> None:
        """Give the C decoder the current table (its steps then add adapter rows themselves)."""
        if self._decoder is not None and not self._decoder.attach_adapters(self.adapters.by_index()):
            log.warning("LoRA adapters beyond the C decoder's limits: steps with adapter rows run as torch operations")

    # --- engine thread --------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            self._serve()
        except Exception as exc:  # noqa: BLE001 - a bug outside a step (scheduling): fail, do not hang
            log.exception("the engine loop failed; its requests fail and it takes no more")
            with self._cv:
                self._closing = True
                held = [*self.scheduler.sequences(), *self._arriving, *self._inbox]
                pending, self._inbox = list({seq.id: seq for seq in held}.values()), []
            out: dict[asyncio.AbstractEventLoop, list[tuple[Sequence, EngineStep | BaseException]]] = defaultdict(list)
            for seq in pending:
                out[seq.loop].append((seq, EngineError(f"the engine stopped: {type(exc).__name__}: {exc}")))
            self._post(out)
        finally:  # however the loop ends, nobody waits for a command forever
            with self._cv:
                self._closing = True
                commands, self._commands = self._commands, []
            for _, loop, done in commands:
                _post_result(loop, done, EngineError("the engine is shutting down"))

    def _serve(self) -> None:
        while True:
            with self._cv:
                while not (self._inbox or self._aborts or self._commands or self._closing or self.scheduler.has_work()):
                    self._cv.wait()
                if self._closing:
                    break
                commands, self._commands = self._commands, []
            for fn, loop, done in commands:
                _run_command(fn, loop, done)
            with self._cv:
                # Held here until the scheduler has them (failed, should adding them raise).
                self._arriving, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, []
            for seq in aborts:
                if seq.status is not Status.FINISHED:
                    self.scheduler.finish(seq)
            for seq in self._arriving:
                if not seq.aborted:
                    self.scheduler.add(seq)
            self._arriving = []
            if self.scheduler.has_work():
                self._step()
        for seq in list(self.scheduler.running):
            self.scheduler.finish(seq)

    def _step(self) -> None:
        step = self.scheduler.schedule()
        if not step.work:
            return
        out: dict[asyncio.AbstractEventLoop, list[tuple[Sequence, EngineStep | BaseException]]] = defaultdict(list)
        try:
            sampled = self.runner.run(step)
        except Exception as exc:  # noqa: BLE001 - fail this step's requests, keep serving
            log.exception("engine step failed")
            for w in step.work:
                self.scheduler.finish(w.seq)
                out[w.seq.loop].append((w.seq, EngineError(f"{type(exc).__name__}: {exc}")))
            self._post(out)
            return
        self.steps += 1
        for s in sampled:
            seq = s.work.seq
            req = seq.request
            first = seq.num_output == 0
            finish = stop_token = None
            for kept, token in enumerate(s.tokens, 1):  # more than one after a draft
                seq.tokens.append(token)
                finish, stop_token = finish_reason(req, token, seq.num_output, len(seq.tokens), self.max_model_len, self.tokenizer.eos_token_ids)
                if finish is not None:
                    break
            if s.work.draft:  # the draft tokens the model agreed with, before any end among them
                drafted, agreed = len(s.work.draft), len(s.tokens) - 1
                self.proposer.record(seq, drafted, agreed)
                if s.work.predicted:  # usage counts only what the answer holds
                    seq.prediction_kept += min(agreed, kept)
                    seq.prediction_refused += drafted - agreed
                seq.trim(self.pool)  # blocks that held only rejected rows
            step_out = EngineStep(
                s.tokens[:kept],
                s.logprobs[:kept] if s.logprobs[0] is not None else None,
                finish,
                stop_token,
                seq.cached_tokens if first else None,
                seq.prompt_logprobs if first else None,
                # Every step: a stop string may end the request before the engine's last step.
                (seq.prediction_kept, seq.prediction_refused) if seq.prediction is not None else None,
            )
            out[seq.loop].append((seq, step_out))
        for w in step.work:
            w.seq.register_full_blocks(self.pool)
        for seq, item in (pair for items in out.values() for pair in items):
            if item.finish_reason is not None:
                self.scheduler.finish(seq)
        self._post(out)

    def _post(self, out: dict) -> None:
        for loop, items in out.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:
                pass  # that event loop is gone; nobody is listening


def _run_command(fn: Callable[[], object], loop: asyncio.AbstractEventLoop, done: asyncio.Future) -> None:
    try:
        result: object = fn()
    except Exception as exc:  # noqa: BLE001 - the caller's to handle
        result = exc
    _post_result(loop, done, result)


def _post_result(loop: asyncio.AbstractEventLoop, done: asyncio.Future, result: object) -> None:
    def settle() -> None:
        if done.done():
            return  # the caller gave up waiting
        if isinstance(result, BaseException):
            done.set_exception(result)
        else:
            done.set_result(result)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:
        pass  # that event loop is gone


def _deliver(items: list[tuple[Sequence, EngineStep | BaseException]]) -> None:
    for seq, item in items:
        if not seq.aborted:
            seq.deliver(item)
