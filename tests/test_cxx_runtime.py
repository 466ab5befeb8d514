"""Our extensions link the process's libstdc++ (lookahead_kernels/cxx_runtime.py): found in /proc/self/maps, and a
library built with libstdc++ forced static still formats the numbers of its refusals once it is on the link line
(the H200 image's crash, session 57)."""

import os
import sys

import pytest
import torch

from lookahead_kernels.cxx_runtime import loaded_libstdcxx, runtime_link_flags

PROBE = r"""
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

at::Tensor refuse(const at::Tensor& x, double t) {
  TORCH_CHECK_VALUE(t > 0, "refuse: t must be > 0, got ", t, " of ", x.numel(), " elements");
  return x;
}
TORCH_LIBRARY(NAMESPACE, m) { m.def("refuse(Tensor x, float t) -> Tensor"); }
TORCH_LIBRARY_IMPL(NAMESPACE, CPU, m) { m.impl("refuse", &refuse); }
"""


def test_the_maps_line_of_libstdcxx_is_found(tmp_path):
    lib = tmp_path / "dir with space" / "libstdc++.so.6.0.33"
    lib.parent.mkdir()
    lib.write_bytes(b"")
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r--p 00000000 00:00 0 \n"
                    "7f01-7f02 r-xp 00000000 08:01 12 /usr/lib/libc.so.6\n"
                    f"7f02-7f03 r-xp 00000000 08:01 13 {lib}\n")
    assert loaded_libstdcxx(str(maps)) == str(lib)
    maps.write_text("7f01-7f02 r-xp 00000000 08:01 12 /usr/lib/libc.so.6\n")
    assert loaded_libstdcxx(str(maps)) is None
    maps.write_text(f"7f02-7f03 r-xp 00000000 08:01 13 {tmp_path}/gone/libstdc++.so.6\n")
    assert loaded_libstdcxx(str(maps)) is None  # mapped but deleted: nothing to link
    assert loaded_libstdcxx(str(tmp_path / "no-such-file")) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps is Linux's")
def test_this_process_has_a_libstdcxx_to_link():
    path = loaded_libstdcxx()
    assert path is not None and os.path.isfile(path) and "libstdc++.so" in os.path.basename(path)
    assert runtime_link_flags() == [path]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps is Linux's")
def test_a_static_libstdcxx_build_keeps_its_numbers_with_the_runtime_linked(tmp_path):
    from torch.utils import cpp_extension

    name = f"cxx_runtime_probe_{os.getpid()}"
    try:
        cpp_extension.load_inline(name=name, cpp_sources=[PROBE.replace("NAMESPACE", name)], extra_cflags=["-O1"],
                                  extra_ldflags=["-static-libstdc++", *runtime_link_flags()],
                                  is_python_module=False, build_directory=str(tmp_path))
    except Exception as exc:  # no compiler, or no static libstdc++ to force: nothing to show here
        pytest.skip(f"the probe did not build: {str(exc)[-200:]}")
    with pytest.raises(ValueError, match=r"got 0 of 3 elements"):
        getattr(torch.ops, name).refuse(torch.zeros(3), 0.0)
