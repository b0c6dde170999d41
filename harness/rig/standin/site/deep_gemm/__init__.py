"""Stand-in for the `deep_gemm` package (DeepSeek's FP8 GEMM library), import only.

SGLang 0.5.20 imports `deep_gemm` unconditionally on CUDA in
`srt/layers/attention/dsa_backend.py`, which `models/deepseek_v2.py` reaches through its
MLA forward methods; without the package SGLang skips its own DeepSeek model file and
falls back to the Transformers backend, which cannot serve MLA. A bf16 DeepSeek-V2 model
with the triton attention backend never calls deep_gemm, so this package only has to
import. Run servers with SGLANG_ENABLE_JIT_DEEPGEMM=false, so that SGLang does not take
its presence as a usable library; any attribute use raises, naming what was reached.
"""


def __getattr__(name):
    raise AttributeError(f"deep_gemm stand-in: {name} is not available (import-only stand-in)")
