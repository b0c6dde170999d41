"""sglang-kernel 0.4.5's compiled ops on a torch 2.11 machine: pack.sh, setup.sh, and the
op recorder sgl_kernel_calls.py, which setup.sh hooks into the unpacked package."""
