"""After a bare `import qvg`, submodules are attributes (imported when first used), as the README's dotted names
assume; `import qvg` itself stays light."""
import subprocess
import sys


def _runs_clean(code: str) -> None:
    """`code` in a fresh interpreter (what it imports starts from nothing) exits 0."""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_entry_points_import_no_torch_before_their_main():
    """qvg-generate's console script imports qvg and qvg.app.generate before main(): with torch among them, a
    Ctrl-C in the first seconds was a traceback (main's one-line handling was not yet running)."""
    code = ("import sys, qvg, qvg.app.generate, qvg.app.ui, qvg.eval.cli\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "from qvg import compress, Packed\n"
            "assert qvg.methods()[0] == 'rtn' and qvg.QuantSpec.__name__ == 'QuantSpec' and 'torch' in sys.modules\n"
            "assert {'compress', 'decompress', 'bits_per_element', 'Packed'} <= set(dir(qvg))\n")
    _runs_clean(code)


def test_submodules_are_attributes_after_import_qvg():
    code = ("import sys, qvg\n"
            "light = not any(m in sys.modules for m in ('qvg.cache', 'qvg.pipelines', 'qvg.app', 'gradio'))\n"
            "assert light, sorted(m for m in sys.modules if m.startswith('qvg'))\n"
            "assert qvg.cache.KVCache.__name__ == 'KVCache'\n"
            "assert callable(qvg.pipelines.world_model.load_world) and callable(qvg.eval.metrics.psnr)\n"
            "for bad in ('qvg.nope', 'qvg.pipelines.nope', 'qvg._private'):\n"
            "    try:\n"
            "        eval(bad)\n"
            "    except AttributeError as e:\n"
            "        assert 'has no attribute' in str(e), e\n"
            "    else:\n"
            "        raise AssertionError(bad)\n"
            "assert not hasattr(qvg, 'a.b') and getattr(qvg.eval, 'x.y', None) is None\n")
    _runs_clean(code)
