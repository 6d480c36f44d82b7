"""qvg.kmeans: batched Lloyd k-means, checked against scikit-learn's KMeans as the CPU oracle."""
import numpy as np
import pytest
import torch

from conftest import blobs, gen, randn
from optional_deps import need
from qvg.kmeans import MAX_K, SEEDINGS, assign, id_dtype, kmeans, reseed_empty, seed_centroids, update

sklearn_cluster = need("sklearn.cluster", "scikit-learn, in the test extra: pip install -e '.[test]'")


def sk_lloyd(x: torch.Tensor, init: torch.Tensor, iters: int):
    """sklearn's Lloyd from the same init. Its max_iter counts centre updates, and when it stops without strict
    convergence it re-runs the assignment so labels_ belong to cluster_centers_: the same as our iters + final
    assignment (at strict convergence, further Lloyd steps change nothing). Run on one thread, so the result no
    longer depends on the machine's core count (sklearn splits its sums by thread): on the 16-core H100 image the
    oracle test failed three times (pytest-gpu-9219506-h100.log, pytest-gpu-079e987-h100.log, and at 18dc8db with
    the token, d 4.42 against 3.56, that one thread flips on this 2-core machine). Another CPU's float32 kernels may
    still sum in another order; the test's tolerances are for that."""
    from threadpoolctl import threadpool_limits  # (installed with scikit-learn)
    km = sklearn_cluster.KMeans(n_clusters=init.shape[0], init=init.numpy(), n_init=1, max_iter=iters, tol=0.0,
                                algorithm="lloyd")
    with threadpool_limits(limits=1):
        return km.fit(x.numpy())


def brute_assign(x, c):
    """argmin_k |x - c_k|^2 in float64."""
    return torch.cdist(x.double(), c.double()).argmin(-1)


def assert_nearest(x, c, ids, atol=1e-5):
    """Each token's assigned centroid is (up to float rounding, for near-ties) its nearest one."""
    d2 = ((x.double()[:, None, :] - c.double()[None]) ** 2).sum(-1)
    got = d2.gather(1, ids.long()[:, None])[:, 0]
    assert (got <= d2.min(-1).values + atol).all()


# --- oracle: scikit-learn -----------------------------------------------------------------------------------------

ORACLE_CASES = [  # n, d, k, sep, noise, iters, seed
    (600, 8, 10, 20.0, 0.5, 1, 0),   # well-separated blobs
    (600, 8, 10, 20.0, 0.5, 5, 1),
    (1000, 16, 32, 20.0, 0.5, 8, 2),
    (600, 8, 10, 5.0, 1.0, 3, 3),    # overlapping blobs: the centroids really move for several steps
    (800, 4, 16, 3.0, 1.0, 10, 4),
    (500, 32, 8, 2.0, 1.0, 20, 5),
]


@pytest.mark.parametrize("init_kind", ["data", "k-means++"])
@pytest.mark.parametrize("n,d,k,sep,noise,iters,seed", ORACLE_CASES)
def test_matches_sklearn_lloyd(n, d, k, sep, noise, iters, seed, init_kind):
    x, _ = blobs(n, d, k, sep=sep, noise=noise, seed=seed)
    if init_kind == "data":
        init = x[torch.randperm(n, generator=gen(100 + seed))[:k]].clone()
    else:
        init = seed_centroids(x[None], k, seed=seed)[0]
    # both relocate empty clusters, each its own way: the oracle applies only where no assignment left one empty
    for it in range(1, iters + 1):
        if torch.bincount(kmeans(x[None], k, iters=it, init=init[None]).ids[0].long(), minlength=k).min() == 0:
            pytest.skip(f"an empty cluster at iteration {it}: relocation differs from sklearn's by design")
    ours = kmeans(x[None], k, iters=iters, init=init[None], track=True)
    ids, c = ours.ids[0].long(), ours.centroids[0]
    km = sk_lloyd(x, init, iters)
    assert km.n_iter_ <= iters
    # centroids: sklearn's after `iters` updates; ids: the assignment those centroids were updated from, i.e.
    # sklearn's labels after iters - 1 updates (our result ends on an update, sklearn's on a final assignment)
    # (float32 sums in another order can part the two runs at a near-tie, after which a token on the border between
    # two centroids that share a blob may flip: on one thread case (1000, 16, 32) flips one, so allow a handful)
    prev = sk_lloyd(x, init, iters - 1).labels_ if iters > 1 else brute_assign(x, init).numpy()
    flipped = ids.numpy() != prev
    assert flipped.mean() <= 0.005
    # a cluster with the same members in both is the mean of the same tokens in both; a flipped token changes only
    # the two clusters it moved between (one token moves such a centroid by ~|x - c| / size, far above rounding),
    # and those are checked as the means of our own members
    # (a safeguard: prev comes from a second sklearn run; had it parted from `km` at an earlier near-tie, as on
    # several threads, km's centre would not be the mean of prev's members: such clusters are left out, and at
    # least half of them must remain)
    moved = set(ids.numpy()[flipped].tolist()) | set(prev[flipped].tolist())
    xs = x.double().numpy()
    consistent = [j for j in range(k) if (prev == j).any() and
                  np.allclose(xs[prev == j].mean(0), km.cluster_centers_[j], atol=1e-4, rtol=0)]
    same = [j for j in consistent if j not in moved]
    assert len(same) >= k // 2
    np.testing.assert_allclose(c.numpy()[same], km.cluster_centers_[same], atol=1e-4, rtol=0)
    assert_cluster_means(x, ids, c)
    # each flipped token sits on the border between two centroids of one blob, under the centroids our last
    # assignment used: sklearn's label is nearly as close as ours (a token given to another blob would be ~2 d sep^2
    # away). Where the two runs parted at an earlier near-tie that border has moved a little: with sklearn on one
    # thread, case (1000, 16, 32) flips one token whose other centroid is 1.24x as far (d 4.42 against 3.56)
    if flipped.any():
        c_prev = (kmeans(x[None], k, iters=iters - 1, init=init[None]).centroids[0] if iters > 1 else init).double()
        t = torch.from_numpy(flipped.nonzero()[0])
        d_ours = ((x.double()[t] - c_prev[ids[t]]) ** 2).sum(-1)
        d_theirs = ((x.double()[t] - c_prev[torch.from_numpy(prev[flipped]).long()]) ** 2).sum(-1)
        assert (d_ours <= d_theirs + 1e-3).all() and (d_theirs <= 1.5 * d_ours + 1e-3).all()
    inertia = ours.trace[-1].item() * n  # the trace is the mean squared distance; this is the sum
    expected = ((x.double() - c.double()[ids]) ** 2).sum().item()
    assert abs(inertia - expected) <= 1e-4 * expected


def test_well_separated_blobs_recover_truth():
    x, truth = blobs(900, 8, 12, sep=30.0, noise=0.3, seed=6)
    r = kmeans(x[None], 12, iters=10, seed=0)
    ids = r.ids[0].long()
    # a perfect clustering up to relabelling: each true blob maps to exactly one cluster and vice versa
    pairs = set(zip(truth.tolist(), ids.tolist()))
    assert len(pairs) == 12 and len({a for a, _ in pairs}) == 12 and len({b for _, b in pairs}) == 12


def assert_cluster_means(x, ids, c, atol=1e-4):
    """Every non-empty cluster's returned centroid is the mean of its returned tokens."""
    for k in ids.long().unique():
        members = x[ids.long() == k]
        torch.testing.assert_close(c[k], members.mean(0), rtol=0, atol=atol * (1 + members.abs().max().item()))


@pytest.mark.parametrize("seeding", SEEDINGS)
def test_result_is_last_assignment_and_its_means(seeding):
    x = randn(3, 400, 8, seed=7)
    r2 = kmeans(x, 20, iters=2, seed=1, seeding=seeding)
    r3 = kmeans(x, 20, iters=3, seed=1, seeding=seeding)
    for g in range(3):  # iteration 3 assigns to the centroids iteration 2 returned, then updates from that
        assert torch.equal(r3.ids[g].long(), brute_assign(x[g], r2.centroids[g]))
        assert_cluster_means(x[g], r3.ids[g], r3.centroids[g])
    ids, _ = assign(x, r2.centroids)
    assert torch.equal(ids, r3.ids.long())


def test_iters_zero_is_plain_assignment():
    x = randn(2, 300, 6, seed=8)
    init = x[:, :15].clone()
    r = kmeans(x, 15, iters=0, init=init, track=True)
    assert torch.equal(r.centroids, init)
    assert r.trace.shape == (1,)
    for g in range(2):
        assert torch.equal(r.ids[g].long(), brute_assign(x[g], init[g]))


def test_chunked_assignment_matches_unchunked(monkeypatch):
    """The distance matrix is built in row blocks capped at _CHUNK_ELEMS entries: tiny blocks give the same result."""
    import qvg.kmeans as km
    x = torch.stack([blobs(500, 8, 12, sep=10.0, noise=0.5, seed=30 + g)[0] for g in range(3)])
    full = kmeans(x, 12, iters=4, seed=0, track=True)
    monkeypatch.setattr(km, "_CHUNK_ELEMS", 3 * 12 * 7)  # 7 rows per block, and a ragged last block
    assert km._rows_per_block(3, 500, 12) == 7
    chunked = kmeans(x, 12, iters=4, seed=0, track=True)
    assert torch.equal(chunked.ids, full.ids)
    torch.testing.assert_close(chunked.centroids, full.centroids, rtol=0, atol=1e-5)
    torch.testing.assert_close(chunked.trace, full.trace, rtol=1e-5, atol=0)


# --- batching, determinism, seeds ---------------------------------------------------------------------------------

def test_batched_equals_per_group_calls():
    g_count, n, d, k = 4, 500, 16, 24
    x = torch.stack([blobs(n, d, k, sep=4.0, noise=1.0, seed=10 + g)[0] for g in range(g_count)])
    init = torch.stack([x[g, torch.randperm(n, generator=gen(20 + g))[:k]] for g in range(g_count)])
    batched = kmeans(x, k, iters=6, init=init)
    for g in range(g_count):
        single = kmeans(x[g:g + 1], k, iters=6, init=init[g:g + 1])
        assert torch.equal(batched.ids[g], single.ids[0])
        torch.testing.assert_close(batched.centroids[g], single.centroids[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("seeding", SEEDINGS)
def test_deterministic_same_seed(seeding):
    x = randn(3, 700, 16, seed=11)
    runs = [kmeans(x.clone(), 32, iters=4, seed=5, seeding=seeding, track=True) for _ in range(3)]
    for r in runs[1:]:
        assert torch.equal(r.ids, runs[0].ids)
        assert torch.equal(r.centroids, runs[0].centroids)
        assert torch.equal(r.trace, runs[0].trace)


@pytest.mark.parametrize("seeding", SEEDINGS)
def test_a_groups_seeding_does_not_depend_on_the_batch(seeding):
    """Group i's cold start is the same alone or batched with others (k-means++ drew its numbers [K, G], so a head
    compressed beside others got other centroids than alone: a batch of two videos changed the first one's)."""
    x = randn(3, 500, 16, seed=14)
    both = seed_centroids(x, 24, seed=2, seeding=seeding)
    for n in (1, 2):
        assert torch.equal(seed_centroids(x[:n], 24, seed=2, seeding=seeding), both[:n])
    alone = kmeans(x[:1], 24, iters=2, seed=2, seeding=seeding)
    batched = kmeans(x, 24, iters=2, seed=2, seeding=seeding)
    assert torch.equal(alone.ids[0], batched.ids[0]) and torch.equal(alone.centroids[0], batched.centroids[0])


@pytest.mark.parametrize("seeding", SEEDINGS)
def test_different_seeds_differ(seeding):
    x = randn(2, 700, 16, seed=12)
    a = kmeans(x, 32, iters=2, seed=0, seeding=seeding)
    b = kmeans(x, 32, iters=2, seed=1, seeding=seeding)
    assert not torch.equal(a.centroids, b.centroids)
    assert not torch.equal(a.ids, b.ids)


@pytest.mark.parametrize("seeding", SEEDINGS)
def test_seeding_draws_data_points(seeding):
    x = randn(2, 300, 8, seed=13)
    c = seed_centroids(x, 40, seed=3, seeding=seeding)
    assert c.shape == (2, 40, 8)
    for g in range(2):
        is_token = (c[g][:, None, :] == x[g][None, :, :]).all(-1).any(-1)
        assert is_token.all(), "every seed centroid is one of the group's tokens"
        assert torch.unique(c[g], dim=0).shape[0] == 40, "distinct tokens on distinct data"


# --- convergence and warm start -----------------------------------------------------------------------------------

def _steps_to_converge(trace: torch.Tensor, rel: float = 1e-6) -> int:
    final = trace[-1].item()
    return int(next(i for i, v in enumerate(trace.tolist()) if v <= final * (1 + rel)))


@pytest.mark.parametrize("seeding", SEEDINGS)
def test_trace_non_increasing(seeding):
    x = torch.cat([blobs(600, 8, 16, sep=3.0, noise=1.0, seed=14)[0][None], randn(1, 600, 8, seed=15)])
    r = kmeans(x, 16, iters=15, seed=2, seeding=seeding, track=True)
    t = r.trace.double()
    assert t.shape == (16,)
    assert (t[1:] <= t[:-1] * (1 + 1e-6)).all(), t


def test_warm_start_from_converged_is_fixed_point():
    x = torch.stack([blobs(800, 8, 16, sep=4.0, noise=1.0, seed=16 + g)[0] for g in range(2)])
    cold = kmeans(x, 16, iters=60, seed=0, track=True)
    torch.testing.assert_close(cold.trace[-1], cold.trace[-2], rtol=1e-5, atol=0)  # converged
    warm = kmeans(x, 16, iters=3, init=cold.centroids, track=True)
    assert torch.equal(warm.ids, cold.ids)
    torch.testing.assert_close(warm.centroids, cold.centroids, rtol=0, atol=1e-6)
    assert _steps_to_converge(warm.trace) == 0


def test_warm_start_converges_faster_than_cold():
    """Streaming: the next chunk from the same mixture, warm-started from the previous chunk's centroids."""
    g = gen(17)
    centres = torch.randn(2, 24, 16, generator=g) * 3.0

    def chunk(n):
        which = torch.randint(0, 24, (2, n), generator=g)
        return torch.gather(centres, 1, which[..., None].expand(-1, -1, 16)) + torch.randn(2, n, 16, generator=g)

    prev = kmeans(chunk(1500), 24, iters=40, seed=0)
    nxt = chunk(1500)
    cold = kmeans(nxt, 24, iters=40, seed=0, track=True)
    warm = kmeans(nxt, 24, iters=40, init=prev.centroids, track=True)
    assert warm.trace[0] < cold.trace[0]
    assert _steps_to_converge(warm.trace) < _steps_to_converge(cold.trace)


# --- empty clusters -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seeding", SEEDINGS)
def test_duplicate_points_give_finite_centroids(seeding):
    base = randn(1, 5, 4, seed=18)
    x = base.repeat(1, 40, 1)  # 200 tokens, 5 distinct values
    r = kmeans(x, 8, iters=4, seed=0, seeding=seeding, track=True)
    assert torch.isfinite(r.centroids).all() and torch.isfinite(r.trace).all()
    if seeding == "k-means++":  # D^2 sampling picks all 5 distinct values first: zero error (up to rounding).
        assert r.trace[-1] < 1e-6  # ("random" draws 8 distinct *tokens*, which may repeat values)
    assert_nearest(x[0], r.centroids[0], r.ids[0])  # (duplicate values make near-ties of centroids)


def test_all_identical_points():
    x = torch.ones(2, 50, 8)
    r = kmeans(x, 10, iters=3, seed=0, track=True)
    assert torch.isfinite(r.centroids).all()
    assert (r.ids == 0).all()  # ties go to the lowest index
    assert r.trace[-1] == 0


def test_k_close_to_n():
    x = randn(2, 20, 4, seed=19)
    for k in (18, 19, 20):
        r = kmeans(x, k, iters=5, seed=0)
        assert torch.isfinite(r.centroids).all()
        assert int(r.ids.long().max()) < k


def test_empty_cluster_is_reseeded_on_the_farthest_token():
    x = randn(1, 300, 4, seed=20)
    far = torch.full((1, 1, 4), 1e3)
    init = torch.cat([x[:, :7].clone(), far], 1)  # centroid 7 is far from every token: empty after assignment 1
    r1 = kmeans(x, 8, iters=1, init=init, track=True)
    assert (r1.ids != 7).all()
    ids, dist = assign(x, init)
    assert torch.equal(r1.centroids[0, 7], x[0, dist[0].argmax()])  # moved onto the farthest token
    r = kmeans(x, 8, iters=5, init=init)
    assert (r.ids.long() == 7).any()  # and it is used from then on
    assert torch.isfinite(r.centroids).all()


def test_reseeding_ranks_empties_and_breaks_ties_by_index():
    x = torch.arange(10.0).view(1, 10, 1).repeat(1, 1, 2)
    c = torch.zeros(1, 4, 2)
    dist = torch.tensor([[0, 5, 5, 1, 9, 2, 9, 0, 0, 0]], dtype=torch.float32)
    counts = torch.tensor([[10, 0, 0, 0]])  # clusters 1, 2, 3 are empty
    out = reseed_empty(x, c, counts, dist)  # 4 slices of 2 tokens: maxima 5 (token 1), 5 (2), 9 (4), 9 (6)
    assert torch.equal(out[0, 0], c[0, 0])
    assert out[0, 1:, 0].tolist() == [4.0, 6.0, 1.0]  # farthest first; equal distances: lower token index first


def test_update_empty_cluster_directly():
    x = randn(2, 10, 3, seed=21)
    c = randn(2, 4, 3, seed=22)
    ids = torch.tensor([[0] * 5 + [1] * 5, [3] * 10])
    out = update(x, ids, c)
    torch.testing.assert_close(out[0, 0], x[0, :5].mean(0))
    torch.testing.assert_close(out[0, 1], x[0, 5:].mean(0))
    assert torch.equal(out[0, 2:], c[0, 2:])
    torch.testing.assert_close(out[1, 3], x[1].mean(0))
    assert torch.equal(out[1, :3], c[1, :3])


# --- id dtypes and large K ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("k,dtype", [(1, torch.uint8), (2, torch.uint8), (256, torch.uint8), (257, torch.uint16),
                                     (1000, torch.uint16), (MAX_K, torch.uint16)])
def test_id_dtype(k, dtype):
    assert id_dtype(k) == dtype


@pytest.mark.parametrize("k", (1, 256, 257, 600))
def test_ids_dtype_and_range(k):
    x = randn(1, 1024, 4, seed=23)
    r = kmeans(x, k, iters=1, seed=0, seeding="random")
    assert r.ids.dtype == (torch.uint8 if k <= 256 else torch.uint16)
    assert r.ids.shape == (1, 1024)
    ids = r.ids.long()  # (torch implements few ops on uint16, e.g. no max)
    assert int(ids.max()) < k
    if k > 256:
        assert int(ids.max()) > 255  # ids above the uint8 range survive the cast
    assert_cluster_means(x[0], r.ids[0], r.centroids[0])


@pytest.mark.slow
def test_k_65536_small_d():
    """K = MAX_K on N = 65536, D = 4: a distance matrix of 2^32 entries (~25 s on 2 cores even with a given init;
    the k-means++ seeding alone would take minutes: one pass over N per centroid)."""
    x = randn(1, MAX_K, 4, seed=24)
    r = kmeans(x, MAX_K, iters=1, init=x.clone())
    assert r.ids.dtype == torch.uint16
    assert torch.equal(r.ids[0].long(), torch.arange(MAX_K))  # every token is its own centroid: a fixed point
    assert torch.equal(r.centroids, x)


# --- errors -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("x_shape,k,init_shape,match", [
    ((1, 10, 4), 11, None, r"centroids \(11\) > tokens"),
    ((1, 10, 4), MAX_K + 1, None, "centroids must be in"),
    ((1, 10, 4), 0, None, "centroids must be in"),
    ((10, 4), 2, None, r"\[G, N, D\]"),
    ((1, 1, 10, 4), 2, None, r"\[G, N, D\]"),
    ((2, 10, 4), 3, (1, 3, 4), "init centroids must have shape"),
    ((2, 10, 4), 3, (2, 4, 4), "init centroids must have shape"),
    ((2, 10, 4), 3, (2, 3, 5), "init centroids must have shape"),
])
def test_errors(x_shape, k, init_shape, match):
    x = torch.zeros(x_shape)
    init = None if init_shape is None else torch.zeros(init_shape)
    with pytest.raises(ValueError, match=match):
        kmeans(x, k, init=init)


def test_unknown_seeding():
    with pytest.raises(ValueError, match="unknown seeding"):
        kmeans(randn(1, 10, 4, seed=0), 2, seeding="kmeans||")
