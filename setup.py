"""Installs MegatronDPP and builds its native extensions (csrc/)."""

import glob
import logging
import os

from setuptools import find_namespace_packages, setup


def native_extension():
    """The pybind11 extension megatron.dpp._native: CUDA and ibverbs parts only where present."""
    from torch.utils import cpp_extension

    sources = sorted(glob.glob("csrc/*.cpp"))
    macros, libraries = [], ["rt"]
    cuda_sources = sorted(glob.glob("csrc/*.cu"))
    with_cuda = _with_cuda()
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


def _cublaslt_location():
    """(include dir, link arguments) for cuBLASLt: the CUDA toolkit's, else the one pip's
    nvidia packages hold (torch's own); None where neither is there."""
    from torch.utils import cpp_extension

    home = cpp_extension.CUDA_HOME
    if home and os.path.exists(os.path.join(home, "include", "cublasLt.h")):
        for libdir in ("lib64", "lib", os.path.join("targets", "x86_64-linux", "lib")):
            if glob.glob(os.path.join(home, libdir, "libcublasLt.so*")):
                return os.path.join(home, "include"), [f"-L{os.path.join(home, libdir)}",
                                                       "-lcublasLt"]
    try:
        import nvidia
    except ImportError:
        return None
    for root in nvidia.__path__:
        for header in sorted(glob.glob(os.path.join(root, "*", "include", "cublasLt.h"))):
            package = os.path.dirname(os.path.dirname(header))
            libraries = sorted(glob.glob(os.path.join(package, "lib", "libcublasLt.so*")))
            if libraries:  # pip ships the versioned name only: link it by path
                return os.path.dirname(header), [libraries[0],
                                                 f"-Wl,-rpath,{os.path.dirname(libraries[0])}"]
    return None


def gemm_extension():
    """megatron.trainer.kernels._gemm_epilogues (csrc/gemm/): host code calling cuBLASLt, built
    where CUDA and cuBLASLt are; the MLP's GEMMs fall back to torch's without it."""
    from torch.utils import cpp_extension

    location = _cublaslt_location()
    if location is None:
        logging.getLogger("setup").warning(
            "cuBLASLt headers not found: megatron.trainer.kernels._gemm_epilogues is not built "
            "(the MLP keeps separate GEMM and GeLU kernels)")
        return None
    include, link = location
    return cpp_extension.CUDAExtension(
        name="megatron.trainer.kernels._gemm_epilogues",
        sources=sorted(glob.glob("csrc/gemm/*.cpp")),
        include_dirs=[include],
        extra_link_args=link,
        extra_compile_args={"cxx": ["-O2", "-std=c++17"], "nvcc": []},
    )


def _torch_has_cuda():
    import torch

    return torch.version.cuda is not None


def extensions():
    # DPP_NO_NATIVE=1: install without it (the shm / RDMA transports then refuse to start)
    if not glob.glob("csrc/*.cpp") or os.environ.get("DPP_NO_NATIVE") == "1":
        return [], {}
    from torch.utils.cpp_extension import BuildExtension

    modules = [native_extension()]
    if _with_cuda():
        modules.append(gemm_extension())
    return ([module for module in modules if module is not None],
            {"build_ext": BuildExtension.with_options(use_ninja=True)})


def _with_cuda() -> bool:
    from torch.utils import cpp_extension

    return cpp_extension.CUDA_HOME is not None and _torch_has_cuda()


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
        # checked on 0.16.1-0.19.2 (megatron/dpp/compat/core_internals.py); >= 0.17 needs Python 3.12
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
