"""Benchmarks: each prints its figures, as ratios against a peer measured in the same run
where there is one (most also write them as JSON: `--json` or `--output-json`)."""
