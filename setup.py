"""Builds the extension torch_kda._C.

CPU sources always; CUDA sources too when torch is a CUDA build and nvcc is found
(no GPU is needed to compile them). Target architectures come from
TORCH_KDA_CUDA_ARCHS, a space- or semicolon-separated list such as "90a" (default).
"""
import glob
import os
import sys

from setuptools import setup

import torch
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))


def _cuda_home():
    # torch guesses CUDA_HOME from `which nvcc`; on machines where nvcc is a
    # symlink in /usr/local/bin that guess is /usr/local, which has no cudart.
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        return home
    if os.path.exists("/usr/local/cuda/bin/nvcc"):
        os.environ["CUDA_HOME"] = "/usr/local/cuda"
        cpp_extension.CUDA_HOME = "/usr/local/cuda"
        return "/usr/local/cuda"
    return cpp_extension.CUDA_HOME


def _want_cuda():
    if os.environ.get("TORCH_KDA_FORCE_CPU", "0") == "1":
        return False
    if torch.version.cuda is None:
        return False
    home = _cuda_home()
    return bool(home) and os.path.exists(os.path.join(home, "bin", "nvcc"))


def _gencode_flags():
    archs = os.environ.get("TORCH_KDA_CUDA_ARCHS", "90a").replace(";", " ").split()
    flags = []
    for arch in archs:
        flags.append(f"-gencode=arch=compute_{arch},code=sm_{arch}")
    return flags


def _extra_cuda_includes(home):
    # ATen's CUDA headers include cusparse.h; some toolkits ship without it while
    # the nvidia-* wheels that a CUDA build of torch depends on carry it.
    if os.path.exists(os.path.join(home, "include", "cusparse.h")):
        return []
    found = []
    for site in sys.path:
        for inc in glob.glob(os.path.join(site, "nvidia", "cu*", "include")):
            if os.path.exists(os.path.join(inc, "cusparse.h")):
                found.append(inc)
    return found[:1]


def _sources(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern), recursive=True))


cxx_flags = ["-O3", "-fopenmp-simd"]  # torch picks the C++ standard it needs
sources = _sources("csrc/*.cpp") + _sources("csrc/cpu/*.cpp") + _sources("csrc/testing/*.cpp") + _sources("meta/*.cpp")
define_macros = []
include_dirs = [os.path.join(ROOT, "csrc")]

if os.environ.get("TORCH_KDA_REQUIRE_CUDA", "0") == "1" and not _want_cuda():
    raise RuntimeError(
        "TORCH_KDA_REQUIRE_CUDA=1 but the CUDA sources cannot be built: torch "
        f"{torch.__version__} (CUDA {torch.version.cuda}), CUDA_HOME={_cuda_home()}"
    )

if _want_cuda():
    sources += _sources("csrc/cuda/**/*.cpp") + _sources("csrc/cuda/**/*.cu") + _sources("csrc/testing/cuda/*.cpp")
    define_macros.append(("TORCH_KDA_WITH_CUDA", None))
    include_dirs += _extra_cuda_includes(_cuda_home())
    nvcc_flags = ["-O3", "--expt-relaxed-constexpr", "-lineinfo"] + _gencode_flags()
    ext = cpp_extension.CUDAExtension(
        "torch_kda._C",
        sources,
        include_dirs=include_dirs,
        define_macros=define_macros,
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
    )
else:
    ext = cpp_extension.CppExtension(
        "torch_kda._C",
        sources,
        include_dirs=include_dirs,
        define_macros=define_macros,
        extra_compile_args={"cxx": cxx_flags},
    )

setup(
    name="torch_kda",
    version="0.1.0",
    description="Kimi Delta Attention as PyTorch operators (CPU and Hopper CUDA kernels)",
    packages=["torch_kda"],
    ext_modules=[ext],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
    python_requires=">=3.10",
)
