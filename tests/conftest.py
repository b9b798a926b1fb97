import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from server import RouterProcess, llamacpp_config  # noqa: E402


@pytest.fixture(scope="session")
def llama_server(tmp_path_factory):
    """One router serving the bundled SmolLM2 with llama.cpp, shared by the e2e tests."""
    server = RouterProcess(llamacpp_config(), tmp_path_factory.mktemp("llama"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def base_url(llama_server):
    return llama_server.url
