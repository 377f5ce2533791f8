"""Install the ds_trhash package; the top-level kernels/ folder becomes ds_trhash.kernels."""
from setuptools import find_packages, setup

packages = find_packages(include=["ds_trhash", "ds_trhash.*"])
packages.append("ds_trhash.kernels")

setup(
    name="ds-trhash",
    version="0.1.0",
    description="DeepSpeed trainer for TR-HASH hash-routed MoE language models",
    python_requires=">=3.11",
    packages=packages,
    package_dir={"ds_trhash.kernels": "kernels"},
    install_requires=[
        "torch>=2.11",
        "deepspeed>=0.19,<0.20",
        "triton",
        "liger-kernel",
        "packaging",
        "numpy",
        "safetensors",
        "huggingface_hub",
        "tokenizers",
        "pyyaml",
        "rich",
        "transformers>=4.50",
        "jinja2",
        "matplotlib",
        "supervisor",
        "filelock",
        "datasets",
        "pyarrow",
    ],
    extras_require={"tensorboard": ["tensorboard"]},
    entry_points={"console_scripts": ["ds-trhash=ds_trhash.cli:main"]},
)
