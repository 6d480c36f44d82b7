"""qvg.app: the qvg-generate CLI and (later) the Gradio UI. Thin: no model logic lives here."""
