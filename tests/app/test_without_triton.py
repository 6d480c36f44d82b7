"""The README's main command on a CPU machine: the CPU torch wheel brings no triton (only the test extra installs
it), so qvg-generate must run every method on the torch reference without importing triton. On a GPU machine the
same test runs on CUDA without triton (as a CUDA torch where triton is not installed, e.g. on Windows): the cache,
its graphed compress and the report take the reference there too (qvg.backend.kernels_on)."""
import subprocess
import sys

from qvg.cache import CACHE_METHODS


def test_every_method_runs_where_triton_cannot_be_imported(tmp_path):
    code = ("import sys\n"
            "sys.modules['triton'] = None  # import triton now raises ImportError, as where it is not installed\n"
            "from qvg.app.generate import main\n"
            f"for m in {list(CACHE_METHODS)!r}:\n"
            f"    rc = main(['--frames', '4', '--method', m, '--quiet', '--out', {str(tmp_path)!r} + f'/{{m}}.mp4'])\n"
            "    assert rc == 0, m\n"
            "from qvg.cache import KVCache  # a kernel preset named for the commits: unused by the reference\n"
            "KVCache(1, 'qvg', chunk_frames=1, tokens_per_frame=32, centroids=4, compress_preset='fast')\n"
            "assert not [k for k in sys.modules if k == 'triton' or k.startswith('triton.')\n"
            "            if sys.modules[k] is not None]\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.glob("*.mp4")) == sorted(f"{m}.mp4" for m in CACHE_METHODS)
