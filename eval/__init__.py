"""qvg.eval: synthetic KV, analyses, metrics and benchmarks. Results land in eval/results/."""
