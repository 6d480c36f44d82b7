"""qvg.assets: small shipped files (the embedded model, prompts, images)."""
