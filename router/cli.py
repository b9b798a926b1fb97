"""``router``: serve a router.toml, list its models, check it.

Imports stay light here (no torch, no llama_cpp) so ``router --help`` answers at once; backends
load their heavy packages only when a model of theirs starts.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import urllib.error
import urllib.request


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="router", description="An OpenAI-compatible router: one endpoint, many models."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser("serve", help="serve the models of a router.toml over HTTP")
    serve.add_argument("--config", default="router.toml", help="path of router.toml (default: %(default)s)")
    serve.add_argument("--host", help="address to listen on (default: [server].host)")
    serve.add_argument("--port", type=int, help="port to listen on (default: [server].port)")
    serve.add_argument("--log-level", help="debug, info, warning or error (default: [server].log_level)")
    models = sub.add_parser("models", help="list the models of a router.toml and whether they are ready")
    models.add_argument("--config", default="router.toml", help="path of router.toml (default: %(default)s)")
    check = sub.add_parser("check-config", help="validate a router.toml and print every problem")
    check.add_argument("config", nargs="?", default="router.toml", help="path of router.toml")
    return parser


def _load(path: str):  # type: ignore[no-untyped-def]
    from .config import ConfigError, load_config
    from .plugins import PluginConflict, load_plugins
    from .requests import FieldConflict, compose

    try:
        plugins = load_plugins()
        compose(plugins.request_fields())  # two plugins claiming one field stop us here
    except (PluginConflict, FieldConflict) as exc:
        print(f"plugins conflict: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        return load_config(path, plugins.backends), plugins
    except ConfigError as exc:
        print(f"{path}: invalid configuration", file=sys.stderr)
        for problem in exc.problems:
            print(f"  {problem}", file=sys.stderr)
        raise SystemExit(2) from None


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from .app import create_app

    config, plugins = _load(args.config)
    host = args.host or config.server.host
    port = args.port if args.port is not None else config.server.port
    level = (args.log_level or config.server.log_level).lower()
    from .telemetry import configure_logging

    configure_logging(level)
    for name, why in plugins.skipped.items():
        logging.getLogger("router").warning("plugin %s skipped: %s", name, why)
    app = create_app(config, plugins, tune_gc=True)
    logging.getLogger("router").info("serving %d model(s) on http://%s:%d", len(config.models), host, port)
    # SIGTERM: uvicorn stops accepting, lets running requests (streams too) finish for up to
    # shutdown_timeout seconds, then runs the lifespan shutdown; we then exit 0.
    config_ = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=level,
        access_log=False,
        lifespan="on",
        # Nothing here reads the client address or scheme that X-Forwarded-* would rewrite;
        # uvicorn's middleware for them is one more ASGI layer on every request.
        proxy_headers=False,
        timeout_graceful_shutdown=config.server.shutdown_timeout,
        log_config=None,
    )
    _graceful_server()(config_).run()
    return 0


def _graceful_server():  # type: ignore[no-untyped-def]
    import signal

    import uvicorn

    class GracefulServer(uvicorn.Server):
        """uvicorn re-raises SIGTERM after draining, which ends the process with status -15;
        a shutdown the operator asked for is a success, so it exits 0 instead."""

        def handle_exit(self, sig: int, frame) -> None:  # type: ignore[no-untyped-def]
            super().handle_exit(sig, frame)
            if sig == signal.SIGTERM and sig in self._captured_signals:
                self._captured_signals.remove(sig)

    return GracefulServer


def _models(args: argparse.Namespace) -> int:
    config, _ = _load(args.config)
    states: dict[str, dict] = {}
    server = f"http://{config.server.host}:{config.server.port}"
    try:
        with urllib.request.urlopen(f"{server}/health", timeout=2) as resp:
            states = json.load(resp).get("models", {})
    except urllib.error.HTTPError as exc:
        states = json.load(exc).get("models", {})
    except (urllib.error.URLError, OSError, ValueError):
        server = ""
    rows = [("MODEL", "BACKEND", "STATE")]
    for m in config.models:
        if server:
            st = states.get(m.name, {})
            state = st.get("state", "unknown") + (f" ({st['error']})" if st.get("error") else "")
        else:
            state = "not served (no router answering on the configured address)"
        rows.append((m.name, m.backend, state))
        rows.extend((adapter, f"{m.backend} (LoRA of {m.name})", state) for adapter in m.adapter_names())
    width = [max(len(r[i]) for r in rows) for i in range(2)]
    for r in rows:
        print(f"{r[0]:<{width[0]}}  {r[1]:<{width[1]}}  {r[2]}")
    return 0


def _check(args: argparse.Namespace) -> int:
    config, _ = _load(args.config)
    print(f"{args.config}: ok, {len(config.models)} model(s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return {"serve": _serve, "models": _models, "check-config": _check}[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
