"""harness/checkpoint.py's smoke test: a tiny llama written as llama.cpp's converter writes one
(q and k permuted, Q4_1/Q8_0/F16/F32, a BPE vocabulary), from values all of those and bf16
hold exactly, converts back to the original tensors bit for bit. The real checkpoint: `make test-checkpoint`."""
from __future__ import annotations

import json

import numpy as np
import pytest

from harness import checkpoint

pytestmark = pytest.mark.project_files

LAYERS, HIDDEN, HEADS, KV_HEADS, FFN = 2, 64, 4, 2, 96
HEAD_DIM = HIDDEN // HEADS
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<file_sep>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "Ġa n", "Ġan d", "2 0"]
TEMPLATE = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n'}}"
            "{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\\n'}}{% endif %}")
ROPE_THETA, EPS = 50000.0, 1e-5


def llama_cpp_permute(w, n_head):
    """convert_hf_to_gguf's q and k: each head's two rotary halves interleaved row by row."""
    head = w.shape[0] // n_head
    out = np.empty_like(w)
    for h in range(n_head):
        block = w[h * head:(h + 1) * head]
        out[h * head:(h + 1) * head:2][:] = block[:head // 2]
        out[h * head + 1:(h + 1) * head:2][:] = block[head // 2:]
    return out


def exact_values(rng, shape, kind):
    """Values `kind` and bf16 hold exactly: quantized blocks of 32 span d*(lo..hi), both ends
    present, d a power of two; F32/F16 multiples of 2**-7."""
    rows, cols = shape
    if kind in ("Q4_1", "Q8_0"):
        lo, hi = (-8, 7) if kind == "Q4_1" else (-127, 127)
        q = rng.integers(lo, hi + 1, size=(rows, cols // 32, 32))
        q[..., 0], q[..., 1] = hi, lo
        d = 2.0 ** -rng.integers(3, 7, size=(rows, cols // 32, 1))
        return (q * d).reshape(shape).astype(np.float32)
    return (rng.integers(-127, 128, size=shape) / 128).astype(np.float32)


def tiny_llama(rng):
    """The original model: Hugging Face names -> (tensor, how llama.cpp stores it)."""
    import tokenizers
    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tokens = SPECIAL + alphabet + ["".join(m.split(" ")) for m in MERGES]
    kinds = {"self_attn.q_proj.weight": ((HIDDEN, HIDDEN), "Q4_1"),
             "self_attn.k_proj.weight": ((KV_HEADS * HEAD_DIM, HIDDEN), "Q4_1"),
             "self_attn.v_proj.weight": ((KV_HEADS * HEAD_DIM, HIDDEN), "F16"),
             "self_attn.o_proj.weight": ((HIDDEN, HIDDEN), "Q8_0"),
             "mlp.gate_proj.weight": ((FFN, HIDDEN), "Q4_1"), "mlp.up_proj.weight": ((FFN, HIDDEN), "F32"),
             "mlp.down_proj.weight": ((HIDDEN, FFN), "F32"),
             "input_layernorm.weight": ((1, HIDDEN), "F32"), "post_attention_layernorm.weight": ((1, HIDDEN), "F32")}
    weights = {"model.embed_tokens.weight": (exact_values(rng, (len(tokens), HIDDEN), "Q8_0"), "Q8_0"),
               "model.norm.weight": (exact_values(rng, (1, HIDDEN), "F32")[0] + 1, "F32")}
    for i in range(LAYERS):
        for name, (shape, kind) in kinds.items():
            w = exact_values(rng, shape, kind)
            weights[f"model.layers.{i}.{name}"] = (w[0] + 1 if "norm" in name else w, kind)
    return tokens, weights


GGUF_NAMES = {v: k for k, v in checkpoint.GLOBAL_TENSORS.items()}
GGUF_LAYER = {v: k for k, v in checkpoint.LAYER_TENSORS.items()}


def write_gguf(path, tokens, weights):
    import gguf
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in dict(
            name="tiny llama", block_count=LAYERS, context_length=256, embedding_length=HIDDEN,
            feed_forward_length=FFN, head_count=HEADS, head_count_kv=KV_HEADS, rope_freq_base=ROPE_THETA,
            layer_norm_rms_eps=EPS, rope_dimension_count=HEAD_DIM, vocab_size=len(tokens), tokenizer_model="gpt2",
            tokenizer_pre="smollm", token_list=tokens, token_types=[3 if t in SPECIAL else 1 for t in tokens],
            token_merges=MERGES, bos_token_id=1, eos_token_id=2, unk_token_id=0, pad_token_id=2,
            add_bos_token=False, chat_template=TEMPLATE).items():
        getattr(w, f"add_{key}")(value)
    for hf, (t, kind) in weights.items():
        if hf in GGUF_NAMES:
            name = GGUF_NAMES[hf]
        else:
            layer, rest = hf.removeprefix("model.layers.").split(".", 1)
            name = f"blk.{layer}.{GGUF_LAYER[rest]}"
        if name.endswith(("attn_q.weight", "attn_k.weight")):
            t = llama_cpp_permute(t, HEADS if "attn_q" in name else KV_HEADS)
        qtype = gguf.GGMLQuantizationType[kind]
        if kind in ("Q4_1", "Q8_0"):
            w.add_tensor(name, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, t.astype(np.float16 if kind == "F16" else np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    rng = np.random.default_rng(40)
    tokens, weights = tiny_llama(rng)
    root = tmp_path_factory.mktemp("tiny")
    write_gguf(root / "tiny.gguf", tokens, weights)
    return root, tokens, weights


def test_tiny_gguf_converts_back_to_the_original_tensors_exactly(tiny, tmp_path):
    import torch
    from safetensors.torch import load_file
    root, tokens, weights = tiny
    checkpoint.main(["convert", str(root / "tiny.gguf"), "--out", str(tmp_path / "hf")])
    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert set(got) == set(weights)   # tied embeddings: no lm_head.weight written
    for name, (want, _) in weights.items():
        tensor = got[name]
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor.float(), torch.from_numpy(want.reshape(tensor.shape))), name
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["head_dim"], config["intermediate_size"]) == (
        LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN)
    assert config["vocab_size"] == len(tokens) and config["tie_word_embeddings"] is True
    assert config["rope_parameters"]["rope_theta"] == ROPE_THETA and config["rms_norm_eps"] == EPS
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)

