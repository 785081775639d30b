"""MindRLHF's tutorial path of the RL job (GRPO or PPO): `mindrlhf-train`, whose code and `--help` are in
mindrlhf/cli/train.py.

    msrun --worker_num=2 --local_worker_num=2 --master_port=8118 --join=True --log_dir=output/msrun_log \\
        examples/qwen_grpo_tutorial/grpo_one_stage.py --sft_path_train train.yaml --sft_path_infer infer.yaml ...
"""
from mindrlhf.cli.train import run

if __name__ == "__main__":
    run()
