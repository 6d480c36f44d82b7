"""qvg.pipelines: chunk-wise auto-regressive model loops (model + cache + loop)."""
