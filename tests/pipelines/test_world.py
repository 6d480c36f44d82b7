"""The embedded world model: data (camera trajectories, rendering), the action-conditioned model, its strict
loader, the teacher-forcing trainer (mask, resumable state) and the shipped weights (CPU)."""
import copy
import json
import random
import shutil
import time

import pytest
import torch

from qvg.pipelines.world_data import (HELD_OUT, Camera, WorldData, cameras_for, load_photo, photo_names,
                                      random_trajectory, render)
from qvg.pipelines.world_model import (ACTIONS, DEFAULT_CONFIG, WORLD_DIR, WorldModelError, build_world, load_world,
                                       parse_actions, rollout, save_world)
from qvg.pipelines.world_train import Trainer, dense_mask, token_layout

SMALL = copy.deepcopy(DEFAULT_CONFIG)
SMALL["transformer"].update(num_layers=1, ffn_dim=64, num_attention_heads=2)
SMALL["frame_size"] = 32


def test_held_out_photos_are_not_in_training():
    train, held = photo_names("train"), photo_names("eval")
    assert sorted(held) == sorted(HELD_OUT) and not set(train) & set(held) and len(train) >= 10


def test_a_pan_shifts_the_view_by_whole_pixels():
    canvas = load_photo("astronaut")
    cams = cameras_for(Camera(150.0, 160.0, 1.0), ["stay", "right"], 3)
    v = render(canvas, cams)
    step = int(DEFAULT_CONFIG["pan_pixels"])
    assert torch.allclose(v[:, 3, :, :-step], v[:, 2, :, step:], atol=1e-5)  # content moved left by `step`
    assert torch.equal(v[:, 0], v[:, 2])  # the start chunk is still


def test_trajectories_stay_inside_and_revisits_come_back():
    rng = random.Random(0)
    for _ in range(50):
        start, acts = random_trajectory(rng, (256, 384), 11, revisit=True)
        assert acts[0] == "stay" and len(acts) == 11 and set(acts) <= set(ACTIONS)
        cams = cameras_for(start, acts, 3)
        assert all(c.inside(256, 384, 64) for c in cams)
    start, acts = random_trajectory(random.Random(3), (256, 384), 9, revisit=True)
    cams = cameras_for(start, acts, 3)
    seen = {(round(c.x, 3), round(c.y, 3), round(c.z, 5)) for c in cams[:len(cams) // 2]}
    assert any((round(c.x, 3), round(c.y, 3), round(c.z, 5)) in seen for c in cams[len(cams) // 2 + 3:])


def test_data_stream_is_seeded():
    a = WorldData(5, 3).batch(2)
    b = WorldData(5, 3).batch(2)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert a[0].shape == (2, 3, 9, 64, 64) and a[0].abs().max() <= 1 and (a[1][:, 0] == 0).all()


def test_action_embedding_starts_at_zero_and_conditions_the_output():
    m = build_world(SMALL).eval()
    x = torch.randn(1, 3, 3, 32, 32)
    t = torch.tensor([500.0])
    with torch.no_grad():
        a = m(x, t, m.null_text(), actions=torch.tensor([1]))
        b = m(x, t, m.null_text(), actions=torch.tensor([2]))
        assert torch.equal(a, b)  # zero-initialised: no effect yet
        m.condition_embedder.time_embedder.action_embedding.weight.normal_()
        a = m(x, t, m.null_text(), actions=torch.tensor([1]))
        b = m(x, t, m.null_text(), actions=torch.tensor([2]))
    assert not torch.allclose(a, b)
    with pytest.raises(ValueError, match="actions must be in"):
        m(x, t, m.null_text(), actions=torch.tensor([7]))


def test_save_and_strict_load(tmp_path):
    m = build_world(SMALL, seed=3)
    save_world(m, SMALL, tmp_path / "w")
    got, cfg = load_world(tmp_path / "w")
    assert cfg["frame_size"] == 32
    for k, v in m.state_dict().items():
        assert torch.allclose(got.state_dict()[k], v, atol=1e-3 * (1 + v.abs().max()))  # FP16 storage
    with pytest.raises(WorldModelError, match="config.json missing"):
        load_world(tmp_path / "nothing")
    bad = dict(SMALL, transformer=dict(SMALL["transformer"], num_layers=2))
    (tmp_path / "w" / "config.json").write_text(json.dumps(bad, default=list))
    with pytest.raises(WorldModelError, match="missing: blocks.1"):
        load_world(tmp_path / "w")
    (tmp_path / "w" / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(WorldModelError, match="unreadable"):
        load_world(tmp_path / "w")


def test_a_broken_config_is_one_error(tmp_path):
    """A config.json that is not UTF-8 JSON, or whose sizes the layers refuse, is a WorldModelError naming the file
    (it was a UnicodeDecodeError / RuntimeError traceback in qvg-eval report --model)."""
    d = tmp_path / "w"
    save_world(build_world(SMALL), SMALL, d)
    neg = dict(SMALL, transformer=dict(SMALL["transformer"], attention_head_dim=-64))
    zero = dict(SMALL, transformer=dict(SMALL["transformer"], num_attention_heads=0))
    odd = dict(SMALL, transformer=dict(SMALL["transformer"], attention_head_dim=63))
    for text in (b"\xff\xfe\x00binary", b"[1, 2]", b"null", b"{}", json.dumps(neg).encode(),
                 json.dumps(zero).encode(), json.dumps(odd).encode()):
        (d / "config.json").write_bytes(text)
        with pytest.raises(WorldModelError, match="config.json: not a world-model config"):
            load_world(d)
    with pytest.raises(WorldModelError, match="cannot read config.json"):
        load_world(d / "model.safetensors")  # (a file given as the folder)


def test_a_config_value_the_runners_cannot_use_is_named(tmp_path):
    """A mistyped or out-of-range field (a string size, world_rope "yes", no steps) is one WorldModelError naming
    the field; it was a TypeError deep in a run, or ran: bool("false") turned world RoPE on."""
    d = tmp_path / "w"
    save_world(build_world(SMALL), SMALL, d)
    cases = [("frame_size", "32", "frame_size must be an integer >= 1 and <= 16384"),
             ("frame_size", 30, "multiple of the patch"), ("frame_size", 32.0, "an integer"),
             ("chunk_frames", 0, "chunk_frames must be an integer >= 1 and <= 1024"),
             ("chunk_frames", True, "chunk_frames"), ("chunk_frames", 10**400, "chunk_frames"),
             ("fps", 10**400, "fps must be a number > 0 and <= 1000"), ("steps", [], "steps must be a non-empty list"),
             ("steps", [1000, "500"], r"steps\[1\] must be a number"), ("steps", [1001], r"<= 1000"),
             ("shift", 0, "shift must be a number > 0"), ("fps", float("nan"), "fps"),
             ("context_sigma", 2, "context_sigma"), ("pan_pixels", -4, "pan_pixels"),
             # (the pipeline's bounds: a config passing here was refused when the rollout built its pipeline)
             ("steps", [1000, 0], r"steps\[1\] must be a number > 0 and <= 1000"),
             ("context_sigma", 1, "context_sigma must be a number >= 0 and < 1, got 1"),
             ("shift", 10**400, "shift must be a number > 0 and <= 1000"),
             ("pan_pixels", 10**400, "pan_pixels must be a number >= 0 and <= 32"), ("zoom_factor", 0, "zoom"),
             ("world_rope", "false", "world_rope must be true or false"),
             ("actions", ["left", "stay"], "must start with 'stay'"), ("actions", ["stay", "stay"], "distinct"),
             ("actions", "stay,left", "non-empty list"), ("transformer", [], "transformer must be an object")]
    for key, value, msg in cases:
        (d / "config.json").write_text(json.dumps(dict(SMALL, **{key: value}), default=list))
        with pytest.raises(WorldModelError, match=f"config.json: not a world-model config \\(.*{msg}"):
            load_world(d)
    (d / "config.json").write_text(json.dumps(dict(SMALL, world_rope=True, pan_pixels=6.0), default=list))
    with pytest.raises(WorldModelError, match="whole number of 4 x 4 patches"):
        load_world(d)


def test_parse_actions():
    assert parse_actions("right*2, left,stay") == [2, 2, 1, 0]
    assert len(parse_actions("left*60000,right*40000")) == 100_000
    assert parse_actions("left, right ,") == [1, 2]  # (a trailing comma is no action)
    for bad, msg in (("fly", "unknown action"), ("left*x", "bad repeat"), ("left*", "bad repeat"),
                     ("left*0", r"in \[1, 100,000\]"), ("left*100001", r"in \[1, 100,000\]"), (" , ", "no actions"),
                     ("left*60000,right*40001", "more than 100,000 chunks"), ("left*100000," * 1000, "more than"),
                     ("left,,right", "empty action at position 2 in 'left,,right'"), (",left", "position 1")):
        with pytest.raises(WorldModelError, match=msg):
            parse_actions(bad)


def test_training_mask():
    copy_, chunk = token_layout(3, 1, 2)  # 3 chunks of one frame of 2 tokens: clean 0,1,2 then noisy 1,2
    m = dense_mask(copy_, chunk)
    tok = {(int(c), int(b)): i for i, (c, b) in enumerate(zip(copy_, chunk))}
    assert m[tok[(0, 2)], tok[(0, 1)]] and m[tok[(0, 1)], tok[(0, 1)]] and not m[tok[(0, 1)], tok[(0, 2)]]
    assert m[tok[(1, 2)], tok[(0, 1)]] and m[tok[(1, 2)], tok[(1, 2)]]
    assert not m[tok[(1, 2)], tok[(0, 2)]]  # a noisy chunk never sees its own clean copy
    assert not m[tok[(1, 2)], tok[(1, 1)]] and not m[tok[(0, 2)], tok[(1, 2)]]


def test_trainer_steps_and_resumes(tmp_path):
    args = dict(chunks=3, batch=2, warmup=2, total_steps=10)
    tr = Trainer(args, SMALL, "cpu", attention="dense")
    data = WorldData(0, 3, SMALL, revisit=0.7)
    tr.train(data, minutes=5, max_steps=2, log_every=1)
    assert tr.step == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in tr.log)
    tr.save(tmp_path / "ck")
    files = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert files[-1] == "state.json" and all((tmp_path / "ck" / f).stat().st_size < 16 * 2**20 for f in files)
    tr2 = Trainer(args, SMALL, "cpu", attention="dense")
    assert tr2.load(tmp_path / "ck") and tr2.step == 2 and len(tr2.log) == len(tr.log)
    for (k, v), w in zip(tr.model.state_dict().items(), tr2.model.state_dict().values()):
        assert torch.equal(v, w), k
    p = next(tr.model.parameters())
    p2 = next(tr2.model.parameters())
    assert torch.allclose(tr.opt.state[p]["exp_avg"], tr2.opt.state[p2]["exp_avg"], rtol=1e-2, atol=1e-8)
    tr2.train(data, minutes=5, max_steps=1)
    assert tr2.step == 3


def test_trainer_saves_every_n_steps_and_a_save_replaces_the_old_state(tmp_path):
    """save_every: the state on disk follows the run (a run killed from outside resumes from the last save); each
    save writes its files before state.json and removes the old ones after it."""
    tr = Trainer(dict(chunks=3, batch=2, warmup=2, total_steps=10), SMALL, "cpu", attention="dense")
    saved = []
    orig = tr.save
    tr.save = lambda d: (orig(d), saved.append(json.loads((tmp_path / "ck" / "state.json").read_text())["step"]))
    tr.train(WorldData(0, 3, SMALL, revisit=0.7), minutes=5, max_steps=5, save_every=2, save_to=tmp_path / "ck")
    assert saved == [2, 4]
    meta = json.loads((tmp_path / "ck" / "state.json").read_text())
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == sorted(meta["files"] + ["state.json"])
    assert all(f.startswith("state-s4-") for f in meta["files"]) and meta["elapsed_seconds"] <= tr.elapsed


def test_rollout_context_is_the_models_own_generation():
    args = dict(chunks=4, batch=2, warmup=2, total_steps=10, rollout_fraction=1.0)
    tr = Trainer(args, SMALL, "cpu", attention="dense")
    frames, actions = WorldData(0, 4, SMALL, revisit=0.0).batch(2)
    ctx = tr.rollout_context(frames, actions)
    cf = SMALL["chunk_frames"]
    assert ctx.shape == (2, 3, 2 * cf, 32, 32) and ctx.abs().max() <= 1 and tr.model.training
    from qvg.cache import KVCache  # the same frames the sampler gives one sequence alone (batching changes nothing)
    from qvg.pipelines.world_model import world_pipeline
    tr.model.eval()
    cache = KVCache(1, "bf16", chunk_frames=cf, tokens_per_frame=tr.model.tokens_per_latent_frame(32, 32))
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=torch.Generator().manual_seed(tr.args["seed"] + 1)))
    one = torch.cat([r.video for r in world_pipeline(tr.model, SMALL).generate(
        tr.model.null_text(2), 2 * cf, (32, 32), cache, seed=seed, batch=2, context=frames[:, :, :cf],
        chunk_inputs=lambda c: {"actions": actions[:, c]})], 2)
    assert torch.allclose(ctx, one, atol=1e-5)
    tr.model.train()
    tr.train(WorldData(1, 4, SMALL, revisit=0.0), minutes=5, max_steps=1, log_every=1)
    assert tr.step == 1 and torch.isfinite(torch.tensor(tr.log[-1]["loss"]))


@pytest.mark.skipif(not (WORLD_DIR / "model.safetensors").is_file(), reason="the embedded model is not built")
def test_shipped_model_beats_copying_the_start_frame_on_a_held_out_photo():
    from qvg.cache import KVCache
    from qvg.eval.metrics import psnr
    model, cfg = load_world()
    canvas = load_photo(HELD_OUT[0])
    acts = ["stay", "right", "right"]
    gt = render(canvas, cameras_for(Camera(190.0, 128.0, 1.0), acts, 3, cfg))
    cache = KVCache(len(model.blocks), "bf16", chunk_frames=3, tokens_per_frame=256)
    vid = torch.cat([r.video[0] for r in rollout(model, cfg, gt[:, 0], [2, 2], cache, seed=0)], 1)
    assert vid.shape == (3, 6, 64, 64)
    ours = psnr(vid, gt[:, 3:])
    copy_ = psnr(gt[:, :1].expand(-1, 6, -1, -1), gt[:, 3:])
    assert ours > copy_ + 2, (ours, copy_)


def test_photo_view_cuts_the_centre_at_the_training_scale():
    """A user's photo is scaled to the bundled photos' short side and its centre view cut at scale 1: for a
    768 x 1024 photo (scale 1/2) the 64-pixel view spans the photo's centre 128 x 128 pixels, not the whole."""
    from qvg.pipelines.world_data import PHOTO_SHORT_SIDE, photo_view
    assert PHOTO_SHORT_SIDE == 384
    img = torch.full((3, 768, 1024), -1.0)
    img[0, 384 - 72:384 + 72, 512 - 72:512 + 72] = 1.0  # a red square of 144 px at the centre, the rest black
    v = photo_view(img)
    assert v.shape == (3, 64, 64)
    assert torch.allclose(v[0], torch.ones(64, 64), atol=0.05) and v[1:].max() < -0.95
    small = photo_view(torch.rand(3, 40, 50) * 2 - 1)  # smaller than the view: upscaled, still a full frame
    assert small.shape == (3, 64, 64) and torch.isfinite(small).all()


WORLD = dict(SMALL, world_rope=True)


def test_pan_offsets_follow_the_camera_and_shift_the_rope_columns():
    """pan_offsets = the camera's path in patches (world_data's signs; zoom frames keep their offset), and a right
    pan of k frames moves frame k's RoPE column index by exactly k patches (the cos / sin tables themselves)."""
    from qvg.pipelines.world_model import pan_offsets, world_inputs
    names = ["stay", "right", "down", "zoom_in", "left", "up", "up"]
    off = pan_offsets(torch.tensor([[ACTIONS.index(a) for a in names]]), WORLD)[0]
    start = Camera(200.0, 200.0, 1.0)
    cams = cameras_for(start, names[:3], 3, WORLD)  # pans at z = 1: 4 view px = 4 canvas px = one patch
    assert off[:9].tolist() == [[round((c.y - start.y) / 4), round((c.x - start.x) / 4)] for c in cams]
    assert off[9:12].tolist() == [[3, 3]] * 3 and off[-1].tolist() == [-3, 0]
    m = build_world(WORLD).eval()
    with pytest.raises(ValueError, match="pass spatial_offsets"):
        m(torch.zeros(1, 3, 3, 32, 32), torch.tensor([0.0]), m.null_text())
    kw = world_inputs(WORLD, torch.tensor([[0, ACTIONS.index("right")]]))
    assert kw["actions"].tolist() == [2] and kw["spatial_offsets"].tolist() == [[[0, 1], [0, 2], [0, 3]]]
    x = torch.zeros(1, 3, 3, 32, 32)
    m.rope.spatial_offsets = kw["spatial_offsets"]
    try:
        shifted = m.rope(x)
    finally:
        m.rope.spatial_offsets = None
    w0 = m.rope.t_dim + m.rope.h_dim  # the column band's first channel
    for got, table in zip(shifted, (m.rope.freqs_cos, m.rope.freqs_sin)):
        g = got.view(3, 8, 8, -1)  # frames, rows, columns of 4 x 4 patches
        for k in range(3):  # frame k has panned k + 1 patches right: column j reads table row j + k + 1
            assert torch.equal(g[k, 5, :, w0:], table[k + 1:k + 9, w0:])
            assert torch.equal(g[k, :, 0, m.rope.t_dim:w0], table[:8, m.rope.t_dim:w0])  # rows unchanged


def test_trainer_offsets_follow_the_frame_ids_layout():
    """Training's tokens hold clean copies of all frames, then noisy copies of chunks 1..: their spatial offsets are
    the frames' pan offsets in exactly frame_ids' order, and they reach the model (the loss changes)."""
    from qvg.pipelines.world_model import pan_offsets
    args = dict(chunks=3, batch=2, warmup=2, total_steps=10)
    tr = Trainer(args, WORLD, "cpu", attention="dense")
    frames, actions = WorldData(0, 3, WORLD, revisit=0.0).batch(2)
    actions = torch.tensor([[0, 2, 4], [0, 1, 5]])  # right then down; left then zoom_in
    off = tr.spatial_offsets(actions)
    per_frame = pan_offsets(actions, WORLD)
    assert off.shape == (2, len(tr.frame_ids), 2) and tr.frame_ids.tolist() == list(range(9)) + list(range(3, 9))
    assert torch.equal(off[:, :9], per_frame) and torch.equal(off[:, 9:], per_frame[:, 3:])
    assert off[0, -1].tolist() == [3, 3] and off[1, -1].tolist() == [0, -3]
    plain = Trainer(args, SMALL, "cpu", attention="dense")
    assert plain.spatial_offsets(actions) is None
    plain.model.load_state_dict(tr.model.state_dict())
    for t in (tr, plain):
        t.gen.manual_seed(7)
    with torch.no_grad():
        assert not torch.equal(tr.loss(frames, actions), plain.loss(frames, actions))


def test_world_rope_rollout_gives_each_chunk_its_pan_offsets():
    """rollout (and through it the eval runners) passes every forward of chunk c the offsets of chunk c's frames
    after all earlier actions; with the same weights the video differs from screen-coordinate RoPE."""
    from qvg.cache import KVCache
    m = build_world(WORLD, seed=2).eval()
    seen = []
    m.register_forward_pre_hook(lambda mod, a, kw: seen.append(kw["spatial_offsets"].tolist()), with_kwargs=True)
    start = torch.rand(3, 32, 32) * 2 - 1
    acts = [ACTIONS.index("right"), ACTIONS.index("up")]
    vid = torch.cat([r.video for r in rollout(m, WORLD, start, acts, KVCache(1, "bf16", chunk_frames=3,
                                                                          tokens_per_frame=64), seed=0)], 2)
    steps = len(WORLD["steps"]) + 1  # denoising steps + the clean re-run
    assert seen == [[[[0, 0]] * 3]] + [[[[0, 1], [0, 2], [0, 3]]]] * steps + [[[[-1, 3], [-2, 3], [-3, 3]]]] * steps
    plain = build_world(SMALL, seed=2).eval()
    ref = torch.cat([r.video for r in rollout(plain, SMALL, start, acts, KVCache(1, "bf16", chunk_frames=3,
                                                                             tokens_per_frame=64), seed=0)], 2)
    assert not torch.equal(vid, ref)


def test_photo_view_bounds_its_work_and_says_what_it_takes():
    """An extreme strip is cut to 4:1 around its centre before scaling (a 16 x 32,000 PNG took gigabytes); a photo
    in [H, W, 3] order is refused; a photo within 4:1 is scaled whole, as before."""
    from qvg.pipelines.world_data import photo_view
    strip = torch.rand(3, 16, 32000) * 2 - 1
    assert photo_view(strip).shape == (3, 64, 64)
    assert torch.equal(photo_view(strip), photo_view(strip[:, :, (32000 - 64) // 2:(32000 - 64) // 2 + 64]))
    with pytest.raises(ValueError, match=r"a photo must be a tensor \[3, H, W\] \(channels first\), got \[64, 80, 3\]"):
        photo_view(torch.zeros(64, 80, 3))
    from qvg.pipelines.world_data import PHOTO_SHORT_SIDE, centre_view
    wide = torch.rand(3, 512, 1990) * 2 - 1  # (3.9:1: scaled whole, as before the cut)
    f = PHOTO_SHORT_SIDE / 512
    whole = torch.nn.functional.interpolate(wide[None], size=(round(512 * f), round(1990 * f)), mode="area")[0]
    assert torch.equal(photo_view(wide), centre_view(whole.clamp(-1, 1), 64))


def test_rollout_takes_action_names_and_says_what_does_not_fit():
    from qvg.cache import KVCache
    model, cfg = build_world(SMALL), SMALL
    size, cf = cfg["frame_size"], cfg["chunk_frames"]
    tpf = model.tokens_per_latent_frame(size, size)

    def cache(layers=len(model.blocks), tokens=tpf):
        return KVCache(layers, "bf16", chunk_frames=cf, tokens_per_frame=tokens)
    start = torch.zeros(3, size, size)
    by_name = [r.video for r in rollout(model, cfg, start, ["left", "stay"], cache())]
    by_id = [r.video for r in rollout(model, cfg, start, [ACTIONS.index("left"), 0], cache())]
    by_tensor = [r.video for r in rollout(model, cfg, start, torch.tensor([ACTIONS.index("left"), 0]), cache())]
    by_iter = [r.video for r in rollout(model, cfg, start, (a for a in ["left", "stay"]), cache())]
    assert len(by_name) == 2 and all(torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d)
                                     for a, b, c, d in zip(by_name, by_id, by_tensor, by_iter))
    for kw, msg in ((dict(start=start.permute(1, 2, 0)), rf"start must be a frame \[3, {size}, {size}\]"),
                    (dict(actions=["fly"]), "unknown action 'fly'"), (dict(actions=[99]), "unknown action 99"),
                    (dict(c=cache(layers=len(model.blocks) + 1)), "the cache must have num_layers"),
                    (dict(c=cache(tokens=tpf * 2)), f"tokens_per_frame={tpf}"),
                    # values outside [-1, 1] (an image's 0..255, a uint8 tensor) and NaN ran silently
                    (dict(start=start + 200), r"values in \[-1, 1\] .* got torch.float32 in \[200.0, 200.0\]"),
                    (dict(start=start.to(torch.uint8)), "floating-point frame"),
                    (dict(start=start + float("nan")), "floating-point frame"),
                    (dict(actions="left"), "give a list of at least one action"),
                    (dict(actions=[]), "give a list of at least one action"),
                    (dict(actions=1), "give a list of at least one action"),
                    (dict(actions=torch.tensor(1)), "give a list of at least one action")):
        with pytest.raises(ValueError, match=msg):
            rollout(model, cfg, kw.get("start", start), kw.get("actions", ["left"]), kw.get("c") or cache())


def test_train_numbers_out_of_range_are_one_line_and_write_nothing(tmp_path, capsys):
    """A NaN or negative learning rate, an empty batch, no chunks, negative minutes: one error line and exit 2 before
    anything runs (they were tracebacks from deep in a step, or a saved untrained state)."""
    from qvg.pipelines import world_train as wt
    ck = tmp_path / "ck"
    for args, msg in ((["--lr", "nan"], "--lr must be > 0 and <= 1, got nan"),
                      (["--batch", "0"], "--batch must be >= 1"),
                      (["--chunks", "1"], "--chunks must be >= 2"), (["--minutes", "-1"], "--minutes must be > 0"),
                      (["--max-steps", "0"], "--max-steps must be >= 1"), (["--save-every", "-1"], "--save-every"),
                      (["--seed", str(2**32)], "--seed must be >= 0 and <= 4294967295"),
                      (["--chunks", "2", "--rollout-fraction", "0.5"], "--rollout-fraction 0.5 needs --chunks >= 3"),
                      (["--revisit-fraction", "1.5"], "<= 1"), (["--warmup", "1_0"], "invalid integer value")):
        with pytest.raises(SystemExit) as e:
            wt.main(["--ckpt", str(ck), *args])
        err = capsys.readouterr().err
        assert e.value.code == 2 and msg in err and err.count("\n") == 1, err
        assert err.startswith("python -m qvg.pipelines.world_train: error: ")
    assert not ck.exists()


def test_resuming_with_other_settings_says_so_and_records_them(tmp_path, capsys, monkeypatch):
    """A resumed run applies a changed setting, says so on stderr and keeps it in state.json and the exported card;
    --init on a directory that holds a state is refused (exit 2) instead of being ignored."""
    from qvg.pipelines import world_train as wt
    monkeypatch.setattr(wt, "DEFAULT_CONFIG", SMALL)
    ck = str(tmp_path / "ck")
    base = ["--ckpt", ck, "--device", "cpu", "--attention", "dense", "--max-steps", "1", "--chunks", "3",
            "--batch", "1"]
    assert wt.main(base + ["--warmup", "2"]) == 0
    assert "changed settings" not in capsys.readouterr().err
    assert wt.main(base + ["--warmup", "2"]) == 0  # the same settings again: nothing to say
    assert "changed settings" not in capsys.readouterr().err
    assert wt.main(base + ["--lr", "0.0001"]) == 0
    err = capsys.readouterr().err
    assert "resumed at step 2 with changed settings: lr 0.0003 -> 0.0001" in err
    meta = json.loads((tmp_path / "ck" / "state.json").read_text())
    assert meta["setting_changes"] == [{"step": 2, "settings": {"lr": [0.0003, 0.0001]}}] and meta["args"]["lr"] == 1e-4
    assert wt.main(["--ckpt", ck, "--export", str(tmp_path / "model")]) == 0
    card = json.loads((tmp_path / "model" / "config.json").read_text())
    assert "setting_changes" in json.dumps(card)
    with pytest.raises(SystemExit) as e:
        wt.main(base + ["--init", str(tmp_path / "model")])
    assert e.value.code == 2 and "already holds a training state (step 3)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # settings with --export would only rewrite the card's record
        wt.main(["--ckpt", ck, "--export", str(tmp_path / "model2"), "--lr", "0.1"])
    assert e.value.code == 2 and "drop --lr" in capsys.readouterr().err and not (tmp_path / "model2").exists()
    with pytest.raises(SystemExit) as e:  # run flags with --export: nothing would run them, so refused too
        wt.main(["--ckpt", ck, "--export", str(tmp_path / "model2"), "--max-steps", "5", "--device", "cpu",
                 "--compile"])
    assert e.value.code == 2 and "drop --device, --compile, --max-steps" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # a run flag given as 0 is given too
        wt.main(["--ckpt", ck, "--export", str(tmp_path / "model2"), "--save-every", "0"])
    assert e.value.code == 2 and "drop --save-every" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # a device that is not there (torch takes cpu:5 as the CPU)
        wt.main(base + ["--device", "cpu:5"])
    assert e.value.code == 2 and "--device must be cpu or cuda[:N], got 'cpu:5'" in capsys.readouterr().err
    for bad in ("missing", "garbage"):  # no state to export: one error line, nothing written
        (tmp_path / "garbage").mkdir(exist_ok=True)
        (tmp_path / "garbage" / "state.json").write_text("{not json")
        with pytest.raises(SystemExit) as e:
            wt.main(["--ckpt", str(tmp_path / bad), "--export", str(tmp_path / "model3")])
        assert e.value.code == 2 and "holds no readable training state" in capsys.readouterr().err
        assert not (tmp_path / "model3").exists()
    with pytest.raises(SystemExit) as e:  # ... nor one to resume
        wt.main(base[:1] + [str(tmp_path / "garbage")] + base[2:])
    assert e.value.code == 2 and "state.json cannot be read as a training state" in capsys.readouterr().err
    broken = tmp_path / "broken"  # a state whose shard file is gone: export and resume are one error line each
    shutil.copytree(ck, broken)
    for f in broken.glob("*.safetensors"):
        f.unlink()
    for args in (["--ckpt", str(broken), "--export", str(tmp_path / "model3")], base[:1] + [str(broken)] + base[2:]):
        with pytest.raises(SystemExit) as e:
            wt.main(args)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and "does not load (" in err[-1] and "Traceback" not in "".join(err), err
    assert not (tmp_path / "model3").exists()
    damaged = tmp_path / "damaged"  # a shard cut short (a SafetensorError, not an OSError): one line too
    shutil.copytree(ck, damaged)
    for f in damaged.glob("*.safetensors"):
        f.write_bytes(f.read_bytes()[:100])
    shaped = tmp_path / "shaped"  # a state.json that parses but whose args is no object
    shaped.mkdir()
    (shaped / "state.json").write_text(json.dumps({"args": [], "config": {}, "step": 1}))
    (tmp_path / "afile").write_text("x")
    for args, msg in ((["--ckpt", str(damaged), "--export", str(tmp_path / "model3")], "does not load ("),
                      (base[:1] + [str(damaged)] + base[2:], "does not load ("),
                      (base[:1] + [str(shaped)] + base[2:], "cannot be read as a training state"),
                      (base[:1] + [str(tmp_path / "afile")] + base[2:], "is a file; give the folder"),
                      (base[:1] + [str(tmp_path / "fresh")] + base[2:] + ["--init", str(tmp_path / "nomodel")],
                       "--init: " + str(tmp_path / "nomodel") + " is no model this run can start from")):
        with pytest.raises(SystemExit) as e:
            wt.main(args)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and msg in err[-1] and "Traceback" not in "".join(err), (args, err)
    assert not (tmp_path / "model3").exists()
    # a fine-tune resumed with its README command (the same --init again) continues
    tune = ["--ckpt", str(tmp_path / "tune"), "--device", "cpu", "--attention", "dense", "--max-steps", "1",
            "--chunks", "3", "--batch", "1", "--init", str(tmp_path / "model")]
    assert wt.main(tune) == 0 and wt.main(tune) == 0
    assert json.loads((tmp_path / "tune" / "state.json").read_text())["step"] == 2
    # ... also from another folder, the model named by another relative path (its training card matches)
    monkeypatch.chdir(tmp_path)
    rel = ["--ckpt", "tune2", *tune[2:-2], "--init", "model"]
    assert wt.main(rel) == 0
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    assert wt.main(["--ckpt", "../tune2", *tune[2:-2], "--init", "../model"]) == 0
    with pytest.raises(SystemExit):  # another model: refused
        wt.main(["--ckpt", "../tune2", *tune[2:-2], "--init", str(tmp_path / "model2")])
    with pytest.raises(SystemExit) as e:  # --export with --init: refused too
        wt.main(["--ckpt", "../tune2", "--export", "x", "--init", "../model"])
    assert e.value.code == 2 and "drop --init" in capsys.readouterr().err


def test_train_paths_configs_and_records(tmp_path, capsys, monkeypatch):
    """A --ckpt that can't be made (under a file) or an --export onto a file: one line before any training (a
    traceback at the first save, after the run); '' for either is refused (--export '' trained instead). A resumed
    run keeps its saved config (it took the code's defaults, silently); a new --init run takes its model's config,
    world_rope included (fine-tuning a world-RoPE model without --world-rope trained screen RoPE). The exported card
    records each run's argv and commit, the exporting commit and the init weights' SHA-256."""
    from qvg.pipelines import world_train as wt
    from qvg.revision import file_sha256
    monkeypatch.setattr(wt, "DEFAULT_CONFIG", SMALL)
    (tmp_path / "afile").write_text("x")
    base = ["--device", "cpu", "--attention", "dense", "--max-steps", "1", "--chunks", "3", "--batch", "1"]
    for args, msg in ((["--ckpt", str(tmp_path / "afile" / "sub")], "--ckpt: cannot make"),
                      (["--ckpt", ""], "--ckpt: empty"),
                      (["--ckpt", str(tmp_path / "ck"), "--export", ""], "--export: empty"),
                      (["--ckpt", str(tmp_path / "ck"), "--export", str(tmp_path / "afile")], "is not a folder")):
        with pytest.raises(SystemExit) as e:
            wt.main(args + (base if "--export" not in args else []))
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and msg in err[-1] and "Traceback" not in "".join(err), (args, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
    # a resumed run keeps its config (pan_pixels 8, saved with the state), not the code's
    ck = tmp_path / "ck"
    monkeypatch.setattr(wt, "DEFAULT_CONFIG", dict(SMALL, pan_pixels=8.0))
    assert wt.main(["--ckpt", str(ck)] + base) == 0
    monkeypatch.setattr(wt, "DEFAULT_CONFIG", SMALL)
    assert wt.main(["--ckpt", str(ck)] + base) == 0
    meta = json.loads((ck / "state.json").read_text())
    assert meta["config"]["pan_pixels"] == 8.0 and meta["step"] == 2
    assert [r["step"] for r in meta["runs"]] == [0, 1] and meta["runs"][1]["argv"][:2] == ["--ckpt", str(ck)]
    # a world-RoPE model fine-tuned without --world-rope stays world-RoPE
    assert wt.main(["--ckpt", str(tmp_path / "wr"), "--world-rope"] + base) == 0
    assert wt.main(["--ckpt", str(tmp_path / "wr"), "--export", str(tmp_path / "wr-model")]) == 0
    assert wt.main(["--ckpt", str(tmp_path / "tune"), "--init", str(tmp_path / "wr-model")] + base) == 0
    assert wt.main(["--ckpt", str(tmp_path / "tune"), "--export", str(tmp_path / "tuned")]) == 0
    cfg = json.loads((tmp_path / "tuned" / "config.json").read_text())
    assert cfg["world_rope"] is True
    card = cfg["training"]
    assert card["init"]["sha256"] == file_sha256(tmp_path / "wr-model" / "model.safetensors")
    assert card["runs"][0]["argv"][:2] == ["--ckpt", str(tmp_path / "tune")] and card["runs"][0]["commit"]
    assert card["exported"]["commit"] and card["exported"]["date"]


def test_a_second_save_at_the_same_step_keeps_the_saved_state(tmp_path, monkeypatch):
    """The end-of-run save after a save at the same step rewrote the shards state.json named: killed there, the
    state no longer loaded. Each save writes new names now, so the state on disk loads until the new one is in."""
    tr = Trainer(dict(chunks=3, batch=2, warmup=2, total_steps=10), SMALL, "cpu", attention="dense")
    tr.train(WorldData(0, 3, SMALL, revisit=0.7), minutes=5, max_steps=1)
    tr.save(tmp_path / "ck")
    import safetensors.torch
    real = safetensors.torch.save_file

    def killed(tensors, path, metadata=None):  # the second save dies half way through its first shard
        with open(path, "wb") as f:
            f.write(b"\x00" * 10)
        raise KeyboardInterrupt
    monkeypatch.setattr(safetensors.torch, "save_file", killed)
    with pytest.raises(KeyboardInterrupt):
        tr.save(tmp_path / "ck")
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    tr2 = Trainer(dict(chunks=3, batch=2, warmup=2, total_steps=10), SMALL, "cpu", attention="dense")
    assert tr2.load(tmp_path / "ck") and tr2.step == 1


def test_logged_seconds_do_not_count_a_save_twice(tmp_path):
    """After an in-loop save the log's seconds added the time before that save twice (the card's final_log too)."""
    tr = Trainer(dict(chunks=3, batch=2, warmup=2, total_steps=10), SMALL, "cpu", attention="dense")
    orig = tr.save
    tr.save = lambda d: (time.sleep(0.3), orig(d))
    tr.train(WorldData(0, 3, SMALL, revisit=0.7), minutes=5, max_steps=4, log_every=1, save_every=1,
             save_to=tmp_path / "ck")
    secs = [r["seconds"] for r in tr.log]
    assert secs == sorted(secs) and secs[-1] <= tr.elapsed + 0.1, (secs, tr.elapsed)


def test_an_export_stopped_while_writing_leaves_the_model_as_it_was(tmp_path, monkeypatch):
    """save_world writes both files beside their places and puts them in place together: stopped while writing the
    weights, the folder keeps the old weights and config (it held new weights beside the old config before)."""
    import safetensors.torch
    d = tmp_path / "w"
    save_world(build_world(SMALL), SMALL, d)
    before = {p.name: p.read_bytes() for p in d.iterdir()}

    def stopped(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"\x00" * 10)
        raise KeyboardInterrupt
    monkeypatch.setattr(safetensors.torch, "save_file", stopped)
    with pytest.raises(KeyboardInterrupt):
        save_world(build_world(SMALL, seed=1), dict(SMALL, pan_pixels=8.0), d)
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before
