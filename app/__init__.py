"""qvg.app: the qvg-generate CLI and the qvg-app live UI (gradio, imported only by app/ui.py). Thin: no model logic
lives here."""
