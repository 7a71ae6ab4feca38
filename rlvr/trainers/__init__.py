"""Trainers: one readable loop per kind of job."""
