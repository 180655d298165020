"""Shinkai's GPU kernels: one operation per file, a Triton kernel beside its launcher, and
``reference.py`` with the plain-PyTorch version of each (the test oracle and the CPU path), and ``interpret.py``,
which runs them on CPU tensors under Triton's interpreter.

The name clashes with Hugging Face's ``kernels`` package, which the environment must not hold;
``tests/kernels/test_package.py`` checks that this package is the one that imports.
"""

SHINKAI_KERNELS = True
