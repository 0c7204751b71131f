"""Planning a run before it starts: memory per GPU term by term, predicted step time, and the best
layouts for a cluster, from the same flags as the run (`tools/plan.py`, `pretrain_gpt.py --dry-run`).
See docs/planning.md."""
