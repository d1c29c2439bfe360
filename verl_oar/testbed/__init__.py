"""A CPU testbed where the causal tokens of a response are known exactly (pure python + torch, no verl).

``chain_sum``: a synthetic reasoning task (running sums with filler words), its generator, verl RL
rows, and the oracle of causal tokens read from a response's text. ``importance_quality``: how well a
token ranking (OAR-G, OAR-P, entropy, random) finds those tokens -- recall at top-K% and the
counterfactual accuracy drop when the top-K% tokens are occluded or deleted.
"""
