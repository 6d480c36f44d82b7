"""Wan's text encoder: umT5-XXL's encoder, from Wan's own checkpoint (`models_t5_umt5-xxl-enc-bf16.pth`) or a
transformers folder, run as transformers' `UMT5EncoderModel`; the prompt embedding formed as Wan forms it.

Wan's T5 names its weights `token_embedding`, `blocks.{i}.{norm1, attn.{q,k,v,o}, pos_embedding.embedding,
norm2, ffn.{gate.0, fc1, fc2}}` and `norm`: every block has its own relative-position table (umT5: no shared
position bias), the gated feed-forward is `fc2(fc1(x) * gelu_tanh(gate(x)))`, attention is unscaled: the same
computation as transformers' UMT5 (`wi_0` the gate, `wi_1` the linear branch). `WAN_TO_UMT5` below maps the names.

The embedding (Wan's convention): the prompt cleaned (ftfy, HTML unescaped twice, whitespace collapsed), tokenized
with the end-of-sequence token and padded / truncated to 512 tokens, encoded with the padding masked out, and the
positions past the prompt's tokens set to zero: [1, 512, 4096].

transformers (and ftfy, sentencepiece) come with the `wan` extra (`pip install -e ".[wan]"`); they are imported
only here, only when a real checkpoint is loaded.
"""
from __future__ import annotations

import html
import re
from pathlib import Path

import torch

from .state_dicts import CheckpointError, check_tensors, describe_missing, empty_init, first_line, load_strict, \
    merged_keys_error, read_json, read_safetensors, read_torch

TEXT_LEN = 512  # Wan's text length (tokens)
UMT5_XXL = dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_heads=64, num_layers=24,
                relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
                layer_norm_epsilon=1e-6, dropout_rate=0.0, tie_word_embeddings=False)
# Wan's block names -> UMT5's (under encoder.block.{i}.)
WAN_TO_UMT5 = {"norm1.weight": "layer.0.layer_norm.weight",
               "attn.q.weight": "layer.0.SelfAttention.q.weight", "attn.k.weight": "layer.0.SelfAttention.k.weight",
               "attn.v.weight": "layer.0.SelfAttention.v.weight", "attn.o.weight": "layer.0.SelfAttention.o.weight",
               "pos_embedding.embedding.weight": "layer.0.SelfAttention.relative_attention_bias.weight",
               "norm2.weight": "layer.1.layer_norm.weight", "ffn.gate.0.weight": "layer.1.DenseReluDense.wi_0.weight",
               "ffn.fc1.weight": "layer.1.DenseReluDense.wi_1.weight", "ffn.fc2.weight": "layer.1.DenseReluDense.wo.weight"}
EMBED, EMBED_ALIAS = "shared.weight", "encoder.embed_tokens.weight"  # one tensor under two names (tied)


class MissingDependency(ImportError):
    """A package of the `wan` extra is not installed."""


def require(module: str):
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingDependency(f"loading Wan checkpoints needs the '{module.split('.')[0]}' package: install the "
                                "wan extra (pip install -e \".[wan]\" in the repository)") from None


def wan_key_to_umt5(key: str) -> str | None:
    """Wan's T5 encoder key -> UMT5EncoderModel's (None: not a key of Wan's encoder)."""
    if key == "token_embedding.weight":
        return EMBED
    if key == "norm.weight":
        return "encoder.final_layer_norm.weight"
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)", key)
    if m and m.group(2) in WAN_TO_UMT5:
        return f"encoder.block.{int(m.group(1))}.{WAN_TO_UMT5[m.group(2)]}"
    return None


_UMT5_TO_WAN = {v: k for k, v in WAN_TO_UMT5.items()}


def umt5_key_to_wan(key: str) -> str:
    """UMT5EncoderModel's key -> the name Wan's T5 file gives it (the inverse of wan_key_to_umt5, for naming the keys
    a file lacks in its own terms; a key Wan's file has no name for is returned as it is)."""
    if key in (EMBED, EMBED_ALIAS):
        return "token_embedding.weight"
    if key == "encoder.final_layer_norm.weight":
        return "norm.weight"
    m = re.fullmatch(r"encoder\.block\.(\d+)\.(.+)", key)
    return f"blocks.{m.group(1)}.{_UMT5_TO_WAN[m.group(2)]}" if m and m.group(2) in _UMT5_TO_WAN else key


def _config_from_wan(sd: dict, source) -> dict:
    """umT5-XXL's architecture (24 layers) with the widths read from the checkpoint (every key is then checked
    against them): vocab and model width from the embedding, heads and buckets from block 0's position table."""
    probe = ["token_embedding.weight", "blocks.0.pos_embedding.embedding.weight", "blocks.0.attn.q.weight",
             "blocks.0.ffn.fc1.weight"]
    missing = [k for k in probe if k not in sd or sd[k].dim() != 2]
    if missing:
        raise CheckpointError(f"{source}: not a Wan umT5 encoder checkpoint: missing {', '.join(missing)}")
    vocab, d_model = sd[probe[0]].shape
    buckets, heads = sd[probe[1]].shape
    return dict(UMT5_XXL, vocab_size=vocab, d_model=d_model, num_heads=heads, relative_attention_num_buckets=buckets,
                d_kv=sd[probe[2]].shape[0] // heads, d_ff=sd[probe[3]].shape[0])


def read_wan_t5(path: Path):
    """(UMT5 config kwargs, state dict in UMT5 names, UMT5 name -> Wan name) from Wan's T5 encoder file."""
    sd = check_tensors(read_torch(path), path)
    config = _config_from_wan(sd, path)
    out, names, merged = {}, {}, []
    for key, t in sd.items():
        new = wan_key_to_umt5(key) or key  # not Wan's: kept, and reported as unexpected
        if new in out:  # (a Wan name beside its transformers name: one would silently replace the other)
            merged.append(key)
        out[new], names[new] = t, key
    if merged:
        raise merged_keys_error(path, "umT5 encoder", merged)
    if EMBED in out:
        out[EMBED_ALIAS] = out[EMBED]
    return config, out, names


def read_hf_t5(folder: Path):
    """(config kwargs, state dict) from a transformers UMT5EncoderModel folder (config.json + safetensors)."""
    config = read_json(folder / "config.json")
    sd = read_safetensors(folder)
    for a, b in ((EMBED, EMBED_ALIAS), (EMBED_ALIAS, EMBED)):
        if a in sd and b not in sd:
            sd[b] = sd[a]
    return config, sd, {}


def wan_clean(text: str) -> str:
    """Wan's prompt cleaning ('whitespace'): ftfy, HTML unescaped twice, whitespace collapsed."""
    ftfy = require("ftfy")
    text = html.unescape(html.unescape(ftfy.fix_text(text))).strip()
    return re.sub(r"\s+", " ", text).strip()


class UMT5TextEncoder:
    """prompt -> [1, text_len, d_model] (Wan's convention, module docstring) in `out_dtype` on `device`.

    The encoder's weights stay on the CPU (memory-mapped from the file when its dtype is `dtype`); each call
    copies them to `device`, encodes and frees that copy again unless `keep_on_device` (umT5-XXL is ~11 GB in
    BF16: more than the 1.3B transformer and its cache, and needed once per prompt)."""

    def __init__(self, config: dict, sd: dict, tokenizer_dir: Path, source, *, names=None, missing_names=None,
                 device="cpu", dtype=torch.bfloat16, out_dtype=None, text_len: int = TEXT_LEN,
                 keep_on_device: bool = False):
        self.config = require("transformers").UMT5Config.from_dict(config)
        self.source, self.device, self.dtype = source, torch.device(device), dtype
        self.out_dtype, self.text_len, self.keep_on_device = out_dtype or dtype, text_len, keep_on_device
        self.cpu_model = load_strict(self._empty(), sd, source, what="umT5 encoder", file_names=names,
                                     missing_names=missing_names, dtype=dtype)
        self.tokenizer = load_tokenizer(tokenizer_dir)
        rows = self.config.vocab_size
        if len(self.tokenizer) > rows:  # its ids would index past the embedding (an IndexError at the first prompt)
            raise CheckpointError(f"{tokenizer_dir}: a tokenizer of {len(self.tokenizer)} tokens for an encoder "
                                  f"({source}) whose embedding has {rows} rows: not the encoder's tokenizer")
        self._on_device = None

    def _empty(self):
        with empty_init():
            return require("transformers").UMT5EncoderModel(self.config)

    def _model(self):
        if self.device.type == "cpu":
            return self.cpu_model
        if self._on_device is None:
            sd = self.cpu_model.state_dict()
            model = load_strict(self._empty(), sd, self.source, what="umT5 encoder", device=self.device)
            if not self.keep_on_device:
                return model
            self._on_device = model
        return self._on_device

    @torch.no_grad()
    def __call__(self, prompt: str) -> torch.Tensor:
        tok = self.tokenizer([wan_clean(prompt)], padding="max_length", truncation=True, max_length=self.text_len,
                             add_special_tokens=True, return_tensors="pt")
        ids, mask = tok["input_ids"].to(self.device), tok["attention_mask"].to(self.device)
        out = self._model()(input_ids=ids, attention_mask=mask).last_hidden_state
        out[:, int(mask[0].sum()):] = 0  # Wan zeroes the context past the prompt's tokens
        return out.to(self.out_dtype)


def load_tokenizer(folder: Path):
    """transformers' AutoTokenizer from a local folder (no download)."""
    auto = require("transformers").AutoTokenizer
    if not Path(folder).is_dir():
        raise CheckpointError(f"{folder}: {describe_missing(folder, 'tokenizer folder')}")
    try:
        return auto.from_pretrained(str(folder), local_files_only=True)
    except (MemoryError, KeyboardInterrupt):
        raise
    except Exception as e:
        raise CheckpointError(f"{folder}: not a readable tokenizer folder ({first_line(e)})") from None
