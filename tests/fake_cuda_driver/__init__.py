"""Test support: a stub and a FAKE CUDA driver for running fa_verify's PyCUDA path without a GPU.

See build.py (building them and PyCUDA), generate_stub.py (the stub from cuda.h), fake_driver.c
(the fake's entry points) and launch.py (its launches, on the CUDA-on-CPU runner). Nothing here
is, or stands for, a GPU: tests that use it say "fake driver".
"""
