"""Loading Self-Forcing / Wan2.1 checkpoints (pipelines/checkpoints.py) from tiny checkpoints written here in the
original formats: the generator .pt ({'generator', 'generator_ema'} with Wan's key names under `model.`), the Wan
VAE .pth, Wan's umT5 .pth and a tokenizer folder. The original-format dicts are made from seeded diffusers /
transformers models through inverse key tables written out below, so loading them back proves the converters."""
import json
import os
import re
import shutil

import pytest
import torch

from optional_deps import need

need("transformers", "pip install -e '.[wan]'")
need("ftfy", "pip install -e '.[wan]'")  # (the `wan` extra: CI has it; the bare GPU image does not)
from transformers import UMT5Config, UMT5EncoderModel  # noqa: E402

from qvg.pipelines.causal_wan import CausalWanTransformer  # noqa: E402
from qvg.pipelines.checkpoints import load_self_forcing, wan_name, wan_vae_name  # noqa: E402
from qvg.pipelines.state_dicts import CheckpointError  # noqa: E402

WAN_CONFIG = {"_class_name": "WanModel", "model_type": "t2v", "dim": 128, "num_heads": 2, "ffn_dim": 256,
              "freq_dim": 64, "text_dim": 32, "num_layers": 2, "in_dim": 16, "out_dim": 16, "text_len": 512,
              "eps": 1e-6}
TRANSFORMER = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=64, in_channels=16, out_channels=16,
                   text_dim=32, freq_dim=64, ffn_dim=256, num_layers=2)
T5 = dict(vocab_size=40, d_model=32, d_kv=8, d_ff=64, num_heads=4, num_layers=24, relative_attention_num_buckets=32,
          relative_attention_max_distance=128, feed_forward_proj="gated-gelu", layer_norm_epsilon=1e-6,
          dropout_rate=0.0, tie_word_embeddings=False)
WORDS = "a red fox running through fresh snow cinematic the cat".split()
WAN = "wan_models/Wan2.1-T2V-1.3B"
F32 = dict(dtype=torch.float32, text_dtype=torch.float32)


# --- inverse key tables: diffusers / transformers names -> the original (Wan) names ---------------------------------
# (the transformer's and the VAE's are the product's: qvg.pipelines.checkpoints.wan_name / wan_vae_name, checked
# against diffusers' converters below)

T5_BLOCK = {"layer.0.layer_norm.weight": "norm1.weight", "layer.0.SelfAttention.q.weight": "attn.q.weight",
            "layer.0.SelfAttention.k.weight": "attn.k.weight", "layer.0.SelfAttention.v.weight": "attn.v.weight",
            "layer.0.SelfAttention.o.weight": "attn.o.weight",
            "layer.0.SelfAttention.relative_attention_bias.weight": "pos_embedding.embedding.weight",
            "layer.1.layer_norm.weight": "norm2.weight", "layer.1.DenseReluDense.wi_0.weight": "ffn.gate.0.weight",
            "layer.1.DenseReluDense.wi_1.weight": "ffn.fc1.weight", "layer.1.DenseReluDense.wo.weight": "ffn.fc2.weight"}


def wan_t5_dict(model) -> dict:
    out = {}
    for k, v in model.state_dict().items():
        if k == "encoder.embed_tokens.weight":
            continue  # the tied alias of shared.weight
        m = re.fullmatch(r"encoder\.block\.(\d+)\.(.+)", k)
        name = {"shared.weight": "token_embedding.weight", "encoder.final_layer_norm.weight": "norm.weight"}.get(k) \
            or f"blocks.{m[1]}.{T5_BLOCK[m[2]]}"
        out[name] = v.clone()
    return out


# --- the tiny checkpoint directory ----------------------------------------------------------------------------------

def _seeded(seed, ctor):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = ctor()
        for p in model.parameters():  # non-trivial norms and biases too
            p.data.add_(0.05 * torch.randn_like(p))
        return model.eval()


def _generator_dict(model) -> dict:
    return {"model." + wan_name(k): v.clone() for k, v in model.state_dict().items()}


def write_tokenizer(folder):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    folder.mkdir(parents=True)
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>", "eos_token": "</s>",
        "unk_token": "<unk>", "model_max_length": 512}))


def source_models() -> dict:
    """The seeded source models."""
    from diffusers import AutoencoderKLWan
    return {"ema": _seeded(1, lambda: CausalWanTransformer(**TRANSFORMER)),
            "raw": _seeded(2, lambda: CausalWanTransformer(**TRANSFORMER)),
            "vae": _seeded(3, lambda: AutoencoderKLWan(base_dim=8)),
            "t5": _seeded(4, lambda: UMT5EncoderModel(UMT5Config(**T5)))}


def write_checkpoint(root, src):
    """root/checkpoints/self_forcing_dmd.pt + root/wan_models/Wan2.1-T2V-1.3B/ as Self-Forcing lays them out (also
    used by tests/app/test_ui.py)."""
    (root / "checkpoints").mkdir()
    torch.save({"generator": _generator_dict(src["raw"]), "generator_ema": _generator_dict(src["ema"])},
               root / "checkpoints" / "self_forcing_dmd.pt")
    wan = root / WAN
    wan.mkdir(parents=True)
    (wan / "config.json").write_text(json.dumps(WAN_CONFIG))
    torch.save({wan_vae_name(k): v.clone() for k, v in src["vae"].state_dict().items()}, wan / "Wan2.1_VAE.pth")
    torch.save(wan_t5_dict(src["t5"]), wan / "models_t5_umt5-xxl-enc-bf16.pth")
    write_tokenizer(wan / "google" / "umt5-xxl")
    return root


@pytest.fixture(scope="module")
def src():
    return source_models()


@pytest.fixture(scope="module")
def ckpt(src, tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("sf"), src)


@pytest.fixture(scope="module")
def loaded(ckpt):
    return load_self_forcing(ckpt, "cpu", **F32)


def _same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def _t5_reference(t5, n_tokens, ids):
    mask = torch.zeros(1, 512, dtype=torch.long)
    mask[:, :n_tokens] = 1
    full = torch.zeros(1, 512, dtype=torch.long)
    full[0, :n_tokens] = torch.tensor(ids)
    with torch.no_grad():
        ref = t5(input_ids=full, attention_mask=mask).last_hidden_state
    ref[:, n_tokens:] = 0
    return ref


def test_original_layout_round_trip(src, loaded):
    transformer, vae, text, sources = loaded
    assert isinstance(transformer, CausalWanTransformer) and sources["weights"] == "generator_ema"
    assert sources["layout"] == "original" and sources["transformer_config"].endswith("config.json")
    assert all(os.path.isabs(sources[k]) for k in ("generator", "wan", "transformer_config"))

    assert sources["generator_bytes"] == __import__("os").path.getsize(sources["generator"])  # (which file it was)
    _same_weights(transformer, src["ema"])
    _same_weights(vae, src["vae"])
    x = torch.randn(1, 16, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    ctx = torch.randn(1, 512, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(transformer(x, torch.tensor([500.0]), ctx), src["ema"](x, torch.tensor([500.0]), ctx))
    # Wan's embedding: cleaned prompt, </s> appended, padded to 512, the rows past the tokens zero
    emb = text("  a red   fox &amp; snow ")
    ids = [WORDS.index(w) + 3 for w in "a red fox".split()] + [2, WORDS.index("snow") + 3, 1]  # '&' is <unk>
    assert emb.shape == (1, 512, 32) and emb.dtype == torch.float32
    assert torch.allclose(emb, _t5_reference(src["t5"], len(ids), ids), atol=1e-6)
    assert emb[0, len(ids) - 1].abs().sum() > 0 and emb[0, len(ids):].abs().sum() == 0
    t5 = text.cpu_model  # the tied embedding is one tensor, loaded once
    assert t5.shared.weight.data_ptr() == t5.encoder.embed_tokens.weight.data_ptr()


def test_a_broken_link_beside_the_one_generator_is_not_in_the_way(ckpt, tmp_path):
    """A dangling *.pt beside the only real generator file, or a dangling VAE link in a folder looked in before the
    complete one: the real files are used (a broken link is said only where nothing else is found)."""
    from qvg.pipelines.checkpoints import find_files
    def edit(r):
        (r / GEN).rename(r / "checkpoints" / "my_gen.pt")
        (r / "checkpoints" / "old.pt").symlink_to(r / "gone.pt")
        (r / WAN).rename(r / "Wan2.1-T2V-1.3B")  # (the complete folder, looked in after wan_models/...)
        (r / WAN).mkdir()
        (r / WAN / "Wan2.1_VAE.pth").symlink_to(r / "gone")
    root = _variant(ckpt, tmp_path, edit)
    files = find_files(root)
    assert files.generator.name == "my_gen.pt" and files.wan == root / "Wan2.1-T2V-1.3B"
    (root / "Wan2.1-T2V-1.3B" / "Wan2.1_VAE.pth").unlink()  # (nothing else found: then the link is named)
    with pytest.raises(CheckpointError, match=r"Wan2.1-T2V-1.3B/Wan2.1_VAE.pth: a broken symbolic link"):
        find_files(root)


def test_reported_config_path_is_absolute_for_a_relative_checkpoint_dir(ckpt, monkeypatch):
    """(the report's transformer_config was the path as typed, useless from another directory)"""
    from qvg.pipelines.checkpoints import find_files, transformer_config
    monkeypatch.chdir(ckpt.parent)
    _, source = transformer_config(find_files(ckpt.name))
    assert os.path.isabs(source) and source.endswith("config.json"), source


@pytest.mark.parametrize("ema,weights", [(False, "generator"), (True, "generator_ema"), (None, "generator_ema")])
def test_ema_selection(src, ckpt, ema, weights):
    m = load_self_forcing(ckpt, "cpu", **F32, ema=ema)
    assert m.sources["weights"] == weights
    _same_weights(m.transformer, src["raw" if weights == "generator" else "ema"])


def _variant(ckpt, tmp_path, edit=None):
    """A copy of the checkpoint directory (files linked), with `edit(root)` applied."""
    root = tmp_path / "ckpt"
    shutil.copytree(ckpt, root, copy_function=lambda s, d: __import__("os").symlink(s, d))
    if edit:
        edit(root)
    return root


def _rewrite(rel, change):
    def edit(root):
        path = root / rel
        obj = torch.load(path, weights_only=True)
        path.unlink()
        out = change(obj)
        if isinstance(out, bytes):
            path.write_bytes(out)
        elif out is not None:
            torch.save(out, path)
    return edit


GEN = "checkpoints/self_forcing_dmd.pt"


def _drop(key):
    def change(obj):
        del obj["generator_ema"][key]
        return obj
    return change


def _add(key, value):
    def change(obj):
        obj["generator_ema"][key] = value
        return obj
    return change


def _replace(key, change):
    def edit(obj):
        obj["generator_ema"][key] = change(obj["generator_ema"][key])
        return obj
    return edit


def _two_generators(root):
    (root / GEN).rename(root / "checkpoints" / "a.pt")
    (root / "other.pt").write_bytes(b"")


def _reshape(obj):
    obj["generator_ema"]["model.blocks.1.self_attn.q.weight"] = torch.zeros(128, 64)
    return obj


BAD = [
    # missing keys named as the file names its keys (Wan's names under Self-Forcing's prefix), as unexpected ones are
    ("missing-key", _rewrite(GEN, _drop("model.blocks.1.ffn.2.bias")), ["1 missing key (model.blocks.1.ffn.2.bias)"]),
    ("missing-keys", _rewrite(GEN, lambda o: {"generator_ema": {k: v for k, v in o["generator_ema"].items()
                                                                if ".norm3." not in k and "head.modulation" not in k}}),
     ["5 missing keys (model.head.modulation, model.blocks.0.norm3.weight, model.blocks.0.norm3.bias, "
      "model.blocks.1.norm3.weight, model.blocks.1.norm3.bias)"]),
    ("missing-key-ddp", _rewrite(GEN, lambda o: {"generator_ema": {f"module.{k}": v for k, v in o["generator_ema"].items()
                                                                   if k != "model.text_embedding.2.weight"}}),
     ["1 missing key (module.model.text_embedding.2.weight)"]),
    # wrappers inside keys (FSDP's, activation checkpointing's): no one prefix rebuilds the file's names
    ("missing-key-fsdp", _rewrite(GEN, lambda o: {"generator_ema": {
        k.replace("model.blocks.1.", "model.blocks.1._checkpoint_wrapped_module."): v
        for k, v in o["generator_ema"].items() if k != "model.blocks.1.ffn.2.bias"}}),
     ["1 missing key (blocks.1.ffn.2.bias; Wan's names, without the file's wrappers)"]),
    ("unexpected-key", _rewrite(GEN, _add("model.blocks.0.extra.weight", torch.zeros(3))),
     ["1 unexpected key", "model.blocks.0.extra.weight"]),
    ("wrong-shape", _rewrite(GEN, _reshape), ["wrong shape", "model.blocks.1.self_attn.q.weight [128, 64]",
                                              "expected [128, 128]"]),
    ("int-tensor", _rewrite(GEN, lambda o: {"generator_ema": {k: v.long() if k == "model.blocks.0.ffn.0.bias" else v
                                                              for k, v in o["generator_ema"].items()}}),
     ["1 tensor of the wrong kind", "model.blocks.0.ffn.0.bias (torch.int64, expected torch.float32)"]),
    ("ema-not-a-dict", _rewrite(GEN, lambda o: {"generator_ema": None}),
     ["no 'generator_ema' or 'generator' state dict ('generator_ema' is a NoneType, not a state dict)"]),
    ("top-level", _rewrite(GEN, lambda o: {"model": o["generator"]}), ["no 'generator_ema' or 'generator'",
                                                                      "top-level keys: 'model'"]),
    ("not-a-dict", _rewrite(GEN, lambda o: {"generator_ema": {"model.x": 3}}), ["not a state dict", "model.x"]),
    ("garbage", _rewrite(GEN, lambda o: b"not a checkpoint at all"),
     ["not a readable PyTorch checkpoint", "the file is only 23 bytes: an incomplete download, or a Git LFS pointer?"]),
    ("fewer-blocks", _rewrite(GEN, lambda o: {"generator_ema": {k: v for k, v in o["generator_ema"].items()
                                                                if not k.startswith("model.blocks.1.")}}),
     ["missing keys", "the model's config is", "config.json", "the checkpoint holds 1 block of dim 128"]),
    ("tokenizer-vocab", _rewrite(f"{WAN}/models_t5_umt5-xxl-enc-bf16.pth",
                                 lambda o: {k: v[:8] if k == "token_embedding.weight" else v for k, v in o.items()}),
     ["google/umt5-xxl: a tokenizer of", "whose embedding has 8 rows: not the encoder's tokenizer"]),
    ("no-generator", lambda r: (r / GEN).unlink(), ["no Self-Forcing generator checkpoint", "self_forcing_dmd.pt"]),
    ("two-generators", _two_generators, ["2 candidate generator checkpoints", "a.pt, other.pt"]),
    ("no-vae", lambda r: (r / WAN / "Wan2.1_VAE.pth").unlink(), ["no Wan2.1-T2V-1.3B files", "Wan2.1_VAE.pth"]),
    ("no-t5", lambda r: (r / WAN / "models_t5_umt5-xxl-enc-bf16.pth").unlink(),
     ["incomplete Wan2.1-T2V-1.3B folder", "missing models_t5_umt5-xxl-enc-bf16.pth"]),
    ("vae-missing-key", _rewrite(f"{WAN}/Wan2.1_VAE.pth", lambda o: {k: v for k, v in o.items()
                                                                     if k != "decoder.head.2.bias"}),
     ["Wan2.1_VAE.pth: not a Wan2.1 VAE checkpoint", "1 missing key (decoder.head.2.bias)"]),
    # a Wan VAE file's unexpected keys in its own names too; and a key in diffusers' names beside its Wan name, which
    # the conversion made one key (one tensor silently replaced the other: strict checking bypassed)
    ("vae-unexpected-key", _rewrite(f"{WAN}/Wan2.1_VAE.pth",
                                    lambda o: {**o, "decoder.upsamples.5.residual.9.weight": torch.ones(3)}),
     ["not a Wan2.1 VAE checkpoint", "1 unexpected key (decoder.upsamples.5.residual.9.weight)"]),
    ("vae-two-names", _rewrite(f"{WAN}/Wan2.1_VAE.pth",
                               lambda o: {**o, "decoder.conv_in.bias": torch.full_like(o["decoder.conv1.bias"], 7.0)}),
     ["not a Wan2.1 VAE checkpoint", "1 unexpected key (", "once converted, another key of the file has the same "
      "name"]),
    # two of the generator's keys that become one once the training wrappers' names are stripped
    ("generator-two-names", _rewrite(GEN, lambda o: {**o, "generator_ema": {
        **o["generator_ema"], "model._orig_mod.head.modulation": o["generator_ema"]["model.head.modulation"] + 1}}),
     ["not a Self-Forcing generator checkpoint", "1 unexpected key (", "once converted, another key of the file has "
      "the same name"]),
    # Wan's T5 file's missing keys in its own names (the embedding, tied to a second name in the model, is one key)
    ("t5-missing-keys", _rewrite(f"{WAN}/models_t5_umt5-xxl-enc-bf16.pth", lambda o: {
        k: v for k, v in o.items() if k not in ("blocks.1.ffn.gate.0.weight", "norm.weight")}),
     ["not a umT5 encoder checkpoint", "2 missing keys (blocks.1.ffn.gate.0.weight, norm.weight)"]),
    ("t5-unexpected-key", _rewrite(f"{WAN}/models_t5_umt5-xxl-enc-bf16.pth",
                                   lambda o: {**o, "blocks.24.norm1.weight": torch.ones(32)}),
     ["not a umT5 encoder checkpoint", "1 unexpected key", "blocks.24.norm1.weight"]),
    ("t5-two-names", _rewrite(f"{WAN}/models_t5_umt5-xxl-enc-bf16.pth",
                              lambda o: {**o, "shared.weight": o["token_embedding.weight"] + 1}),
     ["not a umT5 encoder checkpoint", "1 unexpected key (shared.weight): once converted, another key of the file has "
      "the same name"]),
    ("t5-width", _rewrite(f"{WAN}/models_t5_umt5-xxl-enc-bf16.pth",
                          lambda o: {k: v[..., :16] if k == "token_embedding.weight" else v for k, v in o.items()}),
     ["text encoder width 16 does not match the transformer's text_dim 32"]),
    ("tokenizer", lambda r: shutil.rmtree(r / WAN / "google" / "umt5-xxl") or (r / WAN / "google" / "umt5-xxl").mkdir(),
     ["not a readable tokenizer folder"]),
    ("config", lambda r: (r / WAN / "config.json").unlink() or (r / WAN / "config.json").write_text("{dim: 3"),
     ["config.json: not a readable JSON config"]),
    ("config-heads", lambda r: (r / WAN / "config.json").unlink() or (r / WAN / "config.json").write_text(
        json.dumps({**WAN_CONFIG, "num_heads": 3})), ["config.json: dim 128 is not a multiple of num_heads 3"]),
    ("config-type", lambda r: (r / WAN / "config.json").unlink() or (r / WAN / "config.json").write_text(
        json.dumps({**WAN_CONFIG, "patch_size": 2})), ["config.json: unusable transformer config"]),
    ("config-i2v", lambda r: (r / WAN / "config.json").unlink() or (r / WAN / "config.json").write_text(
        json.dumps({**WAN_CONFIG, "model_type": "i2v"})), ["only text-to-video Wan models"]),
    ("config-float-dim", lambda r: (r / WAN / "config.json").unlink() or (r / WAN / "config.json").write_text(
        json.dumps({**WAN_CONFIG, "dim": 128.0})), ["config.json: dim and num_heads must be positive integers, got "
                                                    "128.0 and"]),
    # tensors without dense data (saved from the meta device, sparse): NotImplementedError in a copy, unnamed, before
    ("meta-tensor", _rewrite(GEN, _replace("model.blocks.0.ffn.0.bias", lambda v: torch.empty(v.shape, device="meta"))),
     ["self_forcing_dmd.pt [generator_ema]: 1 tensor without dense data: model.blocks.0.ffn.0.bias (meta)"]),
    ("sparse-tensor", _rewrite(GEN, _replace("model.blocks.0.ffn.0.bias", lambda v: v.to_sparse())),
     ["1 tensor without dense data: model.blocks.0.ffn.0.bias (torch.sparse_coo)"]),
    ("vae-meta-tensor", _rewrite(f"{WAN}/Wan2.1_VAE.pth", lambda o: {
        **o, "decoder.head.2.bias": torch.empty(o["decoder.head.2.bias"].shape, device="meta")}),
     ["Wan2.1_VAE.pth: 1 tensor without dense data: decoder.head.2.bias (meta)"]),
    # a dangling or looping link was "absent", though `ls` shows the very name
    ("generator-link-loop", lambda r: (r / GEN).unlink() or (r / GEN).symlink_to(r / GEN),
     ["self_forcing_dmd.pt: a broken symbolic link"]),
    ("t5-dangling-link", lambda r: (r / WAN / "models_t5_umt5-xxl-enc-bf16.pth").unlink() or (
        r / WAN / "models_t5_umt5-xxl-enc-bf16.pth").symlink_to(r / "gone"),
     ["models_t5_umt5-xxl-enc-bf16.pth: a broken symbolic link"]),
]


def test_ddp_prefix_is_stripped(src, ckpt, tmp_path):
    """A generator saved from a DistributedDataParallel model (every key under `module.`) loads as the plain one."""
    root = _variant(ckpt, tmp_path, _rewrite(GEN, lambda o: {w: {f"module.{k}": v for k, v in o[w].items()}
                                                             for w in ("generator", "generator_ema")}))
    _same_weights(load_self_forcing(root, "cpu", **F32).transformer, src["ema"])


def test_diffusers_named_generator_loads_as_it_is(src, ckpt, tmp_path):
    """A generator saved with diffusers' key names (a CausalWanTransformer's own state_dict, under the wrapper
    prefix or not) loads unchanged; Wan's converter would have swapped norm2 and norm3 (missing / unexpected
    keys)."""
    for prefix in ("model.", ""):
        root = _variant(ckpt, tmp_path / prefix.strip("."), _rewrite(GEN, lambda o: {
            "generator": {prefix + k: v.clone() for k, v in src["raw"].state_dict().items()},
            "generator_ema": {prefix + k: v.clone() for k, v in src["ema"].state_dict().items()}}))
        _same_weights(load_self_forcing(root, "cpu", **F32).transformer, src["ema"])
        _same_weights(load_self_forcing(root, "cpu", **F32, ema=False).transformer, src["raw"])


def test_diffusers_named_generator_missing_key_is_named_as_the_file_names_keys(src, ckpt, tmp_path):
    sd = {"model." + k: v.clone() for k, v in src["ema"].state_dict().items() if k != "blocks.1.norm2.bias"}
    root = _variant(ckpt, tmp_path, _rewrite(GEN, lambda o: {"generator_ema": sd}))
    with pytest.raises(CheckpointError, match=r"1 missing key \(model\.blocks\.1\.norm2\.bias\)"):
        load_self_forcing(root, "cpu", **F32)


@pytest.mark.parametrize("config", ["tiny", "1.3B"])
def test_wan_names_invert_diffusers_converter(config):
    """wan_name is the inverse of diffusers' Wan converter on every key of a text-to-video transformer (the tests'
    tiny one and Wan2.1-T2V-1.3B's, built on the meta device)."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    from qvg.pipelines.checkpoints import WAN_T2V_1_3B
    from qvg.pipelines.state_dicts import empty_init
    with empty_init():
        model = CausalWanTransformer(**(WAN_T2V_1_3B if config == "1.3B" else TRANSFORMER))
    keys = list(model.state_dict())
    wan = {wan_name(k): k for k in keys}
    assert len(wan) == len(keys) and not any(".attn" in w or "condition_embedder" in w or ".to_" in w for w in wan)
    back = convert_wan_transformer_to_diffusers(dict(wan))  # each Wan name, converted, is the key it came from
    assert back == {k: k for k in keys}
    assert {"head.modulation", "head.head.weight", "time_projection.1.weight", "blocks.0.norm3.weight",
            "blocks.0.self_attn.o.weight", "blocks.0.cross_attn.norm_k.weight", "blocks.0.modulation"} <= set(wan)


@pytest.mark.parametrize("base_dim", [8, 96])
def test_wan_vae_names_invert_diffusers_converter(base_dim):
    """wan_vae_name is the inverse of diffusers' Wan VAE converter on every key of the VAE (the tests' width and
    Wan2.1's, built on the meta device), so a Wan2.1_VAE.pth's missing keys are named as the file names its keys."""
    from diffusers import AutoencoderKLWan
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    from qvg.pipelines.state_dicts import empty_init
    with empty_init():
        keys = list(AutoencoderKLWan(base_dim=base_dim).state_dict())
    wan = {wan_vae_name(k): k for k in keys}
    assert len(wan) == len(keys) and not any(w == k for w, k in wan.items())  # (every key renamed, none twice)
    assert convert_wan_vae_to_diffusers(dict(wan)) == {k: k for k in keys}
    assert {"conv1.weight", "conv2.bias", "decoder.head.2.bias", "encoder.middle.1.to_qkv.weight",
            "decoder.upsamples.3.resample.1.weight", "encoder.downsamples.0.residual.2.weight"} <= set(wan)
    assert wan_vae_name("decoder.something_else.weight") == "decoder.something_else.weight"  # (no rule: as given)


@pytest.mark.parametrize("case,edit,needles", BAD, ids=[b[0] for b in BAD])
def test_bad_checkpoint_one_clear_error(ckpt, tmp_path, case, edit, needles):
    root = _variant(ckpt, tmp_path, edit)
    with pytest.raises(CheckpointError) as e:
        load_self_forcing(root, "cpu", **F32)
    msg = str(e.value)
    assert "\n" not in msg and all(n in msg for n in needles), msg


def test_ema_required_but_absent(ckpt, tmp_path):
    root = _variant(ckpt, tmp_path, _rewrite(GEN, lambda o: {"generator": o["generator"]}))
    with pytest.raises(CheckpointError, match="no 'generator_ema' state dict"):
        load_self_forcing(root, "cpu", **F32, ema=True)
    assert load_self_forcing(root, "cpu", **F32).sources["weights"] == "generator"  # default: falls back


def test_a_malformed_ema_falls_back_to_the_generator_and_says_so(src, ckpt, tmp_path):
    root = _variant(ckpt, tmp_path, _rewrite(GEN, lambda o: {"generator_ema": None, "generator": o["generator"]}))
    with pytest.warns(UserWarning, match="'generator_ema' is a NoneType, not a state dict: loading 'generator'"):
        m = load_self_forcing(root, "cpu", **F32)
    assert m.sources["weights"] == "generator"
    _same_weights(m.transformer, src["raw"])
    with pytest.raises(CheckpointError, match="no 'generator_ema' state dict"):
        load_self_forcing(root, "cpu", **F32, ema=True)


def test_flat_layout_and_default_config(src, ckpt, tmp_path):
    """The generator as the only *.pt in DIR, the Wan files directly in DIR; without config.json the 1.3B config
    is expected, so the tiny generator is reported as the wrong shape."""
    root = tmp_path / "flat"
    root.mkdir()
    (root / "mine.pt").symlink_to(ckpt / GEN)
    for f in (ckpt / WAN).iterdir():
        (root / f.name).symlink_to(f)
    m = load_self_forcing(root, "cpu", **F32)
    assert m.sources["generator"].endswith("mine.pt") and m.sources["wan"] == str(root)
    _same_weights(m.transformer, src["ema"])
    (root / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"not a Wan transformer \(30 layers, dim 1536\) checkpoint"):
        load_self_forcing(root, "cpu", **F32)


def test_diffusers_layout(src, ckpt, tmp_path):
    root = tmp_path / "d"
    (root / "checkpoints").mkdir(parents=True)
    (root / GEN).symlink_to(ckpt / GEN)
    wan = root / "Wan2.1-T2V-1.3B-Diffusers"
    src["vae"].save_pretrained(wan / "vae")
    src["t5"].save_pretrained(wan / "text_encoder")
    shutil.copytree(ckpt / WAN / "google" / "umt5-xxl", wan / "tokenizer")
    (wan / "transformer").mkdir()
    (wan / "transformer" / "config.json").write_text(json.dumps({"_class_name": "WanTransformer3DModel",
                                                                  **TRANSFORMER}))
    m = load_self_forcing(root, "cpu", **F32)
    assert m.sources["layout"] == "diffusers"
    _same_weights(m.transformer, src["ema"])
    _same_weights(m.vae, src["vae"])
    ids = [WORDS.index("cat") + 3, 1]
    assert torch.allclose(m.text_encoder("cat"), _t5_reference(src["t5"], 2, ids), atol=1e-6)


def test_missing_transformers_is_one_clear_error(ckpt, monkeypatch):
    from qvg.pipelines.umt5 import MissingDependency
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)
    with pytest.raises(MissingDependency,
                       match=r"needs the 'transformers' package: install the wan extra \(pip install -e \"\.\[wan\]\""):
        load_self_forcing(ckpt, "cpu", **F32)


# --- qvg-generate on the tiny checkpoint ----------------------------------------------------------------------------

def test_cli_self_forcing_end_to_end(ckpt, tmp_path):
    from qvg.app.generate import main
    out = tmp_path / "sf.mp4"
    assert main(["--pipeline", "self-forcing", "--checkpoint", str(ckpt), "--frames", "1", "--device", "cpu",
                 "--method", "qvg", "--out", str(out), "--quiet"]) == 0
    rep = json.loads(out.with_suffix(".json").read_text())
    assert rep["pipeline"] == "self-forcing" and rep["frames"] == 1 and rep["fps"] == 16
    assert rep["checkpoint"]["weights"] == "generator_ema" and rep["checkpoint"]["generator"].endswith(GEN)
    import imageio.v3 as iio
    assert iio.imread(out).shape == (1, 480, 832, 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sf.json", "sf.mp4"]
    # --weights generator: the raw generator's state dict (Self-Forcing without --use_ema)
    assert main(["--pipeline", "self-forcing", "--checkpoint", str(ckpt), "--frames", "1", "--device", "cpu",
                 "--weights", "generator", "--out", str(tmp_path / "raw.mp4"), "--quiet"]) == 0
    assert json.loads((tmp_path / "raw.json").read_text())["checkpoint"]["weights"] == "generator"


def test_generator_file_chosen_over_the_layouts(src, ckpt, tmp_path, capsys):
    """--generator FILE (load_self_forcing(generator=)) runs that file, wherever it is, instead of the layout's
    self_forcing_dmd.pt; a missing file, or --generator with the embedded model, is one line, exit 2."""
    from qvg.app.generate import main
    other = tmp_path / "elsewhere" / "self_forcing_sid.pt"
    other.parent.mkdir()
    torch.save({"generator": _generator_dict(src["raw"])}, other)
    m = load_self_forcing(ckpt, "cpu", **F32, generator=other)
    assert m.sources["generator"] == str(other) and m.sources["weights"] == "generator"
    _same_weights(m.transformer, src["raw"])
    assert main(["--pipeline", "self-forcing", "--checkpoint", str(ckpt), "--generator", str(other), "--frames",
                 "1", "--device", "cpu", "--out", str(tmp_path / "v.mp4"), "--quiet"]) == 0
    assert json.loads((tmp_path / "v.json").read_text())["checkpoint"]["generator"] == str(other)
    capsys.readouterr()  # (that one-chunk run's note: its cache holds more than BF16 at so short a history)
    sf = ["--pipeline", "self-forcing", "--checkpoint", str(ckpt)]
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    for args, msg in (([*sf, "--generator", str(tmp_path / "no.pt")], "--generator: no such file"),
                      ([*sf, "--generator", str(tmp_path)], "--generator: a directory, not a file"),
                      ([*sf, "--generator", str(tmp_path / "junk.pt")], f"--generator: {tmp_path / 'junk.pt'}: "),
                      (["--generator", str(other)], "--generator applies to --pipeline self-forcing")):
        assert main([*args, "--frames", "1", "--out", str(tmp_path / "w.mp4"), "--quiet"]) == 2
        err = capsys.readouterr().err.strip()
        assert msg in err and len(err.splitlines()) == 1 and not (tmp_path / "w.mp4").exists(), err


@pytest.mark.parametrize("args,msg", [
    (["--pipeline", "self-forcing", "--weights", "ema"], "--weights must be auto, generator_ema, generator"),
    (["--weights", "generator"], "--weights applies to --pipeline self-forcing"),
])
def test_cli_weights_choice_is_checked(ckpt, tmp_path, capsys, args, msg):
    from qvg.app.generate import main
    sf = ["--checkpoint", str(ckpt)] if "self-forcing" in args else []
    assert main([*args, *sf, "--frames", "1", "--out", str(tmp_path / "v.mp4"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and len(err.splitlines()) == 1 and list(tmp_path.iterdir()) == [], err


def test_cli_weights_absent_is_one_line(ckpt, tmp_path, capsys):
    from qvg.app.generate import main
    root = _variant(ckpt, tmp_path, _rewrite(GEN, lambda o: {"generator": o["generator"]}))
    assert main(["--pipeline", "self-forcing", "--checkpoint", str(root), "--weights", "generator_ema", "--frames",
                 "1", "--device", "cpu", "--out", str(tmp_path / "v.mp4"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "no 'generator_ema' state dict" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "v.mp4").exists()


CLI_BAD = [b for b in BAD if b[0] in ("missing-key", "garbage", "no-generator", "no-vae", "meta-tensor",
                                      "generator-link-loop")]


@pytest.mark.parametrize("case,edit,needles", CLI_BAD, ids=[b[0] for b in CLI_BAD])
def test_cli_bad_checkpoint_exit_2_nothing_written(ckpt, tmp_path, capsys, case, edit, needles):
    from qvg.app.generate import main
    root = _variant(ckpt, tmp_path, edit)
    out = tmp_path / "out"
    out.mkdir()
    assert main(["--pipeline", "self-forcing", "--checkpoint", str(root), "--device", "cpu",
                 "--out", str(out / "v.mp4"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qvg-generate: error: --checkpoint: "), err
    assert all(n in err[0] for n in needles), err
    assert list(out.iterdir()) == []


def test_our_modules_import_transformers_lazily():
    """transformers is the `wan` extra's: importing the CLI and the loaders does not import it (diffusers itself
    may, where it is installed)."""
    import subprocess
    import sys
    code = ("import sys; import qvg.app.generate, qvg.pipelines.checkpoints, qvg.pipelines.umt5, "
            "qvg.pipelines.state_dicts; assert 'transformers' not in sys.modules, 'transformers imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


class _Pickled:  # an object a weights-only load refuses
    pass


@pytest.mark.parametrize("case", ["random-bytes", "pickled-object", "truncated-zip"])
def test_unreadable_torch_file_reason_is_ours(tmp_path, case):
    """read_torch's one line gives the reason without the library's advice: a weights-only refusal says what it means
    here (never PyTorch's 'set weights_only=False'), miniz's paragraph is cut to its first sentence."""
    from qvg.pipelines.state_dicts import read_torch
    path = tmp_path / "g.pt"
    if case == "random-bytes":
        path.write_bytes(bytes(range(256)) * 8)
    elif case == "pickled-object":
        torch.save({"x": _Pickled()}, path)
    else:
        torch.save({"w": torch.zeros(64)}, path)
        path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(CheckpointError) as e:
        read_torch(path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{path}: not a readable PyTorch checkpoint (")
    assert "weights_only` set to `False`" not in msg and "If you are seeing this error" not in msg, msg
    if case == "pickled-object":
        assert "pickled Python objects besides tensors, which are never unpickled here" in msg


def test_umt5_key_names_round_trip():
    """umt5_key_to_wan inverts wan_key_to_umt5 on every key of a UMT5 encoder (the tied embedding's two names
    are Wan's one), so a Wan T5 file's missing keys are named as the file would name them."""
    from qvg.pipelines import umt5
    transformers = pytest.importorskip("transformers")
    model = transformers.UMT5EncoderModel(transformers.UMT5Config(
        vocab_size=8, d_model=8, d_kv=4, d_ff=8, num_heads=2, num_layers=2, feed_forward_proj="gated-gelu"))
    for key in model.state_dict():
        wan = umt5.umt5_key_to_wan(key)
        assert wan != key and umt5.wan_key_to_umt5(wan) in (key, umt5.EMBED), key


def test_a_device_that_is_not_here_is_refused_before_any_file_is_read(tmp_path):
    with pytest.raises(ValueError, match="device: not a device: 'gpu'"):
        load_self_forcing(tmp_path / "nothing-here", "gpu")  # (the device first: no 'no checkpoint' error)
