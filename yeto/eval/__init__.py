"""Task evaluation: what a model answers to a task's prompts, scored, with a confidence interval.

A task is records of `{messages | prompt, answer}` (`yeto.eval.task`), scored by normalized exact match or a scorer
the user names (`yeto.eval.score`); the generation itself is a backend's (`generate(prompts, max_new_tokens)`, greedy
and batched), so the same evaluation runs on torch, on MLX, in `yeto eval` and on an island during a run.
"""
