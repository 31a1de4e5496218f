"""Package definition for vmoe_ext."""

import re
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
VERSION = re.search(r'__version__ = "([^"]+)"',
                    (HERE / "vmoe_ext" / "__init__.py").read_text()).group(1)

setup(
    name="vmoe_ext",
    version=VERSION,
    description=("Sparse Mixture-of-Experts vision models in JAX/Flax: V-MoE, "
                 "expert choice, SoftMoE, pluggable routers and streams."),
    long_description=(HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["vmoe_ext", "vmoe_ext.*"]),
    install_requires=[
        "jax>=0.10",
        "jaxlib>=0.10",
        "flax>=0.12",
        "optax>=0.2.5",
        "orbax-checkpoint>=0.11",
        "ml-collections>=1.0",
        "chex>=0.1.90",
        "numpy>=1.26",
        "scipy>=1.11",
        "absl-py>=2.1",
        "mlxtend>=0.23",
        "scikit-learn>=1.3",
        "tensorboardX>=2.6",
        "tqdm>=4.60",
        "matplotlib>=3.7",
        "pillow>=10",
    ],
    extras_require={
        # JAX for an accelerator (docs/install.md): NVIDIA's CUDA and cuDNN
        # as pip wheels for a CUDA 13 or CUDA 12 driver, or a Cloud TPU VM.
        # The plain `jax` above runs on the CPU only.
        "cuda13": ["jax[cuda13]>=0.10"],
        "cuda12": ["jax[cuda12]>=0.10"],
        "tpu": ["jax[tpu]>=0.10"],
        # Reading TFDS datasets prepared as array_record (no TensorFlow needed;
        # tfrecord-prepared datasets also need `pip install tensorflow-cpu`).
        # grain: the streaming training pipeline (vmoe_ext/data/streaming.py).
        "tfds": ["tensorflow-datasets>=4.9.10", "pillow>=10", "grain>=0.2.18"],
        # pytest-xdist: the suite runs its test files in parallel workers
        # (pyproject's addopts), one file per worker so that module fixtures
        # are built once, in conftest's order (3.6: --no-loadscope-reorder).
        "dev": ["pytest>=8", "pytest-xdist>=3.6", "hypothesis>=6.100",
                "tensorflow-datasets>=4.9.10", "pillow>=10", "grain>=0.2.18",
                # FGSM/PGD oracle of tests/test_attacks.py.
                "foolbox>=3.3.4",
                # An independent writer and reader of Hugging Face
                # checkpoints for tests/test_carve_decoder.py (numpy API).
                "safetensors>=0.4",
                # colab/execute.py runs the notebooks in a Jupyter kernel;
                # tests/test_notebooks.py validates them.
                "nbclient>=0.10", "nbformat>=5.10", "ipykernel>=6.29"],
    },
)
