"""Training utilities for mmspec (data generation, ...)."""
