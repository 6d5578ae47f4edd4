"""Parallel plan advisor: memory and step-time estimates for parallel layouts."""
