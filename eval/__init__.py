"""qvg.eval: synthetic KV, analyses, metrics and benchmarks. Results land in eval/results/."""
from qvg._lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__)  # its modules as attributes, imported when used
