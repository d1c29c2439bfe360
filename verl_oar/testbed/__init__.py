"""A CPU testbed where the causal tokens of a response are known exactly, and the comparison of the
credit-assignment methods on it through verl's real trainer.

``pick_max``: the task (pick the larger digit of each pair among random filler words), its generator,
verl RL rows and the oracle of causal tokens read from a response's text; ``workspace``: the committed
warm-started start and the script that builds it; ``methods``: the methods compared (one entry each);
``training_runs``, ``comparison``, ``measures``, ``credit``, ``report``, ``demo``: the runs, the
pre-registered measures with bootstrap intervals, the credit each run assigned, the report;
``importance_quality``, ``quality``: how well a token ranking (``core.token_ranking``) finds the causal tokens.
"""
