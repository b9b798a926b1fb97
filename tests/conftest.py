import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from server import RouterProcess, llamacpp_config, torch_config  # noqa: E402

MODELS = ["smollm2", "smollm2-torch"]
LONG_RUNNING = ("soak", "load")


def pytest_collection_modifyitems(config, items):
    """Soak and load tests run only when asked for by marker (``-m soak``, ``-m load``)."""
    expr = config.option.markexpr or ""
    keep, skip = [], []
    for item in items:
        marks = {m for m in LONG_RUNNING if item.get_closest_marker(m)}
        (skip if marks and not any(m in expr for m in marks) else keep).append(item)
    if skip:
        config.hook.pytest_deselected(items=skip)
        items[:] = keep


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """One router serving the bundled SmolLM2 twice: llama.cpp and the torch engine."""
    config = llamacpp_config("smollm2") + torch_config("smollm2-torch")
    router = RouterProcess(config, tmp_path_factory.mktemp("router"))
    yield router
    router.stop()


@pytest.fixture(scope="module")
def upstream():
    """An OpenAI-shaped upstream on loopback that answers well until told otherwise
    (tests/upstreams.py's ``FaultUpstream``)."""
    from upstreams import FaultUpstream

    with FaultUpstream(name="up") as up:
        yield up


@pytest.fixture(scope="session")
def base_url(server):
    return server.url


@pytest.fixture(params=MODELS)
def model(request):
    """Each contract test runs against every backend."""
    return request.param
