"""The GPU verification rig (README.md beside this file): stand-ins, sglang-kernel's real
ops and their recorder, the Mooncake bundle, and the one-call device session."""
