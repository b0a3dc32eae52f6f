"""Planning: the layouts of a model on a cluster, pruned with closed forms (estimates.py),
traced and ranked (plan.py); the largest micro-batch that fits (search.py)."""
