"""Converts Qwen2/Qwen2.5/Llama weights between a Hugging Face folder and one MindSpore `.ckpt`.

HF -> MindSpore:
    python tools/convert_weight.py --torch_ckpt_dir HF_DIR --mindspore_ckpt_path OUT.ckpt \
        [--dtype fp32|fp16|bf16] [--config_path model.yaml] [--output_yaml OUT.yaml]
MindSpore -> HF (writes model.safetensors + config.json, and the tokenizer files with --tokenizer_dir):
    python tools/convert_weight.py --reverse --mindspore_ckpt_path IN.ckpt|STEP_DIR --torch_ckpt_dir OUT_DIR \
        --config_path model.yaml [--dtype fp32|fp16|bf16] [--tokenizer_dir HF_TOKENIZER_DIR]
    IN may be a trainer checkpoint folder (save_ckpt_dir/step_NNNNNN): its tensor-parallel shards are merged
    through the strategy file; optimizer entries are dropped. `--net critic` exports a PPO run's critic from it
    (written as a one-label *ForSequenceClassification, or *ForTokenClassification when its YAML sets
    value_head_bias; the critic's YAML as --config_path).
    A LoRA policy (a checkpoint with adapters) is written as a PEFT adapter folder (adapter_config.json,
    adapter_model.safetensors: `peft.PeftModel.from_pretrained(base, OUT_DIR)` loads it), or with --merge_lora as
    a Hugging Face model of the merged weights W + (lora_alpha / r) B A. lora_alpha is the step folder's (its
    meta.json) or --lora_alpha's. A reward model or critic with adapters (`--net critic`) is written merged: its
    value head trained whole, which a PEFT LoRA folder does not hold.

The same command is installed as `mindrlhf-convert-weight`. Bad input prints one line `error: ...` to stderr
and exits with status 2.
"""
from __future__ import annotations

import argparse
import sys

from mindrlhf.checkpoint.step import STEP_NETS, CheckpointError
from mindrlhf.checkpoint.weights import read_weights, saved_lora_alpha
from mindrlhf.configs.base import ConfigError
from mindrlhf.configs.cli import OneLineErrorParser
from mindrlhf.models.qwen2.convert import ConversionError, convert_hf_to_ms, convert_ms_to_hf
from mindrlhf.models.qwen2.peft_files import LoraFilesError, merged_weights, split_adapters, write_peft_folder


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--torch_ckpt_dir", required=True,
                        help="Hugging Face model folder: the input, or the output with --reverse.")
    parser.add_argument("--mindspore_ckpt_path", required=True,
                        help="MindSpore .ckpt file: the output, or the input with --reverse (there also a "
                             "trainer checkpoint folder step_NNNNNN).")
    parser.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default=None,
                        help="dtype of the written weights. Default: the YAML's param_init_type, else fp32; "
                             "with --reverse, the checkpoint's own dtype.")
    parser.add_argument("--config_path", default=None,
                        help="Model YAML (model.model_config). HF -> MindSpore: check every shape against it "
                             "instead of using config.json. Required with --reverse.")
    parser.add_argument("--output_yaml", default=None,
                        help="HF -> MindSpore: also write the model YAML matching the checkpoint.")
    parser.add_argument("--tokenizer_dir", default=None,
                        help="With --reverse: copy this folder's tokenizer files (tokenizer.json, "
                             "tokenizer_config.json, vocab.json, merges.txt, ...) into the output folder.")
    parser.add_argument("--net", choices=tuple(STEP_NETS), default="actor",
                        help="With --reverse of a trainer checkpoint folder: the policy (actor) or the PPO critic.")
    parser.add_argument("--reverse", "--reversed", dest="reverse", action="store_true",
                        help="Convert a MindSpore ckpt back to a Hugging Face folder.")
    parser.add_argument("--merge_lora", action="store_true",
                        help="With --reverse of a LoRA policy: write the merged weights as a Hugging Face model "
                             "instead of a PEFT adapter folder.")
    parser.add_argument("--lora_alpha", type=float, default=None,
                        help="With --reverse of a LoRA policy: its lora_alpha (default: the step folder's).")
    parser.add_argument("--base_model", default=None,
                        help="With --reverse of a LoRA policy: base_model_name_or_path of the adapter config.")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.reverse and args.config_path is None:
        parser.error("--reverse needs --config_path (the model YAML the checkpoint was made for)")
    if args.reverse and args.output_yaml is not None:
        parser.error("--output_yaml only applies to HF -> MindSpore")
    if not args.reverse and args.tokenizer_dir is not None:
        parser.error("--tokenizer_dir only applies to --reverse")
    if not args.reverse and args.net != "actor":
        parser.error("--net only applies to --reverse")
    try:
        if args.reverse:
            weights = read_weights(args.mindspore_ckpt_path, args.net)
            merged = ""
            if split_adapters(weights)[1]:
                alpha = lora_alpha_of(args)
                if not args.merge_lora and args.net == "actor":
                    if args.tokenizer_dir is not None:
                        parser.error("--tokenizer_dir applies to a model folder; a PEFT folder holds the adapters "
                                     "only (or give --merge_lora)")
                    config = write_peft_folder(weights, alpha, args.torch_ckpt_dir, args.base_model)
                    print(f"wrote {args.torch_ckpt_dir} (PEFT LoRA adapters: r={config['r']}, lora_alpha={alpha:g}, "
                          f"{', '.join(config['target_modules'])})")
                    return 0
                weights, merged = merged_weights(weights, alpha), " with the LoRA adapters merged"
            cfg = convert_ms_to_hf(args.mindspore_ckpt_path, args.config_path, args.torch_ckpt_dir, args.dtype,
                                   weights=weights, tokenizer_dir=args.tokenizer_dir)
            print(f"wrote {args.torch_ckpt_dir} ({cfg.num_parameters()} parameters, {cfg.param_init_type}{merged})")
        else:
            cfg = convert_hf_to_ms(args.torch_ckpt_dir, args.mindspore_ckpt_path, args.dtype, args.config_path,
                                   args.output_yaml)
            print(f"wrote {args.mindspore_ckpt_path} ({cfg.num_parameters()} parameters, {cfg.param_init_type})")
    except (ConversionError, ConfigError, CheckpointError, LoraFilesError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def lora_alpha_of(args) -> float:
    """The LoRA policy's lora_alpha: --lora_alpha, else the step folder's job config."""
    return args.lora_alpha if args.lora_alpha is not None else saved_lora_alpha(args.mindspore_ckpt_path)


if __name__ == "__main__":
    sys.exit(main())
