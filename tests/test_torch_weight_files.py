"""Which safetensors files of a checkpoint folder hold its weights: the index's shards, and never
Mistral's second copy of the weights in its own names (``consolidated.safetensors``)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from backends.torch.loader import INDEX, load_checkpoint, weight_files
from test_torch_engine import engine_for, generate_all, random_prompts, run
from torch_models import hf_greedy, tiny_checkpoint


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("files") / "llama", "llama")


def sharded(base, out, consolidated=True):
    """``base`` saved as two shards with an index, as large checkpoints are, and (Mistral's
    repositories) a ``consolidated.safetensors`` in Mistral's names whose final norm is wrong:
    read by mistake, it would change the output."""
    shutil.copytree(base, out)
    (out / "model.safetensors").unlink()
    weights = load_file(str(base / "model.safetensors"))
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: weights[k] for k in keys}, str(out / file), metadata={"format": "pt"})
    (out / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}))
    if consolidated:
        mistral = {"tok_embeddings.weight": weights["model.embed_tokens.weight"],
                   "norm.weight": torch.full_like(weights["model.norm.weight"], 7.0)}
        save_file(mistral, str(out / "consolidated.safetensors"))
    return out


def test_the_index_names_the_files_and_mistrals_copy_is_never_read(llama, tmp_path):
    folder = sharded(llama, tmp_path / "sharded")
    assert [f.name for f in weight_files(folder)] == ["model-00001-of-00002.safetensors",
                                                       "model-00002-of-00002.safetensors"]
    checkpoint = load_checkpoint(folder)
    assert "norm.weight" not in checkpoint.weights and "tok_embeddings.weight" not in checkpoint.weights
    assert torch.equal(checkpoint.weights["model.norm.weight"], load_checkpoint(llama).weights["model.norm.weight"])
    engine = engine_for(folder, block_size=4, max_batched_tokens=16)
    try:
        prompts = random_prompts(3, (9, 21))
        outs = generate_all(engine, prompts, 12)
    finally:
        run(engine.stop())
    assert outs == [hf_greedy(llama, p, 12) for p in prompts]


def test_without_an_index_every_file_but_the_consolidated_copy(llama, tmp_path):
    folder = sharded(llama, tmp_path / "sharded")
    (folder / INDEX).unlink()
    assert [f.name for f in weight_files(folder)] == ["model-00001-of-00002.safetensors",
                                                       "model-00002-of-00002.safetensors"]
    # A folder with Mistral's file alone reads it (and fails by name on what is missing).
    for f in folder.glob("model-*.safetensors"):
        f.unlink()
    assert [f.name for f in weight_files(folder)] == ["consolidated.safetensors"]


@pytest.mark.parametrize("index,error", [
    ("[1, 2]", "not a safetensors index"),
    ('{"weight_map": {}}', "must map weight names to file names"),
    ('{"weight_map": {"model.norm.weight": "../model.safetensors"}}', "must map weight names to file names"),
    ('{"weight_map": {"model.norm.weight": 3}}', "must map weight names to file names"),
    ('{"weight_map": {"model.norm.weight": "model-00009-of-00009.safetensors"}}',
     "names files that are not in .*: model-00009-of-00009.safetensors"),
])
def test_a_broken_index_is_refused_by_name(llama, tmp_path, index, error):
    folder = sharded(llama, tmp_path / "sharded", consolidated=False)
    (folder / INDEX).write_text(index)
    with pytest.raises((ValueError, FileNotFoundError), match=error):
        weight_files(folder)
