"""qvg.app: the qvg-generate CLI and the qvg-app live UI (gradio, imported only by app/ui.py). Thin: no model logic
lives here."""
from qvg._lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__)  # its modules as attributes, imported when used
