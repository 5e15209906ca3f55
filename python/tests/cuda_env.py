"""The CUDA driver of the Python device tests (test_cuda.py, test_dlpack.py), chosen when this
module is imported, before anything touches CUDA (the driver is picked at its first use in a
process; spawned and forkserver children inherit the environment):
- by default the fake driver with two devices (docs/cuda.md, "Testing without a GPU");
- SHMTENSOR_CUDA_TEST_REAL=1: the real driver, as the C++ `gpu` tests (tools/gpu/check,
  tools/gpu/python_check).
"""
import os

import pytest

REAL_DRIVER = os.environ.get("SHMTENSOR_CUDA_TEST_REAL") == "1"
if not REAL_DRIVER:
    os.environ["SHMTENSOR_CUDA_DRIVER"] = "fake"
    os.environ["SHMTENSOR_FAKE_CUDA_DEVICES"] = "2"
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)

# The tests' second device: cuda:1 of the fake driver's two; with the real driver, cuda:1
# where SHMTENSOR_CUDA_TEST_DEVICES says there are two, else cuda:0.
I1 = 1 if not REAL_DRIVER or int(os.environ.get("SHMTENSOR_CUDA_TEST_DEVICES", "1")) > 1 else 0
D1 = f"cuda:{I1}"

# Tests that need the fake driver's two devices, or make it fail.
FAKE_ONLY = pytest.mark.skipif(REAL_DRIVER, reason="the fake driver's two devices, or its failures")
