"""Tests of the SFS core (services/estimator/sfs): replay, batch-time fit, baselines, policies."""
