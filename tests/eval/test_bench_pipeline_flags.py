"""bench_pipeline's method flags map to the KVCache options they name (CPU: the caches are only built)."""
import pytest

from qvg.eval.bench_pipeline import new_cache


class _Model:
    @staticmethod
    def tokens_per_latent_frame(h, w):
        return 4


def test_flags_set_the_cache_options():
    c = new_cache(_Model(), "qvg:noprefetch:eager-commit:batch=64", 6, {"centroids": 4})
    assert (c.prefetch_bytes, c.defer_commits, c.commit_batch_bytes, c.async_commit) == (0, False, 64 << 20, True)
    assert new_cache(_Model(), "qvg:batch=0:sync", 6, {}).commit_batch_bytes == 0


@pytest.mark.parametrize("bad", ["qvg:batch=x", "qvg:batch=-1", "qvg:fast"])
def test_bad_flags_are_refused(bad):
    with pytest.raises(ValueError, match="flag"):
        new_cache(_Model(), bad, 6, {})
