"""What the lent H200's image holds (KINDS.md, read 2026-11-17: Python 3.12, torch 2.11.0, triton 3.6.0) and what
the run carries on top: the import names the GPU run may use. tests/test_gpu_image_imports.py imports every
module the run needs with everything else refused, so a new dependency shows here, not on the GPU."""
from __future__ import annotations

# Distributions in the image (KINDS.md's list), as import names.
IMAGE = """absl accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated_doc anyio attr attrs botorch build
certifi charset_normalizer chex click cloudpickle cmake colorama contourpy coverage cuda cupy cycler cython diffrax
e3nn einops equinox etils execnet filelock flatbuffers flax fontTools formulaic frozenlist fsspec gpytorch grpc h11
h5py hf_xet httpcore httpx huggingface_hub humanize hypothesis idna imageio iniconfig interface_meta jax jaxlib
jaxtyping jinja2 joblib kiwisolver lazy_loader lightning lightning_utilities linear_operator lineax llvmlite lxml
markdown markdown_it markupsafe matplotlib mdurl meson ml_dtypes mpi4py mpmath msgpack multidict multipledispatch
mypy_extensions nanobind narwhals networkx ninja numba numpy numpyro nvidia onnx onnx_ir onnxruntime onnxscript cv2
optax opt_einsum opt_einsum_fx optimistix orbax packaging pandas pathspec patsy peft PIL pip pluggy portalocker
prometheus_client propcache google psutil pyarrow pybind11 cpuinfo pygments pyparsing pyproject_hooks pyre_extensions
pytest pytest_benchmark pytest_cov pytest_mock pytest_timeout xdist dateutil pytorch_lightning yaml regex requests rich
sacrebleu safetensors scikit_build_core skimage sklearn scipy seaborn sentencepiece sentence_transformers setuptools
pkg_resources _distutils_hack shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard_data_server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq
torch_geometric torchmetrics torchvision tqdm transformers treescope triton typer typing_extensions typing_inspect
torchgen functorch
urllib3 uvloop wadler_lindig werkzeug wheel wrapt xarray xxhash yarl zipp""".split()

# Carried by the run: .whl (e2e/gpu/fetch_wheels.sh) and the flashinfer bundle (.flashinfer_aot).
# The versions this project's CI runs; fastapi needs opentelemetry-api, pydantic typing-extensions >= 4.16 (the
# image's version is not recorded: carried, it shadows the image's, which torch takes too).
WHEELS = ["fastapi==0.165.0", "starlette==1.10.0", "pydantic==2.14.4", "pydantic-core==2.50.5",
          "annotated-types==0.8.0", "typing-inspection==0.4.5", "uvicorn==0.54.0", "opentelemetry-api==1.45.2",
          "typing-extensions==4.16.0", "llguidance==1.9.1"]  # the last: the daemon's structured-output grammars
CARRIED = ["fastapi", "starlette", "pydantic", "pydantic_core", "annotated_types", "typing_inspection", "uvicorn",
           "opentelemetry", "llguidance", "flashinfer", "tvm_ffi"]

# What the run imports: the check's sections, the daemon and its benchmark.
RUN_MODULES = ["gpu_check", "gpu_kernel_checks", "gpu_engine_checks", "gpu_fused_checks", "serve_check",
               "stallfree.kernels.triton_attention", "stallfree.kernels.flashinfer_backend",
               "stallfree.kernels.fused_ops", "stallfree.node_daemon.engine.model_runner",
               "stallfree.node_daemon.engine.cuda_graphs", "stallfree.node_daemon.models.loader",
               "stallfree.cli.serve", "stallfree.node_daemon.server.app", "stallfree.bench.engine",
               "stallfree.bench.daemon_process"]

LOCAL = ["stallfree", "gpu_check", "gpu_report", "gpu_timing", "gpu_kernel_checks", "gpu_engine_checks",
         "gpu_fused_checks", "gpu_plan", "gpu_image", "batches", "roofline", "scale", "serve_check"]


def refuse_outside_image() -> None:
    """From now on, importing a module the GPU run would not have raises ModuleNotFoundError."""
    import importlib.abc
    import sys

    allowed = set(sys.stdlib_module_names) | set(IMAGE) | set(CARRIED) | set(LOCAL)

    class Refuse(importlib.abc.MetaPathFinder):
        refused: list[str] = []

        def find_spec(self, name, path=None, target=None):
            top = name.split(".")[0]
            if top in allowed or top.startswith("_"):  # private modules: the interpreter's own (_sysconfigdata...)
                return None
            Refuse.refused.append(top)
            raise ModuleNotFoundError(f"No module named {name!r} on the GPU image (e2e/gpu/gpu_image.py)", name=name)

    sys.meta_path.insert(0, Refuse())
