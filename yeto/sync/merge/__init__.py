"""The merge math, pure functions on flat fp32 vectors: weighted sums, merge rules, the outer step."""
