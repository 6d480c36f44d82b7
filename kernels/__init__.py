"""qvg.kernels: Triton kernels; each mirrors a pure-torch reference in qvg/ and is tested against it."""
