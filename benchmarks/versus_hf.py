"""mindrlhf vs transformers + torch on the same weights: sampling throughput, train-step throughput, peak memory.

Both sides get the same seeded `transformers` Qwen2 (converted to MindSpore with `tools/convert_weight.py`'s
converter) and the same work: generation samples at temperature 1 with no top-k/top-p and no EOS (every
token is generated); a train step is forward + causal-LM loss over every position + backward + AdamW
(lr 1e-5, betas 0.9/0.95, eps 1e-8, weight decay 0.01), and the first step's losses must agree. Every
measurement runs in its own process (so peak RSS is that side's alone), the sides are interleaved (ours,
theirs, ours, theirs, ...), each process times `--inner` calls after a warm-up, and the table gives medians
over all calls; all repeats go to the JSON.

    .venv/bin/python benchmarks/versus_hf.py                      # every case (the 0.5B ones take minutes)
    .venv/bin/python benchmarks/versus_hf.py --cases gen_tiny,train_tiny --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
from results_io import write_results

HERE = os.path.dirname(os.path.abspath(__file__))  # benchmarks/

# Hugging Face config fields of the two model shapes (Qwen2.5-0.5B's, and a tiny one where per-step overhead
# dominates); weights are random (seeded), converted once per work folder.
MODELS = {
    "tiny": dict(vocab_size=2000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=688, tie_word_embeddings=False),
    "0.5b": dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, intermediate_size=4864, tie_word_embeddings=True),
    # SmolLM2-135M-Instruct's shape (Llama architecture: no qkv bias), a real small model users bring
    "smollm2": dict(arch="llama", vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, intermediate_size=1536, tie_word_embeddings=True),
}
CASES = {
    "gen_tiny": dict(kind="generate", model="tiny", batch=16, prompt=32, new_tokens=64, target=1.5),
    "gen_0.5b": dict(kind="generate", model="0.5b", batch=8, prompt=64, new_tokens=32, target=2.0),
    "train_tiny": dict(kind="train", model="tiny", batch=16, seq=96, target=1.2),
    "train_0.5b": dict(kind="train", model="0.5b", batch=4, seq=128, target=1.5),
    # the same step with gradient accumulation over 1-row micro-batches on our side (the trainer's
    # micro_batch_size_per_device); torch still takes the 4 rows at once
    "train_0.5b_micro": dict(kind="train", model="0.5b", batch=4, seq=128, micro=1, target=1.5),
    # every decoder layer recomputed in the backward pass on our side (recompute_config.recompute: true); torch
    # keeps its activations
    "train_0.5b_recompute": dict(kind="train", model="0.5b", batch=4, seq=128, recompute=True, target=1.5),
}
ADAMW = dict(lr=1e-5, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01)
SEQ_LENGTH = 256  # cache / position length on our side; every case fits


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--rounds", type=int, default=2, help="process pairs (ours, theirs) per case, interleaved")
    p.add_argument("--inner", type=int, default=3, help="timed calls per process after one warm-up call")
    p.add_argument("--workdir", default=None, help="where the converted models are kept (default: a temp dir)")
    p.add_argument("--output", default=os.path.join("benchmarks", "results", "versus_hf.json"))
    # internal: one side's measurement in a child process
    p.add_argument("--side", choices=("ours", "theirs"), help=argparse.SUPPRESS)
    p.add_argument("--case", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = sorted(set(args.cases.split(",")) - set(CASES))
    if unknown:
        p.error(f"--cases: unknown {', '.join(unknown)}; known: {', '.join(CASES)}")
    return args


# ---------------------------------------------------------------- model preparation

def model_dir(workdir: str, name: str) -> str:
    return os.path.join(workdir, name)


def prepare_model(workdir: str, name: str) -> None:
    """Seeded HF Qwen2 saved as safetensors and converted to a MindSpore ckpt + YAML (once per work folder)."""
    folder = model_dir(workdir, name)
    if os.path.isfile(os.path.join(folder, "model.yaml")):
        return
    import torch
    import transformers

    from mindrlhf.models.qwen2.convert import convert_hf_to_ms

    fields = dict(MODELS[name])
    prefix = "Llama" if fields.pop("arch", "qwen2") == "llama" else "Qwen2"
    torch.manual_seed(0)
    config = getattr(transformers, f"{prefix}Config")(**fields, max_position_embeddings=4096, rope_theta=1000000.0,
                                                      torch_dtype="float32")
    getattr(transformers, f"{prefix}ForCausalLM")(config).save_pretrained(os.path.join(folder, "hf"))
    convert_hf_to_ms(os.path.join(folder, "hf"), os.path.join(folder, "model.ckpt"), dtype="fp32",
                     output_yaml=os.path.join(folder, "model.yaml.tmp"))
    os.replace(os.path.join(folder, "model.yaml.tmp"), os.path.join(folder, "model.yaml"))


def case_inputs(case: dict) -> np.ndarray:
    """Token ids of the case: [batch, prompt] prompts or [batch, seq] training rows (seeded)."""
    rng = np.random.default_rng(1)
    length = case["prompt"] if case["kind"] == "generate" else case["seq"]
    return rng.integers(1, MODELS[case["model"]]["vocab_size"], size=(case["batch"], length)).astype(np.int64)


# ---------------------------------------------------------------- one side, in its own process

def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def timed(call, inner: int) -> tuple[float, list[float], object]:
    start = time.perf_counter()
    first = call()
    warmup = time.perf_counter() - start
    times = []
    for _ in range(inner):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return warmup, times, first


def run_ours(case: dict, folder: str, inner: int) -> dict:
    import dataclasses

    import mindspore as ms

    from mindrlhf.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
    from mindrlhf.parallel.host_setup import configure_cpu_memory_pool

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    configure_cpu_memory_pool(world_size=1)  # as the trainer does
    from mindrlhf.configs.recompute import RecomputeConfig

    config = dataclasses.replace(Qwen2Config.from_yaml(os.path.join(folder, "model.yaml")), seq_length=SEQ_LENGTH,
                                 compute_dtype="float32",
                                 recompute=RecomputeConfig(recompute=case.get("recompute", False)))
    model = Qwen2ForCausalLM(config)
    ms.load_param_into_net(model, ms.load_checkpoint(os.path.join(folder, "model.ckpt")), strict_load=True)
    ids = case_inputs(case)
    if case["kind"] == "generate":
        from mindrlhf.configs.generation import GenerationConfig
        from mindrlhf.generation import Generator

        gen = Generator(model, GenerationConfig(max_new_tokens=case["new_tokens"], num_generations=1,
                                                temperature=1.0, eos_token_ids=[], pad_token_id=0,
                                                prompt_buckets=[case["prompt"]], seed=0))
        prompts = ids.tolist()
        warmup, times, _ = timed(lambda: gen.generate(prompts), inner)
        return {"warmup_s": warmup, "times_s": times, "tokens": case["batch"] * case["new_tokens"]}
    from mindrlhf.algorithms import aggregation_weights
    from mindrlhf.algorithms.policy_cells import SFTLossNet
    from mindrlhf.engine.batches import prompt_micro_batches
    from mindrlhf.optim import AdamW
    from mindrlhf.parallel.layout import Layout
    from mindrlhf.parallel.spmd import MicroBatchedTrainStep

    optimizer = AdamW(model.trainable_params(), learning_rate=ADAMW["lr"], beta1=ADAMW["beta1"],
                      beta2=ADAMW["beta2"], eps=ADAMW["eps"], weight_decay=ADAMW["weight_decay"])
    # the first token as "prompt", the rest as "response": the loss covers every next-token prediction
    response_mask = np.ones((case["batch"], case["seq"] - 1), np.int32)
    # the whole batch's token-mean weights: the micro-batches' losses add up to the batch's
    arrays = [ids[:, :1].astype(np.int32), np.ones((case["batch"], 1), np.int32), ids[:, 1:].astype(np.int32),
              response_mask, aggregation_weights(response_mask, "token-mean").astype(np.float32)]
    micro = case.get("micro", case["batch"])
    step = MicroBatchedTrainStep(SFTLossNet(model), optimizer, Layout())
    micro_batches = prompt_micro_batches(dict(zip(SFTLossNet.INPUTS, arrays)), micro, 1)
    losses = []

    def call():
        outputs, _ = step(micro_batches)
        losses.append(float(outputs[0]))

    warmup, times, _ = timed(call, inner)
    return {"warmup_s": warmup, "times_s": times, "tokens": case["batch"] * case["seq"], "first_loss": losses[0]}


def run_theirs(case: dict, folder: str, inner: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(os.path.join(folder, "hf"), dtype=torch.float32)
    ids = torch.from_numpy(case_inputs(case))
    if case["kind"] == "generate":
        model.eval()
        mask = torch.ones_like(ids)

        @torch.no_grad()
        def call():
            return model.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                  max_new_tokens=case["new_tokens"], min_new_tokens=case["new_tokens"],
                                  pad_token_id=0, eos_token_id=None)

        warmup, times, out = timed(call, inner)
        assert out.shape[1] == case["prompt"] + case["new_tokens"], out.shape
        return {"warmup_s": warmup, "times_s": times, "tokens": case["batch"] * case["new_tokens"]}
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=ADAMW["lr"], betas=(ADAMW["beta1"], ADAMW["beta2"]),
                                  eps=ADAMW["eps"], weight_decay=ADAMW["weight_decay"])
    losses = []

    def call():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))

    warmup, times, _ = timed(call, inner)
    return {"warmup_s": warmup, "times_s": times, "tokens": case["batch"] * case["seq"], "first_loss": losses[0]}


def child_main(args: argparse.Namespace) -> None:
    case = CASES[args.case]
    run = run_ours if args.side == "ours" else run_theirs
    result = run(case, model_dir(args.workdir, case["model"]), args.inner)
    result["peak_rss_bytes"] = peak_rss_bytes()
    print("RESULT " + json.dumps(result), flush=True)


# ---------------------------------------------------------------- driver

def run_child(side: str, case_name: str, workdir: str, inner: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--side", side, "--case", case_name, "--workdir", workdir,
           "--inner", str(inner)]
    env = dict(os.environ, GLOG_v=os.environ.get("GLOG_v", "3"), HF_HUB_OFFLINE="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"error: {side} {case_name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def summarize(case_name: str, runs: dict[str, list[dict]]) -> dict:
    case = CASES[case_name]
    row = {"case": case_name, **case}
    for side, results in runs.items():
        times = [t for r in results for t in r["times_s"]]
        tokens = results[0]["tokens"]
        row[side] = {"tokens_per_s": tokens / statistics.median(times),
                     "all_tokens_per_s": [tokens / t for t in times],
                     "warmup_s": [r["warmup_s"] for r in results],
                     "peak_rss_gib": max(r["peak_rss_bytes"] for r in results) / 2**30}
        if "first_loss" in results[0]:
            row[side]["first_loss"] = results[0]["first_loss"]
    row["ratio"] = row["ours"]["tokens_per_s"] / row["theirs"]["tokens_per_s"]
    row["meets_target"] = row["ratio"] >= case["target"]
    if case["kind"] == "train":
        ours, theirs = row["ours"]["first_loss"], row["theirs"]["first_loss"]
        row["first_loss_rel_diff"] = abs(ours - theirs) / abs(theirs)
    return row


def print_table(rows: list[dict]) -> None:
    header = (f"{'case':<18}{'ours tok/s':>12}{'theirs tok/s':>14}{'ratio':>8}{'target':>8}"
              f"{'ours GiB':>10}{'theirs GiB':>12}  first-loss diff")
    print(header)
    print("-" * len(header))
    for row in rows:
        loss = f"{row['first_loss_rel_diff']:.1e}" if "first_loss_rel_diff" in row else "-"
        print(f"{row['case']:<18}{row['ours']['tokens_per_s']:>12.1f}{row['theirs']['tokens_per_s']:>14.1f}"
              f"{row['ratio']:>7.2f}x{row['target']:>7.1f}x{row['ours']['peak_rss_gib']:>10.2f}"
              f"{row['theirs']['peak_rss_gib']:>12.2f}  {loss}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.side:
        child_main(args)
        return {}
    import mindspore as ms
    import torch
    import transformers

    workdir = args.workdir or tempfile.mkdtemp(prefix="versus_hf-")
    names = args.cases.split(",")
    for model in sorted({CASES[n]["model"] for n in names}):
        print(f"preparing the {model} model in {workdir} ...", flush=True)
        # in a process of its own, run in benchmarks/ (a `-c` command imports from its working directory)
        subprocess.run([sys.executable, "-c", "import sys; from versus_hf import prepare_model; "
                        "prepare_model(sys.argv[1], sys.argv[2])", os.path.abspath(workdir), model], check=True,
                       cwd=HERE, env=dict(os.environ, GLOG_v="3"))
    rows = []
    for name in names:
        runs = {"ours": [], "theirs": []}
        for round_index in range(args.rounds):
            for side in ("ours", "theirs"):
                runs[side].append(run_child(side, name, workdir, args.inner))
                print(f"  {name} round {round_index + 1} {side}: "
                      f"{runs[side][-1]['tokens'] / statistics.median(runs[side][-1]['times_s']):.1f} tok/s",
                      flush=True)
        rows.append(summarize(name, runs))
    result = {"rows": rows, "rounds": args.rounds, "inner": args.inner, "adamw": ADAMW,
              "sampling": "temperature 1.0, no top-k/top-p, no EOS",
              "environment": {"mindspore": ms.__version__, "torch": torch.__version__,
                              "transformers": transformers.__version__, "numpy": np.__version__,
                              "python": platform.python_version(), "cpus": os.cpu_count(),
                              "torch_threads": torch.get_num_threads(), "loadavg": os.getloadavg()}}
    print_table(rows)
    write_results(result, args.output)
    return result


if __name__ == "__main__":
    main()
