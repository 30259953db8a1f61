"""Specialization: per-rank executable graphs, pipelines and schedules (paper 6.2-6.3, A.2)."""
