"""benchmarks/generation.py: its networks are the ones it names (the tiny Qwen2, or the shipped SmolLM2 YAML's cut to
the layers asked) and a run reports what it generated."""
import json

import pytest

from benchmarks import generation


def test_the_smollm2_shape_is_the_shipped_yaml_with_the_layers_and_vocabulary_asked():
    from mindrlhf.models.qwen2 import Qwen2Config

    shipped = Qwen2Config.from_yaml(generation.SMOLLM2_YAML)
    cut = generation.model_config("smollm2", 2, 1024)
    assert (cut.num_layers, cut.vocab_size) == (2, 1024)
    assert (cut.hidden_size, cut.num_heads, cut.n_kv_heads, cut.intermediate_size, cut.tie_word_embeddings) == \
        (shipped.hidden_size, shipped.num_heads, shipped.n_kv_heads, shipped.intermediate_size, True)
    assert generation.model_config("smollm2", None, None) == shipped
    tiny = generation.model_config("tiny", None, None)
    assert (tiny.hidden_size, tiny.num_layers, tiny.vocab_size) == (64, 2, 1024)


@pytest.mark.slow
def test_a_run_at_the_smollm2_shape_generates_every_token_it_counts(tmp_path, graph_mode):
    out = tmp_path / "generation.json"
    result = generation.main(["--shape", "smollm2", "--layers", "1", "--vocab-size", "1024", "--batch", "8",
                              "--num-samples", "4", "--new-tokens", "3", "--max-prompt-len", "8", "--buckets", "8",
                              "--repeats", "1", "--kv-cache-only", "--temperature", "0.7", "--output", str(out)])
    (run,) = result["runs"]
    assert run["tokens"] == 8 * 3 and run["compilations"]["decode"] == 1 and run["compilations"]["prefill"] == 1
    assert result["model"] == {"shape": "smollm2", "num_layers": 1, "hidden_size": 576, "vocab_size": 1024}
    assert result["sampling"].startswith("temperature 0.7") and json.loads(out.read_text())["batch"] == 8
