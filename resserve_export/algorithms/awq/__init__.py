"""Activation-aware weight scaling (AWQ): the search, the folds into producers, mixture-of-experts layers."""
