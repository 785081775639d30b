"""mindrlhf: GRPO post-training of Qwen2/Qwen2.5 models on MindSpore."""
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent


def _requirements(name):
    lines = (HERE / name).read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith(("#", "-r"))]


setup(
    name="mindrlhf",
    version="0.1.0",
    description="Reinforcement-learning post-training (GRPO) of Qwen2/Qwen2.5 models on MindSpore",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.11,<3.12",
    packages=find_packages(include=["mindrlhf", "mindrlhf.*"]),
    package_data={"mindrlhf": ["py.typed"]},
    install_requires=_requirements("requirements.txt"),
    extras_require={"test": _requirements("requirements-test.txt")},
    entry_points={"console_scripts": [
        "mindrlhf-train = mindrlhf.cli.train:run",
        "mindrlhf-sft = mindrlhf.cli.stages:sft",
        "mindrlhf-reward = mindrlhf.cli.stages:reward",
        "mindrlhf-dpo = mindrlhf.cli.stages:dpo",
        "mindrlhf-prepare-data = mindrlhf.cli.prepare_data:main",
        "mindrlhf-convert-weight = mindrlhf.cli.convert_weight:main",
        "mindrlhf-transform-checkpoint = mindrlhf.cli.transform_checkpoint:main",
    ]},
)
