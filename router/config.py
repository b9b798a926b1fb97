"""router.toml: decoded strictly, each model entry by the options type of its backend.

Every problem is reported with its key path (``models[1].n_ctx: Expected `int`, got `str```).
"""

from __future__ import annotations

import importlib.resources
import os
import re
import types
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Mapping

import msgspec
from msgspec import Meta, Struct

from .units import format_size, parse_duration, parse_size

if TYPE_CHECKING:
    from .backend import Backend


class ConfigError(Exception):
    """router.toml is wrong; ``problems`` lists each one with its key path."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


class Limits(Struct, forbid_unknown_fields=True, kw_only=True):
    """Bounds a hostile client cannot get around (``[server.limits]``); each breach is a 400."""

    max_messages: Annotated[int, Meta(ge=1)] = 4096
    max_n: Annotated[int, Meta(ge=1)] = 128
    max_stop: Annotated[int, Meta(ge=0)] = 64
    max_stop_length: Annotated[int, Meta(ge=1)] = 1024
    max_logit_bias: Annotated[int, Meta(ge=0)] = 1024
    max_json_depth: Annotated[int, Meta(ge=2)] = 64
    """Nesting of free-form JSON (tool parameters, schemas, chat_template_kwargs)."""
    max_prompts: Annotated[int, Meta(ge=1)] = 256
    """Prompts in one /v1/completions request."""


class ServerConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535)] = 8000
    max_body_bytes: Annotated[int, Meta(ge=1024)] = 8 * 1024 * 1024
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_content: bool = False
    """Log prompt and completion text. Off: logs never contain what users wrote."""
    api_keys: list[str] = []
    """Keys (``env:NAME`` or the key itself) that may use every model."""
    shutdown_timeout: Annotated[float, Meta(ge=0)] = 30.0
    """On SIGTERM, how long running requests may take to finish."""
    runtime_lora_updating: bool = False
    """Serve ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's, which it
    opens with VLLM_ALLOW_RUNTIME_LORA_UPDATING): LoRA adapters of a model whose engine takes
    them, loaded from the router's file system while it serves. Off: those paths are 404. With
    ``api_keys``, only those keys (not a ``[[keys]]`` entry limited to some models) may call them;
    without, anyone who reaches the server may (and learn from the errors which paths exist)."""
    limits: Limits = msgspec.field(default_factory=Limits)
    memory_limit: int | str | None = None
    """The memory local models may take together, counted as their worker processes' resident
    memory: bytes, or a size with a unit (``"12GiB"``, ``"800MB"``). Past it, idle models are
    unloaded, least recently used first (docs/fleet.md). None: no limit."""
    load_timeout: float | str = 300.0
    """How long a request waits for its model to load, room for it included: seconds or a
    duration (``"5m"``). Then 503 with Retry-After, naming the models in the way."""

    def __post_init__(self) -> None:
        if self.memory_limit is not None:
            self.memory_limit = _quantity("memory_limit", parse_size, self.memory_limit)
        timeout = _quantity("load_timeout", parse_duration, self.load_timeout)
        if timeout is None:
            raise ValueError("load_timeout: must be a duration of zero or more (\"5m\", 300)")
        self.load_timeout = timeout


def _quantity(key: str, parse: Any, value: Any) -> Any:
    try:
        return parse(value)
    except ValueError as exc:
        raise ValueError(f"{key}: {exc}") from None


class KeyConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    """``[[keys]]``: a key limited to some models (others look as if they did not exist)."""

    key: str
    models: list[str]


class ModelConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    """Options every model entry has. Backends subclass this with their own options."""

    name: Annotated[str, Meta(min_length=1)]
    backend: str
    task: Literal["generate", "embed"] = "generate"
    """What the model does: ``generate`` (chat, completions, messages) or ``embed``
    (``/v1/embeddings``), as vLLM's ``--task``. Each endpoint refuses the other task's models."""
    max_model_len: Annotated[int, Meta(ge=16)] | None = None
    chat_template: str | None = None
    """Path of a Jinja file that overrides the model's own chat template."""
    owned_by: str = "router"
    tool_parser: Literal["hermes", "llama3_json", "mistral", "granite", "qwen3_coder", "seed_oss", "glm45", "minimax_m2",
                         "openai"] | None = "hermes"
    """How a local model writes tool calls (docs/tools.md); None: the model takes no tools.
    ``openai``: gpt-oss's harmony format, read with its reasoning (router/harmony.py)."""
    reasoning_parser: Literal["deepseek_r1", "qwen3", "mistral", "seed_oss", "openai_gptoss"] | None = None
    """How a local thinking model marks its reasoning, sent apart as ``reasoning``
    (router/reasoning.py, router/harmony.py); None: all of the reply is content."""
    max_tokens_limit: Annotated[int, Meta(ge=1)] | None = None
    """Most tokens one request may generate; more is a 400, none asked means at most this."""
    max_concurrency: Annotated[int, Meta(ge=1)] | None = None
    """Requests running at once; more wait in the admission queue (None: no limit here)."""
    max_queue: Annotated[int, Meta(ge=0)] | None = None
    """Requests waiting beyond max_concurrency; past it, 429 at once (None: no limit)."""
    # How a local model's engine lives (docs/fleet.md); remote models take none of these.
    preload: bool = True
    """Load at start-up; false: on the first request for it (or ``POST /models/load``)."""
    keep_alive: float | str | None = None
    """Unload after this long without requests, as Ollama's ``keep_alive`` (``"5m"``, ``"30s"``,
    seconds; 0: as soon as its last request ends). None or negative: never."""
    pin: bool = False
    """Never unloaded to make room for another model."""
    worker: bool = True
    """Run the engine in a worker process of its own (``router.workers``); false: in the
    router's process, sharing its fate and its memory, which is then only estimated."""

    def __post_init__(self) -> None:
        if self.keep_alive is not None:
            self.keep_alive = _quantity("keep_alive", parse_duration, self.keep_alive)
        # Harmony is one format: one parser reads a gpt-oss reply's reasoning, content and calls.
        if (self.reasoning_parser == "openai_gptoss") != (self.tool_parser == "openai"):
            raise ValueError(
                'gpt-oss\'s harmony format takes both reasoning_parser = "openai_gptoss" and '
                'tool_parser = "openai"; '
                f"got reasoning_parser = {self.reasoning_parser!r} and tool_parser = {self.tool_parser!r}"
            )

    def adapter_names(self) -> list[str]:
        """Further model names this entry serves (LoRA adapters of it, each a model of its own
        on the wire); a backend's config that has such an option overrides this."""
        return []


class _RawConfig(Struct, forbid_unknown_fields=True):
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    keys: list[KeyConfig] = []
    models: list[dict[str, Any]] = []


class RouterConfig(Struct, kw_only=True):
    server: ServerConfig
    models: list[ModelConfig]
    keys: list[KeyConfig] = []
    base_dir: Path = Path(".")
    """Folder relative paths in the file are resolved against."""


def _where(exc: msgspec.ValidationError, prefix: str, schema: type | None = None) -> str:
    """``models[0].n_ctx: Expected `int`, got `str``` from msgspec's message; for a value outside
    a fixed set of choices (a ``Literal`` field of ``schema``), the choices too."""
    text = str(exc)
    path = ""
    marker = " - at `$"
    if marker in text:
        text, path = text.rsplit(marker, 1)
        path = path.rstrip("`")
    if text.startswith("Object contains unknown field `"):
        name = text.split("`")[1]
        path, text = f"{path}.{name}", "unknown key"
    if text.startswith("Invalid enum value") and schema is not None:
        choices = _choices(schema, path)
        if choices:
            text = f"{text}; one of {choices}"
    key = re.match(r"([a-z_]+): (.+)", text, re.DOTALL)
    if key:  # a __post_init__ check names its key: models[0].keep_alive: ...
        path, text = f"{path}.{key.group(1)}", key.group(2)
    where = f"{prefix}{path}".lstrip(".") or "(top level)"
    return f"{where}: {text}"


def _choices(schema: Any, path: str) -> list[Any] | None:
    """The values a ``Literal`` field at ``path`` (``.a[0].b``) of struct ``schema`` allows."""
    tp = _bare(schema)
    for name, index in re.findall(r"\.(\w+)|\[(\d+)\]", path):
        if index:  # list[X] -> X
            args = typing.get_args(tp)
            tp = _bare(args[0]) if args else None
        elif isinstance(tp, type) and issubclass(tp, Struct):
            tp = _bare(next((f.type for f in msgspec.structs.fields(tp) if f.name == name), None))
        else:
            return None
    return list(typing.get_args(tp)) if typing.get_origin(tp) is Literal else None


def _bare(tp: Any) -> Any:
    """``tp`` without ``Annotated[...]`` and ``| None`` around it."""
    while typing.get_origin(tp) in (Annotated, typing.Union, types.UnionType):
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    return tp


def load_config(
    path: str | Path, backends: Mapping[str, type["Backend"]], *, text: str | None = None
) -> RouterConfig:
    """Read and validate router.toml against the registered backend types."""
    path = Path(path)
    try:
        data = text.encode() if text is not None else path.read_bytes()
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read: {exc.strerror}"]) from None
    return parse_config(data, backends, base_dir=path.resolve().parent)


def parse_config(
    data: bytes, backends: Mapping[str, type["Backend"]], *, base_dir: Path = Path(".")
) -> RouterConfig:
    try:
        raw = msgspec.toml.decode(data, type=_RawConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError([_where(exc, "", _RawConfig)]) from None
    except msgspec.DecodeError as exc:
        raise ConfigError([f"not valid TOML: {exc}"]) from None
    problems: list[str] = []
    models: list[ModelConfig] = []
    seen: dict[str, int] = {}
    for i, entry in enumerate(raw.models):
        where = f"models[{i}]"
        backend_name = entry.get("backend")
        if not isinstance(backend_name, str):
            problems.append(f"{where}.backend: required, one of {sorted(backends)}")
            continue
        backend = backends.get(backend_name)
        if backend is None:
            problems.append(
                f"{where}.backend: unknown backend `{backend_name}`; registered: {sorted(backends)}"
            )
            continue
        try:
            model = msgspec.convert(entry, type=backend.Config)
        except msgspec.ValidationError as exc:
            problems.append(_where(exc, where, backend.Config))
            continue
        if model.name in seen:
            problems.append(f"{where}.name: `{model.name}` is already used by models[{seen[model.name]}]")
            continue
        seen[model.name] = i
        tasks = getattr(backend, "tasks", frozenset({"generate"}))
        if model.task not in tasks:
            problems.append(f"{where}.task: backend `{backend_name}` cannot `{model.task}` here; it can "
                            + ", ".join(f"`{t}`" for t in sorted(tasks)))
        for adapter in model.adapter_names():
            if adapter in seen:
                problems.append(f"{where}: adapter name `{adapter}` is already used by models[{seen[adapter]}]")
            else:
                seen[adapter] = i
        problems.extend(f"{where}.{p}" for p in model_problems(model, base_dir))
        problems.extend(f"{where}.{p}" for p in _lifecycle_problems(model, backend, raw.server, base_dir))
        models.append(model)
    for i, key in enumerate(raw.server.api_keys):
        problems.extend(f"server.api_keys[{i}]: {p}" for p in _secret_problems(key))
    for i, entry in enumerate(raw.keys):
        problems.extend(f"keys[{i}].key: {p}" for p in _secret_problems(entry.key))
        for j, name in enumerate(entry.models):
            if name not in seen:
                problems.append(f"keys[{i}].models[{j}]: no model named `{name}`")
    if problems:
        raise ConfigError(problems)
    return RouterConfig(server=raw.server, models=models, keys=raw.keys, base_dir=base_dir)


_LOCAL_ONLY = {"preload": True, "keep_alive": None, "pin": False, "worker": True}


def _lifecycle_problems(model: ModelConfig, backend: type["Backend"], server: ServerConfig,
                        base_dir: Path) -> list[str]:
    """Keys only a local model takes, and a local model larger than the whole memory limit."""
    if not backend.local:
        return [f"{key}: only a local model takes it (backend `{model.backend}` runs elsewhere)"
                for key, default in _LOCAL_ONLY.items() if getattr(model, key) != default]
    if server.memory_limit is None:
        return []
    try:
        estimate = backend.estimate_memory(model, base_dir)
    except Exception:  # noqa: BLE001 - a file it cannot read: its load will say why
        return []
    limit = server.memory_limit
    if estimate is not None and estimate.total > limit:  # type: ignore[operator]
        return [f"name: model `{model.name}` needs about {estimate.describe()}, more than the whole "
                f"server.memory_limit ({format_size(limit)})"]  # type: ignore[arg-type]
    return []


def _secret_problems(spec: str) -> list[str]:
    try:
        value = resolve_secret(spec)
    except ValueError as exc:
        return [str(exc)]
    return [] if value else ["empty key"]


def model_problems(model: ModelConfig, base_dir: Path) -> list[str]:
    """Checks that need the file system (a template override that does not exist)."""
    problems = []
    if model.chat_template is not None:
        try:
            p = resolve_path(model.chat_template, base_dir)
        except ValueError as exc:
            problems.append(f"chat_template: {exc}")
        else:
            if not p.is_file():
                problems.append(f"chat_template: no such file: {p}")
    return problems


def resolve_path(spec: str, base_dir: Path = Path(".")) -> Path:
    """A model path from router.toml: ``pkg:<package>/<file>`` (a file shipped inside an
    installed Python package), ``~/...``, absolute, or relative to the config file."""
    if spec.startswith("pkg:"):
        package, _, inner = spec[4:].partition("/")
        if not package or not inner:
            raise ValueError(f"`{spec}` is not of the form pkg:<package>/<file>")
        try:
            root = importlib.resources.files(package)
        except ModuleNotFoundError:
            raise ValueError(f"package `{package}` is not installed") from None
        return Path(str(root.joinpath(inner)))
    p = Path(os.path.expanduser(spec))
    return p if p.is_absolute() else (base_dir / p)


def resolve_secret(spec: str) -> str:
    """``env:NAME`` reads the environment; anything else is the value itself."""
    if spec.startswith("env:"):
        name = spec[4:]
        value = os.environ.get(name)
        if value is None:
            raise ValueError(f"environment variable `{name}` is not set")
        return value
    return spec
