"""Parity and forward speed of the Qwen2 network vs Hugging Face, GRAPH_MODE vs PyNative (CPU).

    python benchmarks/model_forward.py [--output benchmarks/results/model_forward.json]

Builds random tiny HF models (tests/support/hf_fixtures.py), converts them with the project's converter and
prints, per variant, the max |logit difference| and the median forward time in each mode.
"""
import argparse
import importlib.util
import json
import tempfile
import time
from pathlib import Path

import mindspore as ms
import numpy as np

from mindrlhf.models.qwen2 import Qwen2ForCausalLM
from mindrlhf.models.qwen2.convert import convert_hf_to_ms

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {"qwen2-untied": dict(arch="qwen2", tie=False), "qwen2-tied": dict(arch="qwen2", tie=True),
            "llama": dict(arch="llama", tie=False)}


def hf_fixtures():
    """tests/support/hf_fixtures.py, loaded from its file (tests/ is no installed package; the module imports only
    torch and transformers)."""
    spec = importlib.util.spec_from_file_location("hf_fixtures", ROOT / "tests" / "support" / "hf_fixtures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def median_time(fn, repeats):
    fn()  # warm-up (compiles in GRAPH_MODE)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "model_forward.json"))
    args = parser.parse_args()
    fixtures = hf_fixtures()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, kwargs in VARIANTS.items():
            hf_dir, hf_model = fixtures.make_hf_model_dir(Path(tmp) / name, seed=0, **kwargs)
            config = convert_hf_to_ms(hf_dir, f"{tmp}/{name}.ckpt")
            config.seq_length = max(args.seq, 128)
            ids = np.random.RandomState(0).randint(0, config.vocab_size, (args.batch, args.seq)).astype(np.int32)
            ref = fixtures.hf_logits(hf_model, ids).numpy()
            row = {"variant": name}
            for mode_name, mode in (("graph", ms.GRAPH_MODE), ("pynative", ms.PYNATIVE_MODE)):
                ms.set_context(mode=mode, device_target="CPU")
                net = Qwen2ForCausalLM(config)
                ms.load_param_into_net(net, ms.load_checkpoint(f"{tmp}/{name}.ckpt"), strict_load=True)
                tensor = ms.Tensor(ids)
                row[f"max_abs_logit_diff_{mode_name}"] = float(np.abs(net(tensor).asnumpy() - ref).max())
                forward = lambda net=net, tensor=tensor: net(tensor).asnumpy()
                row[f"forward_ms_{mode_name}"] = 1000 * median_time(forward, args.repeats)
            row["pynative_over_graph"] = row["forward_ms_pynative"] / row["forward_ms_graph"]
            rows.append(row)
    header = f"{'variant':<14}{'max|dlogit| graph':>19}{'pynative':>11}{'graph ms':>10}{'pynative ms':>13}{'ratio':>8}"
    print(f"batch {args.batch} x seq {args.seq}, median of {args.repeats}")
    print(header)
    for r in rows:
        print(f"{r['variant']:<14}{r['max_abs_logit_diff_graph']:>19.2e}{r['max_abs_logit_diff_pynative']:>11.2e}"
              f"{r['forward_ms_graph']:>10.2f}{r['forward_ms_pynative']:>13.2f}{r['pynative_over_graph']:>8.1f}")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"batch": args.batch, "seq": args.seq, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
