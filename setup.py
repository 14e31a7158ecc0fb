"""Installs MegatronDPP and builds its native transport extension (csrc/)."""

import glob
import os

from setuptools import find_namespace_packages, setup


def native_extension():
    """The pybind11 extension megatron.dpp._native: CUDA and ibverbs parts only where present."""
    from torch.utils import cpp_extension

    sources = sorted(glob.glob("csrc/*.cpp"))
    macros, libraries = [], ["rt"]
    cuda_sources = sorted(glob.glob("csrc/*.cu"))
    with_cuda = cpp_extension.CUDA_HOME is not None and _torch_has_cuda()
    if with_cuda:
        sources += cuda_sources
        macros.append(("DPP_WITH_CUDA", "1"))
    with_rdma = os.environ.get("DPP_NO_RDMA") != "1" and os.path.exists(
        "/usr/include/infiniband/verbs.h"
    )
    if with_rdma:
        macros.append(("DPP_WITH_RDMA", "1"))
        libraries += ["ibverbs"]
    else:
        sources = [s for s in sources if not s.endswith("_rdma.cpp")]
    builder = cpp_extension.CUDAExtension if with_cuda else cpp_extension.CppExtension
    return builder(
        name="megatron.dpp._native",
        sources=sources,
        define_macros=macros,
        libraries=libraries,
        extra_compile_args={"cxx": ["-O3", "-std=c++17"], "nvcc": ["-O3"]},
    )


def _torch_has_cuda():
    import torch

    return torch.version.cuda is not None


def extensions():
    # DPP_NO_NATIVE=1: install without it (the shm / RDMA transports then refuse to start)
    if not glob.glob("csrc/*.cpp") or os.environ.get("DPP_NO_NATIVE") == "1":
        return [], {}
    from torch.utils.cpp_extension import BuildExtension

    return [native_extension()], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = extensions()

setup(
    name="megatron-dpp",
    version="0.1.0",
    description="Megatron-style LLM training with a dynamic pipeline-parallel schedule",
    packages=find_namespace_packages(include=["megatron.trainer*", "megatron.dpp*"]),
    py_modules=["pretrain_gpt", "pretrain_bert"],
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        # checked on 0.16.1-0.19.2 (megatron/trainer/core_overrides.py); >= 0.17 needs Python 3.12
        "megatron-core>=0.16.1,<0.20",
        "numpy",
        "regex",
        "nltk",
        "six",
        "pybind11",
        "psutil",
        "tokenizers",
        "tiktoken",
        "tensorboard",
        "matplotlib",
        "pyyaml",
    ],
    extras_require={"test": ["pytest", "ruff"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
