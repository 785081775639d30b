"""The reward-model training job as a script msrun launches: `mindrlhf-reward`, whose code and `--help` are in
mindrlhf/cli/stages.py.

    msrun --worker_num=2 --local_worker_num=2 --master_port=8118 --join=True --log_dir=output/reward/msrun_log \\
        examples/qwen_grpo_tutorial/reward.py --sft_path_train train.yaml --tokenizer_dir tokenizer/ ...
"""
from mindrlhf.cli.stages import reward

if __name__ == "__main__":
    reward()
