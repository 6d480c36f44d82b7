"""Fixtures of the evaluation-suite tests: a tiny random world model (16 x 16 frames, 2 layers, 1 head of 64
channels: a chunk is 48 tokens), so that whole sweeps and reports run in seconds."""
from __future__ import annotations

import copy

import pytest
import torch
from parent_helpers import reexport

reexport(globals())  # (tests/conftest.py's helpers for the top-level test modules collected after this file)

TINY_PRESET = dict(
    sweep=dict(inputs=["coffee"], seeds=[0, 1], methods=["rtn", "qvg"], bits=[2], kmeans_seeds=[0, 1],
               floor_bits=[2], chunks=2, onset_chunks=1, threshold=30.0),
    long=dict(image="coffee", seed=0, chunks=4, every=3, methods=[["qvg int2", "qvg", {"bits": 2}]]),
    block=dict(image="coffee", seed=0, chunks=2, bits=2, sizes=[16, 64]),
    kv=dict(chunks=[1, 2], kmeans_seeds=[0, 1]),
    warm=dict(chunks=[0, 1, 2, 3], layers=[1], iters=10),
    rope=dict(chunks=[0, 1, 2]))


def tiny_world(seed: int = 0):
    from qvg.pipelines.world_model import DEFAULT_CONFIG, build_world
    cfg = copy.deepcopy(DEFAULT_CONFIG)
    cfg["transformer"].update(num_attention_heads=1, attention_head_dim=64, ffn_dim=64, num_layers=2, text_dim=16,
                              freq_dim=32)
    cfg["frame_size"] = 16
    model = build_world(cfg, seed=seed).eval()
    with torch.no_grad():  # random, but not silent: the zero-initialised action embedding gets weights too
        model.condition_embedder.time_embedder.action_embedding.weight.normal_(0, 0.5)
    return model, cfg


@pytest.fixture(scope="module")
def tiny_runner():
    from qvg.eval.runners import EmbeddedRunner
    model, cfg = tiny_world()
    return EmbeddedRunner(model, cfg, "cpu")


@pytest.fixture
def tiny_preset():
    return copy.deepcopy(TINY_PRESET)


@pytest.fixture
def tiny_backbones(monkeypatch):
    """The VBench backbones' architecture check (`backbones.EXPECTED`: ViT-B/16, B/32, L/14) taking the tests'
    tiny random ViT / CLIP (test_vbench.VIT, CLIP: widths 64 and 32) for the real ones, so their loading paths
    run in seconds; the check itself is tested with the real numbers."""
    from qvg.eval.vbench import backbones
    monkeypatch.setattr(backbones, "EXPECTED", {
        "dino": ("DINO ViT-B/16", {"patch_size": 16, "hidden_size": 64}),
        "clip-b32": ("CLIP ViT-B/32", {"patch_size": 32, "hidden_size": 32}),
        "clip-l14": ("CLIP ViT-L/14", {"patch_size": 32, "hidden_size": 32})})
