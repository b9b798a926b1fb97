"""router.toml: decoded strictly, each model entry by the options type of its backend.

Every problem is reported with its key path (``models[1].n_ctx: Expected `int`, got `str```).
"""

from __future__ import annotations

import importlib.resources
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Mapping

import msgspec
from msgspec import Meta, Struct

if TYPE_CHECKING:
    from .backend import Backend


class ConfigError(Exception):
    """router.toml is wrong; ``problems`` lists each one with its key path."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


class ServerConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535)] = 8000
    max_body_bytes: Annotated[int, Meta(ge=1024)] = 8 * 1024 * 1024
    log_level: str = "info"


class ModelConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    """Options every model entry has. Backends subclass this with their own options."""

    name: Annotated[str, Meta(min_length=1)]
    backend: str
    max_model_len: Annotated[int, Meta(ge=16)] | None = None
    chat_template: str | None = None
    """Path of a Jinja file that overrides the model's own chat template."""
    owned_by: str = "router"


class _RawConfig(Struct, forbid_unknown_fields=True):
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    models: list[dict[str, Any]] = []


class RouterConfig(Struct, kw_only=True):
    server: ServerConfig
    models: list[ModelConfig]
    base_dir: Path = Path(".")
    """Folder relative paths in the file are resolved against."""


def _where(exc: msgspec.ValidationError, prefix: str) -> str:
    """``models[0].n_ctx: Expected `int`, got `str``` from msgspec's message."""
    text = str(exc)
    path = ""
    marker = " - at `$"
    if marker in text:
        text, path = text.rsplit(marker, 1)
        path = path.rstrip("`")
    if text.startswith("Object contains unknown field `"):
        name = text.split("`")[1]
        path, text = f"{path}.{name}", "unknown key"
    where = f"{prefix}{path}".lstrip(".") or "(top level)"
    return f"{where}: {text}"


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
        raise ConfigError([_where(exc, "")]) from None
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
            problems.append(_where(exc, where))
            continue
        if model.name in seen:
            problems.append(f"{where}.name: `{model.name}` is already used by models[{seen[model.name]}]")
            continue
        seen[model.name] = i
        problems.extend(f"{where}.{p}" for p in model_problems(model, base_dir))
        models.append(model)
    if problems:
        raise ConfigError(problems)
    return RouterConfig(server=raw.server, models=models, base_dir=base_dir)


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
