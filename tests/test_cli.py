"""The command line: fast help, config checking, model listing."""

import subprocess
import sys

from server import GGUF


def run(*args, **kw):
    return subprocess.run([sys.executable, "-m", "router.cli", *args], capture_output=True, text=True, timeout=60, **kw)


def test_help_imports_no_heavy_package():
    code = (
        "import sys, router.cli, router.app\n"
        "from router.plugins import load_plugins\n"
        "load_plugins()\n"
        "print(sorted(m for m in ('torch', 'llama_cpp', 'transformers', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


def test_help_lists_commands():
    out = run("--help")
    assert out.returncode == 0
    for cmd in ("serve", "models", "check-config"):
        assert cmd in out.stdout


def test_check_config_ok_and_bad(tmp_path):
    assert run("check-config", "router.toml").returncode == 0
    bad = tmp_path / "bad.toml"
    bad.write_text('[[models]]\nname="a"\nbackend="llamacpp"\npath="x"\nn_ctx="big"\n[[models]]\nname="b"\nbackend="zzz"\n')
    out = run("check-config", str(bad))
    assert out.returncode == 2
    assert "models[0].n_ctx" in out.stderr and "models[1].backend" in out.stderr


def test_models_lists_with_readiness(tmp_path, server):
    cfg = tmp_path / "r.toml"
    cfg.write_text(f'[server]\nport = {server.port}\n[[models]]\nname="smollm2"\nbackend="llamacpp"\npath="{GGUF}"\n')
    out = run("models", "--config", str(cfg))
    assert out.returncode == 0
    line = [l for l in out.stdout.splitlines() if l.startswith("smollm2")][0]
    assert "llamacpp" in line and "ready" in line
    cfg.write_text(f'[server]\nport = 1\n[[models]]\nname="smollm2"\nbackend="llamacpp"\npath="{GGUF}"\n')
    out = run("models", "--config", str(cfg))
    assert "not served" in out.stdout


def test_models_lists_lora_adapters_under_their_parent(tmp_path):
    cfg = tmp_path / "r.toml"
    cfg.write_text('[server]\nport = 1\n[[models]]\nname="t"\nbackend="torch"\npath="x"\n'
                   'lora_modules = { t-pirate = "a", t-poet = "b" }\n')
    out = run("models", "--config", str(cfg))
    assert out.returncode == 0
    lines = out.stdout.splitlines()[1:]
    assert [line.split()[0] for line in lines] == ["t", "t-pirate", "t-poet"]
    assert "torch (LoRA of t)" in lines[1] and "not served" in lines[2]
