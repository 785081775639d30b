"""The DPO job as a script msrun launches: `mindrlhf-dpo`, whose code and `--help` are in
mindrlhf/cli/stages.py.

    msrun --worker_num=2 --local_worker_num=2 --master_port=8118 --join=True --log_dir=output/dpo/msrun_log \\
        examples/qwen_grpo_tutorial/dpo.py --sft_path_train train.yaml --tokenizer_dir tokenizer/ ...
"""
from mindrlhf.cli.stages import dpo

if __name__ == "__main__":
    dpo()
