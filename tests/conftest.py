"""Shared fixtures."""
import pytest


@pytest.fixture(scope="module")
def graph_mode():
    """MindSpore GRAPH_MODE on CPU for one test module (the mode users run in); restores the previous mode."""
    import mindspore as ms

    previous = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    yield
    ms.set_context(mode=previous)
