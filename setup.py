"""owl_cl: continual learning of OWL-ViT with replay, in JAX/Flax."""

import setuptools

INSTALL_REQUIRES = [
  "jax>=0.4.35",
  "flax>=0.10",
  "optax>=0.2.4",
  "orbax-checkpoint>=0.11",
  "grain>=0.2.10",
  "ml_collections>=1.0",
  "absl-py>=2.1",
  "numpy>=1.26",
  "scipy>=1.13",
  # owl_cl.analysis: the mixed model of variance components and the power of paired tests.
  "statsmodels>=0.14",
  "pycocotools>=2.0.8",
  "pillow>=10.0",
  "scikit-learn>=1.5",  # built-in benchmark: bundled handwritten digits
  "scikit-image>=0.24",  # built-in benchmark: bundled photographs
  "matplotlib>=3.8",  # built-in benchmark photographs/fonts, plots
  "tqdm>=4.66",
  "tensorboardX>=2.6",
  "tokenizers>=0.15",  # the CLIP BPE tokenizer of the ViT variants (no transformers needed)
  "lvis>=0.5.3",  # LVIS AP / APr / APc / APf (federated evaluation)
  # TFDS detection datasets read with `tfds.data_source` from ArrayRecord files (no TensorFlow;
  # owl_cl.data.tfds_source).
  "tensorflow-datasets>=4.9.10",  # tested version (as_data_source(deserialize_method=...))
  "array_record>=0.5",
  # LoRA adapters on the Dense layers of the linen model (owl_cl.model.lora; docs/lora.md).
  "qwix>=0.1.8",
]

EXTRAS = {
  # ruff is pinned: its formatter's output may change between releases (ruff.toml).
  # import-linter checks the import layers of .importlinter (2.10: the acyclic_siblings contract).
  # nbclient, nbformat and ipykernel: tests/analysis/test_notebook.py runs
  # notebooks/analysis.ipynb in a Jupyter kernel.
  "test": [
    "pytest>=8",
    "pytest-xdist>=3.5",
    "ruff==0.17.6",
    "import-linter>=2.10",
    "nbclient>=0.10",
    "nbformat>=5.10",
    "ipykernel>=6.29",
    "faster-coco-eval>=1.8",
  ],
  # HF weight conversion and parity tests; OpenAI CLIP TorchScript init.
  "hf": ["torch==2.13.0", "transformers>=4.44", "safetensors>=0.4"],
  # The documentation site (mkdocs.yml): `mkdocs serve`, `mkdocs build --strict` in .ci/run.
  "docs": [
    "mkdocs>=1.6.1",
    "mkdocs-material>=9.8",
    "mkdocstrings>=1.0",
    "mkdocstrings-python>=2.0",
  ],
  # owl_cl.eval.coco_eval's backend='faster_coco_eval': a maintained C++ drop-in for
  # pycocotools' COCOeval (every metric equal on generated data: tests/eval/test_coco_backends.py).
  "fast_coco": ["faster-coco-eval>=1.8"],
  "cuda12": ["jax[cuda12]"],
  "tpu": ["jax[tpu]"],
}

setuptools.setup(
  name="owl_cl",
  version="0.1.0",
  description="Continual learning of the open-vocabulary detector OWL-ViT with replay (JAX/Flax).",
  packages=setuptools.find_packages(include=["owl_cl", "owl_cl.*"]),
  package_data={
    "owl_cl.data": ["forbidden_labels.json", "orders/*.json"],
    "owl_cl.configs": ["examples/*.py"],
  },
  python_requires=">=3.10",
  install_requires=INSTALL_REQUIRES,
  extras_require=EXTRAS,
)
